"""Generate text with the one GPT of train.py, dense and mixture-of-experts, on both op sets.

The model is train.py's GPT with its KV-cache seam: the prompt is prefilled in one pass, then one token
per step is decoded against a cache preallocated at the context length. The same weights run on the
PyTorch op set and on our kernels (GEMV for every projection, the cache write, fused attention of one
query against the cache, layernorm, GELU, embedding, softmax and top-k for the router and the sampler;
on Hopper launched early, each while the one before runs: kernels.set_pdl), eagerly and with
the decode step captured in a CUDA graph, and with the whole step in one persistent kernel,
kernels.decode_megakernel; the generated tokens are compared one by one.

    python inference.py                              # dense and MoE, random weights, seeds 0-4
    python inference.py --ckpt=out/ckpt_torch.pt     # a train.py checkpoint: its config, vocabulary, text
    python inference.py --temperature=0.8 --sample_top_k=20
    python inference.py --device=cpu --seeds=0       # PyTorch path only
    python inference.py --dtype=fp32,bf16            # also in bf16 (weights, activations, KV cache), compared

patched() runs other people's models on our kernels: torch.nn.functional's calls, routed to them; apply_kernels()
swaps in our kernels for the Hugging Face modules that call none (RMSNorm, SwiGLU MLP, RoPE, Conv1D, GELU).

Every default below can be overridden with --key=value; python inference.py --help lists them.
"""

import collections
import contextlib
import copy
import functools
import itertools
import math
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

import data
import train
from data import CharTokenizer

# -----------------------------------------------------------------------------
# options: key=(default, what it means); override with --key=value
OPTIONS = dict(
    n_layer=(12, "transformer blocks (random weights; --ckpt brings its own shape)"),
    n_head=(8, "attention heads; the cuda path needs n_embd // n_head in kernels.LIMITS['fused_head_sizes']"),
    n_embd=(768, "model width"),
    arch=train.OPTIONS["arch"],
    n_kv_head=train.OPTIONS["n_kv_head"],  # the KV cache holds only these heads
    block_size=(256, "context length; the KV cache holds this many positions"),
    n_expert=(8, "experts of the MoE model"),
    top_k=(2, "experts per token"),
    models=("dense,moe,trained", "which models to decode, comma-separated: dense and moe (random weights, one model a "
                                 "seed) and trained (the --ckpt checkpoint, where its file exists)"),
    seeds=("0,1,2,3,4", "random-weight seeds, one generation per seed and path, comma-separated"),
    ckpt=("out/ckpt_torch.pt", "the train.py checkpoint of the trained model: its config, vocabulary and weights "
                               "(dense); given on the command line, it is the only model decoded"),
    prompt=("Dorothy lived in the midst of the great Kansas prairies", "the text to continue"),
    max_new_tokens=(200, "tokens generated per run"),
    temperature=(0.0, "0: greedy argmax; > 0: sample from softmax(logits / temperature)"),
    sample_top_k=(0, "with temperature > 0: sample among the k most likely tokens (0: all; the cuda op set's "
                     "top-k takes at most kernels.LIMITS['topk_max_k'])"),
    device=("cuda" if torch.cuda.is_available() else "cpu", "cuda, cuda:N or cpu; cpu runs the PyTorch path only"),
    backend=("both", "which op sets decode: both, torch or cuda"),
    cuda_graph=(True, "on a GPU, also run each path with its decode step captured in a CUDA graph"),
    megakernel=(True, "with --cuda_graph, also decode on kernels.decode_megakernel: the whole step in one launch "
                      "(gpt or llama, dense or MoE; graphed with the token's pick)"),
    pdl=(True, "cuda op set: launch our kernels (prefill and decode) with programmatic dependent launch (Hopper: "
               "each may start while the one before runs); false: ordinary launches, to measure the difference"),
    dtype=("fp32", "fp32, bf16 or fp32,bf16: the model's weights, activations and KV cache (bf16: half the bytes per "
                   "decoded token; each op still computes in fp32); both: the bf16 / fp32 speed ratio too"),
    out_dir=("out", "folder for inference.json"),
)
DEFAULTS = {k: v for k, (v, _) in OPTIONS.items()}
PRINTABLE = "".join(chr(c) for c in range(32, 127))  # the random-weight vocabulary: 95 printable ASCII
MODEL_KINDS = ("dense", "moe", "trained")


def fail(msg):
    sys.exit(f"inference.py: error: {msg}")


def parse_config(argv):
    cfg, given = data.parse_options(argv, OPTIONS, fail, lambda: data.print_options(
        "inference.py", "Decode with the GPT of train.py on both op sets and compare them.", OPTIONS))
    cfg.given = sorted(given)  # the keys the command line set
    cfg.models = [m.strip() for m in cfg.models.split(",") if m.strip()]
    if not cfg.models or any(m not in MODEL_KINDS for m in cfg.models) or len(set(cfg.models)) < len(cfg.models):
        fail(f"--models must be some of {','.join(MODEL_KINDS)}, comma-separated, got {','.join(cfg.models)!r}")
    try:
        cfg.seeds = [int(s) for s in cfg.seeds.split(",")]
    except ValueError:
        fail(f"--seeds must be comma-separated integers, got {cfg.seeds!r}")
    data.check_at_least(cfg, 1, ("n_layer", "n_head", "n_embd", "block_size", "n_expert", "top_k", "max_new_tokens"),
                        fail)
    train.check_arch(cfg, fail)
    if cfg.top_k > cfg.n_expert:
        fail(f"--top_k ({cfg.top_k}) must be <= --n_expert ({cfg.n_expert})")
    if cfg.temperature < 0:
        fail(f"--temperature must be >= 0 (0 is greedy), got {cfg.temperature}")
    if cfg.sample_top_k < 0:
        fail(f"--sample_top_k must be >= 0 (0: all tokens), got {cfg.sample_top_k}")
    data.check_backend_and_device(cfg, fail)
    cfg.dtypes = [d.strip() for d in cfg.dtype.split(",") if d.strip()]
    if not cfg.dtypes or any(d not in train.DTYPES for d in cfg.dtypes) or len(set(cfg.dtypes)) < len(cfg.dtypes):
        fail(f"--dtype must be fp32, bf16 or fp32,bf16, got {cfg.dtype!r}")
    if "ckpt" in cfg.given and cfg.models != ["trained"]:
        if "models" in cfg.given:
            print("note: --ckpt given: decoding its trained model only")
        cfg.models = ["trained"]
    return cfg


# -----------------------------------------------------------------------------
# models: train.py's GPT, with a mixture of experts in its feed-forward seam, and a KV cache

