"""Hyper-connections: Sinkhorn-Knopp, the stream mixing, and the HC / mHC residual streams with their
stability metrics.

Manifold-constrained hyper-connections (mHC, arXiv 2512.24880) widen the residual stream into n
parallel streams mixed by learned matrices, and keep the residual mixing matrix doubly stochastic by
projecting it with Sinkhorn-Knopp. Plain hyper-connections (HC, arXiv 2409.19606) leave it free.
"""

import math
from typing import NamedTuple

import torch
import torch.nn as nn


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


def stream_merge_torch(x, h):
    """The PyTorch twin of kernels.stream_merge: x (..., n, C) merged into one stream (..., C),
    out[..., c] = sum_i h[i] x[..., i, c]. h is (n,), the same for every token, or (..., n), one set
    per token (x's leading dims)."""
    return (h.unsqueeze(-1) * x).sum(-2)


def stream_mix_torch(x, h_res, h_post, y):
    """The PyTorch twin of kernels.stream_mix: the streams x (..., n, C) mixed by h_res, plus y (..., C)
    spread over them by h_post: out[..., i, c] = sum_j h_res[i, j] x[..., j, c] + h_post[i] y[..., c].
    h_res (n, n) and h_post (n,) for every token, or (..., n, n) and (..., n) per token."""
    return h_res @ x + h_post.unsqueeze(-1) * y.unsqueeze(-2)


# -----------------------------------------------------------------------------
# residual streams: how a block's sublayer output F joins the residual stream x.
# Written against the op namespace (softmax, sinkhorn, rmsnorm, linear; stream_merge and stream_mix
# for the mixing), so each variant runs on both op sets. On the cuda op set each mixing step is one
# fused kernel per direction that reads the streams once, instead of PyTorch's chain of kernels.
# A residual module gets a sublayer as two callables: norm(x) -> (x as a tensor, the sublayer's
# normalized input), and f, the sublayer's body on that input.

class PendingSum(NamedTuple):
    """The residual stream x + y with the add not yet done. The baseline hands its sum on like this and
    the norm that reads the stream next does the add in its own pass (train.pre_norm: ops.add_layernorm),
    which saves a pass over the stream each way (forward and backward) on the cuda op set."""
    x: torch.Tensor
    y: torch.Tensor

VARIANTS = ("baseline", "hc", "mhc", "mhc-dynamic")


def pre_logits_init(n, index):
    """H_pre's starting logits for the index-th sublayer: 2 on stream index mod n, 0 elsewhere, so it reads
    mostly that stream (softmax 0.71, the others 0.10 each for n = 4), as hyper-connections start each
    layer on its own stream. With every stream a copy of the embedding and the same H_pre for every
    sublayer, the streams would be symmetric: equal gradients keep them equal, H_res x = x for any
    row-stochastic H_res, so the mixing would learn only from rounding noise. Reading different
    streams gives them different gradients from the first step."""
    return 2 * torch.eye(n)[index % n]


class PlainResidual(nn.Module):
    """baseline: x + F(norm(x)), one stream, the add left to the next norm (a PendingSum)."""

    def forward(self, x, norm, f, ops):  # x (B, T, C), or a PendingSum of two
        x, h = norm(x)
        return PendingSum(x, f(h))


class StaticHyperConnection(nn.Module):
    """hc / mhc: n streams x (B, T, n, C) mixed by learned matrices that do not depend on the input.
    The sublayer sees the merged stream H_pre x; then x <- H_res x + H_post^T F(H_pre x).
    H_pre, H_post = softmax of their logits (H_pre: mostly stream index mod n at init, pre_logits_init;
    H_post: 1/n each); H_res = exp(L) for hc (unconstrained), Sinkhorn(L) for mhc (doubly stochastic);
    L starts at 2I - 1."""

    def __init__(self, n, constrained, sinkhorn_iters=20, index=0):
        super().__init__()
        self.constrained, self.iters = constrained, sinkhorn_iters
        self.pre_logits = nn.Parameter(pre_logits_init(n, index))
        self.post_logits = nn.Parameter(torch.zeros(n))
        self.res_logits = nn.Parameter(2 * torch.eye(n) - 1)
        self.last_res = None  # H_res of the latest forward, detached, for the gain metrics

    def forward(self, x, norm, f, ops):  # x (B, T, n, C)
        h_pre, h_post = ops.softmax(self.pre_logits), ops.softmax(self.post_logits)  # (n,) each
        h_res = ops.sinkhorn(self.res_logits, self.iters) if self.constrained else torch.exp(self.res_logits)
        self.last_res = h_res.detach()  # (n, n)
        y = f(norm(ops.stream_merge(x, h_pre))[1])  # F of H_pre x: (B, T, C)
        return ops.stream_mix(x, h_res, h_post, y)  # H_res x + H_post^T y: (B, T, n, C)


