"""The scripts' plumbing, so that train.py and inference.py hold only the model, the op sets and their loops:
the text and its batches, the command line, the machine (our kernels where they can run, step timing,
Ctrl-C), checkpoint and result files, plots, and the processes that share the batches under torchrun.

The training text is The Wonderful Wizard of Oz (Project Gutenberg eBook #55). It is downloaded once
and cached next to this file, or read from any UTF-8 file given with --data_path. Gutenberg's header
and license footer are stripped, the characters of the text become the vocabulary, and training
batches are random windows drawn with a CPU generator so every backend sees the same batches.
The synthetic incrementing-token task of the mHC depth sweep lives here too (increment_batch).
"""

import contextlib
import datetime
import difflib
import fcntl
import hashlib
import json
import math
import os
import re
import signal
import sys
import threading
import time
import zipfile
from types import SimpleNamespace

import requests
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

BOOK_URL = "https://www.gutenberg.org/cache/epub/55/pg55.txt"
CACHE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data_cache")
CACHE_NAME = "wizard_of_oz.txt"

_START = re.compile(r"^.*\*\*\* *START OF TH(E|IS) PROJECT GUTENBERG EBOOK.*$", re.I | re.M)
_END = re.compile(r"^.*\*\*\* *END OF TH(E|IS) PROJECT GUTENBERG EBOOK.*$", re.I | re.M)


def clean_text(raw: str) -> str:
    """Drop the BOM, normalise line ends to LF and cut Gutenberg's header and footer if present."""
    text = raw.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    start = _START.search(text)
    if start:
        text = text[start.end():]
    end = _END.search(text)
    if end:
        text = text[:end.start()]
    return text.strip() + "\n"


def _short_reason(e: requests.RequestException) -> str:
    # requests' own messages run to several nested lines; the chained exception keeps the detail.
    if isinstance(e, requests.HTTPError) and e.response is not None:
        return f"HTTP {e.response.status_code} {e.response.reason}"
    if isinstance(e, requests.Timeout):
        return "no answer within the timeout"
    m = re.search(r"\[Errno -?\d+\] ([^'\")]+)", str(e))
    return m.group(1).strip() if m else type(e).__name__


def read_text_file(path: str, what: str = "data file") -> str:
    """The cleaned text of a UTF-8 file; errors name the file and say what is wrong with it."""
    if os.path.isdir(path):
        raise IsADirectoryError(f"{what} is a directory, expected a UTF-8 text file: {path}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what} not found: {path}")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = clean_text(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} is not UTF-8 text: {path} (byte 0x{raw[e.start]:02x} at offset {e.start})") from None
    if not text.strip():
        raise ValueError(f"{what} is empty after cleaning: {path}")
    return text


def load_text(data_path=None, cache_dir=CACHE_DIR, url=BOOK_URL, timeout=30.0) -> str:
    """Return the training text: from data_path, else the cache, else a one-time download.

    Every route goes through clean_text: a copy of the book placed in the cache by hand (BOM, CRLF,
    Gutenberg header) gives the same text, and so the same vocabulary, as the download or --data_path.
    """
    if data_path is not None:
        return read_text_file(data_path)

    cache_path = os.path.join(cache_dir, CACHE_NAME)
    if os.path.exists(cache_path):
        return read_text_file(cache_path, "cached book")

    try:
        resp = requests.get(url, timeout=timeout)
        resp.raise_for_status()
    except requests.RequestException as e:
        raise RuntimeError(
            f"could not download the book from {url} ({_short_reason(e)}). "
            f"Without network, put a UTF-8 copy of the book at {cache_path} "
            f"or pass --data_path=FILE."
        ) from e
    # Gutenberg does not always name the charset, and requests would then guess Latin-1.
    text = clean_text(resp.content.decode("utf-8"))

    os.makedirs(cache_dir, exist_ok=True)
    atomic_write(cache_path, lambda f: f.write(text.encode("utf-8")))  # never a truncated cache
    print(f"cached {len(text):,} characters of {url} at {cache_path}")
    return text


