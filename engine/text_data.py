"""Text datasets, `text:SOURCE`: a corpus read, tokenized and cut into blocks for a causal or a
masked language model.

SOURCE is one of:

- `stdlib[:KB]`: Python's own standard library source, on every machine with Python: the
  top-level `*.py` modules of the running interpreter's standard-library directory
  (`sysconfig.get_paths()["stdlib"]`, packages, tests and site-packages left out), sorted by
  name (CPython 3.11.7: 168 files, 4.7 MB). `:KB` keeps whole files, in that order, until the
  total reaches KB kilobytes (the first file at least): `text:stdlib:300` is about 300 KB.
- a file or a directory of text files: a path, or `file:///abs/path`. A directory is read
  recursively; files and folders whose names start with `.` are skipped; files are read in
  the sorted order of their relative paths, each one document.
- `s3://bucket/prefix[?endpoint=URL]`, `az://container/prefix[?account_url=URL]`, or a store
  block `block:<type slug>/<name>`: every key below the prefix, in sorted order, one document
  each, read through the project's store classes (`comm.store`); a block is opened by the
  coordinator (the caller's `open_source`: the worker side never loads Prefect blocks).

Every document must be UTF-8 text; the corpus is identified by the SHA-256 of its documents'
bytes (their names and places do not count), so the same text read from anywhere is the same
corpus.

Tokenizers (job field `tokenizer`):

- `bytes`: ids 0..255 are the UTF-8 bytes, 256 end-of-text, 257 mask; vocabulary 258.
- `bpe:<vocab size>`: a byte-level BPE trained on the corpus with the `tokenizers` package,
  offline and deterministic, with the special tokens end-of-text (id 0) and mask (id 1). Its
  JSON is cached in the durable store under `core.keys.tokenizer_key(corpus hash, settings)`;
  a second run on the same corpus with the same settings reads it instead of training.

Objectives (job fields `objective`, `seq_len`): documents are joined into one stream, each
followed by the end-of-text token.

- `causal`: blocks of `seq_len + 1` tokens, one every `seq_len` (each next-token transition
  of the stream is trained once); x = block[:-1], y = block[1:].
- `mlm`: blocks of `seq_len` tokens, published unmasked (y = x); the worker masks each batch
  it reads (`mlm_mask`, through `engine.datasets.read_subsets`) afresh every epoch.

The last `VAL_FRACTION` of the blocks (at least one) is the validation set. Token ids and
targets are int64 tensors [N, seq_len]; `TextInfo` describes them.
"""
from __future__ import annotations

import dataclasses
import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple
from urllib.parse import urlsplit

import numpy as np
import torch

from comm.store import Store, open_store
from core.errors import StoreError, ZooidValueError
from core.keys import tokenizer_key
from engine.objective import IGNORE_INDEX

TEXT_PREFIX = "text:"
"""Datasets whose name starts with this are text corpora."""
STDLIB = "stdlib"
"""The shipped corpus: Python's standard-library source."""
OBJECTIVES = ("causal", "mlm")
BYTES = "bytes"
BPE_PREFIX = "bpe:"
BYTE_EOT, BYTE_MASK, BYTES_VOCAB = 256, 257, 258
"""The `bytes` tokenizer's end-of-text and mask ids and its vocabulary size."""
EOT_TOKEN, MASK_TOKEN = "<|endoftext|>", "<|mask|>"
"""The BPE tokenizer's special tokens (ids 0 and 1)."""
BPE_MIN_VOCAB, BPE_MAX_VOCAB = 258, 1 << 20
"""A BPE vocabulary holds the 256 byte symbols and the two special tokens at least."""
BPE_RECIPE = "bytelevel-v1"
"""Names the BPE training recipe in the cache key: change it when the recipe changes."""
VAL_FRACTION = 0.1
"""The last tenth of the blocks is the validation set."""
MLM_SELECT, MLM_TO_MASK, MLM_TO_RANDOM = 0.15, 0.8, 0.1
"""BERT's masking: 15 % of positions chosen; of those 80 % become the mask token, 10 % a random
token, 10 % stay unchanged."""
VAL_EPOCH = 0
"""The epoch the validation set's mask is drawn for, whatever the epoch: a fixed mask makes
validation losses comparable across epochs."""


