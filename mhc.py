"""Hyper-connections: Sinkhorn-Knopp, the stream mixing, and the HC / mHC residual streams with their
stability metrics.

Manifold-constrained hyper-connections (mHC, arXiv 2512.24880) widen the residual stream into n
parallel streams mixed by learned matrices, and keep the residual mixing matrix doubly stochastic by
projecting it with Sinkhorn-Knopp. Plain hyper-connections (HC, arXiv 2409.19606) leave it free.
"""

import functools
import json
import math
import os
import sys
import time
from types import SimpleNamespace
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from data import (INCREMENT_VOCAB, StopRequest, device_name, fmt_seconds, get_batch, increment_batch, pyplot,
                  read_text_splits, signal_exit, signal_words, write_json)


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


def hc_coeffs_torch(h, alpha, bias, iters=20):
    """The PyTorch twin of kernels.hc_coeffs: mhc-dynamic's coefficients from each token's K = 2n + n^2
    projections h (..., K), with one scale per group alpha (3,) and a bias (K,): u = alpha h + bias, then
    H_pre = sigmoid(u[..., :n]) (..., n), H_post = 2 sigmoid(u[..., n:2n]) (..., n) and
    H_res = Sinkhorn(u[..., 2n:] as (n, n)) (..., n, n)."""
    n = math.isqrt(h.shape[-1] + 1) - 1  # K + 1 = (n + 1)^2
    scale = torch.cat([alpha[0].expand(n), alpha[1].expand(n), alpha[2].expand(n * n)])  # (K,)
    u = h * scale + bias
    res = sinkhorn_torch(u[..., 2 * n:].reshape(*u.shape[:-1], n, n), iters)
    return torch.sigmoid(u[..., :n]), 2 * torch.sigmoid(u[..., n:2 * n]), res


def fp32_streams(twin):
    """A stream twin run with autocast off: under --dtype=bf16 the streams stay fp32 and so does their math, as
    in the cuda op set's stream kernels (autocast would run h_res @ x and the projection in bf16)."""
    @functools.wraps(twin)
    def run(x, *args, **kwargs):
        with torch.autocast(x.device.type, enabled=False):
            return twin(x, *args, **kwargs)
    return run


@fp32_streams
def hc_project_torch(x, weight, phi, eps=1e-5):
    """The PyTorch twin of kernels.hc_project: mhc-dynamic's projections of each token's flattened streams,
    RMSNorm(x, weight) phi^T, x (..., D), weight (D,), phi (2n + n^2, D) -> (..., 2n + n^2)."""
    return F.linear(F.rms_norm(x, x.shape[-1:], weight, eps), phi)


def hc_pre_torch(x, weight, phi, alpha, bias, iters=20, eps=1e-5):
    """The PyTorch twin of kernels.hc_pre: mhc-dynamic's step before a sublayer, from the streams x (..., n, C):
    the coefficients of the projections of each token's flattened streams, hc_coeffs(hc_project(x)), and the
    streams merged by H_pre: (merged (..., C), H_post (..., n), H_res (..., n, n))."""
    h_pre, h_post, h_res = hc_coeffs_torch(hc_project_torch(x.flatten(-2), weight, phi, eps), alpha, bias, iters)
    return stream_merge_torch(x, h_pre), h_post, h_res


def hc_mix_pre_torch(x, h_res, h_post, y, weight, phi, alpha, bias, iters=20, eps=1e-5):
    """The PyTorch twin of kernels.hc_mix_pre: mhc-dynamic between two sublayers, the previous one's mix of the
    streams s = stream_mix(x, h_res, h_post, y), then this one's hc_pre of them: (s, merged, H_post, H_res)."""
    s = stream_mix_torch(x, h_res, h_post, y)
    return (s, *hc_pre_torch(s, weight, phi, alpha, bias, iters, eps))


def stream_merge_torch(x, h):
    """The PyTorch twin of kernels.stream_merge: x (..., n, C) merged into one stream (..., C),
    out[..., c] = sum_i h[i] x[..., i, c]. h is (n,), the same for every token, or (..., n), one set
    per token (x's leading dims)."""
    return (h.unsqueeze(-1) * x).sum(-2)


@fp32_streams
def stream_mix_torch(x, h_res, h_post, y):
    """The PyTorch twin of kernels.stream_mix: the streams x (..., n, C) mixed by h_res, plus y (..., C)
    spread over them by h_post: out[..., i, c] = sum_j h_res[i, j] x[..., j, c] + h_post[i] y[..., c].
    h_res (n, n) and h_post (n,) for every token, or (..., n, n) and (..., n) per token. y may be bf16 (the
    sublayer's output under --dtype=bf16): the result is x's dtype."""
    return h_res @ x + h_post.unsqueeze(-1) * y.unsqueeze(-2)