class CharTokenizer:
    """Maps each distinct character of the training text to an integer id."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self._index = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, s: str) -> list:
        try:
            return [self._index[c] for c in s]
        except KeyError as e:
            raise ValueError(
                f"character {e.args[0]!r} is not in the vocabulary, "
                f"which was built from the training text"
            ) from None

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def to_dict(self) -> dict:
        return {"chars": "".join(self.chars)}

    @classmethod
    def from_dict(cls, d: dict) -> "CharTokenizer":
        # Keep the saved order as is: ids in a checkpoint depend on it.
        tok = cls.__new__(cls)
        tok.chars = list(d["chars"])
        tok._index = {c: i for i, c in enumerate(tok.chars)}
        return tok


def split_data(ids: torch.Tensor, val_fraction=0.1):
    """Split into a leading training part and a trailing validation part, unshuffled."""
    n_val = int(len(ids) * val_fraction)
    n_train = len(ids) - n_val
    if n_train < 1 or n_val < 1:
        raise ValueError(
            f"the text has only {len(ids)} tokens, too few to split into non-empty "
            f"training and validation parts with val_fraction={val_fraction}"
        )
    return ids[:n_train], ids[n_train:]


def read_text_splits(data_path, block_size, fail):
    """The tokenizer of the training text and its (train, validation) token ids; fail(msg) if it can't, or if
    a split holds no window of block_size + 1 tokens (get_batch would fail in training or, later, in evaluation)."""
    try:
        text = load_text(data_path)
        tok = CharTokenizer(text)
        train_ids, val_ids = split_data(torch.tensor(tok.encode(text), dtype=torch.long))
    except (OSError, ValueError, RuntimeError) as e:
        fail(str(e))
    for name, part in (("training", train_ids), ("validation", val_ids)):
        if len(part) <= block_size:
            source = f"--data_path={data_path}" if data_path is not None else "the book"
            fail(f"the {name} split of {source} has {len(part)} tokens, not more than --block_size={block_size}; "
                 f"use a longer text or a smaller --block_size")
    return tok, train_ids, val_ids


def get_batch(data: torch.Tensor, batch_size: int, block_size: int,
              generator: torch.Generator, device="cpu", rank=0, world=1):
    """Draw batch_size random windows; y is x shifted one token ahead. With world > 1 every rank draws the
    windows of all world * batch_size rows and keeps its own slice: N ranks see exactly the batches one
    process at N times the batch size would, and their generators stay in step."""
    if len(data) <= block_size:
        raise ValueError(
            f"the text has {len(data)} tokens and block_size is {block_size}; "
            f"use a longer text or a smaller block_size"
        )
    # The generator lives on the CPU so a given seed yields the same batches on every device.
    starts = torch.randint(0, len(data) - block_size, (batch_size * world,), generator=generator)
    starts = starts[rank * batch_size:(rank + 1) * batch_size]
    x = torch.stack([data[i:i + block_size] for i in starts.tolist()]).long()
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in starts.tolist()]).long()
    non_blocking = torch.device(device).type == "cuda"
    return x.to(device, non_blocking=non_blocking), y.to(device, non_blocking=non_blocking)


# -----------------------------------------------------------------------------
# the incrementing-token task (the mHC depth sweep): no text, a fresh batch every step

INCREMENT_VOCAB = 256  # token ids 0..255


def increment_batch(batch_size: int, block_size: int, generator: torch.Generator, device="cpu",
                    vocab_size: int = INCREMENT_VOCAB):
    """Each row counts up from a random start, (s, s+1, s+2, ...) mod vocab_size; y is x one token
    ahead. Only the starts come from the generator (on the CPU, so a seed gives the same batches on
    every device); the rows are built where they are used."""
    starts = torch.randint(0, vocab_size, (batch_size, 1), generator=generator)  # (B, 1)
    starts = starts.to(device, non_blocking=torch.device(device).type == "cuda")
    x = (starts + torch.arange(block_size, device=device)) % vocab_size  # (B, T)
    return x, (x + 1) % vocab_size


# -----------------------------------------------------------------------------
# what the scripts write: files whole or not at all, plots without a display, durations

def atomic_write(path, write):
    """write(file) into a temp file next to path, then rename: a crash never leaves a truncated file."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json(path, obj):
    atomic_write(path, lambda f: f.write(json.dumps(obj, indent=1).encode()))


