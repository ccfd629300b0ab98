"""Hyper-connections: Sinkhorn-Knopp, and the HC / mHC residual streams with their stability metrics.

Manifold-constrained hyper-connections (mHC, arXiv 2512.24880) widen the residual stream into n
parallel streams mixed by learned matrices, and keep the residual mixing matrix doubly stochastic by
projecting it with Sinkhorn-Knopp. Plain hyper-connections (HC, arXiv 2409.19606) leave it free.
"""

import torch


def sinkhorn_torch(logits, iters=20):
    """The PyTorch twin of kernels.sinkhorn: logits (..., n, n) -> doubly stochastic (..., n, n).

    Each of the `iters` iterations normalises the columns, then the rows (the paper's order,
    M <- T_r(T_c(M))), so the rows of the result sum to 1 exactly and the columns nearly so. It runs
    in the log domain: A <- A - logsumexp over a column, then over a row, and the result is exp(A).
    In exact arithmetic that is the same iteration as exp() followed by divisions by the sums, but it
    stays finite for any finite logits, where exp(logits) would underflow a whole column to zero and
    the division would give NaN. Differentiable through autograd (the kernel has its own backward).
    """
    a = logits
    for _ in range(iters):
        a = a - torch.logsumexp(a, dim=-2, keepdim=True)  # columns
        a = a - torch.logsumexp(a, dim=-1, keepdim=True)  # rows
    return torch.exp(a)