def stream_mix_merge_torch(x, h_res, h_post, y, h_pre):
    """The PyTorch twin of kernels.stream_mix_merge: the mix and the merge of its result by h_pre (the next
    sublayer's), (stream_mix(x, h_res, h_post, y) (..., n, C), its stream_merge by h_pre (..., C))."""
    out = stream_mix_torch(x, h_res, h_post, y)
    return out, stream_merge_torch(out, h_pre)


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


class PendingMix(NamedTuple):
    """The streams H_res x + H_post^T y with the mix not yet done, as the hyper-connections hand them on: the next
    sublayer mixes in the op that reads the mixed streams (hc / mhc: ops.stream_mix_merge, the mix and the merge
    in one pass; mhc-dynamic: ops.hc_mix_pre), so the mixed streams have one consumer and autograd has no two
    gradients of them to add; stream_mix_merge also saves the merge's read of the streams."""
    x: torch.Tensor
    h_res: torch.Tensor
    h_post: torch.Tensor
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


class StaticMixing(nn.Module):
    """hc / mhc: the mixing logits of all of a model's sublayers, stacked, and their matrices for the current
    forward. H_pre, H_post = softmax of their logits (H_pre: mostly stream index mod n at init,
    pre_logits_init; H_post: 1/n each); H_res = exp(L) for hc (unconstrained), Sinkhorn(L) for mhc (doubly
    stochastic); L starts at 2I - 1. Stacked, every sublayer's matrices take one softmax each and one Sinkhorn
    per forward (and as many launches backward), where a module each would launch three kernels per sublayer
    each way, every launch's latency paid for a few numbers."""

    def __init__(self, n, count, constrained, sinkhorn_iters=20):
        super().__init__()
        self.constrained, self.iters = constrained, sinkhorn_iters
        self.pre_logits = nn.Parameter(torch.stack([pre_logits_init(n, i) for i in range(count)]))  # (count, n)
        self.post_logits = nn.Parameter(torch.zeros(count, n))
        self.res_logits = nn.Parameter((2 * torch.eye(n) - 1).repeat(count, 1, 1))  # (count, n, n)
        # per sublayer (H_pre, H_post, H_res) of the forward under way: the list the sublayers hold, refilled
        # at its start and emptied at its end (the views hold that forward's autograd graph)
        self.matrices = []
        self.last_res = None  # every H_res of the latest forward, detached (count, n, n), for the gain metrics

    def compute(self, ops):
        h_pre, h_post = ops.softmax(self.pre_logits), ops.softmax(self.post_logits)  # (count, n) each
        h_res = ops.sinkhorn(self.res_logits, self.iters) if self.constrained else torch.exp(self.res_logits)
        self.last_res = h_res.detach()
        self.matrices[:] = zip(h_pre.unbind(0), h_post.unbind(0), h_res.unbind(0))  # views: one stack backward


class StaticHyperConnection(nn.Module):
    """hc / mhc: n streams x (B, T, n, C) mixed by learned matrices that do not depend on the input.
    The sublayer sees the merged stream H_pre x; then x <- H_res x + H_post^T F(H_pre x). The matrices are
    entry `index` of StaticMixing.matrices, the list it refills at the start of every forward."""

    def __init__(self, matrices, index):
        super().__init__()
        self.matrices, self.index = matrices, index

    def forward(self, x, norm, f, ops):  # x (B, T, n, C), or the previous sublayer's PendingMix
        h_pre, h_post, h_res = self.matrices[self.index]  # (n,), (n,), (n, n)
        if isinstance(x, PendingMix):
            x, merged = ops.stream_mix_merge(*x, h_pre)
        else:
            merged = ops.stream_merge(x, h_pre)
        y = f(norm(merged)[1])  # F of H_pre x: (B, T, C)
        return PendingMix(x, h_res, h_post, y)  # H_res x + H_post^T y: (B, T, n, C), mixed by the next sublayer


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

    def forward(self, x, norm, f, ops):  # x (B, T, n, C), or the previous sublayer's PendingMix
        # H_pre x (B, T, C), H_post (B, T, n), H_res (B, T, n, n): the RMSNorm and phi of hc_project, the
        # coefficients of hc_coeffs and the merge in one op (hc_pre), whose backward reads x once for both uses;
        # after a sublayer, with its mix first (hc_mix_pre), so the mixed streams have one consumer
        weights = self.norm_w, self.phi_w, self.alpha, self.bias, self.iters
        if isinstance(x, PendingMix):
            x, merged, h_post, h_res = ops.hc_mix_pre(*x, *weights)
        else:
            merged, h_post, h_res = ops.hc_pre(x, *weights)
        self.last_res = h_res.detach()
        y = f(norm(merged)[1])  # (B, T, C)
        return PendingMix(x, h_res, h_post, y)  # H_res x + H_post^T y: (B, T, n, C), mixed by the next sublayer