def pyplot():
    """matplotlib.pyplot drawing to files only (no display needed), or None with a note if missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed, so no plots (pip install matplotlib)")
        return None
    return plt


def fmt_seconds(s):
    s = int(round(s))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


OP_SET_TITLES = {"torch": "PyTorch op set", "cuda": "custom CUDA op set"}


def plot_losses(runs, path):
    """train.py's loss.png: each op set's train and val losses, and below them the curves' difference."""
    plt = pyplot()
    if plt is None:
        return
    both = len(runs) == 2
    fig, axes = plt.subplots(2 if both else 1, 1, figsize=(8, 7 if both else 4.5), sharex=True, squeeze=False)
    ax = axes[0, 0]
    for name, r in runs.items():
        steps = range(1, len(r["train_loss"]) + 1)
        ax.plot(steps, r["train_loss"], lw=0.8, label=f"{name} ({r['mode']}) train")
        ax.plot([e["iter"] for e in r["evals"]], [e["val"] for e in r["evals"]], "o--", ms=3, label=f"{name} val")
    ax.set_ylabel("loss")
    ax.legend()
    stopped = [f"{name} {r['status']} at iteration {r['stopped_at']}" for name, r in runs.items()
               if r["status"] != "completed"]
    title = ("char GPT: " + " vs ".join(OP_SET_TITLES.get(name, name) for name in runs)
             + (f" ({'; '.join(stopped)})" if stopped else ""))
    ax.set_title(title)
    if both:
        t, c = runs["torch"]["train_loss"], runs["cuda"]["train_loss"]
        diffs = [max(abs(a - b), 1e-12) for a, b in zip(t, c)]  # floor: log scale cannot show exact zeros
        axes[1, 0].semilogy(range(1, len(diffs) + 1), diffs, lw=0.8)
        axes[1, 0].axhline(1e-3, color="gray", ls=":", lw=0.8)
        axes[1, 0].set_ylabel("|torch - cuda| train loss")
    axes[-1, 0].set_xlabel("iteration")
    fig.tight_layout()
    fig.savefig(path, dpi=120, metadata={"Title": title})  # the title, readable without looking
    plt.close(fig)
    print(f"wrote {path}")


# -----------------------------------------------------------------------------
# command lines: --key=value options typed by their defaults (train.py and inference.py)

def one_line(e, limit=200):
    return " ".join(str(e).split())[:limit]


def device_name(device):
    """What results record as the machine: the GPU's name, or cpu."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def print_help_and_exit(print_help):
    """--help: print_help(), then exit 0, quietly also where the reader stops early (`| head`): the closed
    pipe would otherwise end the script in a BrokenPipeError traceback, once when printing, again at exit."""
    try:
        print_help()
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left for the exit's flush
    sys.exit(0)


def print_options(prog, what, options):
    """--help: what the script does, then each option with its default and its meaning."""
    print(f"usage: python {prog} [--key=value ...]\n\n{what} Each key below is shown with its\n"
          "default; --key=value overrides it, parsed as the default's type (bools: true/false/1/0).\n")
    width = 24
    for k, (v, meaning) in options.items():
        opt = f"--{k}={v}"
        print(f"  {opt:<{width}}{meaning}" if len(opt) < width else f"  {opt}\n  {'':<{width}}{meaning}")


def parse_options(argv, options, fail, print_help, presets=None):
    """The command line as a namespace: each option's default, then the chosen --preset's values (where the
    script has presets), then the --key=value overrides, each parsed as its default's type; fail(msg) on the
    first bad one, --help prints print_help() and exits. Returns (namespace, the keys the command line set)."""
    if any(a in ("-h", "--help") for a in argv):
        print_help_and_exit(print_help)
    defaults = {k: v for k, (v, _) in options.items()}
    given = {}
    for key, text in parse_overrides(argv, defaults, fail).items():
        try:
            given[key] = parse_value(key, text, defaults[key])
        except ValueError as e:
            fail(str(e))
    cfg = dict(defaults)
    if presets is not None:
        name = given.get("preset", defaults["preset"])
        if name and name not in presets:
            fail(f"--preset must be '' or one of {', '.join(presets)}, got {name!r}")
        cfg.update(presets.get(name, {}))
    cfg.update(given)
    for key in PATH_OPTIONS.intersection(cfg):  # the shell leaves the ~ of --data_path=~/book.txt as it is
        if isinstance(cfg[key], str):
            cfg[key] = os.path.expanduser(cfg[key])
    return SimpleNamespace(**cfg), list(given)


PATH_OPTIONS = {"data_path", "out_dir", "ckpt"}  # the scripts' options that name files or folders


def check_at_least(cfg, low, keys, fail):
    """fail(msg) on the first of the options keys below low."""
    for key in keys:
        if getattr(cfg, key) < low:
            fail(f"--{key} must be >= {low}, got {getattr(cfg, key)}")


def parse_overrides(argv, defaults, fail):
    """The --key=value arguments as {key: text}, for train.py and inference.py alike; fail(msg) on the first
    that is malformed or names no key of defaults (with the nearest key, where one is near)."""
    overrides = {}
    for arg in argv:
        if arg.startswith("--") and arg[2:] in defaults:
            fail(f"--{arg[2:]} needs a value: --{arg[2:]}=VALUE (default {defaults[arg[2:]]})")
        if not arg.startswith("--") or "=" not in arg:
            fail(f"expected --key=value, got {arg!r}")
        key, val = arg[2:].split("=", 1)
        if key not in defaults:
            near = difflib.get_close_matches(key, defaults, n=1)
            fail(f"unknown option --{key}; " + (f"did you mean --{near[0]}? " if near else "")
                 + f"valid keys: {', '.join(defaults)}")
        overrides[key] = val
    return overrides


def parse_value(key, text, default):
    """--key's text as the type of its default; ValueError with one line when it is not one."""
    if isinstance(default, bool):  # before int: bool is a subclass of int
        low = text.lower()
        if low not in ("true", "false", "1", "0"):
            raise ValueError(f"--{key} expects a bool (true/false/1/0), got {text!r}")
        return low in ("true", "1")
    if isinstance(default, (int, float)):
        kind = type(default)
        try:
            value = kind(text)
        except ValueError:
            raise ValueError(f"--{key} expects {'an int' if kind is int else 'a float'} (default {default}), "
                             f"got {text!r}") from None
        if not math.isfinite(value):
            raise ValueError(f"--{key} expects a finite number, got {text!r}")
        return value
    if default is None and text.lower() in ("", "none"):
        return None
    return text