class MoE(train.MLP):
    """Mixture of experts: a router picks top_k of n_expert feed-forwards (MLP's, per arch) per token, whose
    outputs are summed with the router's softmax probabilities renormalised over the chosen ones."""

    def __init__(self, n_embd, n_expert, top_k, arch="gpt"):
        super().__init__(n_embd, arch, n_expert)
        self.top_k = top_k
        self.router_w = nn.Parameter(torch.empty(n_expert, n_embd))

    def forward(self, h, ops):  # h (..., C)
        shape = h.shape
        x = h.reshape(-1, shape[-1])  # (N, C)
        probs = ops.softmax(ops.linear(x, self.router_w, None))  # (N, E)
        top_i = ops.topk(probs, self.top_k)[1]  # (N, k)
        top_p = probs.gather(-1, top_i)  # (N, k): gathered, so the router gets gradient on both op sets
        top_p = top_p / top_p.sum(-1, keepdim=True)
        if x.shape[0] == 1:
            # One token (decoding): GEMVs that read only the chosen experts' weights, indexed on the
            # device, so the step has no host sync and can be captured in a CUDA graph.
            e, xk = top_i[0], x.expand(self.top_k, -1)  # (k,), (k, C)

            def expert_linear(z, name):  # row s of z through expert e[s]
                w, b = self.params(name)
                return ops.expert_gemv(w, z, b, e)
            y = self.ffn(xk, ops, expert_linear)  # (k, C)
            return (top_p[0, :, None] * y).sum(0).view(shape)
        # Many tokens (prefill, training): each expert runs on the tokens routed to it. nonzero() reads
        # the routing on the host; every token gets exactly top_k contributions added to a zero.
        out = torch.zeros_like(x)
        for e in range(self.router_w.shape[0]):
            rows, slot = torch.nonzero(top_i == e, as_tuple=True)
            if rows.numel():
                y = self.ffn(x[rows], ops, lambda z, name: ops.linear(z, *self.params(name, e)))
                out.index_add_(0, rows, top_p[rows, slot, None] * y)
        return out.view(shape)


class KVCache:
    """Keys and values of every layer, preallocated at the context length: (n_layer, B, n_kv_head, T, hs)
    each, in the model's dtype. `pos` (a 1-element device tensor) counts the tokens already in the cache.
    The model writes each step's keys and values at pos.. in place and attention reads the whole buffer
    with kv_len = pos + T, so a step never copies the cache and its shapes never change (CUDA-graph
    friendly)."""

    def __init__(self, n_layer, batch, n_kv_head, block_size, head_size, device, dtype=torch.float32):
        shape = (n_layer, batch, n_kv_head, block_size, head_size)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.capacity = block_size
        self.positions = self.kv_len = None  # of the tokens in flight, set by GPT.forward

    @property
    def nbytes(self):
        return 2 * self.k.numel() * self.k.element_size()

    def reset(self):
        self.pos.zero_()


def context_std(n_embd):
    """The std of a random model's block matrices (train.GPT's init_std): 3 / sqrt(n_embd), where GPT-2 draws
    0.02. At 0.02 the blocks barely move the residual stream, the token's own embedding decides the tied
    head's logits, and the model repeats its input token; a decode that ignored its context would match
    one that reads it. At 3 / sqrt(n_embd) the blocks' outputs, which depend on every earlier token, decide
    the next one: the text varies and two prompts that differ in one character soon part."""
    return 3.0 / math.sqrt(n_embd)


def random_model(kind, seed, cfg, tok):
    mlp = (lambda: MoE(cfg.n_embd, cfg.n_expert, cfg.top_k, cfg.arch)) if kind == "moe" else None
    return train.model_from_config(cfg, tok.vocab_size, train.TORCH_OPS, seed=seed, mlp=mlp,
                                   init_std=context_std(cfg.n_embd))


def checkpoint_model(cfg):
    """The model and tokenizer of a train.py checkpoint; any problem with the file is one clear line."""
    try:
        ckpt = data.read_checkpoint(cfg.ckpt)
    except ValueError as e:
        fail(f"--ckpt={cfg.ckpt}: {e}")
    c = SimpleNamespace(**ckpt["config"])
    tok = CharTokenizer.from_dict(ckpt["vocab"])
    c.n_kv_head = getattr(c, "n_kv_head", c.n_head)  # older checkpoints: one K/V head per query head
    model = train.model_from_config(c, tok.vocab_size, train.TORCH_OPS)
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        fail(f"--ckpt={cfg.ckpt}: its weights do not fit the model its config describes ({data.one_line(e)})")
    return model, tok, c


CKPT_SHAPE = ("arch", "n_layer", "n_head", "n_kv_head", "n_embd", "block_size")  # what a checkpoint decides


def model_specs(cfg):
    """The models to decode, in order: each with its label, tokenizer, shape (CKPT_SHAPE's keys), seeds
    and make(seed), which builds it on the CPU; and notes to print."""
    specs, notes = [], []
    printable = CharTokenizer.from_dict({"chars": PRINTABLE})
    for kind in cfg.models:
        if kind != "trained":
            specs.append(SimpleNamespace(label=kind, tok=printable, shape=cfg, seeds=cfg.seeds,
                                         make=functools.partial(random_model, kind, cfg=cfg, tok=printable)))
            continue
        if "ckpt" not in cfg.given and not os.path.exists(cfg.ckpt):
            notes.append(f"note: no trained model: {cfg.ckpt} does not exist (python train.py writes it)")
            continue
        model, tok, c = checkpoint_model(cfg)
        ignored = [f"--{k}={getattr(cfg, k)}" for k in CKPT_SHAPE if k in cfg.given and getattr(cfg, k) != getattr(c, k)]
        if ignored:
            notes.append(f"note: --ckpt={cfg.ckpt} brings its own model ("
                         + ", ".join(f"{k}={getattr(c, k)}" for k in CKPT_SHAPE) + f"); ignoring {', '.join(ignored)}")
        specs.append(SimpleNamespace(label="trained", tok=tok, shape=c, seeds=[None],
                                     make=lambda seed, model=model: copy.deepcopy(model)))
    return specs, notes


def describe(shape):
    return (f"{shape.arch}, {shape.n_layer} layers, {shape.n_embd} wide, {shape.n_head} heads ({shape.n_kv_head} K/V), "
            f"context {shape.block_size}")


def kv_cache(model, device):
    """An empty KV cache of one sequence for the model: its K/V heads only, at the full context, in the
    weights' dtype."""
    block = model.blocks[0]
    head_size = model.wte.shape[1] // block.n_head
    return KVCache(len(model.blocks), 1, block.n_kv_head, model.block_size, head_size, device, model.wte.dtype)


def with_dtype(model, dtype):
    """The model with its weights in dtype ("bf16": every parameter rounded to bf16 once; the RoPE tables
    and positions, buffers, stay as they are). Both op sets then run it as it is: every op takes and
    returns the weights' dtype and computes in fp32 inside."""
    if dtype == "bf16":
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.to(torch.bfloat16)
    return model


def weight_bytes_per_token(model):
    """Bytes of weights one decode step reads: every block's parameters, the top_k chosen experts of each
    MoE layer, the output head (the tied token embedding), and one row of each embedding."""
    total = 0
    for name, p in model.named_parameters():
        if name in ("wte", "wpe"):
            total += p[0].numel() * p.element_size()
            if name == "wte":
                total += p.numel() * p.element_size()  # the head reads all of it
        elif ".mlp." in name and isinstance(model.blocks[0].mlp, MoE) and "router" not in name:
            total += p[0].numel() * p.element_size() * model.blocks[0].mlp.top_k
        else:
            total += p.numel() * p.element_size()
    return total


# -----------------------------------------------------------------------------
# decoding