class Streams(nn.Module):
    """One variant's residual streams for a whole model of `sublayers` sublayers: a factory of per-sublayer
    residual modules, and the model's entry (the embedding copied to every stream, and for hc / mhc every
    sublayer's mixing matrices for this forward) and exit (the mean over streams)."""

    def __init__(self, variant, n, n_embd, sublayers, sinkhorn_iters=20):
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"residual variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
        if variant != "baseline" and n < 1:
            raise ValueError(f"n_streams must be >= 1, got {n}")
        self.variant, self.n = variant, 1 if variant == "baseline" else n
        self.n_embd, self.iters, self.sublayers = n_embd, sinkhorn_iters, sublayers
        self.mixing = StaticMixing(n, sublayers, variant == "mhc", sinkhorn_iters) if variant in ("hc", "mhc") else None
        self.made = 0  # residual modules made so far: the next one's sublayer index

    def residual(self):
        """The next sublayer's residual module; the model asks for them in depth order."""
        index, self.made = self.made, self.made + 1
        assert index < self.sublayers, f"sublayer {index} of a model of {self.sublayers}"
        if self.variant == "baseline":
            return PlainResidual()
        if self.variant == "mhc-dynamic":
            return DynamicHyperConnection(self.n, self.n_embd, self.iters, index)
        return StaticHyperConnection(self.mixing.matrices, index)

    def expand(self, x, ops):  # (B, T, C) -> (B, T, n, C)
        if self.mixing is not None:
            self.mixing.compute(ops)
        if self.variant == "baseline":
            return x
        # copied once here: the first sublayer reads the streams twice (its merge, then the next one's mix), and
        # each of our ops would copy a broadcast view to contiguous memory on its own
        return x.unsqueeze(-2).expand(*x.shape[:-1], self.n, x.shape[-1]).contiguous()

    def collapse(self, x, ops):  # (B, T, n, C) or a PendingMix -> (B, T, C); the baseline's (a PendingSum) as it is
        if self.mixing is not None:
            self.mixing.matrices.clear()
        if isinstance(x, PendingMix):
            x = ops.stream_mix(*x)
        return x if self.variant == "baseline" else x.mean(-2)


# -----------------------------------------------------------------------------
# stability metrics of the composite residual map P = H_res[L-1] ... H_res[0]

GAINS = ("proxy", "fwd", "bwd")  # the order of composite_gain_tensor's entries


def residual_maps(model):
    """Every sublayer's H_res of the model's latest forward, detached, in the order they apply: (n, n) each,
    (B, T, n, n) for mhc-dynamic; none for the baseline."""
    if model.streams.mixing is not None:
        return list(model.streams.mixing.last_res.unbind(0))
    return [r.last_res for r in residual_modules(model) if getattr(r, "last_res", None) is not None]


def composite_gain_tensor(mats):
    """The gains of P, the product of the matrices mats (residual_maps: every sublayer's H_res, static or per
    token), as log10 values, max over tokens, in GAINS order: 'proxy' = max |P_ij| (the published runs'
    measure), 'fwd' = max absolute row sum (the paper's forward Amax gain), 'bwd' = max absolute column sum
    (backward). A (3,) float64 tensor on the matrices' device, or None for no matrices (the baseline). Device
    ops only: reading nothing back, it can run every training step (inside a CUDA graph too) without a host
    sync."""
    if not mats:
        return None
    # float64: HC's product can pass float32's range long before it is inf. Multiplied as a tree, each level one
    # batched matmul of neighbours (later @ earlier), so log2(L) launches instead of L - 1.
    p = torch.stack(torch.broadcast_tensors(*mats)).double()  # (L, [B, T,] n, n), H_res[0] first
    while p.shape[0] > 1:
        even = p.shape[0] // 2 * 2
        p = torch.cat([p[1:even:2] @ p[0:even:2], p[even:]])  # an odd one out, the latest, stays last
    a = p.abs()
    return torch.stack([a.amax(), a.sum(-1).amax(), a.sum(-2).amax()]).log10()