BACKENDS = ("both", "torch", "cuda")


def check_backend_and_device(cfg, fail):
    """--backend and --device, shared by train.py and inference.py: fail(msg) on the first bad one."""
    if cfg.backend not in BACKENDS:
        fail(f"--backend must be {', '.join(BACKENDS[:-1])} or {BACKENDS[-1]}, got {cfg.backend!r}")
    try:
        dev = torch.device(cfg.device)
    except RuntimeError:
        fail(f"--device={cfg.device!r} is not a torch device; use cuda, cuda:N or cpu")
    if dev.type not in ("cuda", "cpu"):
        fail(f"--device must be cuda, cuda:N or cpu, got {cfg.device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        fail(f"--device={cfg.device} but PyTorch sees no CUDA device (torch {torch.__version__}); use --device=cpu")
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        fail(f"--device={cfg.device} but PyTorch sees {torch.cuda.device_count()} CUDA device(s)")


# -----------------------------------------------------------------------------
# the machine: our kernels where they can run and in Inductor's graphs, step timing, Ctrl-C

def import_kernels():
    """Return (module, None), or (None, why) when the extension is not built for this machine."""
    try:
        import kernels
    except (ImportError, OSError) as e:
        return None, f"{type(e).__name__}: {e}"
    return kernels, None


def cuda_kernels_for(device, bf16):
    """(kernels, None) where the cuda op set can run on device (with bf16: Hopper's wgmma), else (None, why),
    the reason with the build hint where a build could help (not for a GPU that is not Hopper). train.py
    and inference.py both ask here."""
    hint = "; the cuda op set needs a GPU and the extension built with `python setup.py build_ext --inplace`"
    if torch.device(device).type != "cuda":
        seen = "" if torch.cuda.is_available() else " (no GPU visible to PyTorch)"
        return None, f"device is {device}{seen}{hint}"
    kernels, err = import_kernels()
    if kernels is None:
        return None, f"`import kernels` failed ({err}){hint}"
    if bf16 and torch.cuda.get_device_capability(device) != (9, 0):
        return None, (f"bf16 runs our bf16 matmul on Hopper's wgmma (compute capability 9.0); "
                      f"{torch.cuda.get_device_name(device)} is {torch.cuda.get_device_capability(device)}")
    return kernels, None


def register_inductor_fallbacks(namespace="kernels"):
    """Registers every op of the namespace with Inductor as a call of the op itself, with the layout rule
    Inductor gives a custom op (what it does on meeting one unregistered). Ahead of the compile, because
    torch 2.11 formats the arguments of an unregistered op's first call, their whole IR, into a log line
    whether or not anything logs: on --preset=large that kept Inductor compiling for over 8 minutes."""
    from torch._inductor import lowering
    from torch._library.utils import get_layout_constraint_tag
    names = {n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
             if n.startswith(namespace + "::")}  # "kernels::linear", "kernels::<name>.<overload>"
    for name in sorted(names):
        packet = getattr(getattr(torch.ops, namespace), name)
        for op in (getattr(packet, overload) for overload in packet.overloads()):
            if op not in lowering.lowerings:
                rule = lowering.tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
                lowering.make_fallback(op, layout_constraint=rule)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer:
    """Wall time of training steps only. Eval, checkpoints and logging happen between windows, and each
    window ends with a device sync so that it holds the GPU time of its steps, not just their launches.
    Steps before `skip` are left out of the totals."""

    def __init__(self, device, skip):
        self.device, self.skip = device, skip
        self.seen = 0
        self.timed_s, self.timed_steps = 0.0, 0
        self.start()

    def start(self):
        sync(self.device)
        self.t0, self.steps = time.perf_counter(), 0
        self.counting = self.seen >= self.skip

    def before_step(self):
        if self.seen == self.skip and not self.counting:
            self.start()  # end of warm-up: restart the window so the totals hold steady-state steps only

    def after_step(self):
        self.steps += 1
        self.seen += 1

    def stop(self):
        """End the window; return its (seconds, steps)."""
        sync(self.device)
        dt = time.perf_counter() - self.t0
        if self.counting:
            self.timed_s += dt
            self.timed_steps += self.steps
        return dt, self.steps


class CallTimer:
    """Time of chosen calls only, where other work runs between them (the mHC sweep times its training step, not
    the metrics it reads after each): on a GPU the device time between CUDA events recorded around each call, so
    the host never waits; on a CPU wall time. Calls before `skip` are left out of the totals."""

    def __init__(self, device, skip):
        self.cuda, self.skip = device.type == "cuda", skip
        self.seen = 0
        self.timed_s, self.timed_steps = 0.0, 0
        self.events = []  # on a GPU, the window's (start, end, counted), read at its end
        self.window_s, self.window_calls = 0.0, 0

    def time(self, fn, *args):
        """fn(*args), timed."""
        counted = self.seen >= self.skip
        self.seen += 1
        self.window_calls += 1
        if not self.cuda:
            t0 = time.perf_counter()
            out = fn(*args)
            self.add(time.perf_counter() - t0, counted)
            return out
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn(*args)
        end.record()
        self.events.append((start, end, counted))
        return out

    def add(self, dt, counted):
        self.window_s += dt
        if counted:
            self.timed_s += dt
            self.timed_steps += 1

    def stop(self):
        """End the window; return its (seconds, calls). On a GPU this waits for the window's last call."""
        for start, end, counted in self.events:
            end.synchronize()
            self.add(start.elapsed_time(end) / 1e3, counted)
        window = self.window_s, self.window_calls
        self.events, self.window_s, self.window_calls = [], 0.0, 0
        return window


# Ctrl-C, and SIGTERM: what `kill`, job schedulers and torchrun's agent send to stop a process. Each script stops
# on either in the same orderly way: it keeps what it measured and removes its out_dir lock.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(KeyboardInterrupt):
    """SIGTERM, raised as Python raises KeyboardInterrupt on Ctrl-C (see sigterm_interrupts)."""
    signum = signal.SIGTERM


@contextlib.contextmanager
def sigterm_interrupts():
    """Within it SIGTERM raises Stopped, so the scripts' Ctrl-C handling serves it too; its default action would
    end the process at once, with nothing saved and the lock file left behind."""
    def raise_stopped(signum, frame):
        raise Stopped()
    previous = signal.signal(signal.SIGTERM, raise_stopped)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def signal_of(e):
    """The signal behind a KeyboardInterrupt: SIGTERM for Stopped, else SIGINT."""
    return getattr(e, "signum", signal.SIGINT)


def signal_words(signum):
    return "Ctrl-C (SIGINT)" if signum == signal.SIGINT else signal.Signals(signum).name


def signal_exit(signum):
    """The exit code of a run stopped by signum: the shell's 128 + its number (130 for Ctrl-C, 143 for SIGTERM)."""
    return 128 + signum


class StopRequest:
    """Ctrl-C or SIGTERM while training sets `signum`, which the loop reads after each step: the step in flight
    completes, so the checkpoint written next holds a consistent state (a KeyboardInterrupt raised inside
    opt.step() or a graph capture could leave the weights half updated). A second signal interrupts at once,
    except under torchrun, whose agent passes the terminal's Ctrl-C on to ranks that have it already: there
    every signal sets the flag, and the agent's SIGKILL, 30 s later, is the hard stop."""

    def __init__(self, world=1):  # world: processes torchrun started
        self.signum = None  # the first stop signal's number, once one came
        self.once = world == 1

    def __enter__(self):
        self.previous = {}
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            self.previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        return self

    def _handle(self, signum, frame):
        self.signum = self.signum or signum
        if self.once:
            signal.signal(signum, self.previous[signum])

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def is_out_of_memory(e):
    """Whether e is an allocation that failed: CUDA's OutOfMemoryError, or the CPU allocator's RuntimeError."""
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and any(m in str(e) for m in ("out of memory", "can't allocate memory")))