def megakernel_why_not(model):
    """None where kernels.decode_megakernel decodes this model on the current GPU, else why not."""
    block = model.blocks[0]
    if model.streams.variant != "baseline":
        return "it decodes the baseline residual stream, not hyper-connections"
    if model.wte.device.type != "cuda":
        return f"its weights are on {model.wte.device}, not a CUDA device"
    kernels, why = data.import_kernels()
    if kernels is None:
        return f"`import kernels` failed ({why})"
    moe = isinstance(block.mlp, MoE)
    with torch.cuda.device(model.wte.device):  # the shape limits are kernels.cu's (some depend on the GPU's SMs)
        return kernels.decode_megakernel_why_not(model.wte.shape[1], block.n_head, block.n_kv_head,
                                                 len(model.blocks), model.wte.element_size(),
                                                 hidden=block.mlp.fc_w.shape[-2],
                                                 n_expert=block.mlp.router_w.shape[0] if moe else 0,
                                                 top_k=block.mlp.top_k if moe else 0)


class Megakernel:
    """One decode step of a gpt or llama model, dense or a mixture of experts, as one launch of
    kernels.decode_megakernel: the logits of the token at the cache's position, its key and value written into
    the cache, the position advanced. The weights are handed over in the op's order: a layer's in the order of
    kernels.LIMITS['megakernel_layer_weights'], those the model has (llama's with its RoPE tables); the
    workspace (a launch count, the activations passed between blocks with their steps' tags) is zeroed once and
    kept for every step of this model, cache and GPU."""

    def __init__(self, model, cache):
        why = megakernel_why_not(model)
        if why:
            raise ValueError(f"decode_megakernel cannot decode this model: {why}")
        import kernels
        dev, C, block = model.wte.device, model.wte.shape[1], model.blocks[0]
        params = [dict(b.named_parameters()) for b in model.blocks]
        llama = model.wpe is None
        self.top_k = block.mlp.top_k if isinstance(block.mlp, MoE) else 0
        names = [n for n in kernels.LIMITS["megakernel_layer_weights"] if n in params[0]]
        top = [model.wte, model.ln_f_w] if llama else [model.wte, model.wpe, model.ln_f_w, model.ln_f_b]
        self.weights = top + [p[n] for p in params for n in names]
        self.rope = (model.rope_cos, model.rope_sin) if llama else (None, None)
        with torch.cuda.device(dev):  # sized for this GPU's SMs
            self.workspace = torch.zeros(kernels.decode_megakernel_workspace_floats(C, block.n_head, self.top_k),
                                         device=dev)
        self.logits = torch.empty(model.wte.shape[0], device=dev, dtype=model.wte.dtype)
        self.cache, self.n_head = cache, block.n_head

    def __call__(self, tok, trace=None):  # tok (1, 1) int64 -> logits (V,); trace: see the op's schema
        torch.ops.kernels.decode_megakernel(self.weights, tok, self.cache.pos, self.cache.k, self.cache.v,
                                            self.logits, self.workspace, self.n_head, train.LN_EPS, trace, *self.rope,
                                            self.top_k)
        return self.logits


class Decoder:
    """Prefill and one-token decode steps of one model on one op set, with every buffer preallocated: the
    KV cache, the current token, the generated tokens, the margin between the two largest logits at each
    step and, for sampling, the uniform draws. A step reads and writes only these, so it can be captured
    in a CUDA graph once and replayed for every position. mode: eager, graph (the step captured), or
    megakernel (the step as one Megakernel launch and the pick, captured)."""

    def __init__(self, model, n_new, temperature, sample_top_k, uniforms, mode):
        dev = model.wte.device
        self.model, self.graphed = model, mode != "eager"
        self.cache = kv_cache(model, dev)
        self.megakernel = Megakernel(model, self.cache) if mode == "megakernel" else None
        self.tok = torch.zeros(1, 1, dtype=torch.long, device=dev)  # the last token, input of the next step
        self.tokens = torch.zeros(n_new, dtype=torch.long, device=dev)  # generated tokens
        self.margins = torch.zeros(n_new, device=dev)  # top-1 minus top-2 logit at each step
        self.logits = torch.zeros(n_new, model.wte.shape[0], device=dev)  # each step's, in fp32: what the op sets differ by
        self.step = torch.zeros(1, dtype=torch.long, device=dev)  # index of the next generated token
        self.temperature = temperature
        self.k = min(sample_top_k or model.wte.shape[0], model.wte.shape[0])
        self.uniforms = uniforms.to(dev)  # (n_new,) one draw per step, the same for both paths
        self.graph = None

    def pick(self, logits):  # logits (V,): choose the next token, record it, advance the step counter
        ops = self.model.ops
        if self.temperature == 0:
            vals, idx = ops.topk(logits, 2)  # greedy; the runner-up gives the margin
            nxt, margin = idx[0], vals[0] - vals[1]
        else:
            vals, idx = ops.topk(logits / self.temperature, max(self.k, 2))
            probs = ops.softmax(vals[:self.k])
            u = self.uniforms[self.step]  # (1,)
            choice = (probs.cumsum(0) < u).sum().clamp(max=self.k - 1).view(1)  # inverse CDF
            # gather, not idx[choice]: indexing with a tensor scalar reads it on the host (no graph)
            nxt, margin = idx.gather(0, choice)[0], (vals[0] - vals[1]) * self.temperature
        self.tokens.index_copy_(0, self.step, nxt.view(1))
        self.logits.index_copy_(0, self.step, logits.view(1, -1).float())
        self.margins.index_copy_(0, self.step, margin.view(1).float())
        self.tok.copy_(nxt.view(1, 1))
        self.step += 1

    def prefill(self, ids):  # ids (1, T) int64 on the device
        self.cache.reset()
        logits, _ = self.model(ids, cache=self.cache)  # (1, 1, V)
        self.pick(logits[0, 0])

    def _decode(self):
        if self.megakernel:
            return self.pick(self.megakernel(self.tok))
        logits, _ = self.model(self.tok, cache=self.cache)  # (1, 1, V)
        self.pick(logits[0, 0])

    def decode(self):
        if not self.graphed:
            return self._decode()
        if self.graph is None:
            # One eager step on a side stream first (library handles, workspaces), as capture requires;
            # its effects are undone below, then the step is recorded and replayed from here on.
            saved = (self.cache.pos.clone(), self.step.clone(), self.tok.clone())
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._decode()
            torch.cuda.current_stream().wait_stream(side)
            for buf, val in zip((self.cache.pos, self.step, self.tok), saved):
                buf.copy_(val)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._decode()
        self.graph.replay()


def slide_keep(capacity):
    """The tokens kept when the cache is full: the newest half of the context, prefilled again."""
    return capacity // 2


def generate(dec, prompt_ids, n_new):
    """prompt_ids (T,) int64 on the device. Returns (prefill seconds, decode seconds). When the cache is
    full, the newest slide_keep(capacity) tokens are prefilled again and decoding goes on from there."""
    capacity = dec.cache.capacity
    keep = slide_keep(capacity)
    dec.step.zero_()
    data.sync(prompt_ids.device)
    t0 = time.perf_counter()
    dec.prefill(prompt_ids[None])
    data.sync(prompt_ids.device)
    t1 = time.perf_counter()
    in_cache = len(prompt_ids)
    for i in range(1, n_new):
        if in_cache == capacity:  # slide: re-prefill the newest `keep` tokens (the count is the host's)
            context = torch.cat([prompt_ids, dec.tokens[:i]])[-keep:]
            dec.prefill(context[None])
            in_cache = keep
        else:
            dec.decode()
            in_cache += 1
    data.sync(prompt_ids.device)
    t2 = time.perf_counter()
    dec.model.ops.check_errors()  # a bad index met inside the (graphed) steps raises here, after the timing
    return t1 - t0, t2 - t1


