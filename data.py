"""What the scripts read and write: the text, its batches, their command lines and checkpoint files.

Text data for the character-level GPTs: fetching, cleaning, tokenizing and batching.

The training text is The Wonderful Wizard of Oz (Project Gutenberg eBook #55). It is downloaded once
and cached next to this file, or read from any UTF-8 file given with --data_path. Gutenberg's header
and license footer are stripped, the characters of the text become the vocabulary, and training
batches are random windows drawn with a CPU generator so every backend sees the same batches.
The synthetic incrementing-token task of the mHC depth sweep lives here too (increment_batch).
"""

import contextlib
import difflib
import hashlib
import math
import os
import re
import sys
import zipfile

import requests
import torch

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


# -----------------------------------------------------------------------------
# checkpoint files (train.py writes them, train.py and inference.py read them) and the out_dir lock

def weights_sha256(state_dict):
    """sha256 over every tensor's name, dtype, shape and bytes. torch.load does not check the CRCs of
    the zip it reads, so without this a checkpoint with flipped bytes in its weights loads silently."""
    h = hashlib.sha256()
    for name, t in state_dict.items():
        t = t.detach().cpu().contiguous()
        h.update(f"{name} {t.dtype} {tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def all_finite(tensors):
    flags = [t.isfinite().all() for t in tensors if t.is_floating_point()]
    return not flags or bool(torch.stack(flags).all())  # one host sync for all of them


CKPT_KEYS = ("config", "vocab", "iter", "model", "optimizer", "batch_rng", "train_loss", "evals")


@contextlib.contextmanager
def out_dir_lock(out_dir, script, fail):
    """Holds out_dir for this run of `script` (out_dir/.<script>.lock, holding the process id) until the
    block ends: a second run of the same script into the same folder would overwrite this one's
    checkpoints and results, so it fails(msg) instead while this process lives. A lock left by a process
    that is gone is taken over."""
    path = os.path.join(out_dir, f".{script.removesuffix('.py')}.lock")
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            break
        except FileExistsError:
            try:
                with open(path) as f:
                    pid = int(f.read().strip() or 0)
            except (OSError, ValueError):
                pid = 0
            if pid and pid != os.getpid() and process_alive(pid):
                fail(f"--out_dir={out_dir} is in use by another {script} run (process {pid}); wait for it to end "
                     f"or pass another --out_dir")
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)  # its process is gone (or it is this one's, from an earlier main() in-process)
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def process_alive(pid):
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, under another user
    return True


def read_checkpoint(path):
    """The dict of a checkpoint written by train.py, its weights verified against their checksum. Raises
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
    if "model_sha256" not in ckpt:
        print(f"note: {path} has no weights checksum (written by an older train.py); its weights are not verified")
    elif weights_sha256(ckpt["model"]) != ckpt["model_sha256"]:
        bad("the weights are corrupted (their sha256 differs from the one stored when the file was written)")
    if not all_finite(ckpt["model"].values()):
        bad("its weights hold NaN or inf")
    return ckpt