def out_of_memory_words(e, device):
    """'out of memory on DEVICE (tried to allocate SIZE)', from the allocator's long message."""
    m = re.search(r"tried to allocate (\d+ bytes|[\d.]+ ?[KMGT]i?B)", str(e), re.I)
    size = m.group(1) if m else None
    if size and size.endswith(" bytes"):
        gib = int(size.split()[0]) / 2**30
        size = f"{gib:,.0f} GiB" if gib >= 10 else f"{gib:.1f} GiB"
    return f"out of memory on {device}" + (f" (tried to allocate {size})" if size else "")


# -----------------------------------------------------------------------------
# checkpoint files (train.py writes them, train.py and inference.py read them) and the out_dir lock

def weights_sha256(state_dict):
    """sha256 over every tensor's name, dtype, shape and bytes: the only checksum of checkpoints written before
    checkpoint_digests, still checked when one is read."""
    h = hashlib.sha256()
    for name, t in state_dict.items():
        t = t.detach().cpu().contiguous()
        h.update(f"{name} {t.dtype} {tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def tree_sha256(obj):
    """sha256 of nested dicts, lists and tuples of tensors (dtype, shape, bytes) and plain values, walked in order:
    the same before torch.save and after torch.load. torch.load does not check the CRCs of the zip it reads, so
    without it a checkpoint with flipped bytes loads silently."""
    h = hashlib.sha256()

    def feed(o):
        if torch.is_tensor(o):
            t = o.detach().cpu().contiguous()
            h.update(f"T {t.dtype} {tuple(t.shape)};".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy())
        elif isinstance(o, dict):
            h.update(f"D {len(o)};".encode())
            for k, v in o.items():
                feed(k)
                feed(v)
        elif isinstance(o, (list, tuple)):
            h.update(f"L {len(o)};".encode())
            for v in o:
                feed(v)
        else:
            h.update(f"{type(o).__name__} {o!r};".encode())
    feed(obj)
    return h.hexdigest()


def checkpoint_digests(ckpt):
    """tree_sha256 of each part of a checkpoint (every key but the digests), so that a resume checks everything
    it restores (weights, optimizer state, batch generator, iteration, history) and names the part that is not
    as written."""
    return {k: tree_sha256(v) for k, v in ckpt.items() if k not in ("sha256", "model_sha256")}


CKPT_PARTS = {"model": "weights", "optimizer": "optimizer state", "batch_rng": "batch generator state",
              "dropout_rng": "dropout's rng", "iter": "iteration", "train_loss": "loss history",
              "evals": "evaluations"}  # for messages


def all_finite(tensors):
    flags = [t.isfinite().all() for t in tensors if t.is_floating_point()]
    return not flags or bool(torch.stack(flags).all())  # one host sync for all of them


CKPT_KEYS = ("config", "vocab", "iter", "model", "optimizer", "batch_rng", "train_loss", "evals")


def make_out_dir(out_dir, fail, holds):
    """Creates out_dir if needed, before any work: fail(msg) if it is a file or cannot be written. holds: what
    the script writes there, for the message."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        fail(f"--out_dir={out_dir} is a file; expected a folder for {holds}")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        fail(f"--out_dir={out_dir}: cannot create the folder ({e.strerror})")
    if not os.access(out_dir, os.W_OK | os.X_OK):
        fail(f"--out_dir={out_dir} is not writable")


def unused_path(folder, name):
    """folder/name, or where that file exists the first of name_2, name_3, ... that does not: a run's results
    never replace an earlier run's."""
    stem, ext = os.path.splitext(name)
    path, n = os.path.join(folder, name), 1
    while os.path.exists(path):
        n += 1
        path = os.path.join(folder, f"{stem}_{n}{ext}")
    return path


def lock_taken(path):
    """Called by out_dir_lock between taking the lock and writing the process id into it: a seam where the
    tests pause a run to let another one try."""


@contextlib.contextmanager
def out_dir_lock(out_dir, script, fail):
    """Holds out_dir for this run of `script` until the block ends: a second run of the same script into the
    same folder would overwrite this one's checkpoints and results, so it fails(msg) instead. The hold is an
    flock on out_dir/.<script>.lock, which the kernel drops when the process dies, so a file left by a killed
    run blocks nothing; the process id written into it is only for the message."""
    path = os.path.join(out_dir, f".{script.removesuffix('.py')}.lock")
    while True:
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.read(fd, 32).decode(errors="replace").strip()  # empty if the holder has not written it yet
            os.close(fd)
            fail(f"--out_dir={out_dir} is in use by another {script} run{f' (process {pid})' if pid else ''}; "
                 f"wait for it to end or pass another --out_dir")
        # A run that ends unlinks the file before it lets go, so the lock taken may be on a file no longer
        # at path (opened just before): then open path again.
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                break
        os.close(fd)
    try:
        lock_taken(path)
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)  # before the unlock: a run that opened the file meanwhile sees it gone and retries
        os.close(fd)


