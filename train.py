"""Train a character-level GPT twice, once per op set, and compare the runs.

The model is written once against an op namespace (OP_NAMES, and split). The "torch" op set maps the names
to PyTorch, the "cuda" op set to this repo's kernels, forward and backward. Both runs start from the same
weights and see the same batches, so their loss curves agree to float32 rounding and the tokens/s ratio is
the speedup. With --dtype=bf16 both run under torch.autocast from fp32 master weights (the cuda op set on
our bf16 kernels) and agree to bf16 rounding.

    python train.py                                   # both op sets, default tiny config
    python train.py --preset=large                    # nanoGPT's char recipe: 6 x 384, context 256, dropout 0.2, cosine lr
    python train.py --device=cpu --max_iters=50       # PyTorch op set only
    python train.py --resume=true --max_iters=2000    # continue from out/ckpt_<op set>.pt
    python train.py --dtype=bf16 --compile=true       # mixed precision: autocast vs our bf16 kernels, compiled
    python train.py --residual=mhc --n_layer=24       # mHC residual streams (mhc.py) instead of x + F(x)
    python train.py --preset=mhc                      # the mHC depth sweep (--preset=mhc-demo: one depth)
    torchrun --standalone --nproc_per_node=2 train.py # DistributedDataParallel over 2 GPUs, batch per rank

Every default below can be overridden with --key=value; python train.py --help lists them.
"""

import contextlib
import functools
import gc
import math
import os
import shlex
import signal
import sys
import time
import warnings
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import mhc
from data import (BACKENDS, NO_TIMING, ONE_PROCESS, CallTimer, StepTimer, StopRequest, all_finite, check_at_least,
                  check_backend_and_device, cuda_kernels_for, device_name, fmt_seconds, get_batch, import_kernels,
                  is_out_of_memory, load_checkpoint, lost_other_ranks, make_out_dir, one_line, out_dir_lock,
                  out_of_memory_words, parse_options, plot_losses, print_options, read_text_splits,
                  register_inductor_fallbacks, save_checkpoint, sigterm_interrupts, signal_exit, signal_of, signal_words,
                  start_ranks, write_json)

# -----------------------------------------------------------------------------
# options: key=(default, what it means). Override with --key=value, parsed as the default's type;
# python train.py --help prints this table.
PRESETS = {
    # nanoGPT's char recipe, its lr schedule too; the book's 187k characters are soon learned by heart: with the
    # decay over 1200 steps validation was lowest at step 700, so it ends at 800
    "large": dict(n_layer=6, n_head=6, n_embd=384, block_size=256, batch_size=64, dropout=0.2, max_iters=800,
                  lr=1e-3, lr_schedule="cosine", warmup_iters=100, min_lr=1e-4, out_dir="out/large"),
    **mhc.PRESETS,  # the mHC depth sweeps
}
OPTIONS = dict(
    batch_size=(16, "sequences per training step"),
    block_size=(64, "context length in characters"),
    n_embd=(128, "model width"),
    n_head=(4, "attention heads; the fused attention kernel takes n_embd // n_head in "
                  "kernels.LIMITS['fused_head_sizes']"),
    n_layer=(4, "transformer blocks"),
    arch=("gpt", "gpt: LayerNorm, learned positions, GELU MLP, biases | llama: RMSNorm, RoPE, SwiGLU, no biases"),
    dropout=(0.0, "training's dropout, in [0, 1): on the embeddings, the attention probabilities and the attention "
                  "and MLP outputs; both op sets draw the same masks (torch_dropout); 0: none, not even the draws"),
    n_kv_head=(0, "key/value heads dividing n_head (grouped-query attention); 0: n_head (gpt), n_head // 2 (llama)"),
    lr=(3e-4, "AdamW learning rate, > 0: the whole run's (constant schedule) or the peak (cosine)"),
    lr_schedule=("constant", "constant: --lr throughout, no lr updates in the graphed step | cosine: nanoGPT's, "
                             "--warmup_iters of linear warm-up, then a cosine down to --min_lr at --max_iters (lr_at)"),
    warmup_iters=(0, "cosine: warm-up steps, < max_iters; step it (from 0) of them trains at lr * (it + 1) / "
                     "(warmup_iters + 1)"),
    min_lr=(1e-4, "cosine: the lr reached at --max_iters, in (0, --lr]; a resume to another --max_iters reshapes "
                  "the decay from there"),
    weight_decay=(0.1, "AdamW decay, on weight matrices and embeddings only (not biases or LayerNorm)"),
    beta1=(0.9, "AdamW first-moment decay, in [0, 1)"),
    beta2=(0.99, "AdamW second-moment decay, in [0, 1) (nanoGPT's value for small char models)"),
    max_iters=(1000, "training steps per op set (with --resume=true: the iteration to reach)"),
    eval_interval=(100, "estimate train/val loss and write a checkpoint every this many steps, and at the end"),
    eval_iters=(20, "batches per loss estimate"),
    log_interval=(50, "print loss and speed every this many steps (the only host syncs while training)"),
    timing_warmup=(10, "first steps of a run left out of tokens/s (allocator growth, library init, graph capture)"),
    seed=(1337, "seeds the weights, the batch order, the eval batches and the text sample"),
    device=("cuda" if torch.cuda.is_available() else "cpu", "cuda, cuda:N or cpu (cpu: the PyTorch op set only)"),
    backend=("both", "which op sets to train, torch first: " + ", ".join(BACKENDS)),
    cuda_graph=(True, "cuda op set on a GPU: capture the whole training step in one CUDA graph"),
    graph_torch=(False, "torch op set on a GPU: capture it too, for a like-for-like graphed comparison"),
    compile=(False, "both op sets on a GPU: forward, loss and backward through torch.compile(mode='reduce-overhead') "
                    "(its own CUDA graphs, in place of --cuda_graph); not with --graph_torch=true or --sweep"),
    dtype=("fp32", "fp32 | bf16: bf16 matmuls, attention and activations from fp32 master weights, fp32 norms' "
                   "statistics, softmax and loss (torch: autocast; cuda: the bf16 kernels, Hopper)"),
    data_path=(None, "UTF-8 text to train on; None: the Wizard of Oz from data_cache/, downloaded once"),
    out_dir=("out", "folder for checkpoints, results.json and loss.png (the presets set folders of their own)"),
    preset=("", "'' or " + ", ".join(PRESETS) + ": applied before the other overrides"),
    resume=(False, "continue each op set from out_dir/ckpt_<op set>.pt"),
    overwrite=(False, "let a fresh run replace the checkpoints already in out_dir"),
    sample_len=(300, "characters generated by each trained model at the end"),
    plot=(True, "write out_dir/loss.png (needs matplotlib)"),
    **mhc.OPTIONS,  # --residual, --n_streams and the sweep's
    dist_timeout=(300, "under torchrun: seconds a rank waits for the others before it stops with an error"),
)
DEFAULTS = {k: v for k, (v, _) in OPTIONS.items()}
HELP = {k: h for k, (_, h) in OPTIONS.items()}
LN_EPS = 1e-5
GRAPH_WARMUP = 3                  # eager steps before capture, as in PyTorch's whole-network capture recipe


def fail(msg):
    sys.exit(f"train.py: error: {msg}")


def print_help():
    print_options("train.py", "Train the char GPT on each op set and compare the runs.", OPTIONS)
    print("\n--preset choices:\n  ''     the defaults above")
    for name, values in PRESETS.items():
        print(f"  {name:<6} " + ", ".join(f"{k}={v}" for k, v in values.items()))
    print("--backend choices:\n  both   torch, then cuda, compared (the torch op set only without a GPU)\n"
          "  torch  torch.nn.functional\n  cuda   this repo's kernels (needs a GPU and the built extension)")


def parse_config(argv):
    """DEFAULTS, then the preset, then the other --key=value overrides, each parsed as its default's type."""
    cfg, given = parse_options(argv, OPTIONS, fail, print_help, PRESETS)
    cfg.world_size = int(os.environ.get("WORLD_SIZE", "1"))  # processes torchrun started (1 without it)
    check_at_least(cfg, 1, ("batch_size", "block_size", "n_embd", "n_head", "n_layer", "eval_interval", "eval_iters",
                            "log_interval", "dist_timeout"), fail)
    check_at_least(cfg, 0, ("max_iters", "timing_warmup", "sample_len", "warmup_iters"), fail)
    check_arch(cfg, fail)
    # torch.optim checks these too, but only once training starts, and with a traceback.
    if not cfg.lr > 0:
        fail(f"--lr must be > 0, got {cfg.lr}")
    if cfg.weight_decay < 0:
        fail(f"--weight_decay must be >= 0, got {cfg.weight_decay}")
    for key in ("beta1", "beta2"):
        if not 0 <= getattr(cfg, key) < 1:
            fail(f"--{key} must be in [0, 1), got {getattr(cfg, key)}")
    check_backend_and_device(cfg, fail)
    check_compile(cfg)
    if cfg.dtype not in DTYPES:
        fail(f"--dtype must be fp32 or bf16, got {cfg.dtype!r}")
    if not 0 <= cfg.dropout < 1:
        fail(f"--dropout must be in [0, 1), got {cfg.dropout}")
    if cfg.dropout and cfg.sweep:
        fail(f"--dropout applies to the op sets' training runs, not to the mHC sweep (--sweep={cfg.sweep})")
    check_lr_schedule(cfg, given)
    if given:
        print("overrides: " + ", ".join(f"{k}={getattr(cfg, k)}" for k in given))
    return cfg