@dataclass(frozen=True)
class TextInfo:
    """What a text dataset's tensors are: token ids below `vocab_size`, blocks of `seq_len`,
    the objective they are for, and the special ids (`mask_id` None: no mask token)."""

    vocab_size: int
    objective: str
    seq_len: int
    tokenizer: str
    eot_id: int
    mask_id: int | None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TextInfo":
        """Inverse of `to_dict`."""
        return cls(**d)


@dataclass(frozen=True)
class TextSettings:
    """The job's text fields: `tokenizer`, `objective` and `seq_len`."""

    tokenizer: str = BYTES
    objective: str = "causal"
    seq_len: int = 128


class TextSplit(NamedTuple):
    """A tokenized corpus in blocks: training and validation ids and targets, and their info."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor
    info: TextInfo


class Corpus(NamedTuple):
    """The documents of a source in reading order, and their content hash."""

    documents: tuple[str, ...]
    sha256: str

    @property
    def n_bytes(self) -> int:
        """UTF-8 bytes in all documents."""
        return sum(len(d.encode("utf-8")) for d in self.documents)


Opener = Callable[[str], Store]
"""Opens a store from a URL or a store block reference."""


# --- names and settings ------------------------------------------------------------------


def is_text(name: str) -> bool:
    """Whether dataset `name` is a `text:` corpus."""
    return isinstance(name, str) and name.startswith(TEXT_PREFIX)


def text_source(name: str) -> str:
    """The SOURCE of `text:SOURCE`."""
    source = name[len(TEXT_PREFIX):].strip() if is_text(name) else ""
    if not source:
        raise ZooidValueError("dataset", f"{name!r} is not text:SOURCE (a path, file://, s3://, az://, "
                              "block:<type>/<name> or stdlib)")
    return source


def bpe_vocab(tokenizer: str) -> int | None:
    """The vocabulary size `bpe:<vocab size>` asks for; None for `bytes`. Anything else is
    refused in one line naming `tokenizer`."""
    if tokenizer == BYTES:
        return None
    if isinstance(tokenizer, str) and tokenizer.startswith(BPE_PREFIX):
        size = tokenizer[len(BPE_PREFIX):]
        if size.isdigit() and BPE_MIN_VOCAB <= int(size) <= BPE_MAX_VOCAB:
            return int(size)
        raise ZooidValueError("tokenizer", f"{tokenizer!r}: the vocabulary size is an integer from "
                              f"{BPE_MIN_VOCAB} to {BPE_MAX_VOCAB}")
    raise ZooidValueError("tokenizer", f"{tokenizer!r} is not `bytes` or `bpe:<vocab size>`")


def check_settings(settings: TextSettings) -> None:
    """Refuse a bad tokenizer, objective or sequence length, naming the field."""
    bpe_vocab(settings.tokenizer)
    if settings.objective not in OBJECTIVES:
        raise ZooidValueError("objective", f"{settings.objective!r} is not one of {', '.join(OBJECTIVES)}")
    if not isinstance(settings.seq_len, int) or settings.seq_len < 2:
        raise ZooidValueError("seq_len", f"must be an integer of at least 2, got {settings.seq_len!r}")


def _stdlib_kb(source: str) -> int | None:
    """The KB of `stdlib:KB` (None: the whole selection)."""
    _, _, kb = source.partition(":")
    if not kb:
        return None
    if not kb.isdigit() or int(kb) < 1:
        raise ZooidValueError("dataset", f"text:{source}: KB is a positive integer (text:stdlib:300)")
    return int(kb)


def _local_path(source: str) -> Path | None:
    """The path a local source names (a plain path or file://), else None."""
    scheme = urlsplit(source).scheme.lower()
    if scheme == "file":
        return Path(urlsplit(source).path)
    if scheme == "" or (len(scheme) == 1 and source[1:2] == ":"):
        return Path(source).expanduser()
    return None


def _local_files(root: Path) -> list[Path]:
    """A file itself, or a directory's non-hidden files at any depth, by sorted relative path."""
    if root.is_file():
        return [root]
    return sorted((p for p in root.rglob("*") if p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(root).parts)),
                  key=lambda p: p.relative_to(root).parts)