def composite_gains(mats):
    """composite_gain_tensor read back as {'proxy': float, 'fwd': float, 'bwd': float}, or None."""
    g = composite_gain_tensor(mats)
    return None if g is None else dict(zip(GAINS, g.tolist()))


# -----------------------------------------------------------------------------
# the depth sweep: every residual variant at several depths, trained from the same seed on the same
# batches, with per-step stability metrics (python train.py --preset=mhc | mhc-demo | mhc-text). Each
# finished (variant, depth) cell is written to out_dir/results.json at once, and a rerun skips it.
# train.py hands the sweep a trainer (train.SWEEP_TRAINER: the model, optimizer, step, timer and
# evaluation) so that this file never imports train.py.

SWEEP_METRICS = ("loss", "grad_norm", "nonfinite") + tuple(f"gain_{g}" for g in GAINS)
# What a rerun must share with the results.json it adds cells to (depths and variants may differ).
SWEEP_SETTINGS = ("sweep", "arch", "n_kv_head", "n_embd", "n_head", "block_size", "n_streams", "lr", "weight_decay",
                  "beta1", "beta2", "max_iters", "seed", "data_path", "dtype")

# train.py's options and presets for the residual and the sweep
OPTIONS = dict(
    residual=("baseline", "residual connection (mhc.py): " + " | ".join(VARIANTS)),
    n_streams=(4, "residual streams of hc, mhc and mhc-dynamic"),
    sweep=("", "'' trains the op sets; 'increment' | 'text': the mHC depth sweep on that task instead"),
    sweep_depths=("12,24,48:16", "sweep: depths, comma-separated; depth:B trains that depth with batch B"),
    sweep_variants=(",".join(VARIANTS), "sweep: residual variants, comma-separated"),
)
# The depth sweep at the published runs' settings, a short look at 24 layers, and the book.
PRESETS = {
    "mhc": dict(sweep="increment", n_embd=256, n_head=4, block_size=128, batch_size=32, lr=2e-3, weight_decay=0.0,
                max_iters=200, seed=0, out_dir="out/mhc_sweep"),
    "mhc-demo": dict(sweep="increment", sweep_depths="24", n_embd=128, n_head=4, block_size=128, batch_size=32,
                     lr=2e-3, weight_decay=0.0, max_iters=50, log_interval=10, seed=0, out_dir="out/mhc_demo"),
    "mhc-text": dict(sweep="text", sweep_depths="24,48:16", n_embd=256, n_head=4, block_size=128, batch_size=32,
                     lr=2e-3, weight_decay=0.0, max_iters=200, seed=0, out_dir="out/mhc_text"),
}


def check_config(cfg, fail):
    """The residual and sweep keys, checked before anything trains."""
    if cfg.residual not in VARIANTS:
        fail(f"--residual must be one of {', '.join(VARIANTS)}, got {cfg.residual!r}")
    if cfg.n_streams < 1:
        fail(f"--n_streams must be >= 1, got {cfg.n_streams}")
    if cfg.sweep not in ("", "increment", "text"):
        fail(f"--sweep must be '', increment or text, got {cfg.sweep!r}")
    if cfg.sweep and cfg.max_iters < 1:
        fail(f"--max_iters must be >= 1 for a sweep, got {cfg.max_iters}")
    sweep_depths(cfg, fail)
    sweep_variants(cfg, fail)


def sweep_depths(cfg, fail):
    """'12,24,48:16' -> [(12, batch_size), (24, batch_size), (48, 16)]."""
    out = []
    for item in cfg.sweep_depths.split(","):
        depth, _, batch = item.strip().partition(":")
        try:
            d, b = int(depth), int(batch) if batch else cfg.batch_size
        except ValueError:
            d = b = 0
        if d < 1 or b < 1:
            fail(f"--sweep_depths expects depths or depth:batch pairs >= 1, comma-separated, got {cfg.sweep_depths!r}")
        out.append((d, b))
    return out


def sweep_variants(cfg, fail):
    names = [v.strip() for v in cfg.sweep_variants.split(",")]
    bad = [v for v in names if v not in VARIANTS]
    if bad or len(set(names)) != len(names):
        fail(f"--sweep_variants expects distinct names from {', '.join(VARIANTS)}, got {cfg.sweep_variants!r}")
    return names


def cell_key(variant, depth):
    return f"{variant}/{depth}"  # results.json's key of a (variant, depth) cell