def read_checkpoint(path):
    """The dict of a checkpoint written by train.py, every part verified against its checksum. Raises
    ValueError with one line that says what is wrong with the file (train.py and inference.py print it)."""
    def bad(what):
        raise ValueError(what)

    if not os.path.isfile(path):
        bad("no such file" if not os.path.exists(path) else "not a file")
    if os.path.getsize(path) == 0:
        bad("the file is empty")
    if not zipfile.is_zipfile(path):  # torch.save writes a zip; its directory sits at the very end
        bad("it is truncated or not a PyTorch checkpoint (no zip directory at its end)")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # damage inside the zip shows up as any of RuntimeError, EOFError, UnpicklingError...
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        bad(f"it is damaged or not written by train.py ({type(e).__name__}{': ' + first if first else ''})")
    if not isinstance(ckpt, dict) or any(k not in ckpt for k in CKPT_KEYS) or not isinstance(ckpt["model"], dict):
        have = sorted(ckpt) if isinstance(ckpt, dict) else type(ckpt).__name__
        bad(f"not a train.py checkpoint (expected the keys {', '.join(CKPT_KEYS)}; found {have})")
    stored, mismatch = ckpt.get("sha256"), "differs from the one stored when the file was written"
    if isinstance(stored, dict):
        now = checkpoint_digests(ckpt)
        damaged = [CKPT_PARTS.get(k, k) for k in sorted(now.keys() | stored.keys()) if now.get(k) != stored.get(k)]
        if damaged:
            bad(f"the file is corrupted: the sha256 of its {' and '.join(damaged)} {mismatch}")
    elif "model_sha256" in ckpt:  # train.py before whole-checkpoint checksums: the weights' only
        if weights_sha256(ckpt["model"]) != ckpt["model_sha256"]:
            bad(f"the file is corrupted: the sha256 of its weights {mismatch}")
        print(f"note: {path} predates whole-checkpoint checksums: its weights are verified, its optimizer state, "
              f"batch generator and history are not")
    else:
        print(f"note: {path} has no checksum (written by an older train.py); nothing in it is verified")
    if not all_finite(ckpt["model"].values()):
        bad("its weights hold NaN or inf")
    return ckpt