def copy_bandwidth(device, nbytes=256 * 2**20, reps=20):
    """Device-to-device copy rate in bytes/s (bytes read + written), the memory limit decoding works against."""
    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return 2 * nbytes / statistics.median(times)


def run_path(model, ops, mode, prompt_ids, cfg, uniforms):
    """One path (mode: eager, graph or megakernel): a short warm-up generation (and the graph capture), then
    the timed one."""
    model.ops = ops
    dec = Decoder(model, cfg.max_new_tokens, cfg.temperature, cfg.sample_top_k, uniforms, mode)
    with torch.no_grad():
        generate(dec, prompt_ids, min(cfg.max_new_tokens, 8))
        t_prefill, t_decode = generate(dec, prompt_ids, cfg.max_new_tokens)
    return {
        "tokens": dec.tokens.tolist(),
        "margins": dec.margins.tolist(),
        "logits": dec.logits.cpu(),  # kept out of inference.json: report() compares them
        "prefill_tok_s": len(prompt_ids) / t_prefill,
        "decode_tok_s": (cfg.max_new_tokens - 1) / t_decode if cfg.max_new_tokens > 1 else None,
    }


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


# -----------------------------------------------------------------------------

def check_sample_top_k(cfg, specs, paths):
    """Sampling on the cuda op set picks among the k most likely tokens with our top-k, which takes at most
    kernels.LIMITS['topk_max_k']: a k (or a whole vocabulary) past that is refused before any decoding."""
    if cfg.temperature == 0 or not any(name == "cuda" for p in paths.values() for name, _, _ in p):
        return
    limit = data.import_kernels()[0].LIMITS["topk_max_k"]
    for spec in specs:
        if (cfg.sample_top_k or spec.tok.vocab_size) > limit:
            what = f"--sample_top_k={cfg.sample_top_k}" if cfg.sample_top_k else \
                f"sampling over all {spec.tok.vocab_size} tokens of the {spec.label} model"
            fail(f"{what}: the cuda op set's top-k takes at most {limit}; pass --sample_top_k={limit} or less")


def choose_paths(cfg, specs):
    """For each model spec, [(op set name, ops, mode)], mode eager, graph or megakernel (the cuda op set's);
    and notes to print."""
    dev = torch.device(cfg.device)
    modes = ["eager", "graph"] if dev.type == "cuda" and cfg.cuda_graph else ["eager"]
    names = ["torch", "cuda"] if cfg.backend == "both" else [cfg.backend]
    notes, kernels = [], None
    if "cuda" in names:
        # with bf16, the prefill's linear runs our bf16 matmul (Hopper only), as in train.py
        kernels, why = data.cuda_kernels_for(cfg.device, "bf16" in cfg.dtypes)
        if why:
            if cfg.backend == "cuda":
                fail(f"--backend=cuda cannot run: {why}")
            notes.append(f"note: decoding with the PyTorch op set only: {why}")
            names = ["torch"]
        else:
            kernels.set_pdl(cfg.pdl)
            if not cfg.pdl:
                notes.append("note: --pdl=false: our kernels are launched the ordinary way")
    paths = {}
    for spec in specs:
        paths[spec.label] = []
        for name in names:
            ops = train.TORCH_OPS
            if name == "cuda":
                head = spec.shape.n_embd // spec.shape.n_head
                if head not in kernels.LIMITS["fused_head_sizes"]:
                    fail(f"{spec.label} model: head size {head} (n_embd / n_head): the cuda path decodes with the fused "
                         f"attention, which supports head sizes {kernels.LIMITS['fused_head_sizes']}")
                ops = train.cuda_op_set(kernels, head)
            paths[spec.label] += [(name, ops, m) for m in modes]
            if name == "cuda" and cfg.megakernel and "graph" in modes:
                paths[spec.label].append((name, ops, "megakernel"))
    return paths, notes


# -----------------------------------------------------------------------------
# the drop-in: other people's models on our kernels, through torch.nn.functional and Hugging Face's modules
# (README: In your own model)

FLOAT_DTYPES = (torch.float32, torch.bfloat16)


def tracing(*tensors):
    """Whether a call is traced rather than run: by Dynamo, or by AOTAutograd re-running Dynamo's graph on
    fake or functional tensors. That graph calls torch.nn.functional by name, so inside patched() it calls
    the routes again, where no tensor's data can be read."""
    return torch.compiler.is_compiling() or any(isinstance(t, (FakeTensor, FunctionalTensor)) for t in tensors)


def _takes(device_type, *tensors):
    """Whether our kernels take these tensors: on one device of device_type (a GPU) in float32 or bfloat16 (None:
    an absent optional one), outside autocast or under bf16's (our kernels have no float16 path)."""
    given = [t for t in tensors if t is not None]
    if not given or (torch.is_autocast_enabled(device_type)
                     and torch.get_autocast_dtype(device_type) != torch.bfloat16):
        return False
    return all(torch.is_tensor(t) and t.device.type == device_type and t.device == given[0].device
               and t.dtype in FLOAT_DTYPES for t in given)