def check_lr_schedule(cfg, given):
    """--lr_schedule and the cosine's --warmup_iters and --min_lr."""
    if cfg.lr_schedule not in LR_SCHEDULES:
        fail(f"--lr_schedule must be {' or '.join(LR_SCHEDULES)}, got {cfg.lr_schedule!r}")
    if cfg.lr_schedule == "constant":
        if any(k in given for k in ("warmup_iters", "min_lr")):
            print("note: --warmup_iters and --min_lr shape --lr_schedule=cosine; a constant one trains at --lr")
        return
    if cfg.sweep:
        fail(f"--lr_schedule={cfg.lr_schedule} applies to the op sets' training runs; the mHC sweep (--sweep="
             f"{cfg.sweep}) trains at a constant --lr")
    if not 0 < cfg.min_lr <= cfg.lr:
        fail(f"--min_lr must be in (0, --lr] = (0, {cfg.lr:g}] with --lr_schedule={cfg.lr_schedule}, got {cfg.min_lr}")
    if cfg.max_iters and cfg.warmup_iters >= cfg.max_iters:  # (--max_iters=0 runs no step: no lr to schedule)
        fail(f"--warmup_iters must be < --max_iters ({cfg.max_iters}) with --lr_schedule={cfg.lr_schedule}, got "
             f"{cfg.warmup_iters}: a shorter run needs a shorter warm-up")


