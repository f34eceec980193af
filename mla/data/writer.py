"""Append-only output of one split: raw token ids (``<split>.bin``) and one TSV row per document.

Tokens are appended as they are mixed, so memory does not depend on the corpus size; `sync` makes
what was written durable and returns the byte sizes a resume checkpoint records, and `truncate_to`
cuts both files back to such a checkpoint. `finish` drops the tail that does not fill a block.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

import numpy as np

BUFFER = 1 << 20


def token_dtype(name: str) -> np.dtype:
    return np.dtype(name).newbyteorder("<")  # fixed on disk, whatever the machine


class SplitWriter:
    def __init__(self, folder: Path, split: str, dtype: str):
        self.split = split
        self.tokens_path = folder / f"{split}.bin"
        self.documents_path = folder / f"documents-{split}.tsv"
        self.dtype = token_dtype(dtype)
        self._tokens = self._documents = self._rows = None
        self.tokens = 0  # tokens in the file

    def open(self, sizes: dict | None = None) -> None:
        """Open for appending: fresh files, or the files of a checkpoint cut back to its `sizes`."""
        if sizes is None:
            self.tokens_path.write_bytes(b"")
            self.documents_path.write_text("source\tkey\toffset\ttokens\n")
        else:
            os.truncate(self.tokens_path, sizes["tokens_bytes"])
            os.truncate(self.documents_path, sizes["documents_bytes"])
        self.tokens = self.tokens_path.stat().st_size // self.dtype.itemsize
        self._tokens = open(self.tokens_path, "ab", buffering=BUFFER)
        self._documents = open(self.documents_path, "a", newline="", buffering=BUFFER)
        self._rows = csv.writer(self._documents, delimiter="\t", lineterminator="\n")

    def append(self, source: str, key: str, ids: np.ndarray) -> None:
        self._tokens.write(np.ascontiguousarray(ids, dtype=self.dtype).tobytes())
        self._rows.writerow((source, key, self.tokens, len(ids)))
        self.tokens += len(ids)

    def sync(self) -> dict:
        for f in (self._tokens, self._documents):
            f.flush()
            os.fsync(f.fileno())
        return {"tokens_bytes": self.tokens * self.dtype.itemsize,
                "documents_bytes": self.documents_path.stat().st_size}

    def close(self) -> None:
        for f in (self._tokens, self._documents):
            if f is not None:
                f.close()

    def finish(self, block_length: int) -> tuple[int, int]:
        """Close, cut the tokens file to whole blocks; returns (blocks, tokens dropped)."""
        self.close()
        n_blocks = self.tokens // block_length
        dropped = self.tokens - n_blocks * block_length
        os.truncate(self.tokens_path, n_blocks * block_length * self.dtype.itemsize)
        return n_blocks, dropped