def _functional_routes(kernels, device_type):
    """name -> torch.nn.functional.<name> on our kernels, or NotImplemented where PyTorch's would give another
    dtype, shape or error (then PyTorch's runs). Our ops follow bf16 autocast as PyTorch's do (bindings.cpp,
    autocast); under another autocast dtype every call is PyTorch's."""
    def autocast():
        return torch.is_autocast_enabled(device_type)

    def ours(*tensors):
        return _takes(device_type, *tensors)

    def one_dtype(*tensors):  # outside autocast PyTorch's ops raise on mixed dtypes; ours may not
        given = [t for t in tensors if t is not None]
        return all(t.dtype == given[0].dtype for t in given)

    # our bf16 products run on Hopper's wgmma alone (kernels.cu, matmul_bf16); elsewhere PyTorch's
    bf16_products = device_type != "cuda" or (torch.cuda.is_available()
                                              and torch.cuda.get_device_capability() == (9, 0))

    def linear(input, weight, bias=None):
        # Under autocast PyTorch casts all three to bf16; ours casts the input and rounds an fp32 (master)
        # weight with its bias, which must then share the weight's dtype. PyTorch also broadcasts a bias.
        ok = (ours(input, weight, bias) and input.dim() >= 1 and weight.dim() == 2
              and input.shape[-1] == weight.shape[1] and (bias is None or bias.shape == weight.shape[:1])
              and (one_dtype(weight, bias) if autocast() else one_dtype(input, weight, bias))
              and (bf16_products or (input.dtype == torch.float32 and not autocast())))
        return kernels.linear(input, weight, bias) if ok else NotImplemented

    def norm_ok(input, normalized_shape, *params):  # the last dim, its parameters all given, one dtype
        return (ours(input, *params) and input.dim() >= 1 and isinstance(normalized_shape, (tuple, list))
                and tuple(normalized_shape) == input.shape[-1:] and one_dtype(input, *params)
                and all(p is not None and p.shape == input.shape[-1:] for p in params))

    def norm_dtype():  # autocast runs PyTorch's layer_norm in float32, so it writes float32
        return torch.float32 if autocast() else None

    def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
        ok = norm_ok(input, normalized_shape, weight, bias)
        return kernels.layernorm(input, weight, bias, eps, out_dtype=norm_dtype()) if ok else NotImplemented

    def rms_norm(input, normalized_shape, weight=None, eps=None):
        eps = torch.finfo(torch.float32).eps if eps is None else eps  # as F.rms_norm, which computes in float32
        ok = norm_ok(input, normalized_shape, weight)
        # rms_norm is on none of autocast's lists: PyTorch's writes the input's dtype, where ours would write bf16
        return kernels.rmsnorm(input, weight, eps, out_dtype=input.dtype) if ok else NotImplemented

    def gelu(input, approximate="none"):
        ok = ours(input) and approximate in ("none", "tanh")
        return kernels.gelu(input, approximate=approximate) if ok else NotImplemented

    def silu(input, inplace=False):
        return kernels.silu(input) if ours(input) and not inplace else NotImplemented

    def embedding(input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
                  sparse=False):
        # padding_idx's row gets no gradient in ours as in PyTorch's; one out of range is PyTorch's, which raises
        if (ours(weight) and input.device == weight.device and input.dtype == torch.long and weight.dim() == 2
                and (padding_idx is None or (isinstance(padding_idx, int)
                                             and -weight.shape[0] <= padding_idx < weight.shape[0]))
                and max_norm is None and not scale_grad_by_freq and not sparse):
            return kernels.embedding(input, weight, padding_idx=padding_idx)
        return NotImplemented

    def softmax(input, dim=None, _stacklevel=3, dtype=None):
        # PyTorch casts the input to dtype first: to bfloat16 that rounds it, which ours would not
        ok = (ours(input) and input.dim() >= 1 and dim in (-1, input.dim() - 1)
              and dtype in (None, input.dtype, torch.float32))
        return kernels.softmax(input, out_dtype=dtype) if ok else NotImplemented

    def fresh_rng(device):
        # dropout's {seed, offset}, drawn from PyTorch's generator as its own dropout draws: the generator
        # advances, torch.manual_seed repeats the masks, and a CUDA graph replays fresh ones
        return torch.empty(2, dtype=torch.long, device=device).random_()

    def dropout(input, p=0.5, training=True, inplace=False):
        # Outside training PyTorch's returns the input itself (no work); in place stays PyTorch's. At p = 0 it
        # returns the input itself too, drawing nothing (GPT-2's modules as Hugging Face builds them): so do we.
        if not (ours(input) and training and not inplace and isinstance(p, (int, float)) and 0 <= p <= 1):
            return NotImplemented
        return input if p == 0 else kernels.dropout(input, float(p), fresh_rng(input.device))

    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                     enable_gqa=False):
        # Ours takes q (B, H, Sq, D) and k, v (B, H_kv, Sk, D), query head h reading key head h // (H / H_kv) as
        # SDPA's enable_gqa does. SDPA also broadcasts batch and head dims and lets v's head size differ; its
        # causal mask aligns the queries to the first keys, ours to the last: alike when Sq == Sk. Dropout on
        # the probabilities runs in the fused kernels (masks of our own, from PyTorch's generator).
        if not (ours(query, key, value) and query.dim() == key.dim() == 4 and attn_mask is None
                and 0.0 <= dropout_p <= 1.0):
            return NotImplemented
        (B, H, Sq, D), (Bk, Hkv, Sk, Dk) = query.shape, key.shape
        fused = D in kernels.LIMITS["fused_head_sizes"]
        if (value.shape == key.shape and (Bk, Dk) == (B, D) and query.numel() > 0 and key.numel() > 0
                and (H == Hkv or (enable_gqa and H % Hkv == 0)) and (not is_causal or Sq == Sk)
                and (fused or not dropout_p)
                and (autocast() or (one_dtype(query, key, value) and (fused or query.dtype == torch.float32)))):
            drop = dict(dropout_p=float(dropout_p), rng=fresh_rng(query.device)) if dropout_p else {}
            return kernels.attention(query, key, value, causal=is_causal, scale=scale,
                                     mode="fused" if fused else "tiled", **drop)
        return NotImplemented

    def cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                      reduction="mean", label_smoothing=0.0):
        # Ignored targets are skipped on the device, as PyTorch's skips them, so the data is never read here and
        # a traced graph takes ours too. A target out of range (not ignore_index) is ours as well: a NaN loss and
        # a ValueError from our next op or kernels.check_errors(), where PyTorch's CUDA kernel stops at a
        # device-side assert that leaves the process's CUDA context unusable. PyTorch's mean over no rows is NaN,
        # where ours raises.
        if not (ours(input) and input.dim() == 2 and input.shape[0] > 0 and torch.is_tensor(target)
                and target.dtype == torch.long and target.shape == input.shape[:1] and target.device == input.device
                and weight is None and size_average is None and reduce is None and reduction == "mean"
                and label_smoothing == 0.0 and isinstance(ignore_index, int)):
            return NotImplemented
        # float32, as PyTorch's under autocast; else the logits' dtype
        loss = kernels.cross_entropy(input, target, ignore_index=ignore_index)
        return loss if autocast() else loss.to(input.dtype)

    return {f.__name__: f for f in (linear, layer_norm, rms_norm, gelu, silu, embedding, softmax, cross_entropy,
                                    dropout, scaled_dot_product_attention)}


def _kernels_for(who, kernels):
    """The kernels extension (or the stand-in given), its ops registered with Inductor for torch.compile."""
    if kernels is None:
        kernels, why = data.import_kernels()
        if kernels is None:
            raise RuntimeError(f"{who} needs the kernels extension: {why}")
    data.register_inductor_fallbacks()
    return kernels


@contextlib.contextmanager
def patched(kernels=None, device_type="cuda"):
    """Within it, torch.nn.functional's linear, layer_norm, rms_norm, gelu, silu, embedding, softmax, dropout,
    scaled_dot_product_attention and cross_entropy run on our kernels wherever they compute what PyTorch's
    would (its dtype and shape, values within the op's tolerance; dropout's masks are ours, drawn from
    PyTorch's generator, which advances as with its own), and on PyTorch's own otherwise: where
    PyTorch's would raise, or broadcast, or take what ours do not (float16 or float64, mixed dtypes outside
    bf16 autocast, float16 autocast, bf16 products off Hopper, an attention mask, in-place dropout, v's own head
    size, SDPA's causal mask with Sq != Sk, an embedding's max_norm or a padding_idx out of range, softmax to
    bf16 from fp32, a loss's weights, a reduction other than the mean, label smoothing, an empty batch). An
    embedding's padding_idx and a loss's ignored targets (any ignore_index: Hugging Face's labels pad with -100)
    are ours, as PyTorch computes them. A target out of range (not ignore_index) is ours too: the loss is NaN
    and our next op, or kernels.check_errors(), raises a ValueError naming it, where PyTorch's CUDA kernel
    stops at a device-side assert that leaves the process's CUDA unusable. Yields a Counter of the eager calls
    by (name, "ours" or "torch"). A model under torch.compile traces our ops whole, cross_entropy included,
    at static shapes (dynamic=False: the ops' meta versions are C++ functions of concrete sizes).

        with inference.patched() as counts:
            model = torch.compile(model, fullgraph=True)
            loss = model(x, y)  # F.linear, F.layer_norm, ... on our kernels"""
    counts, routes = collections.Counter(), _functional_routes(_kernels_for("patched()", kernels), device_type)
    originals = {name: getattr(F, name) for name in routes}

    def route(name):
        original = originals[name]

        @functools.wraps(original)
        def call(*args, **kwargs):
            if name not in routes:  # after the block: a function kept from inside it (HF's GELU modules keep F.gelu)
                return original(*args, **kwargs)
            out = routes[name](*args, **kwargs)
            if not tracing(*args, *kwargs.values()):  # eager calls: a compiled graph is traced once
                counts[name, "torch" if out is NotImplemented else "ours"] += 1
            return original(*args, **kwargs) if out is NotImplemented else out
        return call

    for name in routes:
        setattr(F, name, route(name))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(F, name, original)
        routes.clear()