def validate_text(name: str, settings: TextSettings = TextSettings()) -> None:
    """Refuse, in one line naming `dataset` (or the setting), a `text:` dataset that cannot be
    read: a bad source, a missing path, a local corpus with no text; and bad settings. A remote
    source is checked when it is read (`read_corpus`)."""
    source = text_source(name)
    check_settings(settings)
    if source == STDLIB or source.startswith(STDLIB + ":"):
        _stdlib_kb(source)
        return
    path = _local_path(source)
    if path is None:
        scheme = urlsplit(source).scheme.lower()
        if scheme not in ("s3", "az", "block"):
            raise ZooidValueError("dataset", f"{name!r}: unknown scheme {scheme!r}; use a path, file://, "
                                  "s3://, az://, block:<type>/<name> or stdlib")
        return
    if not path.exists():
        raise ZooidValueError("dataset", f"{name!r}: no such file or directory {str(path)!r}")
    if not any(f.stat().st_size for f in _local_files(path)):
        raise ZooidValueError("dataset", f"{name!r}: the corpus is empty (no non-empty file in {str(path)!r})")


# --- reading a corpus --------------------------------------------------------------------


def stdlib_files(kb: int | None = None) -> list[Path]:
    """The shipped corpus's files (see the module docstring): the top-level `*.py` modules of
    the running interpreter's standard library, sorted by name; with `kb`, whole files in that
    order until their total reaches `kb` kilobytes."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"), key=lambda p: p.name)
    if kb is None:
        return files
    kept, total = [], 0
    for f in files:
        if kept and total >= kb * 1000:
            break
        kept.append(f)
        total += f.stat().st_size
    return kept


def _decode(raw: bytes, where: str, name: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ZooidValueError("dataset", f"{name!r}: {where} is not UTF-8 text ({exc.reason} at byte "
                              f"{exc.start})") from None


def _read_store(source: str, name: str, open_source: Opener | None) -> list[str]:
    if urlsplit(source).scheme.lower() == "block" and open_source is None:
        raise ZooidValueError("dataset", f"{name!r}: a store block is opened by the coordinator "
                              "(no block opener given here)")
    try:
        store = (open_source or open_store)(source)
    except ZooidValueError as exc:
        raise ZooidValueError("dataset", f"{name!r}: {str(exc).removeprefix(exc.field + ': ')}") from None
    except Exception as exc:  # a client library's own failure to reach the source is bad input
        raise ZooidValueError("dataset", f"{name!r}: cannot open {source.split('?')[0]}: "
                              f"{type(exc).__name__}: {exc}") from None
    try:
        keys = store.list("")
        return [_decode(store.get(k), k, name) for k in keys]
    except (StoreError, OSError) as exc:
        raise ZooidValueError("dataset", f"{name!r}: cannot read {store.url.split('?')[0]}: {exc}") from None
    finally:
        store.close()


def read_corpus(name: str, open_source: Opener | None = None) -> Corpus:
    """The documents of `text:SOURCE` (see the module docstring), in order, and their hash.
    `open_source` opens an s3://, az:// or block: source (default `comm.store.open_store`,
    which takes URLs only). An empty corpus is refused naming `dataset`."""
    source = text_source(name)
    if source == STDLIB or source.startswith(STDLIB + ":"):
        docs = [_decode(f.read_bytes(), f.name, name) for f in stdlib_files(_stdlib_kb(source))]
    elif (path := _local_path(source)) is not None:
        if not path.exists():
            raise ZooidValueError("dataset", f"{name!r}: no such file or directory {str(path)!r}")
        docs = [_decode(f.read_bytes(), str(f), name) for f in _local_files(path)]
    else:
        docs = _read_store(source, name, open_source)
    docs = [d for d in docs if d]
    if not docs:
        raise ZooidValueError("dataset", f"{name!r}: the corpus is empty (no document with text)")
    digest = hashlib.sha256()
    for d in docs:
        raw = d.encode("utf-8")
        digest.update(len(raw).to_bytes(8, "little"))
        digest.update(raw)
    return Corpus(tuple(docs), digest.hexdigest())


# --- tokenizers --------------------------------------------------------------------------


def encode_bytes(text: str) -> np.ndarray:
    """The `bytes` tokenizer: the UTF-8 bytes of `text` as ids 0..255 (int64)."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)