def residual_modules(model):
    """Every sublayer's residual module, in the order their H_res apply: P = H_res[-1] ... H_res[0]."""
    return [r for block in model.blocks for r in (block.res_attn, block.res_mlp)]


def sweep_metrics(model, loss):
    """The metrics of the training step just taken, as one (len(SWEEP_METRICS),) float64 device tensor: loss,
    gradient norm, count of NaN/Inf values in loss and gradients, and the log10 gains of the composite residual
    map of the step's forward (NaN for the baseline, which has none). The update leaves the gradients in .grad.
    Device ops only, so no step waits for the host; they run after the step, outside its timing."""
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])  # all of them, flat
    nonfinite = (~torch.isfinite(loss)).sum() + (~torch.isfinite(grads)).sum()
    gains = composite_gain_tensor(residual_maps(model))  # (3,)
    if gains is None:
        gains = torch.full((len(GAINS),), math.nan, dtype=torch.float64, device=loss.device)
    head = torch.stack([loss.double(), torch.linalg.vector_norm(grads, dtype=torch.float64)])  # float64: no overflow
    return torch.cat([head, nonfinite.double().view(1), gains])


def sweep_task(cfg, device, trainer):
    """vocab_size, batch(batch_size, generator) -> (x, y) on the device, and the eval splits (text only)."""
    if cfg.sweep == "increment":
        return SimpleNamespace(vocab_size=INCREMENT_VOCAB, splits=None,
                               batch=lambda B, g: increment_batch(B, cfg.block_size, g, device))
    tok, train_ids, val_ids = read_text_splits(cfg.data_path, cfg.block_size, trainer.fail)
    train_ids, val_ids = train_ids.to(device), val_ids.to(device)
    return SimpleNamespace(vocab_size=tok.vocab_size, splits={"train": train_ids, "val": val_ids},
                           batch=lambda B, g: get_batch(train_ids, B, cfg.block_size, g, device))


def finite_or_none(v):
    return v if math.isfinite(v) else None  # results.json stays strict JSON


def sweep_cell(cfg, ops, task, variant, depth, batch_size, trainer, stop=None):
    """Train one (variant, depth) cell for max_iters steps; return its record for results.json. A cell
    whose loss or gradients turn NaN/Inf stops at the next log point (diverged_at says where); one whose
    stop (a data.StopRequest) gets a signal stops after the step in flight (interrupted says by what)."""
    device = torch.device(cfg.device)
    on_cuda = device.type == "cuda"
    graphed = on_cuda and (cfg.cuda_graph if ops.name == "cuda" else cfg.graph_torch)
    model = trainer.model(cfg, task.vocab_size, ops, n_layer=depth, residual=variant).to(device)
    opt = trainer.optimizer(model, cfg, on_cuda, graphed)
    step = trainer.graphed(model, opt) if graphed else functools.partial(trainer.train_step, model, opt)
    batch_gen = torch.Generator().manual_seed(cfg.seed)  # every cell sees the same batches
    hist = torch.zeros(cfg.max_iters, len(SWEEP_METRICS), dtype=torch.float64, device=device)  # (steps, metrics)
    rows, diverged_at = [], None  # rows: hist read back, at log points only
    timer = trainer.timer(device, cfg)
    t0 = time.perf_counter()
    for it in range(cfg.max_iters):
        x, y = task.batch(batch_size, batch_gen)  # (B, T) each
        loss = timer.time(step, x, y)  # timed alone: the metrics are the sweep's, not a cost of the residual
        hist[it].copy_(sweep_metrics(model, loss))
        done = it + 1
        stopped = stop is not None and stop.signum is not None
        if done % cfg.log_interval and done < cfg.max_iters and not stopped:
            continue
        dt, n = timer.stop()
        rows += hist[len(rows):done].tolist()
        ops.check_errors()
        m = dict(zip(SWEEP_METRICS, rows[-1]))
        gains = "" if variant == "baseline" else f" | gain fwd {fmt_gain(m['gain_fwd'])} bwd {fmt_gain(m['gain_bwd'])}"
        print(f"  {variant:<11} L{depth:<3} | step {done:>{len(str(cfg.max_iters))}}/{cfg.max_iters}"
              f" | loss {m['loss']:.4f} | grad norm {m['grad_norm']:.3g}{gains} | {1e3 * dt / n:.1f} ms/step",
              flush=True)
        diverged_at = next((i + 1 for i, r in enumerate(rows) if r[2] > 0), None)
        if diverged_at is not None:
            print(f"  {variant:<11} L{depth:<3} | NaN/Inf from step {diverged_at}: cell stopped at step {done}")
            break
        if stopped:
            break

    names = SWEEP_METRICS[:3] if variant == "baseline" else SWEEP_METRICS
    per_step = {k: [finite_or_none(r[i]) for r in rows] for i, k in enumerate(names)}
    per_step["nonfinite"] = [int(r[2]) for r in rows]
    record = {
        "variant": variant, "depth": depth, "batch_size": batch_size, "steps": len(rows),
        "op_set": ops.name, "dtype": cfg.dtype, "mode": "graph" if graphed else "eager", "device": device_name(device),
        "diverged_at": diverged_at,
        "interrupted": signal_words(stop.signum) if stopped and done < cfg.max_iters else None,
        "nonfinite_steps": sum(1 for r in rows if r[2] > 0),
        "final": {k: per_step[k][-1] if k in per_step else None for k in SWEEP_METRICS},
        "max_gain_fwd": max((g for g in per_step.get("gain_fwd", []) if g is not None), default=None),
        "ms_per_step": 1e3 * timer.timed_s / timer.timed_steps if timer.timed_steps else None,
        "timed_steps": timer.timed_steps,
        "wall_s": time.perf_counter() - t0,
        "per_step": per_step,
    }
    if task.splits is not None and not record["interrupted"]:  # the book: held-out text, the same windows each cell
        eval_cfg = SimpleNamespace(**{**vars(cfg), "batch_size": batch_size})
        record["eval"] = {k: finite_or_none(v) for k, v in trainer.estimate_loss(model, task.splits, eval_cfg).items()}
    return record


