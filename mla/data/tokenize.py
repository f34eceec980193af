"""Multi-process tokenization: documents -> token ids (+ EOS), in order, with bounded look-ahead.

`TokenizerPool` runs N worker processes, each with its own fast tokenizer (batch encoding, Rust
threads off: the parallelism is the processes). `TokenizedStream` turns one source's documents into
`Doc`s: it groups documents into batches, keeps at most `window` batches in flight and hands results
back in submission order, so the output never depends on the number of workers or on timing.
Documents of a split that is already full are skipped before tokenization.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mla.data.corpus import split_of
from mla.errors import UserError

BATCH_CHARS = 1 << 20   # characters per worker task: large enough to amortise the IPC, small enough to stream
FIRST_BATCH_CHARS = 1 << 14  # batches start small and double: a small budget does not tokenize megabytes ahead
BATCH_DOCS = 1024


@dataclass(frozen=True)
class TokenizerInfo:
    eos: int
    vocab_size: int
    dtype: str  # uint16 when every id fits, else uint32


def _load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        raise UserError(f"cannot load a tokenizer from {path}: {' '.join(str(exc).split())[:300]}") from None


def tokenizer_info(path: str | Path) -> TokenizerInfo:
    tokenizer = _load_tokenizer(path)
    if tokenizer.eos_token_id is None:
        raise UserError(f"tokenizer {path} has no EOS token; documents are separated by EOS")
    vocab = len(tokenizer)
    dtype = "uint16" if vocab <= np.iinfo(np.uint16).max + 1 else "uint32"
    return TokenizerInfo(int(tokenizer.eos_token_id), int(vocab), dtype)


# ------------------------------------------------------------------------------------ worker processes

_worker: dict = {}


def _init_worker(path: str, eos: int, dtype: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per process: the pool is the parallelism
    tokenizer = _load_tokenizer(path)
    _worker.update(tokenizer=tokenizer, eos=eos, dtype=np.dtype(dtype))
    # The Rust tokenizer as transformers configured it, without offsets: same ids, ~1.7x faster.
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "encode_batch_fast"):
        _worker["backend"] = backend


def _token_ids(texts: list[str]) -> list:
    backend = _worker.get("backend")
    if backend is not None:
        return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
    return _worker["tokenizer"](texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]


def _encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, flat ids): each document's ids followed by EOS, concatenated."""
    ids = _token_ids(texts)
    lengths = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))
    flat = np.empty(int(lengths.sum()), dtype=_worker["dtype"])
    end = 0
    for x in ids:
        flat[end:end + len(x)] = x
        flat[end + len(x)] = _worker["eos"]
        end += len(x) + 1
    return lengths, flat


class TokenizerPool:
    """Worker processes that encode batches of texts; create it before any thread starts (fork)."""

    def __init__(self, path: str | Path, info: TokenizerInfo, workers: int):
        self.workers = workers
        context = multiprocessing.get_context("fork")
        self._pool = context.Pool(workers, initializer=_init_worker, initargs=(str(path), info.eos, info.dtype))

    def submit(self, texts: list[str]):
        return self._pool.apply_async(_encode, (texts,))

    def close(self, *, abort: bool = False) -> None:
        if abort:
            self._pool.terminate()
        else:
            self._pool.close()
        self._pool.join()


# ------------------------------------------------------------------------------------ one source


@dataclass
class Doc:
    position: int      # index in the source's document stream (for resuming)
    key: str
    split: str
    ids: np.ndarray    # token ids, EOS last


class TokenizedStream:
    """One source's documents, split-assigned (hash of `split_name` and key) and tokenized, in source order.

    `wanted(split)` says whether a split still takes documents; once False it stays False, so
    skipping such documents before tokenization cannot change the output.
    """

    def __init__(self, split_name: str, reader, pool: TokenizerPool, fraction: float, wanted: Callable[[str], bool],
                 start: int = 0):
        self.split_name, self.pool, self.fraction, self.wanted = split_name, pool, fraction, wanted
        self._documents = reader.documents(start)  # a generator: nothing is read before the first batch
        self._next_position = start
        self.position = start            # documents before this one are consumed
        self.exhausted = False
        self.window = pool.workers + 1
        self._pending: deque = deque()   # (async result, [(position, key, split)])
        self._ready: deque = deque()
        self._read_all = False
        self._batch_chars = FIRST_BATCH_CHARS

    def _submit(self) -> None:
        """Read one batch of wanted documents and submit it (if it holds any)."""
        texts, meta, chars = [], [], 0
        while chars < self._batch_chars and len(texts) < BATCH_DOCS:
            try:
                key, text = next(self._documents)
            except StopIteration:
                self._read_all = True
                break
            position = self._next_position
            self._next_position += 1
            if not text or not text.strip():
                continue
            split = split_of(self.split_name, key, self.fraction)  # the source's, or its split_as
            if not self.wanted(split):
                continue
            texts.append(text)
            meta.append((position, key, split))
            chars += len(text)
        if texts:
            self._pending.append((self.pool.submit(texts), meta))
            self._batch_chars = min(2 * self._batch_chars, BATCH_CHARS)

    def _fill(self) -> None:
        while len(self._pending) < self.window and not self._read_all:
            self._submit()

    def next(self) -> Doc | None:
        """The next document, or None when the source has no more."""
        if not self._ready:
            self._fill()
            if not self._pending:
                self.exhausted = True
                return None
            result, meta = self._pending.popleft()
            lengths, flat = result.get()
            for (position, key, split), ids in zip(meta, np.split(flat, np.cumsum(lengths)[:-1])):
                self._ready.append(Doc(position, key, split, ids))
        doc = self._ready.popleft()
        self.position = doc.position + 1
        self._fill()  # keep the workers busy while the caller writes
        return doc

    def close(self) -> None:
        self._documents.close()