def decode_bytes(ids) -> str:
    """Inverse of `encode_bytes` (special ids dropped; invalid UTF-8 replaced)."""
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


_BPE: dict[str, Any] = {}
"""Trained or loaded BPE tokenizers by cache key, in this process (a dry run has no store)."""


def train_bpe(documents, vocab_size: int):
    """A byte-level BPE tokenizer (`tokenizers.Tokenizer`) of at most `vocab_size` ids trained
    on `documents`, end-of-text and mask as ids 0 and 1. Offline and deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT_TOKEN, MASK_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(documents), trainer, length=len(documents))
    return tok


def bpe_tokenizer(corpus: Corpus, vocab_size: int, cache: Store | None = None):
    """The BPE tokenizer of `corpus` and `vocab_size`: read from this process or from `cache`
    (its JSON under `core.keys.tokenizer_key`), else trained and written there."""
    from tokenizers import Tokenizer

    key = tokenizer_key(corpus.sha256, f"bpe{vocab_size}-{BPE_RECIPE}")
    tok = _BPE.get(key)
    cached = cache is not None and cache.exists(key)
    if tok is None and cached:
        tok = Tokenizer.from_str(cache.get(key).decode("utf-8"))
    if tok is None:
        tok = train_bpe(corpus.documents, vocab_size)
    if cache is not None and not cached:
        cache.put(key, tok.to_str().encode("utf-8"))
    if key not in _BPE:
        _BPE.clear()  # one corpus at a time: a coordinator validates and stages the same one
        _BPE[key] = tok
    return tok


def tokenize(corpus: Corpus, settings: TextSettings, cache: Store | None = None) -> tuple[np.ndarray, TextInfo]:
    """The corpus as one stream of ids (each document followed by end-of-text), and its info."""
    vocab = bpe_vocab(settings.tokenizer)
    if vocab is None:
        eot, mask, size = BYTE_EOT, BYTE_MASK, BYTES_VOCAB
        parts = [encode_bytes(d) for d in corpus.documents]
    else:
        tok = bpe_tokenizer(corpus, vocab, cache)
        eot, mask, size = tok.token_to_id(EOT_TOKEN), tok.token_to_id(MASK_TOKEN), tok.get_vocab_size()
        parts = [np.asarray(e.ids, dtype=np.int64) for e in tok.encode_batch(list(corpus.documents))]
    stream = np.concatenate([np.append(p, eot) for p in parts])
    info = TextInfo(vocab_size=int(size), objective=settings.objective, seq_len=settings.seq_len,
                    tokenizer=settings.tokenizer, eot_id=int(eot), mask_id=int(mask))
    return stream, info


# --- blocks ------------------------------------------------------------------------------


def make_blocks(stream: np.ndarray, objective: str, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) int64 [N, seq_len]: `causal` blocks of seq_len + 1 tokens every seq_len tokens,
    x = block[:-1] and y = block[1:]; `mlm` blocks of seq_len tokens, y = x (unmasked)."""
    ids = torch.from_numpy(np.ascontiguousarray(stream, dtype=np.int64))
    if objective == "causal":
        n = (len(ids) - 1) // seq_len
        x = ids[: n * seq_len].view(n, seq_len)
        y = ids[1 : n * seq_len + 1].view(n, seq_len)
        return x.clone(), y.clone()
    n = len(ids) // seq_len
    x = ids[: n * seq_len].view(n, seq_len).clone()
    return x, x.clone()


_TOKENIZED: dict[tuple, tuple[np.ndarray, TextInfo]] = {}
"""The last corpus tokenized in this process (a coordinator validates, then stages it)."""