def load_sweep(path, settings, fail):
    """The cells already in path, or {} if there is none; exits if they were made with other settings."""
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        old = json.load(f)
    theirs = old.get("settings") if isinstance(old, dict) else None
    if theirs != settings:
        diff = "not a sweep's results" if not isinstance(theirs, dict) else ", ".join(
            f"{k}={theirs.get(k)!r} (now {v!r})" for k, v in settings.items() if theirs.get(k) != v)
        fail(f"{path} holds results made with other settings: {diff}; pass another --out_dir or move it away")
    return old["cells"]


def run_sweep(cfg, ops, trainer):
    """The sweep of cfg on the op set ops; trainer (train.SWEEP_TRAINER) builds, steps and evaluates models."""
    device = torch.device(cfg.device)
    graphed = device.type == "cuda" and (cfg.cuda_graph if ops.name == "cuda" else cfg.graph_torch)
    settings = {**{k: getattr(cfg, k) for k in SWEEP_SETTINGS}, "op_set": ops.name}
    path = os.path.join(cfg.out_dir, "results.json")
    cells = load_sweep(path, settings, trainer.fail)
    task = sweep_task(cfg, device, trainer)
    todo = [(v, d, b) for d, b in sweep_depths(cfg, trainer.fail) for v in sweep_variants(cfg, trainer.fail)]
    print(f"mHC sweep on the {'incrementing-token task' if cfg.sweep == 'increment' else 'book'}: "
          f"{len(todo)} cells | {ops.name} op set ({'graph' if graphed else 'eager'}, {cfg.dtype}) on "
          f"{device_name(device)} | "
          f"{cfg.max_iters} steps, {cfg.n_embd} wide, {cfg.n_head} heads, context {cfg.block_size}, "
          f"{cfg.n_streams} streams, lr {cfg.lr:g} | {path}")

    def finished(old, batch):  # a cell in results.json that a rerun skips
        return old is not None and old["batch_size"] == batch and not old.get("interrupted")

    # ETA: a cell's time taken as proportional to depth x batch (the same steps and width for all).
    work_left = sum(d * b for v, d, b in todo if not finished(cells.get(cell_key(v, d)), b))
    work_done, t_run = 0, time.perf_counter()
    with StopRequest() as stop:  # Ctrl-C or SIGTERM: the cell in flight stops after its step and is saved
        for i, (variant, depth, batch) in enumerate(todo, 1):
            tag = f"[{i}/{len(todo)}] {variant} L{depth}"
            old = cells.get(cell_key(variant, depth))
            if finished(old, batch):
                print(f"{tag}: already in {path}, skipping")
                continue
            if stop.signum is not None:
                stop_sweep(stop, "between two cells", cells, path)
            if old is not None:
                print(f"{tag}: " + (f"interrupted at step {old['steps']}" if old.get("interrupted") else
                                    f"recorded with batch {old['batch_size']}") + f", training again with batch {batch}")
            print(f"{tag}: training, batch {batch}", flush=True)
            cells[cell_key(variant, depth)] = rec = sweep_cell(cfg, ops, task, variant, depth, batch, trainer, stop)
            os.makedirs(cfg.out_dir, exist_ok=True)
            results = {"settings": settings, "cells": cells}
            write_json(path, results)
            if rec["interrupted"]:
                stop_sweep(stop, f"at step {rec['steps']} of {cfg.max_iters} of {variant} L{depth} (its steps so far "
                                 f"are kept, marked interrupted; the next run trains it again)", cells, path)
            work_done, work_left = work_done + depth * batch, work_left - depth * batch
            elapsed = time.perf_counter() - t_run
            print(f"{tag}: done in {fmt_seconds(rec['wall_s'])}, final loss {fmt_float(rec['final']['loss'], '.4f')}"
                  f" | sweep {fmt_seconds(elapsed)} elapsed, eta {fmt_seconds(elapsed / work_done * work_left)}",
                  flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the next cell starts from the same free memory

    print()
    print("\n".join(sweep_table(cells)))
    if cfg.plot:
        plot_sweep(cells, cfg.out_dir)


def stop_sweep(stop, where, cells, path):
    """Ends an interrupted sweep: one line that says where, what is kept, and how to go on; the exit code of the
    signal."""
    done = sum(1 for c in cells.values() if not c.get("interrupted"))
    sys.stderr.write(f"train.py: interrupted by {signal_words(stop.signum)} {where}; {path} holds the {done} finished "
                     f"cell(s); run the same command to train the others\n")
    sys.exit(signal_exit(stop.signum))


def fmt_float(v, spec):
    return "nan" if v is None else format(v, spec)


def fmt_gain(v):
    """A log10 gain to 2 decimals; mhc's -4e-7 (float32 row sums) prints 0.00, not -0.00."""
    return fmt_float(v if v is None or math.isnan(v) else round(v, 2) + 0.0, ".2f")


def sweep_cells_in_order(cells):
    order = {v: i for i, v in enumerate(VARIANTS)}
    return sorted(cells.values(), key=lambda c: (c["depth"], order[c["variant"]]))


def sweep_table(cells):
    """A markdown table of every cell in results.json: final values, NaN/Inf, speed against the baseline."""
    text = any("eval" in c for c in cells.values())
    cols = ["variant", "depth", "batch", "steps", "final loss"] + (["val loss"] if text else []) + [
        "gain proxy", "gain fwd", "gain bwd", "max gain fwd", "NaN/Inf steps", "ms/step", "x baseline"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for c in sweep_cells_in_order(cells):
        f = c["final"]
        base = cells.get(cell_key("baseline", c["depth"]), {}).get("ms_per_step")
        ms = c["ms_per_step"]
        nan = str(c["nonfinite_steps"])
        if c["diverged_at"] is not None:
            nan += f" (from step {c['diverged_at']}; stopped at {c['steps']})"
        gains = ["-"] * 4 if c["variant"] == "baseline" else [
            fmt_gain(v) for v in [f[f"gain_{g}"] for g in GAINS] + [c["max_gain_fwd"]]]
        steps = str(c["steps"]) + (" (interrupted)" if c.get("interrupted") else "")
        row = [c["variant"], str(c["depth"]), str(c["batch_size"]), steps, fmt_float(f["loss"], ".4g")]
        row += [fmt_float(c.get("eval", {}).get("val"), ".4f")] if text else []
        row += gains + [nan, fmt_float(ms, ".1f") if ms else "n/a",
                        f"{ms / base:.2f}x" if ms and base else "n/a"]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("gains: log10 of the composite residual map's max |P_ij| (proxy), max row sum (fwd) and max column "
                 "sum (bwd), max over tokens, at the last step; max gain fwd: over all steps; ms/step: the training "
                 "steps of each cell after warm-up, device time (the metrics read after each step not counted)")
    return lines


def plot_sweep(cells, out_dir):
    """loss_per_step.png (a panel per depth), gain_vs_depth.png and gain_per_step.png (log-scale gains)."""
    plt = pyplot()
    if plt is None:
        return
    cells = sweep_cells_in_order(cells)
    color = {v: f"C{i}" for i, v in enumerate(VARIANTS)}
    fig = SimpleNamespace(
        plt=plt, cells=cells, depths=sorted({c["depth"] for c in cells}), color=color,
        style={v: dict(color=color[v], ls="--" if v == "mhc-dynamic" else "-") for v in VARIANTS},  # mhc's twin
        hc_cells=[c for c in cells if c["variant"] != "baseline"])
    fig.width = max(4.2 * len(fig.depths), 6.0)
    written = [os.path.join(out_dir, name) for name in ("loss_per_step.png", "gain_vs_depth.png", "gain_per_step.png")]
    for draw, path in zip((plot_loss_per_step, plot_gain_vs_depth, plot_gain_per_step), written):
        figure = draw(fig)
        figure.tight_layout()
        figure.savefig(path, dpi=110)
        plt.close(figure)
    print("wrote " + ", ".join(written))


def nan_gaps(xs):  # None (a diverged step) -> NaN: a gap in the line
    return [math.nan if x is None else x for x in xs]


def gains_of(xs):  # log10 gains back to gains, None -> NaN
    return [math.nan if x is None else 10.0 ** x for x in xs]


def plot_loss_per_step(f):
    fig, axes = f.plt.subplots(1, len(f.depths), figsize=(f.width, 3.6), squeeze=False, sharey=True)
    for ax, d in zip(axes[0], f.depths):
        for c in (c for c in f.cells if c["depth"] == d):
            ax.semilogy(range(1, c["steps"] + 1), nan_gaps(c["per_step"]["loss"]), lw=1, **f.style[c["variant"]],
                        label=c["variant"] + (f" (NaN from step {c['diverged_at']})" if c["diverged_at"] else ""))
        ax.set_title(f"{d} layers")
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    axes[0, 0].set_ylabel("training loss (log scale)")
    fig.suptitle("loss per step, each residual variant")
    return fig


def plot_gain_vs_depth(f):
    def last_finite(c, g):  # a diverged cell: the gain of its last step with finite weights
        return next((x for x in reversed(c["per_step"][f"gain_{g}"]) if x is not None), None)

    fig, axes = f.plt.subplots(1, 3, figsize=(12, 3.6), squeeze=False)
    for ax, g in zip(axes[0], GAINS):
        for v in VARIANTS[1:]:
            cs = [c for c in f.hc_cells if c["variant"] == v]
            if cs:
                ax.semilogy([c["depth"] for c in cs], gains_of([last_finite(c, g) for c in cs]), marker="o",
                            **f.style[v], label=v)
        bad = [c for c in f.hc_cells if c["diverged_at"]]
        if bad:
            ax.semilogy([c["depth"] for c in bad], gains_of([last_finite(c, g) for c in bad]), "x", ms=12,
                        color="black", label="NaN/Inf: its last finite value")
        ax.axhline(1.0, color=f.color["baseline"], ls=":", lw=1, label="baseline (identity)")
        ax.set_xticks(f.depths)
        ax.set_xlabel("layers")
        ax.set_title({"proxy": "max |P_ij| (proxy)", "fwd": "forward Amax gain (max row sum)",
                      "bwd": "backward Amax gain (max column sum)"}[g], fontsize=10)
    axes[0, 0].set_ylabel("gain at the last step (log scale)")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle("gain of the composite residual map P = H_res[2L-1]...H_res[0] (two per layer) at the last step")
    return fig


def plot_gain_per_step(f):
    fig, axes = f.plt.subplots(2, len(f.depths), figsize=(f.width, 6.2), squeeze=False, sharex=True)
    for col, d in enumerate(f.depths):
        for row, g in enumerate(("fwd", "bwd")):
            ax = axes[row, col]
            for c in (c for c in f.hc_cells if c["depth"] == d):
                series = c["per_step"][f"gain_{g}"]
                ax.semilogy(range(1, c["steps"] + 1), gains_of(series), lw=1, **f.style[c["variant"]],
                            label=c["variant"])
                if c["diverged_at"] and any(x is not None for x in series):  # a line may be a single point
                    last = max(i for i, x in enumerate(series) if x is not None)
                    ax.semilogy([last + 1], gains_of([series[last]]), "x", ms=10, color=f.color[c["variant"]],
                                label=f"{c['variant']}: last finite value")
            ax.axhline(1.0, color=f.color["baseline"], ls=":", lw=1, label="baseline (identity)")
            ax.set_title(f"{d} layers: {g} gain", fontsize=10)
        axes[1, col].set_xlabel("step")
    axes[0, 0].set_ylabel("max row sum of P (log scale)")
    axes[1, 0].set_ylabel("max column sum of P (log scale)")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle("Amax gain of the composite residual map per step")
    return fig