# Model-shape keys: a checkpoint can only be resumed with the same values.
MODEL_KEYS = ("arch", "n_layer", "n_head", "n_kv_head", "n_embd", "block_size", "residual", "n_streams")
# Settings a resume is expected to change; any other difference from the checkpoint is reported.
RESUME_KEYS = ("resume", "overwrite", "max_iters")


def load_checkpoint(path, cfg, tok, model, opt, batch_gen, fail):
    """Restore model, optimizer and batch generator in place; return (iteration, train losses, evals, timing of
    the sessions so far). Whatever is wrong with the file ends the run with one line that names it."""
    def bad(what):
        fail(f"cannot resume from {path}: {what}")

    try:
        ckpt = read_checkpoint(path)
    except ValueError as e:
        bad(str(e))
    # files from before a model key existed: that key's only value then
    old = {"residual": "baseline", "n_streams": cfg.n_streams, "arch": "gpt", "n_kv_head": ckpt["config"].get("n_head")}
    saved = {**old, **ckpt["config"]}
    diff = [f"{k}={saved.get(k)}" for k in MODEL_KEYS if saved.get(k) != getattr(cfg, k)]
    if diff:
        fail(f"{path} was trained with {', '.join(diff)}; pass the same values (or the same --preset) to resume")
    if ckpt["vocab"] != tok.to_dict():
        fail(f"{path} was trained on a text with a different character set; pass the same --data_path")
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        bad(f"its weights do not fit this model ({one_line(e)})")
    # Hyperparameters come from this command line, not the checkpoint; that includes fused/capturable,
    # which also decide whether the step counters are loaded onto the GPU or kept on the CPU.
    state = ckpt["optimizer"]
    try:
        for saved_group, current in zip(state["param_groups"], opt.param_groups):
            saved_group.update({k: v for k, v in current.items() if k != "params"})
        opt.load_state_dict(state)
        batch_gen.set_state(ckpt["batch_rng"])
        if getattr(model, "dropout_rng", None) is not None and "dropout_rng" in ckpt:  # where the masks left off
            model.dropout_rng.copy_(torch.as_tensor(ckpt["dropout_rng"]))
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        bad(f"its optimizer or batch-generator state does not fit this model ({one_line(e)})")

    if getattr(model, "dropout_rng", None) is not None and "dropout_rng" not in ckpt:
        print(f"note: {path} was trained without dropout: its masks start from the seed's first")
    if saved.get("world_size", 1) != cfg.world_size:
        print(f"note: {path} was trained by {saved.get('world_size', 1)} process(es), this run has "
              f"{cfg.world_size}: the global batch is now {cfg.world_size} x {cfg.batch_size}")
    changed = [k for k in saved if k not in MODEL_KEYS + RESUME_KEYS + ("world_size",) and hasattr(cfg, k)
               and saved[k] != getattr(cfg, k)]
    if changed:
        print(f"note: {path} was trained with {', '.join(f'{k}={saved[k]}' for k in changed)}; this run uses "
              f"{', '.join(f'{k}={getattr(cfg, k)}' for k in changed)} (the command line's values)")
    return ckpt["iter"], list(ckpt["train_loss"]), list(ckpt["evals"]), ckpt.get("timing", NO_TIMING)