def load_text(name: str, settings: TextSettings = TextSettings(), *, cache: Store | None = None,
              open_source: Opener | None = None) -> TextSplit:
    """Read, tokenize and block `text:SOURCE` (see the module docstring); the last
    `VAL_FRACTION` of the blocks (at least one) is the validation set. `cache`: the durable
    store that keeps BPE tokenizers; `open_source`: opens remote and block sources."""
    validate_text(name, settings)
    corpus = read_corpus(name, open_source)
    vocab = bpe_vocab(settings.tokenizer)
    if vocab is not None:
        bpe_tokenizer(corpus, vocab, cache)  # trained once per process; written to `cache` if it lacks it
    memo = (corpus.sha256, settings.tokenizer)
    if memo not in _TOKENIZED:
        _TOKENIZED.clear()
        _TOKENIZED[memo] = tokenize(corpus, settings, cache)
    stream, info = _TOKENIZED[memo]
    info = dataclasses.replace(info, objective=settings.objective, seq_len=settings.seq_len)
    x, y = make_blocks(stream, settings.objective, settings.seq_len)
    if len(x) < 2:
        raise ZooidValueError("seq_len", f"{settings.seq_len} leaves fewer than 2 blocks in {name!r} "
                              f"({len(stream)} tokens): give a larger corpus or a shorter seq_len")
    n_val = max(1, int(round(len(x) * VAL_FRACTION)))
    cut = len(x) - n_val
    return TextSplit(x[:cut], y[:cut], x[cut:], y[cut:], info)


# --- masked-LM masking at the worker -----------------------------------------------------

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer on uint64 arrays (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _uniforms(seed: int, epoch: int, split: str, index: np.ndarray, length: int, draws: int) -> np.ndarray:
    """float64 [draws, N, length] in [0, 1): a counter-based generator seeded by (seed, split,
    epoch, global sample index) per sample, counting over (position, draw) within it."""
    with np.errstate(over="ignore"):
        key = _mix(np.asarray([seed], dtype=np.uint64) * _GOLDEN + np.uint64(1 if split == "val" else 2))
        key = _mix(key ^ (np.asarray([epoch], dtype=np.uint64) + np.uint64(1)) * _GOLDEN)
        per_sample = _mix(key ^ (np.asarray(index, dtype=np.uint64) + np.uint64(1)) * _GOLDEN)  # [N]
        counter = (np.arange(draws * length, dtype=np.uint64).reshape(draws, 1, length) + np.uint64(1)) * _GOLDEN
        h = _mix(per_sample.reshape(1, -1, 1) ^ counter)
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def mlm_mask(x: torch.Tensor, info: TextInfo, *, seed: int, epoch: int, first_index: int = 0,
             split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking of blocks `x` [N, T] whose global sample indices are `first_index` ..
    `first_index + N - 1`: returns (inputs, targets), both int64 [N, T].

    Each sample's draws come from a generator seeded by (`seed`, `epoch`, its global index), so
    its mask is the same whichever worker or micro-batch reads it, identical for the same seed
    and different in each epoch; the validation split (`split="val"`) uses `VAL_EPOCH` for every
    epoch. 15 % of the positions are chosen (never an end-of-text token; at least one per sample
    that has another token): of those 80 % become `info.mask_id`, 10 % a random ordinary token
    (neither end-of-text nor mask), 10 % stay. Targets are the original ids at chosen positions
    and `IGNORE_INDEX` (-100) elsewhere."""
    if info.mask_id is None:
        raise ZooidValueError("objective", "mlm needs a tokenizer with a mask token")
    x = x.long()
    n, length = x.shape
    if split == "val":
        epoch = VAL_EPOCH
    u = _uniforms(seed, epoch, split, np.arange(first_index, first_index + n), length, 3)
    ids = x.numpy()
    eligible = ids != info.eot_id
    chosen = (u[0] < MLM_SELECT) & eligible
    # a sample with no chosen position would have no target: choose its smallest draw
    empty = ~chosen.any(axis=1) & eligible.any(axis=1)
    if empty.any():
        first = np.where(eligible, u[0], np.inf).argmin(axis=1)
        chosen[np.flatnonzero(empty), first[empty]] = True
    to_mask = chosen & (u[1] < MLM_TO_MASK)
    to_random = chosen & (u[1] >= MLM_TO_MASK) & (u[1] < MLM_TO_MASK + MLM_TO_RANDOM)
    special = sorted({info.eot_id, info.mask_id})
    random_ids = (u[2] * (info.vocab_size - len(special))).astype(np.int64)
    for s in special:  # skip the special ids: k -> the k-th ordinary id
        random_ids += random_ids >= s
    out = np.where(to_mask, info.mask_id, np.where(to_random, random_ids, ids))
    target = np.where(chosen, ids, IGNORE_INDEX)
    return torch.from_numpy(out.astype(np.int64)), torch.from_numpy(target.astype(np.int64))