class DynamicHyperConnection(nn.Module):
    """mhc-dynamic (the paper's form): per-token coefficients from the streams themselves.
    x' = RMSNorm(flatten(x)) (1 x nC per token); H~ = alpha * (x' phi) + b, one alpha per group;
    H_pre = sigmoid(H~_pre), H_post = 2 sigmoid(H~_post), H_res = Sinkhorn(H~_res), one n x n per token.
    alpha starts at 0.01 and b at the static variants' starting point (H_pre = softmax(pre_logits_init),
    H_post = 1/n, L = 2I - 1), so all three hyper-connection variants begin from the same H_pre and
    H_post, and both mhc variants from the same H_res."""

    def __init__(self, n, n_embd, sinkhorn_iters=20, index=0):
        super().__init__()
        self.n, self.iters = n, sinkhorn_iters
        self.norm_w = nn.Parameter(torch.ones(n * n_embd))
        self.phi_w = nn.Parameter(torch.empty(2 * n + n * n, n * n_embd))  # random init: GPT's weight init
        self.alpha = nn.Parameter(torch.full((3,), 0.01))  # pre, post, res
        b_pre = torch.logit(torch.softmax(pre_logits_init(n, index), -1), eps=1e-6)  # sigmoid -> the static H_pre
        b_post = torch.full((n,), -math.log(2 * n - 1))  # 2 sigmoid -> 1/n
        self.bias = nn.Parameter(torch.cat([b_pre, b_post, (2 * torch.eye(n) - 1).flatten()]))
        self.last_res = None

    def forward(self, x, norm, f, ops):  # x (B, T, n, C)
        B, T, n, C = x.shape
        h = ops.linear(ops.rmsnorm(x.reshape(B, T, n * C), self.norm_w), self.phi_w, None)  # (B, T, 2n + n^2)
        a_pre, a_post, a_res = self.alpha
        scale = torch.cat([a_pre.expand(n), a_post.expand(n), a_res.expand(n * n)])  # (2n + n^2,)
        h = h * scale + self.bias
        h_pre = torch.sigmoid(h[..., :n])  # (B, T, n)
        h_post = 2 * torch.sigmoid(h[..., n:2 * n])  # (B, T, n)
        h_res = ops.sinkhorn(h[..., 2 * n:].reshape(B, T, n, n), self.iters)  # (B, T, n, n)
        self.last_res = h_res.detach()
        y = f(norm(ops.stream_merge(x, h_pre))[1])  # (B, T, C)
        return ops.stream_mix(x, h_res, h_post, y)  # (B, T, n, C)


class Streams:
    """One variant's residual streams for a whole model: a factory of per-sublayer residual modules,
    and the model's entry (the embedding copied to every stream) and exit (the mean over streams)."""

    def __init__(self, variant, n, n_embd, sinkhorn_iters=20):
        if variant not in VARIANTS:
            raise ValueError(f"residual variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
        if variant != "baseline" and n < 1:
            raise ValueError(f"n_streams must be >= 1, got {n}")
        self.variant, self.n = variant, 1 if variant == "baseline" else n
        self.n_embd, self.iters = n_embd, sinkhorn_iters
        self.made = 0  # residual modules made so far: the next one's sublayer index

    def residual(self):
        """The next sublayer's residual module; the model asks for them in depth order."""
        index, self.made = self.made, self.made + 1
        if self.variant == "baseline":
            return PlainResidual()
        if self.variant == "mhc-dynamic":
            return DynamicHyperConnection(self.n, self.n_embd, self.iters, index)
        return StaticHyperConnection(self.n, self.variant == "mhc", self.iters, index)

    def expand(self, x):  # (B, T, C) -> (B, T, n, C)
        return x if self.variant == "baseline" else x.unsqueeze(-2).expand(*x.shape[:-1], self.n, x.shape[-1])

    def collapse(self, x):  # (B, T, n, C) -> (B, T, C); the baseline's (a PendingSum) as it is
        return x if self.variant == "baseline" else x.mean(-2)


# -----------------------------------------------------------------------------
# stability metrics of the composite residual map P = H_res[L-1] ... H_res[0]

GAINS = ("proxy", "fwd", "bwd")  # the order of composite_gain_tensor's entries


def composite_gain_tensor(residuals):
    """From the residual modules of a model (in depth order), after a forward: the gains of P, the
    product of every sublayer's H_res (per token for mhc-dynamic), as log10 values, max over tokens,
    in GAINS order: 'proxy' = max |P_ij| (the published runs' measure), 'fwd' = max absolute row sum
    (the paper's forward Amax gain), 'bwd' = max absolute column sum (backward). A (3,) float64 tensor
    on the matrices' device, or None for the baseline. Device ops only: reading nothing back, it can
    run every training step (inside a CUDA graph too) without a host sync."""
    mats = [r.last_res for r in residuals if getattr(r, "last_res", None) is not None]
    if not mats:
        return None
    p = mats[0].double()  # float64: HC's product can pass float32's range long before it is inf
    for h in mats[1:]:
        p = h.double() @ p  # broadcasts a static (n, n) against per-token (B, T, n, n)
    a = p.abs()
    return torch.stack([a.amax(), a.sum(-1).amax(), a.sum(-2).amax()]).log10()


def composite_gains(residuals):
    """composite_gain_tensor read back as {'proxy': float, 'fwd': float, 'bwd': float}, or None."""
    g = composite_gain_tensor(residuals)
    return None if g is None else dict(zip(GAINS, g.tolist()))