NO_TIMING = {"wall_s": 0.0, "timed_s": 0.0, "timed_steps": 0, "timed_tokens": 0}  # files from before "timing"


def save_checkpoint(path, cfg, tok, ops, done, model, opt, batch_gen, train_loss, evals, timing):
    """timing: the run's wall time and timed steps so far (every session), so that a resume reports the whole run."""
    ckpt = {
        "config": vars(cfg), "vocab": tok.to_dict(), "op_set": ops.name, "iter": done,
        "model": model.state_dict(), "optimizer": opt.state_dict(),
        "batch_rng": batch_gen.get_state(), "train_loss": train_loss, "evals": evals, "timing": timing,
    }
    if getattr(model, "dropout_rng", None) is not None:  # a model trained with dropout: its masks' {seed, offset}
        ckpt["dropout_rng"] = model.dropout_rng.cpu()
    ckpt["sha256"] = checkpoint_digests(ckpt)
    atomic_write(path, lambda f: torch.save(ckpt, f))


# -----------------------------------------------------------------------------
# several processes: `torchrun --nproc_per_node=N train.py` trains with DistributedDataParallel, each rank
# on its slice of every batch (get_batch)

class Ranks:
    """This process's place among torchrun's ranks, and the collectives the training loop needs. A process
    started without torchrun is rank 0 of 1, and its collectives do nothing."""

    def __init__(self, rank=0, world=1, timeout=None):
        self.rank, self.world = rank, world
        self.main = rank == 0
        # Stop requests and refusals are agreed over gloo on the host: no wait for the GPU, so the ranks can ask
        # after every step; and the same code on GPUs and CPUs.
        self.host_group = dist.new_group(backend="gloo", timeout=timeout) if world > 1 else None

    def mean_(self, t):
        """t averaged over the ranks, in place."""
        if self.world > 1:
            dist.all_reduce(t)
            t.div_(self.world)
        return t

    def any(self, flag):
        """Whether flag is set on any rank: every rank then takes the same branch."""
        if self.world == 1:
            return flag
        t = torch.tensor([float(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.host_group)
        return bool(t.item())

    def wrap(self, model, graphed):
        """The module the training step calls: the model, or the model in DistributedDataParallel, whose
        backward averages the gradients over the ranks. Before a CUDA graph captures it, DDP is built on
        a side stream and the step runs eagerly for longer first (train.graph_warmup; PyTorch's notes on
        CUDA graphs with DDP)."""
        if self.world == 1:
            return model
        device = next(model.parameters()).device
        with torch.cuda.stream(torch.cuda.Stream()) if graphed else contextlib.nullcontext():
            return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


ONE_PROCESS = Ranks()


def lost_other_ranks(e):
    """Whether e is a collective's failure: a rank that crashed, stopped or outlasted --dist_timeout.
    gloo reports a closed connection as a plain RuntimeError."""
    under_torchrun = int(os.environ.get("WORLD_SIZE", "1")) > 1
    return under_torchrun and (isinstance(e, dist.DistError) or
                               any(m in str(e) for m in ("gloo", "NCCL", "Connection closed by peer")))


def start_ranks(cfg, fail):
    """Under torchrun (WORLD_SIZE > 1): joins the process group (NCCL on GPUs, gloo on the CPU), gives
    this rank the GPU cuda:LOCAL_RANK."""
    world = cfg.world_size
    if world == 1:
        return ONE_PROCESS
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(cfg.device)
    if device.type == "cuda":
        if device.index is not None:
            fail(f"--device={cfg.device}: under torchrun each rank takes cuda:LOCAL_RANK; pass --device=cuda")
        if local >= torch.cuda.device_count():
            fail(f"rank {rank}: LOCAL_RANK={local}, but this process sees {torch.cuda.device_count()} GPU(s); "
                 f"start at most that many processes a node")
        cfg.device = f"cuda:{local}"
        torch.cuda.set_device(local)
    timeout = datetime.timedelta(seconds=cfg.dist_timeout)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world, timeout=timeout)
    return Ranks(rank, world, timeout)