# Hugging Face modules whose forwards patched() cannot route (Python on PyTorch's tensor ops, addmm, or a function
# kept when the model was built), by class name: transformers stays an optional import.
HF_RMSNORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm")
HF_SWIGLU_MLPS = ("LlamaMLP", "Qwen2MLP", "MistralMLP")
HF_ROPE_ATTENTIONS = ("LlamaAttention", "Qwen2Attention", "MistralAttention")  # their module's apply_rotary_pos_emb
# each GELU module's approximation: NewGELU, FastGELU and AccurateGELU spell out the tanh one in Python
HF_GELUS = {"GELUActivation": "none", "GELUTanh": "tanh", "PytorchGELUTanh": "tanh", "NewGELUActivation": "tanh",
            "FastGELUActivation": "tanh", "AccurateGELUActivation": "tanh"}
HF_CONV1DS = ("Conv1D",)  # GPT-2's projections: y = x @ W + b, W (in, out), by torch.addmm


@contextlib.contextmanager
def apply_kernels(model, kernels=None, device_type="cuda"):
    """Within it, the Hugging Face modules of model's types run on our kernels wherever they compute what the
    originals would, and as the originals otherwise: the RMSNorm (rmsnorm), SwiGLU MLP (linear, swiglu, linear) and
    apply_rotary_pos_emb (rope) of transformers' Llama, Qwen2 and Mistral, GPT-2's Conv1D (linear) and the GELU
    modules (gelu, with the approximation each computes). They call nothing patched() could route: their forwards
    are Python on tensor ops, or torch.addmm, or keep F.gelu from when the model was built; patched() around it
    takes the rest (F.linear, SDPA, the embedding, ...). Under torch.compile, HF's SDPA mask function gives an
    unpadded causal mask as the is_causal flag, as HF's does when not compiling (_causal_sdpa_mask), so the compiled
    attention is ours too. Each forward, and the attention's module's apply_rotary_pos_emb, is swapped in its class
    or module until the block ends: every instance runs ours, built before the block or in it, of this model or
    another. Yields a Counter of the eager calls by (class or function name, "ours" or "torch").

        with inference.patched(), inference.apply_kernels(model) as counts:
            loss = model(input_ids, labels=labels).loss  # RMSNorm, MLP, RoPE, Linear, SDPA, ... on our kernels

    The originals run where patched()'s routes refuse (CPU tensors, float16, float64, mixed dtypes, ...: an RMSNorm
    whose weight's dtype is not its input's, where HF's promotes), for an MLP whose act is not SiLU or whose
    projections are not nn.Linear as built (a LoRA layer, a hook), and for a rotation of positions that differ
    across the batch rows or traced by torch.compile (our rope's one (T, D/2) table needs HF's rows equal and the
    halves of each equal, checked on the data)."""
    kernels = _kernels_for("apply_kernels()", kernels)
    counts, routes = collections.Counter(), _functional_routes(kernels, device_type)
    linear = routes["linear"]

    def rmsnorm(self, hidden_states):  # HF's: in float32, written in the input's dtype, times the weight
        return routes["rms_norm"](hidden_states, self.weight.shape, self.weight, self.variance_epsilon)

    def as_built(m):  # a subclass (a LoRA layer), a hook or a wrapped forward would be skipped by our linear
        return type(m) is nn.Linear and not (m._forward_hooks or m._forward_pre_hooks or "forward" in vars(m))

    def swiglu_mlp(self, x):  # down(act(gate(x)) * up(x)); where one linear refuses, the original does it all
        gate, up, down = self.gate_proj, self.up_proj, self.down_proj
        if type(self.act_fn).__name__ not in ("SiLUActivation", "SiLU") or not all(map(as_built, (gate, up, down))):
            return NotImplemented
        a = linear(x, gate.weight, gate.bias)
        b = a if a is NotImplemented else linear(x, up.weight, up.bias)
        return b if b is NotImplemented else linear(kernels.swiglu(a, b), down.weight, down.bias)

    def conv1d(self, x):  # x @ W + b, W (in, out): our linear reads its transpose, a view, without a copy
        return linear(x, self.weight.t(), self.bias)

    def gelu(approximate):
        return lambda self, input: routes["gelu"](input, approximate)

    def capturing(t):  # a CUDA graph being captured on t's device: no data can be read
        return t.is_cuda and torch.cuda.is_current_stream_capturing()

    # the last cos, sin checked (halves equal, rows equal), and whether they were fit: a check a forward, not a layer
    checked = [None, None, False]

    def rope(q, k, cos, sin, unsqueeze_dim=1):
        # rotate_half pairs element i of q, k (B, H, T, D) with i + D/2, as our rope does, by cos, sin (1 or B, T, D)
        # whose halves HF's rotary embeddings make equal (cat(freqs, freqs)); ours reads (T, D/2) for the whole
        # batch, so B rows of tables must be equal (generate's position ids are per row, mostly the same)
        B, T, D = q.shape[0], *(q.shape[2:] if q.dim() == 4 else (0, 1))
        if not (unsqueeze_dim == 1 and q.dim() == k.dim() == 4 and k.shape[2:] == q.shape[2:] and D % 2 == 0
                and q.dtype == k.dtype and cos.dtype == sin.dtype and cos.shape == sin.shape
                and cos.shape in ((1, T, D), (B, T, D)) and not (cos.requires_grad or sin.requires_grad)
                and _takes(device_type, q, k, cos, sin)
                and not tracing(q, k, cos, sin) and not capturing(q)):  # the tables' checks read the data
            return NotImplemented
        if not (checked[0] is cos and checked[1] is sin):
            checked[:] = cos, sin, all(torch.equal(t[..., :D // 2], t[..., D // 2:]) and
                                       torch.equal(t, t[:1].expand_as(t)) for t in (cos, sin))
        if not checked[2]:
            return NotImplemented
        dtype = torch.promote_types(q.dtype, cos.dtype)  # HF's products promote: bf16 q, fp32 tables give fp32
        c, s = (t[0, :, :D // 2].float() for t in (cos, sin))
        return kernels.rope(q.to(dtype), c, s), kernels.rope(k.to(dtype), c, s)

    ours = {**dict.fromkeys(HF_RMSNORMS, rmsnorm), **dict.fromkeys(HF_SWIGLU_MLPS, swiglu_mlp),
            **dict.fromkeys(HF_CONV1DS, conv1d), **{name: gelu(approximate) for name, approximate in HF_GELUS.items()}}
    swaps = {}  # (class or module, attribute) -> our version
    for cls in {type(m) for m in model.modules() if type(m).__module__.startswith("transformers.")}:
        if cls.__name__ in HF_ROPE_ATTENTIONS and "apply_rotary_pos_emb" in vars(sys.modules[cls.__module__]):
            swaps[sys.modules[cls.__module__], "apply_rotary_pos_emb"] = rope
        elif cls.__name__ in ours and "forward" in vars(cls):
            swaps[cls, "forward"] = ours[cls.__name__]
    originals = {key: vars(key[0])[key[1]] for key in swaps}

    def stand_in(original, fn, label):  # fn's result, or the original's where fn returns NotImplemented
        @functools.wraps(original)
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            if not tracing(*args, *kwargs.values()):  # eager calls: a compiled graph is traced once
                counts[label, "torch" if out is NotImplemented else "ours"] += 1
            return original(*args, **kwargs) if out is NotImplemented else out
        return call

    for (owner, attr), fn in swaps.items():
        label = attr if attr != "forward" else owner.__name__
        setattr(owner, attr, stand_in(originals[owner, attr], fn, label))
    masks = getattr(sys.modules.get("transformers.masking_utils"), "AttentionMaskInterface", None)
    sdpa_mask = masks and masks._global_mapping.get("sdpa")
    if sdpa_mask and swaps:
        masks._global_mapping["sdpa"] = _causal_sdpa_mask(sdpa_mask, sys.modules["transformers.masking_utils"])
    try:
        yield counts
    finally:
        for (owner, attr), original in originals.items():
            setattr(owner, attr, original)
        if sdpa_mask and swaps:
            masks._global_mapping["sdpa"] = sdpa_mask


def _causal_sdpa_mask(original, masking):
    """Hugging Face's SDPA mask function, but under torch.compile, for a mask HF itself would skip when not compiling
    (its caller allows the skip, no padding, no sliding window or chunk that bites, no tensor cache offset, one
    query or as many as keys): None, so that the attention passes is_causal. Compiling, HF's (for torch < 2.14,
    which cannot tell compiling from exporting) builds the whole causal mask, and a masked attention call is
    PyTorch's, not ours. HF calls it by keywords."""
    @functools.wraps(original)
    def mask(*args, **kw):
        q_len, kv_len, local = kw.get("q_length"), kw.get("kv_length"), kw.get("local_size")
        if (not args and torch.compiler.is_compiling() and kw.get("allow_is_causal_skip", True)
                and kw.get("attention_mask") is None and isinstance(q_len, int) and isinstance(kv_len, int)
                and (local is None or kv_len < local) and not torch.is_tensor(kw.get("q_offset", 0))
                and q_len in (1, kv_len)):
            return None
        return original(*args, **kw)
    return mask


def main(argv):
    cfg = parse_config(argv)
    dev = torch.device(cfg.device)
    specs, notes = model_specs(cfg)
    if not specs:
        fail(f"no model to decode: --models={','.join(cfg.models)} and {cfg.ckpt} does not exist (python train.py "
             "writes it)")
    for spec in specs:
        try:
            spec.prompt = spec.tok.encode(cfg.prompt)
        except ValueError as e:
            fail(f"--prompt, for the {spec.label} model's vocabulary: {e}")
        if not spec.prompt:
            fail("--prompt is empty; give at least one character")
        if len(spec.prompt) >= spec.shape.block_size:
            fail(f"--prompt has {len(spec.prompt)} characters, the {spec.label} model's context holds "
                 f"{spec.shape.block_size}: shorten it")
    paths, path_notes = choose_paths(cfg, specs)
    check_sample_top_k(cfg, specs, paths)
    for note in notes + path_notes:
        print(note)
    hw = data.device_name(dev)
    sampling = "greedy" if cfg.temperature == 0 else \
        f"temperature {cfg.temperature}, top-k {cfg.sample_top_k or 'all'}"
    bw = copy_bandwidth(dev) if dev.type == "cuda" else None
    print(f"device: {hw}" + (f", device-to-device copy {bw / 1e9:,.0f} GB/s" if bw else "")
          + f" | {sampling} | {cfg.max_new_tokens} new tokens; when the context fills, its newest half is prefilled"
          + " again")
    if any(spec.label != "trained" for spec in specs):
        print(f"note: dense and moe have random weights (one model a seed; blocks drawn at std "
              f"{context_std(cfg.n_embd):.3g}, inference.context_std), so their text is noise that depends on the "
              f"context; the trained model is {cfg.ckpt}, which python train.py writes")
    results = {"device": hw, "copy_bytes_per_s": bw, "config": vars(cfg), "models": {}}
    data.make_out_dir(cfg.out_dir, fail, "inference.json")
    with data.out_dir_lock(cfg.out_dir, "inference.py", fail):
        # An earlier run's results stay: this run writes beside them, as inference_2.json, inference_3.json, ...
        first, path = os.path.join(cfg.out_dir, "inference.json"), data.unused_path(cfg.out_dir, "inference.json")
        print(f"results: {path}" + ("" if path == first else f" ({first} holds an earlier run's)"))

        def save():  # whole or not at all, after every run: a run killed later keeps what it finished
            data.write_json(path, results)
        try:
            decode_all(cfg, specs, paths, dev, results, save)
        except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: the finished models and the unfinished one's runs
            results["interrupted"] = data.signal_words(data.signal_of(e))
            save()
            sys.stderr.write(f"inference.py: interrupted by {results['interrupted']}; the results so far are in {path}\n")
            sys.exit(data.signal_exit(data.signal_of(e)))
        except RuntimeError as e:  # torch.OutOfMemoryError is one too
            if not data.is_out_of_memory(e):
                raise
            save()
            fail(f"{data.out_of_memory_words(e, dev)}: the model is too large; pass smaller --n_layer, --n_embd, "
                 f"--n_expert or --block_size (the results so far are in {path})")
        save()
    print(f"\nwrote {path}")


def decode_all(cfg, specs, paths, dev, results, save=lambda: None):
    """Every model, dtype and seed on every path, each model's report into results["models"] as it ends;
    the runs of the one in progress stay in results["unfinished"] until then. save() writes results after
    each run and each model."""
    uniforms = torch.rand(cfg.max_new_tokens, generator=torch.Generator().manual_seed(1234))
    bw = results["copy_bytes_per_s"]
    for spec in specs:
        prompt_ids = torch.tensor(spec.prompt, dtype=torch.long, device=dev)
        for dtype in cfg.dtypes:
            label = spec.label if len(cfg.dtypes) == 1 else f"{spec.label} {dtype}"
            runs, logits = [], {}
            results["unfinished"] = {"model": label, "runs": runs}
            for seed in spec.seeds:
                model = with_dtype(spec.make(seed).to(dev), dtype).eval()
                nbytes = weight_bytes_per_token(model)
                cache_bytes = kv_cache(model, "meta").nbytes
                why_not = megakernel_why_not(model) if any(p[2] == "megakernel" for p in paths[spec.label]) else None
                for name, ops, mode in paths[spec.label]:
                    if mode == "megakernel" and why_not:
                        if seed == spec.seeds[0]:
                            print(f"note: {label}: no megakernel row: {why_not}")
                        continue
                    r = run_path(model, ops, mode, prompt_ids, cfg, uniforms)
                    logits[name, mode, seed] = r.pop("logits")
                    r.update(op_set=name, mode=mode, seed=seed)
                    runs.append(r)
                    save()  # before the line that says the run is done
                    print(f"{label} | seed {seed} | {name:<5} {r['mode']:<10} | prefill {r['prefill_tok_s']:>9,.0f} "
                          f"tok/s | decode {r['decode_tok_s'] or 0:>8,.0f} tok/s", flush=True)
                del model
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            results["models"][label] = report(label, spec, runs, logits, nbytes, cache_bytes, bw, cfg)
            del results["unfinished"]
            save()
        if len(cfg.dtypes) == 2:
            results["models"][f"{spec.label} bf16 / fp32"] = dtype_speedups(spec.label, results["models"])


def dtype_speedups(kind, models):
    """Decode tok/s of the bf16 model over the fp32 one, path by path (both measured in this run)."""
    fp32, bf16 = models[f"{kind} fp32"]["speed"], models[f"{kind} bf16"]["speed"]
    ratios = {path: bf16[path]["decode_tok_s"] / fp32[path]["decode_tok_s"]
              for path in fp32 if fp32[path]["decode_tok_s"] and bf16.get(path, {}).get("decode_tok_s")}
    print(f"{kind}: decode tok/s bf16 / fp32: " + ", ".join(f"{p} {r:.2f}x" for p, r in ratios.items()) + "\n")
    return ratios


NEAR_TIE = 10  # a greedy pick is a near tie when its top-1/top-2 margin is under 10x what the op sets' logits differ by


def compare_runs(ts, cs, logits):
    """Torch's and our runs of the same seeds in one mode, seed by seed: the first new token where they
    differ (None if none), and at each step before it and at it (the context still the same) the
    largest logit difference between the two and torch's top-1 minus top-2 margin."""
    out = []
    for t, c in zip(ts, cs, strict=True):
        i = first_difference(t["tokens"], c["tokens"])
        n = len(t["tokens"]) if i is None else i + 1
        diff = (logits["torch", t["mode"], t["seed"]][:n] - logits["cuda", c["mode"], c["seed"]][:n]).abs().amax(-1)
        out.append({"seed": t["seed"], "first_difference": i, "tokens": len(t["tokens"]), "logit_diff": diff.tolist(),
                    "margin_torch": t["margins"][:n], "margin_cuda": c["margins"][:n]})
    return out


def match_line(mode, seeds):
    """The exact-match line of one mode, backed by margins: how many equal picks were no near tie."""
    same = sum(s["tokens"] if s["first_difference"] is None else s["first_difference"] for s in seeds)
    total = sum(s["tokens"] for s in seeds)
    worst = max(max(s["logit_diff"]) for s in seeds)
    margins = [m for s in seeds for m in s["margin_torch"][:len(s["logit_diff"]) - (s["first_difference"] is not None)]]
    decided = sum(m > NEAR_TIE * worst for m in margins)
    line = (f"exact match ({mode}): {same}/{total} tokens equal over {len(seeds)} seed(s); logits differ by at most "
            f"{worst:.1e}, and {decided} of the {same} equal picks won by over {NEAR_TIE}x that"
            + (f" (smallest margin {min(margins):.1e})" if margins else ""))
    for s in seeds:
        if (i := s["first_difference"]) is not None:
            tie = "a near tie" if s["margin_torch"][i] <= NEAR_TIE * worst else "NOT a near tie"
            line += (f"; seed {s['seed']}: first difference at new token {i}, top-1 minus top-2 logit there "
                     f"{s['margin_torch'][i]:.2e} (torch), {s['margin_cuda'][i]:.2e} (cuda): {tie}")
    return line, {"equal_prefix_tokens": same, "tokens": total, "max_logit_diff": worst, "not_near_tie": decided,
                  "near_tie_factor": NEAR_TIE, "seeds": seeds}


def longest_run(tokens):
    return max(len(list(g)) for _, g in itertools.groupby(tokens)) if tokens else 0


def report(label, spec, runs, logits, nbytes, cache_bytes, bw, cfg):
    """Print the speed table (medians over seeds), the speedups, exact match with its margins and the text;
    return a summary."""
    rows = {}
    for r in runs:
        rows.setdefault((r["op_set"], r["mode"]), []).append(r)
    shape = spec.shape
    print(f"\n{label} ({describe(shape)}): {nbytes / 1e6:,.0f} MB of weights read per decoded token; KV cache "
          f"{cache_bytes / 1e6:,.1f} MB; medians over {len(spec.seeds)} seed(s)")
    print(f"{'op set':<7} {'mode':<10} {'prefill tok/s':>14} {'decode tok/s':>13} {'GB/s':>8} {'of copy bw':>11}")
    speed = {}
    for (name, mode), rs in rows.items():
        pre = statistics.median(r["prefill_tok_s"] for r in rs)
        dec = statistics.median(r["decode_tok_s"] for r in rs) if rs[0]["decode_tok_s"] else None
        gbs = dec * nbytes / 1e9 if dec else None
        frac = f"{dec * nbytes / bw:.0%}" if dec and bw else "n/a"
        speed[f"{name} {mode}"] = {"prefill_tok_s": pre, "decode_tok_s": dec, "GB_s": gbs}
        print(f"{name:<7} {mode:<10} {pre:>14,.0f} {dec or 0:>13,.0f} {gbs or 0:>8,.0f} {frac:>11}")
    summary = {"shape": {k: getattr(shape, k) for k in CKPT_SHAPE}, "weight_bytes_per_token": nbytes,
               "kv_cache_bytes": cache_bytes, "speed": speed, "match": {}}
    d = {k: v["decode_tok_s"] for k, v in speed.items()}
    for ours, theirs in (("cuda eager", "torch eager"), ("cuda graph", "torch graph"), ("cuda graph", "torch eager"),
                         ("cuda megakernel", "torch graph"), ("cuda megakernel", "cuda graph")):
        if d.get(ours) and d.get(theirs):
            summary[f"{ours} / {theirs}"] = d[ours] / d[theirs]
            print(f"decode speedup {ours} / {theirs}: {d[ours] / d[theirs]:.2f}x")
    # exact match: our path against the PyTorch path in the same mode (the megakernel: graphed), seed by seed
    for mode in ("eager", "graph", "megakernel"):
        ts, cs = rows.get(("torch", "graph" if mode == "megakernel" else mode)), rows.get(("cuda", mode))
        if ts and cs:
            line, summary["match"][mode] = match_line(mode, compare_runs(ts, cs, logits))
            print(line)
    best = rows.get(("cuda", "graph")) or rows.get(("cuda", "eager")) or next(iter(rows.values()))
    toks = best[0]["tokens"]
    print(f"--- {label}" + (f", seed {best[0]['seed']}" if best[0]["seed"] is not None else "")
          + f", {best[0]['op_set']} {best[0]['mode']}: {len(set(toks))} distinct tokens, longest run of one "
          f"{longest_run(toks)} ---\n{cfg.prompt}|{spec.tok.decode(toks)}\n")
    return summary


if __name__ == "__main__":
    try:
        with data.sigterm_interrupts():
            main(sys.argv[1:])
    except KeyboardInterrupt as e:  # before decoding began (building the models, measuring bandwidth): nothing to keep
        sys.stderr.write(f"inference.py: interrupted by {data.signal_words(data.signal_of(e))}\n")
        sys.exit(data.signal_exit(data.signal_of(e)))