def check_arch(cfg, fail):
    """--arch, --n_head, --n_kv_head and --n_embd fit together; n_kv_head = 0 becomes its default."""
    if cfg.arch not in ARCHS:
        fail(f"--arch must be one of {', '.join(ARCHS)}, got {cfg.arch!r}")
    if cfg.n_embd % cfg.n_head:
        fail(f"--n_embd ({cfg.n_embd}) must be a multiple of --n_head ({cfg.n_head})")
    if cfg.n_kv_head < 0 or (cfg.n_kv_head and cfg.n_head % cfg.n_kv_head):
        fail(f"--n_kv_head must divide --n_head ({cfg.n_head}) (or be 0 for the default), got {cfg.n_kv_head}")
    if cfg.arch == "llama" and not cfg.n_kv_head and cfg.n_head % 2:
        print(f"note: --arch=llama shares each K/V head between two query heads, which an odd --n_head={cfg.n_head} "
              f"cannot do: one K/V head per query head; --n_kv_head=N (a divisor of {cfg.n_head}) groups them")
    cfg.n_kv_head = kv_heads(cfg.arch, cfg.n_head, cfg.n_kv_head)
    if cfg.arch == "llama" and (cfg.n_embd // cfg.n_head) % 2:
        fail(f"--arch=llama needs an even head size for RoPE's pairs; n_embd / n_head = {cfg.n_embd // cfg.n_head}")


def check_compile(cfg):
    """--compile=true only on a GPU, for the op sets' runs, and where nothing else graphs the torch step."""
    if not cfg.compile:
        return
    if cfg.graph_torch:
        fail("--compile=true and --graph_torch=true both put the torch op set's step in CUDA graphs "
             "(reduce-overhead records its own); pass one of them")
    if cfg.sweep:
        fail(f"--compile=true applies to the op sets' training runs, not to the mHC sweep (--sweep={cfg.sweep})")
    if torch.device(cfg.device).type != "cuda":
        fail(f"--compile=true needs a GPU (mode='reduce-overhead' replays CUDA graphs), but --device={cfg.device}")


# -----------------------------------------------------------------------------
# op sets: the same names, signatures and meaning, one on PyTorch, one on our kernels.
# The torch op set is also the reference test_ops.py proves every kernel against.

def torch_attention(q, k, v, causal=False, scale=None, kv_len=None, dropout_p=0.0, rng=None, salt=0):
    """SDPA with this repo's causal convention: q (B, H, Sq, D), k and v (B, H_kv, Sk, D); with causal,
    query i sees keys j <= i + Sk - Sq, so the queries line up with the *last* keys (SDPA's is_causal
    lines them up with the first, which would let one new query against a KV cache see key 0 only).
    kv_len (a 1-element int64 tensor) says how many leading keys are valid, as in a preallocated KV
    cache: the others are ignored and the queries line up with the last valid key. It stays on the
    device, so a decode step that uses it can be captured in a CUDA graph.
    With H_kv < H (grouped-query attention) each K/V head serves H / H_kv consecutive query heads; they are
    repeated here (SDPA's enable_gqa would do the same, but its fp32 CUDA path is the unfused math one).
    dropout_p > 0: dropout on the probabilities with torch_dropout's masks (row (b * H + h) * Sq + i, column
    j), spelled out in fp32 (SDPA's own dropout draws other masks)."""
    if k.shape[1] != q.shape[1]:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    Sq, Sk = q.shape[-2], k.shape[-2]
    if kv_len is None and (not causal or Sq == Sk) and not dropout_p:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    i = torch.arange(Sq, device=q.device)[:, None]  # (Sq, 1)
    j = torch.arange(Sk, device=q.device)[None, :]  # (1, Sk)
    n = Sk if kv_len is None else kv_len  # valid keys
    mask = j < n
    if causal:
        mask = mask & (j <= i + (n - Sq))
    if not dropout_p:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32  # the tests' references in float64
    with torch.autocast(q.device.type, enabled=False):
        s = torch.matmul(q.to(dtype), k.to(dtype).transpose(-1, -2)) * scale  # (B, H, Sq, Sk)
        p = torch.softmax(s.masked_fill(~mask, -math.inf), dim=-1).masked_fill(~mask.any(-1, keepdim=True), 0.0)
        p = torch_dropout(p.flatten(0, 2), dropout_p, rng, salt).view(p.shape)  # rows (b * H + h) * Sq + i
        return torch.matmul(p, v.to(dtype)).to(q.dtype)


# Dropout's masks, as kernels.cu draws them (its section 1.8): element (r, c) of a matrix is kept where the
# 16-bit number lane(c) of philox(counter = (unit(c), r, salt, offset), key = seed) is >= round(p * 65536).
# Philox4x32-10 in int64 tensors (32-bit words), on the device and without a host sync, so a CUDA graph
# replays it with the rng's new offset.
PHILOX_M = (0xD2511F53, 0xCD9E8D57)  # the round's multipliers
PHILOX_W = (0x9E3779B9, 0xBB67AE85)  # the key's Weyl increments
WORD = 0xFFFFFFFF


def mulhilo(a, m):
    """(high, low) 32-bit words of a * m, for a tensor a of 32-bit words and a 32-bit m: by 16-bit halves of a,
    so no product leaves int64."""
    p_lo, p_hi = (a & 0xFFFF) * m, (a >> 16) * m  # each < 2^48
    t = p_lo + ((p_hi & 0xFFFF) << 16)
    return ((p_hi >> 16) + (t >> 32)) & WORD, t & WORD


def philox(c, key):
    """Philox4x32-10 of the counters c (4 tensors or ints of 32-bit words, broadcast together) under key (2)."""
    (c0, c1, c2, c3), (k0, k1) = c, key
    for r in range(10):
        if r:
            k0, k1 = (k0 + PHILOX_W[0]) & WORD, (k1 + PHILOX_W[1]) & WORD
        hi0, lo0 = mulhilo(c0, PHILOX_M[0])
        hi1, lo1 = mulhilo(c2, PHILOX_M[1])
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def dropout_keep(rows, cols, p, rng, salt, device):
    """The (rows, cols) mask drawn from rng (int64 {seed, offset}) at call site salt: True where kept."""
    c = torch.arange(cols, device=device)
    unit, lane = (c >> 5) * 4 + ((c & 7) >> 1), ((c >> 3) & 3) * 2 + (c & 1)  # (cols,) each
    units = torch.arange(-(-cols // 32) * 4, device=device)  # the row's counters
    r = torch.arange(rows, device=device)[:, None]
    seed, offset = rng[0], rng[1] & WORD  # device tensors; nothing here copies from the host, so a CUDA
    # graph can capture it (the torch op set's graphed step)
    words = torch.stack(philox((units, r, salt, offset), (seed & WORD, (seed >> 32) & WORD)), -1)  # (rows, units, 4)
    draw = (words[:, unit, lane >> 1] >> (16 * (lane & 1))) & 0xFFFF  # (rows, cols)
    return draw >= math.floor(p * 65536 + 0.5)


def torch_dropout(x, p, rng, salt=0):
    """x times its dropout factors, 1 / (1 - p) where kept, 0 where dropped: x seen as rows of its last dim,
    masks from dropout_keep (kernels.dropout's). The factor is rounded to fp32; a bf16 x is multiplied in fp32
    and rounded once (the tests' float64 x in float64)."""
    cols = x.shape[-1] if x.dim() else 1
    keep = dropout_keep(x.numel() // max(cols, 1), cols, p, rng, salt, x.device).view(x.shape)
    scale = torch.full((), 1 / (1 - p) if p < 1 else 0.0, dtype=torch.float32, device=x.device)
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (x.to(dtype) * torch.where(keep, scale, 0.0).to(dtype)).to(x.dtype)


def torch_expert_gemv(weight, x, bias, experts):
    """Row s of the result is weight[experts[s]] @ x[s] + bias[experts[s]]: weight (E, N, K), x (S, K),
    bias (E, N) or None, experts (S,) int64. Indexing by a device tensor gathers (copies) the chosen
    experts' weights: plain PyTorch has no way to read them in place without a host sync."""
    y = torch.bmm(weight[experts], x.unsqueeze(-1)).squeeze(-1)  # (S, N)
    return y if bias is None else y + bias[experts]


def torch_topk(x, k):
    """The k largest of the last dim, largest first, as kernels.topk orders them: equal values by lower index,
    NaN above every number. torch.topk leaves the order of ties open, so a router that meets a tie (common
    in bf16) could pick other experts on the two op sets; a stable sort settles it."""
    values, idx = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[..., :k], idx[..., :k]


def torch_kv_write(k_cache, v_cache, positions, k, v):
    """Writes k and v (B, H, T, D) into the caches (B, H, S, D) at positions (T,) along dim 2, in place."""
    k_cache.index_copy_(2, positions, k)
    v_cache.index_copy_(2, positions, v)


def torch_rope(x, cos, sin):
    """Rotary position embedding with the 'rotate half' pairing (element i with i + D/2): x (B, H, T, D),
    cos and sin (T, D/2) the angles of the T tokens' positions."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def torch_add_layernorm(x, y, weight, bias, eps=LN_EPS):
    """(s, layernorm(s)) with s = x + y: the residual add that ends a sublayer and the norm that starts the
    next, one op so that our kernels can do both in one pass (kernels.add_layernorm)."""
    s = x + y
    return s, F.layer_norm(s, s.shape[-1:], weight, bias, eps)


def torch_add_rmsnorm(x, y, weight, eps=LN_EPS):
    """(s, rmsnorm(s)) with s = x + y, as torch_add_layernorm."""
    s = x + y
    return s, F.rms_norm(s, s.shape[-1:], weight, eps)


def join_last(parts):
    """torch.cat(parts, dim=-1), with no copy when the parts already lie side by side in one tensor: same
    storage, dtype, shape but the last dim and strides, each starting where the one before ends, rows
    contiguous and at least as far apart as the joined width."""
    first, offset = parts[0], parts[0].storage_offset()
    for p in parts:
        if (p.dtype != first.dtype or p.device != first.device or p.stride() != first.stride()
                or p.shape[:-1] != first.shape[:-1] or p.storage_offset() != offset
                or p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            return torch.cat(parts, -1)
        offset += p.shape[-1]
    width = offset - first.storage_offset()
    if first.stride(-1) != 1 or (first.dim() > 1 and first.stride(-2) < width):
        return torch.cat(parts, -1)
    return first.as_strided((*first.shape[:-1], width), first.stride(), first.storage_offset())


class JoinedSplit(torch.autograd.Function):
    """x.split(sizes, dim=-1), the cuda op set's split of the attention's q, k, v projection: its backward
    joins the parts' gradients with join_last, where split's concatenates them into a new tensor. The
    fused attention's backward writes dq, dk and dv side by side in one buffer when q, k and v are such
    views, so the join is free (the concatenation copied 37 MB a layer of the large preset). The llama
    arch's q and k reach attention through RoPE, as new tensors: there join_last copies."""

    @staticmethod
    def forward(ctx, x, sizes):
        return x.split(sizes, dim=-1)

    @staticmethod
    def backward(ctx, *grads):
        return join_last(grads), None


def joined_split(x, sizes):
    """The cuda op set's split: JoinedSplit where a gradient will flow back, else a plain split (decoding
    skips autograd.Function's overhead, once per layer and token). Under torch.compile a plain split too:
    join_last reads storage pointers, which a traced graph does not have (Inductor plans the copy)."""
    if torch.is_grad_enabled() and x.requires_grad and not torch.compiler.is_compiling():
        return JoinedSplit.apply(x, sizes)
    return x.split(sizes, dim=-1)


TORCH_OPS = SimpleNamespace(
    name="torch",
    autocast=contextlib.nullcontext,  # the precision context GPT.forward runs in (bf16: torch.autocast)
    embedding=F.embedding,
    layernorm=lambda x, weight, bias, eps=LN_EPS: F.layer_norm(x, x.shape[-1:], weight, bias, eps),
    rmsnorm=lambda x, weight, eps=LN_EPS: F.rms_norm(x, x.shape[-1:], weight, eps),
    add_layernorm=torch_add_layernorm,
    add_rmsnorm=torch_add_rmsnorm,
    linear=F.linear,
    matmul=torch.matmul,
    attention=torch_attention,
    split=lambda x, sizes: x.split(sizes, dim=-1),
    gelu=F.gelu,
    silu=F.silu,
    swiglu=lambda a, b: F.silu(a) * b,
    rope=lambda x, cos, sin: torch_rope(x, cos, sin).to(x.dtype),  # bf16 x: rotated in fp32, rounded once
    softmax=lambda x: torch.softmax(x, -1),
    dropout=torch_dropout,
    cross_entropy=F.cross_entropy,
    gemv=lambda weight, x, bias=None: torch.mv(weight, x) if bias is None else torch.addmv(bias, weight, x),
    expert_gemv=torch_expert_gemv,
    kv_write=torch_kv_write,
    topk=torch_topk,
    sinkhorn=mhc.sinkhorn_torch,
    hc_project=mhc.hc_project_torch, hc_coeffs=mhc.hc_coeffs_torch, hc_pre=mhc.hc_pre_torch,  # mhc-dynamic's
    hc_mix_pre=mhc.hc_mix_pre_torch,
    stream_merge=mhc.stream_merge_torch,
    stream_mix=mhc.stream_mix_torch, stream_mix_merge=mhc.stream_mix_merge_torch,
    check_errors=lambda: None,  # kernels.check_errors raises our bad indices; PyTorch reports its own
)
# the ops kernels.cu implements; split is no kernel (the cuda op set's is joined_split)
OP_NAMES = sorted(k for k in vars(TORCH_OPS) if k not in ("name", "autocast", "split"))
DTYPES = ("fp32", "bf16")


def precision(dtype, device):
    """The context GPT.forward runs in: none for fp32; for bf16 torch.autocast, for both op sets. Our ops'
    autocast kernels (bindings.cpp) make PyTorch's casts (products in bf16 from the fp32 master weights,
    softmax and the loss in fp32, the embedding and the residual stream in fp32) except that our norms,
    computing in fp32, write bf16, the next product's input, where PyTorch's write fp32."""
    if dtype == "fp32":
        return contextlib.nullcontext
    return functools.partial(torch.autocast, torch.device(device).type, dtype=torch.bfloat16)


def torch_op_set(dtype="fp32", device="cuda"):
    """The torch op set; with bf16, GPT.forward runs under torch.autocast(bfloat16) on `device`."""
    return TORCH_OPS if dtype == "fp32" else SimpleNamespace(**{**vars(TORCH_OPS), "autocast": precision(dtype, device)})


def cuda_op_set(kernels, head_size, dtype="fp32"):
    """Our kernels under the same names. Every forward and backward runs in kernels.cu; autograd pairs
    them in bindings.cpp. Attention is the fused kernel where it supports the head size, else tiled (in fp32,
    its output rounded to bf16 under autocast); 'fp32' (3xTF32) matches SDPA's fp32 accuracy, which the curve
    comparison relies on. With bf16, the same ops under torch.autocast, as the torch op set."""
    mode = "fused" if head_size in kernels.LIMITS["fused_head_sizes"] else "tiled"
    ops = SimpleNamespace(name="cuda", autocast=precision(dtype, "cuda"),
                          split=joined_split, **{n: getattr(kernels, n) for n in OP_NAMES})
    ops.attention = functools.partial(kernels.attention, mode=mode, precision="fp32")
    return ops


def choose_op_sets(cfg):
    """The op sets to train, in order, plus notes to print. Exits if --backend=cuda cannot run."""
    torch_ops = torch_op_set(cfg.dtype, cfg.device)
    if cfg.backend == "torch":
        return [torch_ops], []
    kernels, why = cuda_kernels_for(cfg.device, cfg.dtype == "bf16")
    if why is not None:
        if cfg.backend == "cuda":
            fail(f"--backend=cuda cannot run: {why}")
        return [torch_ops], [f"note: training the PyTorch op set only: {why}"]
    head_size = cfg.n_embd // cfg.n_head
    notes = []
    if head_size not in kernels.LIMITS["fused_head_sizes"] and cfg.dropout:
        fail(f"--dropout: the cuda op set drops attention probabilities in its fused kernels, whose head sizes are "
             f"{kernels.LIMITS['fused_head_sizes']}, not {head_size}; change --n_embd / --n_head or pass --backend=torch")
    if head_size not in kernels.LIMITS["fused_head_sizes"]:
        notes.append(f"note: head size {head_size} is not one of {kernels.LIMITS['fused_head_sizes']}; "
                     f"cuda attention uses mode='tiled' instead of 'fused'" + " (in fp32)" * (cfg.dtype == "bf16"))
    cuda = cuda_op_set(kernels, head_size, cfg.dtype)
    return ([torch_ops, cuda] if cfg.backend == "both" else [cuda]), notes


# -----------------------------------------------------------------------------
# the model, written once against an op namespace. Splits, views, transposes and the few elementwise adds
# left are plain tensor ops in both op sets (the residual adds are done by the norm that reads the stream
# next: pre_norm). Three seams let other scripts reuse it: the residual connection (mhc.py's streams), the
# feed-forward (dense MLP or mixture of experts) and the attention's KV cache (inference.py). Two
# architectures: gpt (GPT-2: LayerNorm, learned positions, GELU MLP, biases) and llama (RMSNorm, rotary
# positions, SwiGLU, no biases), both with grouped-query attention.

ARCHS = ("gpt", "llama")
ROPE_THETA = 10000.0  # RoPE's base: frequency i of a head of size D turns by theta^(-2i/D) per position


def kv_heads(arch, n_head, n_kv_head):
    """n_kv_head as given, or its default (0): n_head for gpt, half of them for llama (grouped-query)."""
    if n_kv_head:
        return n_kv_head
    return n_head // 2 if arch == "llama" and n_head % 2 == 0 else n_head


def swiglu_hidden(n_embd):
    """Width of llama's SwiGLU feed-forward: 2/3 of gpt's 4C, so its three matrices hold about as many
    weights as gpt's two, rounded up to a multiple of 64."""
    return (8 * n_embd // 3 + 63) // 64 * 64


def pre_norm(ops, x, weight, bias):
    """The residual stream x and its norm, a sublayer's input: (x, norm(x)), LayerNorm with a bias (gpt) or
    RMSNorm without (llama). A stream whose last add is
    pending (mhc.PendingSum) is added in the norm's own pass (add_layernorm / add_rmsnorm) and comes back
    as a tensor."""
    if isinstance(x, mhc.PendingSum):
        if bias is not None:
            return ops.add_layernorm(x.x, x.y, weight, bias)
        return ops.add_rmsnorm(x.x, x.y, weight)
    return x, ops.layernorm(x, weight, bias) if bias is not None else ops.rmsnorm(x, weight)


class Dropout:
    """One training step's dropout for an op set: p, the model's rng {seed, offset} (a device tensor the
    step advances) and a call site's salt, so that every site draws its own mask and both op sets the same.
    stream: torchrun's rank, whose rows (its slice of the batch) draw masks of their own."""
    SITES_PER_STREAM = 2**20

    def __init__(self, ops, p, rng, stream=0):
        self.ops, self.p, self.rng, self.salt0 = ops, p, rng, stream * self.SITES_PER_STREAM

    def __call__(self, x, salt):
        return self.ops.dropout(x, self.p, self.rng, self.salt0 + salt)

    def attention(self, salt):  # the attention op's arguments for dropout on its probabilities
        return dict(dropout_p=self.p, rng=self.rng, salt=self.salt0 + salt)


# Dropout's call sites: the embedding's 0, then per layer the attention probabilities, the attention's and
# the MLP's outputs.
def dropout_salt(layer, site):  # site 0, 1, 2: probabilities, attention output, MLP output
    return 1 + 3 * layer + site


def last_position(x):  # (B, T, C) -> (B, 1, C), of a tensor or of both terms of a PendingSum
    if isinstance(x, mhc.PendingSum):
        return mhc.PendingSum(x.x[:, -1:, :], x.y[:, -1:, :])
    return x[:, -1:, :]


class MLP(nn.Module):
    """The dense feed-forward: proj(gelu(fc(h))) with biases (gpt), or proj(swiglu(fc(h), up(h))) without
    (llama), swiglu(a, b) = silu(a) * b. With n_expert, every matrix gets a leading expert dim (inference.py's
    mixture of experts builds on that)."""

    def __init__(self, n_embd, arch="gpt", n_expert=None):
        super().__init__()
        C, lead = n_embd, () if n_expert is None else (n_expert,)
        self.swiglu = arch == "llama"
        if self.swiglu:
            H = swiglu_hidden(C)
            shapes = dict(fc_w=(H, C), up_w=(H, C), proj_w=(C, H))
        else:
            shapes = dict(fc_w=(4 * C, C), fc_b=(4 * C,), proj_w=(C, 4 * C), proj_b=(C,))
        for name, shape in shapes.items():  # weights are drawn by GPT, biases stay zero
            setattr(self, name, nn.Parameter(torch.zeros(*lead, *shape)))

    def params(self, name, expert=None):
        """Weight and bias (None in llama) of the linear called name; of one expert, if given."""
        w, b = getattr(self, name + "_w"), getattr(self, name + "_b", None)
        return (w, b) if expert is None else (w[expert], None if b is None else b[expert])

    def ffn(self, x, ops, linear):
        """The feed-forward of x, with linear(x, name) applying the linear called name."""
        if self.swiglu:
            return linear(ops.swiglu(linear(x, "fc"), linear(x, "up")), "proj")
        return linear(ops.gelu(linear(x, "fc")), "proj")

    def forward(self, h, ops):  # h (..., C)
        return self.ffn(h, ops, lambda x, name: ops.linear(x, *self.params(name)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm_1(x)), then x + mlp(norm_2(x)), where the '+' is the
    residual seam (mhc.py) and mlp the feed-forward seam. gpt: LayerNorm and biases; llama: RMSNorm, no
    biases, q and k rotated by position (RoPE). n_kv_head < n_head shares each key/value head among
    n_head / n_kv_head query heads (grouped-query attention), which shrinks the KV cache as much."""

    def __init__(self, n_embd, n_head, n_kv_head, mlp, residual, arch="gpt"):
        super().__init__()
        C, kv = n_embd, n_kv_head * (n_embd // n_head)  # kv: width of the keys (and of the values)

        def bias(n):  # llama has none: the attribute is None, which linear and norm read as "no bias"
            return nn.Parameter(torch.zeros(n)) if arch == "gpt" else None
        self.n_head, self.n_kv_head = n_head, n_kv_head
        self.ln_1_w, self.ln_1_b = nn.Parameter(torch.ones(C)), bias(C)
        self.attn_w, self.attn_b = nn.Parameter(torch.empty(C + 2 * kv, C)), bias(C + 2 * kv)
        self.attn_proj_w, self.attn_proj_b = nn.Parameter(torch.empty(C, C)), bias(C)
        self.ln_2_w, self.ln_2_b = nn.Parameter(torch.ones(C)), bias(C)
        self.mlp = mlp
        self.res_attn, self.res_mlp = residual(), residual()

    def attention(self, h, ops, cache, layer, rope, drop):  # h (B, T, C); rope: (cos, sin) (T, hs/2) each, or None
        B, T, C = h.shape
        nh, nkv, hs = self.n_head, self.n_kv_head, C // self.n_head
        q, k, v = ops.split(ops.linear(h, self.attn_w, self.attn_b), [C, nkv * hs, nkv * hs])
        q = q.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)
        v = v.view(B, T, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)
        if rope is not None:
            q, k = ops.rope(q, *rope), ops.rope(k, *rope)
        kv_len = None
        if cache is not None:  # write this step's keys and values at their positions, attend to all so far
            ops.kv_write(cache.k[layer], cache.v[layer], cache.positions, k, v)
            k, v, kv_len = cache.k[layer], cache.v[layer], cache.kv_len  # (B, nkv, block_size, hs)
        dropout = drop.attention(dropout_salt(layer, 0)) if drop else {}
        y = ops.attention(q, k, v, causal=True, kv_len=kv_len, **dropout)  # (B, nh, T, hs)
        # (B, T, C): heads side by side again; no copy when the attention wrote (B, T, nh, hs) memory,
        # as our fused kernels do (and q, k, v above reach them as views, read in place)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        y = ops.linear(y, self.attn_proj_w, self.attn_proj_b)
        return drop(y, dropout_salt(layer, 1)) if drop else y

    def feed_forward(self, h, ops, layer, drop):
        y = self.mlp(h, ops)
        return drop(y, dropout_salt(layer, 2)) if drop else y

    def forward(self, x, ops, cache=None, layer=0, rope=None, drop=None):
        # x: the residual stream, maybe a PendingSum; drop: a Dropout while training with dropout, else None
        x = self.res_attn(x, lambda s: pre_norm(ops, s, self.ln_1_w, self.ln_1_b),
                          lambda h: self.attention(h, ops, cache, layer, rope, drop), ops)
        return self.res_mlp(x, lambda s: pre_norm(ops, s, self.ln_2_w, self.ln_2_b),
                            lambda h: self.feed_forward(h, ops, layer, drop), ops)


def is_weight_matrix(name, p):
    """Matrices that get the random init and weight decay (not norms, biases or mHC mixing logits)."""
    return p.dim() >= 2 and (name.endswith("_w") or name in ("wte", "wpe"))


class GPT(nn.Module):
    # The output head is tied to the token embedding (as in GPT-2 and nanoGPT): fewer parameters for a
    # small model, and the embedding weight then gets gradient from both the embedding and the linear
    # backward, so both accumulation paths of each op set are exercised.

    def __init__(self, vocab_size, block_size, n_embd, n_head, n_layer, seed, ops,
                 mlp=None, residual="baseline", n_streams=4, arch="gpt", n_kv_head=0, init_std=0.02, dropout=0.0):
        super().__init__()
        n_kv_head = kv_heads(arch, n_head, n_kv_head)
        self.block_size = block_size
        self.dropout = dropout  # while self.training (model.eval() turns it off)
        self.dropout_stream = 0  # the rank under torchrun (OpSetRun sets it): each rank draws its own masks
        if dropout:
            # Its masks' {seed, offset}: next_dropout_masks advances the offset once a training step (a device
            # add, which a CUDA graph replays), so a step's masks depend on the seed and the step alone.
            # Checkpoints carry it (save_checkpoint); not in state_dict, which inference.py loads without it.
            self.register_buffer("dropout_rng", torch.tensor([seed, 0]), persistent=False)
        self.ops = ops  # a plain attribute, not state: swapping op sets never touches the weights
        self.wte = nn.Parameter(torch.empty(vocab_size, n_embd))  # token embedding and output head
        # gpt learns a position embedding; llama rotates q and k instead (tables below)
        self.wpe = nn.Parameter(torch.empty(block_size, n_embd)) if arch == "gpt" else None
        self.streams = mhc.Streams(residual, n_streams, n_embd, sublayers=2 * n_layer)
        mlp = mlp or (lambda: MLP(n_embd, arch))  # the feed-forward seam: inference.py's MoE plugs in here
        self.blocks = nn.ModuleList(Block(n_embd, n_head, n_kv_head, mlp(), self.streams.residual, arch)
                                    for _ in range(n_layer))
        self.ln_f_w = nn.Parameter(torch.ones(n_embd))
        self.ln_f_b = nn.Parameter(torch.zeros(n_embd)) if arch == "gpt" else None
        self.register_buffer("pos", torch.arange(block_size), persistent=False)  # (block_size,)
        if arch == "llama":  # RoPE angles of every position, in float64 then rounded once
            hs = n_embd // n_head
            freq = ROPE_THETA ** (-torch.arange(0, hs, 2, dtype=torch.float64) / hs)  # (hs/2,)
            angles = torch.arange(block_size, dtype=torch.float64)[:, None] * freq  # (block_size, hs/2)
            self.register_buffer("rope_cos", angles.cos().float(), persistent=False)
            self.register_buffer("rope_sin", angles.sin().float(), persistent=False)

        # Drawn on the CPU from a generator of our own, so a seed gives the same weights whatever the
        # device, the op set or anything that used the global RNG before.
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if is_weight_matrix(name, p):
                    # GPT-2: std 0.02, the projections into the residual stream by 1/sqrt(number of them).
                    # init_std sets the blocks' matrices apart from the embeddings (inference.py's demo).
                    std = 0.02 if name in ("wte", "wpe") else init_std
                    std = std / math.sqrt(2 * n_layer) if name.endswith("proj_w") else std
                    p.normal_(0.0, std, generator=g)

    def forward(self, idx, targets=None, cache=None):
        """idx (B, T) int64. With targets (B, T): (logits (B, T, V), mean loss). Without: the last
        position's logits (B, 1, V) and None. With a cache (inference.py's KVCache: k, v, pos, and the
        positions and kv_len this sets), idx continues the cached tokens. Runs in the
        op set's precision context (torch.autocast in bf16: precision)."""
        with self.ops.autocast():
            return self.run(idx, targets, cache)

    def run(self, idx, targets, cache):
        ops = self.ops
        B, T = idx.shape
        positions = self.pos[:T]  # (T,)
        if cache is not None:
            positions = cache.positions = cache.pos + positions
            cache.kv_len = positions[-1:] + 1  # once per step, read by every layer's attention
        x = ops.embedding(idx, self.wte)  # (B, T, C)
        rope = None
        if self.wpe is not None:
            x = x + ops.embedding(positions, self.wpe)  # + (T, C)
        else:
            rope = self.rope_cos[positions], self.rope_sin[positions]  # (T, hs/2) each
        drop = Dropout(ops, self.dropout, self.dropout_rng, self.dropout_stream) \
            if self.dropout and self.training else None
        if drop:
            x = drop(x, 0)
        x = self.streams.expand(x, ops)  # (B, T, n, C) with n residual streams, else unchanged
        for layer, block in enumerate(self.blocks):
            x = block(x, ops, cache, layer, rope, drop)
        x = self.streams.collapse(x, ops)  # (B, T, C), or the baseline's PendingSum: ln_f does the last add
        if cache is not None:
            cache.pos += T
        if targets is None:
            # Generation needs the next-character logits only.
            h = pre_norm(ops, last_position(x), self.ln_f_w, self.ln_f_b)[1]  # (B, 1, C)
            return ops.linear(h, self.wte, None), None
        x = pre_norm(ops, x, self.ln_f_w, self.ln_f_b)[1]  # (B, T, C)
        logits = ops.linear(x, self.wte, None)  # (B, T, V)
        loss = ops.cross_entropy(logits.view(B * T, -1), targets.view(B * T))
        return logits, loss

    def next_dropout_masks(self):
        """Called before each training step: its dropout draws new masks (nothing without dropout)."""
        if self.dropout:
            self.dropout_rng[1:].add_(1)


def model_from_config(cfg, vocab_size, ops, **overrides):
    """The GPT a config describes (a train.py config or a checkpoint's; keys it lacks take their defaults);
    overrides replace any of GPT's arguments (the sweep's depth and residual, inference's experts)."""
    keys = ("block_size", "n_embd", "n_head", "n_layer", "seed", "residual", "n_streams", "arch", "n_kv_head")
    # dropout is training's: a model for inference (or from a checkpoint) is built without it
    args = {k: getattr(cfg, k, DEFAULTS[k]) for k in keys}
    return GPT(vocab_size, ops=ops, **{**args, **overrides})


LR_SCHEDULES = ("constant", "cosine")


def lr_at(cfg, it):
    """The learning rate of step it (0-based): --lr throughout (constant), or nanoGPT's schedule (cosine): a
    linear warm-up over warmup_iters steps, then half a cosine from lr down to min_lr at max_iters."""
    if cfg.lr_schedule == "constant":
        return cfg.lr
    if it < cfg.warmup_iters:
        return cfg.lr * (it + 1) / (cfg.warmup_iters + 1)
    done = (min(it, cfg.max_iters) - cfg.warmup_iters) / (cfg.max_iters - cfg.warmup_iters)  # 0 to 1
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * done)) * (cfg.lr - cfg.min_lr)


def lr_words(cfg):
    """The schedule in a line, for the run's header."""
    if cfg.lr_schedule == "constant":
        return f"lr {cfg.lr:g}, constant"
    return (f"lr {cfg.lr:g}, {cfg.lr_schedule}: {cfg.warmup_iters} warm-up steps, then down to {cfg.min_lr:g} at "
            f"iteration {cfg.max_iters}")


def set_lr(opt, lr):
    """Sets every param group's lr for the next step: a tensor lr is filled in place (a kernel, no host sync),
    so a step captured in a CUDA graph reads the new value at its next replay; a float lr is replaced."""
    for group in opt.param_groups:
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def make_optimizer(model, cfg, on_cuda, graphed):
    decay = [p for n, p in model.named_parameters() if is_weight_matrix(n, p)]
    no_decay = [p for n, p in model.named_parameters() if not is_weight_matrix(n, p)]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # Same optimizer for both op sets on a GPU: fused AdamW. The fused kernel ignores `capturable`
    # (the flag only lets step() pass the graph-capture check), so graphed and eager runs update alike.
    kw = dict(fused=True, capturable=graphed) if on_cuda else {}
    lr = cfg.lr
    if on_cuda and cfg.lr_schedule != "constant":
        # A float lr would be baked into a captured step: the fused kernel reads a float32 device tensor instead,
        # which set_lr fills before each step (the constant schedule keeps the float: no update at all).
        lr = torch.tensor(cfg.lr, dtype=torch.float32, device=next(model.parameters()).device)
    return torch.optim.AdamW(groups, lr=lr, betas=(cfg.beta1, cfg.beta2), **kw)

# -----------------------------------------------------------------------------
# one training step, eager or replayed from a CUDA graph

def train_step(model, opt, x, y, before=None):
    """Forward, backward, AdamW update. Returns the loss as a device tensor (reading it would sync). before:
    called first (GPT.next_dropout_masks, outside a compiled model)."""
    if before is not None:
        before()
    opt.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    opt.step()
    return loss.detach()


class GraphedStep:
    """train_step captured once into a CUDA graph, then replayed: one launch per step instead of hundreds.

    The first `warmup` calls are real eager steps on a side stream (library handles, optimizer state and
    autograd's buffers get created there, as capture requires). The next call captures the step into static
    input, target and loss tensors; every call from then on copies its batch in and replays. `step` is
    train_step or another function of (model, opt, x, y) returning device tensors, captured and replayed as a
    whole."""

    def __init__(self, model, opt, step=train_step, warmup=GRAPH_WARMUP):
        self.model, self.opt, self.step, self.warmup = model, opt, step, warmup
        self.calls = 0
        self.graph = None
        self.side = torch.cuda.Stream()

    def __call__(self, x, y):
        if self.calls < self.warmup:
            self.calls += 1
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                loss = self.step(self.model, self.opt, x, y)
            torch.cuda.current_stream().wait_stream(self.side)
            return loss
        if self.graph is None:
            self.static_x, self.static_y = x.clone(), y.clone()  # (B, T) each
            # Gradients set to None before capture are allocated inside the graph's memory pool, and the
            # captured backward writes them rather than accumulating into stale ones.
            self.opt.zero_grad(set_to_none=True)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.static_loss = self.step(self.model, self.opt, self.static_x, self.static_y)
            # Capture only records; this call's step is done by the replay below.
        self.static_x.copy_(x)
        self.static_y.copy_(y)
        self.graph.replay()
        return self.static_loss  # overwritten by the next replay: copy it out before then


def compiled_step(model, opt, step=train_step):
    """train_step on the model under torch.compile(mode='reduce-overhead'): forward, loss and backward as
    Inductor's kernels around ours (on the cuda op set), replayed from CUDA graphs; AdamW stays eager. The
    compiled module shares the model's parameters and serves this step only: evaluation, sampling and
    checkpoints see the eager model. The first call compiles and the second records, both in the warm-up."""
    register_inductor_fallbacks()
    compiled = torch.compile(model, mode="reduce-overhead")

    def compiled_step_call(x, y):
        # A new iteration for the graphs: the last step's outputs may be overwritten now (its loss has been
        # copied out, and its gradients are dropped by zero_grad before anything reads them).
        torch.compiler.cudagraph_mark_step_begin()
        return step(compiled, opt, x, y)
    return compiled_step_call


DDP_GRAPH_WARMUP = 11  # eager DDP steps before a capture: DDP settles its gradient buckets in the first ones


def graph_warmup(world):
    """Eager steps before a CUDA graph captures the step: DDP needs more than one process does."""
    return DDP_GRAPH_WARMUP if world > 1 else GRAPH_WARMUP


def timing_skip(cfg):
    """Steps left out of tokens/s: at least the eager steps before a graph capture, and the capture."""
    return max(cfg.timing_warmup, graph_warmup(cfg.world_size) + 1)


# -----------------------------------------------------------------------------
# evaluation and sampling

@contextlib.contextmanager
def evaluating(model):
    """model.eval() (no dropout) within, its mode before restored after."""
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)


@torch.no_grad()
def estimate_loss(model, splits, cfg, ranks=ONE_PROCESS):
    """Mean loss over eval_iters batches per split, the same windows at every evaluation of every op set (a
    fresh generator). Under torchrun each rank takes its slice of every batch and the means are averaged."""
    out = {}
    with evaluating(model):
        for name, data in splits.items():
            g = torch.Generator().manual_seed(cfg.seed + 1)
            losses = torch.zeros(cfg.eval_iters, device=data.device)
            for k in range(cfg.eval_iters):
                x, y = get_batch(data, cfg.batch_size, cfg.block_size, g, data.device, ranks.rank, ranks.world)
                losses[k] = model(x, y)[1]
            out[name] = ranks.mean_(losses).mean().item()
    return out


@torch.no_grad()
def generate(model, tok, cfg, device):
    """Seeded multinomial sampling, the same draws for every op set; the model's own ops do the forward."""
    g = torch.Generator().manual_seed(cfg.seed + 2)
    ids = tok.encode("\n") if "\n" in tok.chars else [0]
    n_prompt = len(ids)
    with evaluating(model):
        for _ in range(cfg.sample_len):
            ctx = torch.tensor([ids[-cfg.block_size:]], dtype=torch.long, device=device)  # (1, T <= block_size)
            logits, _ = model(ctx)  # (1, 1, V)
            # Softmax and draw on the CPU in float64 with a CPU generator: identical logits give identical text.
            probs = F.softmax(logits[0, -1].double().cpu(), dim=-1)
            ids.append(int(torch.multinomial(probs, 1, generator=g)))
    return tok.decode(ids[n_prompt:])


# -----------------------------------------------------------------------------
# training one op set

class OpSetRun:
    """One op set's training run: its model, optimizer and step, the losses so far, and how it ended
    (status "completed", "diverged" or "interrupted", why, and at which iteration). train_op_set steps it
    and hands it each log and eval point, where it reads the losses, evaluates and saves."""

    def __init__(self, ops, cfg, tok, train_ids, val_ids, ranks):
        self.ops, self.cfg, self.tok, self.ranks = ops, cfg, tok, ranks
        self.device = torch.device(cfg.device)
        on_cuda = self.device.type == "cuda"
        compiled = cfg.compile  # check_compile: on a GPU, and not with graph_torch
        graphed = on_cuda and not compiled and (cfg.cuda_graph if ops.name == "cuda" else cfg.graph_torch)
        self.mode = "graph" if graphed else "compile" if compiled else "eager"
        self.model = model_from_config(cfg, tok.vocab_size, ops, dropout=cfg.dropout).to(self.device)
        self.model.dropout_stream = ranks.rank
        self.opt = make_optimizer(self.model, cfg, on_cuda, graphed)
        self.batch_gen = torch.Generator().manual_seed(cfg.seed)  # CPU generator: every op set, the same batches
        self.ckpt_path = os.path.join(cfg.out_dir, f"ckpt_{ops.name}.pt")
        self.train_ids, self.splits = train_ids, {"train": train_ids, "val": val_ids}
        self.start, self.train_loss, self.evals = 0, [], []  # train_loss[i] is the loss of step i+1
        self.saved_iter = None  # the iteration held by ckpt_path once this run has read or written it
        self.resume()
        net = ranks.wrap(self.model, graphed)
        step = functools.partial(train_step, before=self.model.next_dropout_masks)
        if graphed:
            self.step = GraphedStep(net, self.opt, step, warmup=graph_warmup(ranks.world))
        elif compiled:
            self.step = compiled_step(net, self.opt, step)
        else:
            self.step = functools.partial(step, net, self.opt)
        self.tokens_per_step = cfg.batch_size * cfg.block_size * ranks.world  # of all ranks
        # Losses stay on the device until a log or eval point: reading each one would sync every step.
        self.loss_buf = torch.zeros(max(cfg.max_iters - self.start, 0), device=self.device)
        self.done = self.fetched = self.start
        self.status, self.why, self.stopped_at, self.signum = "completed", None, None, None
        # At least the graph warm-up and capture (or compile's compilation and recording) are always left out
        # of the timed steps.
        self.timer, self.t0 = StepTimer(self.device, skip=timing_skip(cfg)), time.perf_counter()

    def timing(self):
        """The run's wall time and timed steps: the sessions before a resume (self.earlier) and this one."""
        e, t = self.earlier, self.timer
        return {"wall_s": e["wall_s"] + time.perf_counter() - self.t0, "timed_s": e["timed_s"] + t.timed_s,
                "timed_steps": e["timed_steps"] + t.timed_steps,
                "timed_tokens": e["timed_tokens"] + t.timed_steps * self.tokens_per_step}

    def resume(self):
        """With --resume, the checkpoint's weights, optimizer, batch generator and history; says what runs."""
        name, cfg, start = self.ops.name, self.cfg, 0
        self.earlier = NO_TIMING
        if cfg.resume and os.path.isfile(self.ckpt_path):
            start, self.train_loss, self.evals, self.earlier = load_checkpoint(
                self.ckpt_path, cfg, self.tok, self.model, self.opt, self.batch_gen, fail)
            self.start = self.saved_iter = start
            print(f"{name} | resuming from iteration {start} ({self.ckpt_path})")
        elif cfg.resume:
            print(f"{name} | no checkpoint at {self.ckpt_path}: starting from iteration 0")
        if start < cfg.max_iters:
            print(f"{name} | training {self.mode} on {cfg.device}, iterations {start + 1}..{cfg.max_iters}")
        elif start > 0:
            print(f"{name} | nothing to train: the checkpoint is at iteration {start}, max_iters={cfg.max_iters}")
        else:
            print(f"{name} | nothing to train: max_iters=0; evaluating the untrained model")

    def train_one_step(self):
        cfg, ranks = self.cfg, self.ranks
        if cfg.lr_schedule != "constant":
            # self.done: this step's iteration from 0, a resumed run's too; the lr lives in the param groups
            # load_state_dict left, which set_lr reads each time
            set_lr(self.opt, lr_at(cfg, self.done))
        x, y = get_batch(self.train_ids, cfg.batch_size, cfg.block_size, self.batch_gen, self.device,  # (B, T)
                         ranks.rank, ranks.world)
        self.loss_buf[self.done - self.start].copy_(self.step(x, y))
        self.done += 1

    def stop(self, status, why, at):
        self.status, self.why, self.stopped_at = status, why, at
        return True

    def at_point(self, log, ev, interrupt, seconds, steps):
        """A log, eval or interrupt point after step self.done: read the losses and log, check the weights,
        evaluate, save. interrupt: False, or the stop signal's number (True: another rank's). True when the run
        stops here."""
        done, cfg = self.done, self.cfg
        new = self.ranks.mean_(self.loss_buf[self.fetched - self.start:done - self.start]).tolist()
        self.ops.check_errors()  # the host has waited for the losses: a bad index met on the GPU raises here
        self.fetched = done
        # Checked where the losses reach the host anyway; the first bad one names the iteration.
        bad = next((i for i, v in enumerate(new) if not math.isfinite(v)), None)
        if bad is not None:
            self.train_loss += new[:bad]
            at = len(self.train_loss) + 1
            return self.stop("diverged", f"loss is {new[bad]} at iteration {at}", at)
        self.train_loss += new
        if log:
            print(f"{self.ops.name} | iter {done:>{len(str(cfg.max_iters))}}/{cfg.max_iters} | loss "
                  f"{self.train_loss[-1]:.4f} | {steps * self.tokens_per_step / seconds:>9,.0f} tok/s | eta "
                  f"{fmt_seconds((cfg.max_iters - done) * seconds / steps)}")
        # A finite loss at step k says nothing of the update that step k made: check the weights.
        if (ev or interrupt) and not all_finite(self.model.parameters()):
            return self.stop("diverged", f"weights are NaN or inf after iteration {done}", done)
        if ev and not self.evaluate():
            e = self.evals.pop()
            return self.stop("diverged", f"eval loss after iteration {done} is train {e['train']}, val {e['val']}",
                             done)
        if ev or interrupt:
            self.save(ev)
        if interrupt:
            self.signum = interrupt if interrupt is not True else None
            how = signal_words(self.signum) if self.signum else "a stop signal to another rank"
            return self.stop("interrupted", f"{how} after iteration {done}", done)
        return False

    def evaluate(self):
        """Appends the train and val loss at self.done; False if either is NaN or inf."""
        self.evals.append({"iter": self.done, **estimate_loss(self.model, self.splits, self.cfg, self.ranks)})
        return all(math.isfinite(self.evals[-1][k]) for k in self.splits)

    def save(self, evaluated):
        if self.ranks.main:  # the ranks hold the same weights, optimizer state and batch generator
            save_checkpoint(self.ckpt_path, self.cfg, self.tok, self.ops, self.done, self.model, self.opt,
                            self.batch_gen, self.train_loss, self.evals, self.timing())
        self.saved_iter = self.done
        e = self.evals[-1] if evaluated else None
        what = f"eval: train {e['train']:.4f}, val {e['val']:.4f}" if e else "interrupted"
        print(f"{self.ops.name} | iter {self.done} | {what} | saved {self.ckpt_path}")

    def result(self):
        """The run's record for the report and results.json (the sample from rank 0 only); its timing is the whole
        run's, so that a resume with nothing to train reports what the run measured."""
        timing = self.timing()
        if self.status == "completed" and (not self.evals or self.evals[-1]["iter"] != self.done):
            self.evaluate()  # nothing trained: still report
        if self.status == "diverged":
            kept = (f"{self.ckpt_path} still holds iteration {self.saved_iter}" if self.saved_iter is not None
                    else f"no checkpoint written to {self.ckpt_path}")
            print(f"{self.ops.name} | stopped: {self.why}; {kept}")
        evals = self.evals
        # from rank 0, not from NaN, nor once asked to stop; the status may change during it
        sample = self.sample() if self.status == "completed" and self.ranks.main else None
        return {
            "status": self.status, "stopped_because": self.why, "stopped_at": self.stopped_at,
            "checkpoint_iter": self.saved_iter, "mode": self.mode,
            "iters": len(self.train_loss), "trained_iters": len(self.train_loss) - self.start,
            "final_train_loss": evals[-1]["train"] if evals else None,
            "final_val_loss": evals[-1]["val"] if evals else None,
            "wall_s": timing["wall_s"],
            "tokens_per_s": timing["timed_tokens"] / timing["timed_s"] if timing["timed_steps"] else None,
            "timed_iters": timing["timed_steps"],
            "train_loss": self.train_loss, "evals": evals, "sample": sample,
            "ckpt_path": self.ckpt_path, "signum": self.signum,
        }

    def sample(self):
        """The trained model's text; None after a Ctrl-C or SIGTERM during it, which stops the run here: training
        is done and saved, and the report is still written."""
        try:
            return generate(self.model, self.tok, self.cfg, self.device)
        except KeyboardInterrupt as e:
            self.signum = signal_of(e)
            self.stop("interrupted", f"{signal_words(self.signum)} during the sample, after training", self.done)
            return None


def train_op_set(ops, cfg, tok, train_ids, val_ids, ranks=ONE_PROCESS):
    """Trains one op set from iteration 1 (or its checkpoint) to max_iters; returns OpSetRun.result."""
    run = OpSetRun(ops, cfg, tok, train_ids, val_ids, ranks)
    timer = run.timer
    with StopRequest(ranks.world) as stop:
        while run.done < cfg.max_iters:
            timer.before_step()
            run.train_one_step()
            timer.after_step()
            log = run.done % cfg.log_interval == 0 or run.done == cfg.max_iters
            ev = run.done % cfg.eval_interval == 0 or run.done == cfg.max_iters
            # Read once: a signal from here on is handled after the next step. Under torchrun the ranks agree
            # after every step (on the host, the GPU not waited for), so that all stop after the same one and save
            # within the grace period torchrun's agent gives before its SIGKILL, however slow a step is.
            interrupt = stop.signum or False
            if ranks.world > 1:
                interrupt = ranks.any(interrupt) and (interrupt or True)
            if not (log or ev or interrupt):
                continue
            if run.at_point(log, ev, interrupt, *timer.stop()):
                break
            timer.start()
    return run.result()


# -----------------------------------------------------------------------------
# the comparison

def report(runs, cfg):
    hw = device_name(cfg.device)
    ranks = f" x {cfg.world_size}, global batch {cfg.world_size} x {cfg.batch_size}" if cfg.world_size > 1 else ""
    print(f"\nresults on {hw}{ranks}, {cfg.dtype} (tok/s: training steps only, of all ranks, after "
          f"{timing_skip(cfg)} warm-up steps; wall s: whole run including evals)")
    print(f"{'op set':<7} {'mode':<7} {'iters':>6} {'train loss':>11} {'val loss':>9} {'wall s':>8} {'tok/s':>11}")
    for name, r in runs.items():
        tps = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "n/a"
        tl, vl = (f"{r[k]:.4f}" if r[k] is not None else "n/a" for k in ("final_train_loss", "final_val_loss"))
        print(f"{name:<7} {r['mode']:<7} {r['iters']:>6} {tl:>11} {vl:>9} {r['wall_s']:>8.1f} {tps:>11}"
              + (f"  {r['status']}: {r['stopped_because']}" if r["status"] != "completed" else ""))

    speedup = diff_100 = diff_all = val_rel = None
    if "torch" in runs and "cuda" in runs:
        t, c = runs["torch"], runs["cuda"]
        if t["final_val_loss"] and c["final_val_loss"] is not None:
            val_rel = abs(c["final_val_loss"] - t["final_val_loss"]) / t["final_val_loss"]
            print(f"final val loss: cuda {c['final_val_loss']:.4f} vs torch {t['final_val_loss']:.4f}, "
                  f"{100 * val_rel:.2f}% apart")
        if t["tokens_per_s"] and c["tokens_per_s"]:
            speedup = c["tokens_per_s"] / t["tokens_per_s"]
            print(f"speedup (cuda tok/s / torch tok/s): {speedup:.2f}x ({c['mode']} vs {t['mode']})")
        diffs = [abs(a - b) for a, b in zip(t["train_loss"], c["train_loss"])]
        if diffs:
            diff_100, diff_all = max(diffs[:100]), max(diffs)
            print(f"max |train loss difference|: first {min(100, len(diffs))} iters {diff_100:.2e}, "
                  f"all {len(diffs)} iters {diff_all:.2e}")
    for name, r in runs.items():
        if r["sample"] is None:
            why = "it diverged" if r["status"] == "diverged" else "its run was interrupted"
            print(f"\n--- no sample from the {name} model: {why} ---")
        else:
            print(f"\n--- sample from the {name} model ---\n{r['sample']}")

    os.makedirs(cfg.out_dir, exist_ok=True)
    results = {
        "device": hw,
        # "completed", or the first op set's "diverged" / "interrupted": what follows is what was measured
        "status": next((r["status"] for r in runs.values() if r["status"] != "completed"), "completed"),
        "config": vars(cfg),
        "op_sets": {name: {k: v for k, v in r.items() if k not in ("train_loss", "evals", "ckpt_path", "signum")}
                    for name, r in runs.items()},
        "speedup_cuda_over_torch": speedup,
        "max_abs_loss_diff_first_100": diff_100,
        "max_abs_loss_diff_all": diff_all,
        "val_loss_rel_diff": val_rel,
    }
    path = os.path.join(cfg.out_dir, "results.json")
    write_json(path, results)
    print(f"\nwrote {path}")
    if cfg.plot:
        plot_losses(runs, os.path.join(cfg.out_dir, "loss.png"))


# -----------------------------------------------------------------------------
# main

# What the mHC depth sweep (mhc.run_sweep) takes from this file: it builds, steps and evaluates models
# through these, and so never imports train.py.
SWEEP_TRAINER = SimpleNamespace(
    model=model_from_config, optimizer=make_optimizer, train_step=train_step, graphed=GraphedStep,
    timer=lambda device, cfg: CallTimer(device, skip=timing_skip(cfg)), estimate_loss=estimate_loss,
    fail=fail)


def main(argv):
    if int(os.environ.get("RANK", "0")) > 0:
        sys.stdout = open(os.devnull, "w")  # under torchrun rank 0 alone prints; errors still reach stderr
    cfg = parse_config(argv)
    mhc.check_config(cfg, fail)
    if cfg.sweep and cfg.world_size > 1:
        fail("--sweep trains in one process: start it with python, not torchrun")
    ranks = start_ranks(cfg, fail)
    try:
        run_ranks(cfg, ranks, argv)
        if ranks.world > 1:
            dist.barrier()  # rank 0 writes the report while the others wait: the ranks leave together
    finally:
        if ranks.world > 1:
            # DDP's hooks hold it in reference cycles: collect them now, or its reducer and the gloo threads
            # it keeps would outlive the process group into interpreter exit (std::terminate there).
            gc.collect()
            dist.destroy_process_group()


def run_ranks(cfg, ranks, argv):
    """main's work in each rank: the checks, then the op sets' runs inside out_dir."""
    op_sets, notes = choose_op_sets(cfg)
    for note in notes:
        print(note)
    streams = cfg.residual != "baseline" or cfg.sweep
    cuda = any(o.name == "cuda" for o in op_sets)
    if streams and cuda and cfg.n_streams > (limit := import_kernels()[0].LIMITS["max_streams"]):
        fail(f"--n_streams={cfg.n_streams}: the cuda op set's stream and Sinkhorn kernels take at most {limit} "
             f"streams; use --n_streams<={limit} or --backend=torch")
    cfg.backend = "both" if len(op_sets) == 2 else op_sets[0].name  # what runs, for results.json and checkpoints
    with contextlib.ExitStack() as held:
        # Rank 0 alone holds out_dir and writes there (it saves the checkpoints), so it alone checks it: a refusal
        # is one line from it, the other ranks told to stop quietly.
        refusal = None
        if ranks.main:
            try:
                make_out_dir(cfg.out_dir, refuse, "checkpoints, results.json and loss.png")
                held.enter_context(out_dir_lock(cfg.out_dir, "train.py", refuse))
                check_checkpoints(cfg, op_sets, refuse)
            except Refused as e:
                refusal = str(e)
        if ranks.any(refusal is not None):
            fail(refusal) if ranks.main else sys.exit(1)
        return run_in_out_dir(cfg, op_sets, argv, ranks)


class Refused(Exception):
    pass


def refuse(msg):
    raise Refused(msg)


def check_checkpoints(cfg, op_sets, fail):
    """fail(msg) where the run would replace the checkpoints of another, or has none to resume."""
    if cfg.sweep:
        return  # mhc.load_sweep checks its results.json
    paths = [os.path.join(cfg.out_dir, f"ckpt_{o.name}.pt") for o in op_sets]
    found = [p for p in paths if os.path.exists(p)]
    if cfg.resume and not found:
        fail(f"--resume=true but there is no checkpoint at {', '.join(paths)}; train without --resume first")
    if not cfg.resume and found and not cfg.overwrite:
        fail(f"{', '.join(found)} already exists and a fresh run would replace it; pass --resume=true to "
             f"continue it, --overwrite=true to start over, or another --out_dir")


def run_in_out_dir(cfg, op_sets, argv, ranks=ONE_PROCESS):
    """main's work once out_dir is checked and held: the sweep, or each op set's run and the report. A model or
    batch too large for the device's memory ends it in one line."""
    # Warm-up steps of a graphed optimizer run eagerly; PyTorch warns about that once, harmlessly.
    warnings.filterwarnings("ignore", message="This instance was constructed with capturable=True")
    try:
        if cfg.sweep:  # one op set: cuda where it can run, else torch (a note says so)
            return mhc.run_sweep(cfg, op_sets[-1], SWEEP_TRAINER)
        return train_and_report(cfg, op_sets, argv, ranks)
    except RuntimeError as e:  # torch.OutOfMemoryError is one too
        if not is_out_of_memory(e):
            raise
        fail(f"{out_of_memory_words(e, cfg.device)}: the model or its batch is too large; pass smaller --n_layer, "
             f"--n_embd, --batch_size or --block_size (checkpoints already written are kept)")


def train_and_report(cfg, op_sets, argv, ranks):
    """Each op set's run, then the report; exits non-zero if a run diverged or was stopped."""
    tok, train_ids, val_ids = read_text_splits(cfg.data_path, cfg.block_size, fail)
    # The token ids live on the device, so get_batch cuts batches there: no host-to-device copy per step.
    train_ids, val_ids = train_ids.to(cfg.device), val_ids.to(cfg.device)
    n_params = sum(p.numel() for p in model_from_config(cfg, tok.vocab_size, TORCH_OPS).parameters())
    print(f"op sets: {', '.join(o.name for o in op_sets)} | {n_params / 1e6:.2f}M parameters | vocab {tok.vocab_size}"
          f" | {len(train_ids):,} train / {len(val_ids):,} val tokens")
    print(lr_words(cfg))

    runs = {}
    for ops in op_sets:
        runs[ops.name] = r = train_op_set(ops, cfg, tok, train_ids, val_ids, ranks)
        if torch.device(cfg.device).type == "cuda":
            if cfg.compile:
                torch.compiler.reset()  # the compiled step's CUDA graphs and their memory pool go too
            torch.cuda.empty_cache()  # the next op set starts from the same free memory
        if r["status"] != "completed":
            break  # a diverged or interrupted run stops here; the next op set is not started
    if ranks.main:
        report(runs, cfg)

    name, r = next(((n, r) for n, r in runs.items() if r["status"] != "completed"), (None, None))
    if r is None:
        return
    if r["status"] == "diverged":
        kept = (f"{r['ckpt_path']} still holds iteration {r['checkpoint_iter']}" if r["checkpoint_iter"] is not None
                else "no checkpoint was written")
        fail(f"the {name} op set diverged: {r['stopped_because']}; training stopped, {kept}; try a smaller --lr")
    again = [a for a in argv if not a.startswith(("--resume=", "--overwrite="))] + ["--resume=true"]
    launch = ["python"] if ranks.world == 1 else ["torchrun", "--standalone", f"--nproc_per_node={ranks.world}"]
    if ranks.main:
        sys.stderr.write(f"train.py: the {name} op set stopped on {r['stopped_because']}; saved {r['ckpt_path']} and "
                         f"{os.path.join(cfg.out_dir, 'results.json')}; resume with: "
                         f"{shlex.join([*launch, 'train.py', *again])}\n")
    sys.exit(signal_exit(r["signum"] or signal.SIGINT))


if __name__ == "__main__":
    try:
        with sigterm_interrupts():
            main(sys.argv[1:])
    except KeyboardInterrupt as e:  # outside the training loop and the sample (loading, building): nothing to save
        sys.stderr.write(f"train.py: interrupted by {signal_words(signal_of(e))}; checkpoints already written are kept\n")
        sys.exit(signal_exit(signal_of(e)))
    except RuntimeError as e:  # under torchrun: a collective that another rank left or never joined
        if not lost_other_ranks(e):
            raise
        sys.stderr.write(f"train.py: rank {os.environ.get('RANK', 0)} lost the other ranks: one of them failed "
                         f"or stopped (its error is above), or took longer than --dist_timeout "
                         f"({one_line(e)})\n")
        sys.exit(1)
