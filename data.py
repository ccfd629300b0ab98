"""Text data for the character-level GPTs: fetching, cleaning, tokenizing and batching.

The training text is The Wonderful Wizard of Oz (Project Gutenberg eBook #55). It is downloaded once
and cached next to this file, or read from any UTF-8 file given with --data_path. Gutenberg's header
and license footer are stripped, the characters of the text become the vocabulary, and training
batches are random windows drawn with a CPU generator so every backend sees the same batches.
The synthetic incrementing-token task of the mHC depth sweep lives here too (increment_batch).
"""

import os
import re

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
