"""The data folder's contract: the request that made it, the manifest, and the memory-mapped blocks.

    OUT/train.bin, OUT/validation.bin            token ids, little-endian `dtype`, [n_blocks * block_length]
    OUT/documents-train.tsv, ...-validation.tsv  source, key, offset, tokens (one row per document)
    OUT/manifest.json                            request, shares and tokens per source, sha256 per file
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mla.data.corpus import SPLITS
from mla.data.writer import token_dtype
from mla.errors import UserError

MANIFEST = "manifest.json"
FORMAT_VERSION = 2  # 1: .npy arrays built in memory; 2: streamed raw token files


@dataclass
class DataRequest:
    """Everything that determines the output; an equal request -> the existing folder is reused."""

    corpus: str
    sources: list[dict]
    tokenizer_sha256: str
    block_length: int
    train_tokens: int | None
    validation_tokens: int | None
    validation_fraction: float
    seed: int
    format_version: int = FORMAT_VERSION


def tokenizer_fingerprint(path: Path) -> str:
    names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
             "merges.txt", "tokenizer.model")
    h = hashlib.sha256()
    for name in names:
        f = Path(path) / name
        if f.is_file():
            h.update(name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def read_manifest(data_dir: str | os.PathLike) -> dict:
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise UserError(f"{data_dir} is not a data folder made by `mla data` (no {MANIFEST})")
    return json.loads(path.read_text())


def open_blocks(data_dir: str | os.PathLike, split: str = "train") -> np.ndarray:
    """The packed token blocks of a split, memory-mapped read-only: array [n_blocks, block_length]."""
    if split not in SPLITS:
        raise UserError(f"unknown split {split!r} (one of {SPLITS})")
    manifest = read_manifest(data_dir)
    info = manifest["splits"][split]
    path = Path(data_dir) / info["file"]
    length = manifest["block_length"]
    if path.suffix == ".npy":  # format 1
        blocks = np.load(path, mmap_mode="r")
    else:
        dtype = token_dtype(manifest["dtype"])
        expected = info["n_blocks"] * length * dtype.itemsize
        if not path.is_file() or path.stat().st_size != expected:
            raise UserError(f"{path}: expected {expected} bytes ({info['n_blocks']} blocks of {length} "
                            f"{manifest['dtype']} tokens); the data folder is damaged, rebuild it with --force")
        if info["n_blocks"] == 0:
            return np.zeros((0, length), dtype=dtype)
        blocks = np.memmap(path, dtype=dtype, mode="r", shape=(info["n_blocks"], length))
    if blocks.ndim != 2 or blocks.shape[1] != length:
        raise UserError(f"{data_dir}: {split} array has shape {blocks.shape}, manifest says block length {length}")
    return blocks


def join_consecutive(blocks: np.ndarray, span: int) -> np.ndarray:
    """Blocks [n, L] as sequences of `span` consecutive blocks [n // span, span·L] (a view: no copy of a memory
    map). Packed blocks continue one another, so a joined sequence is running text; leftover blocks are dropped."""
    if span < 1:
        raise UserError(f"span must be >= 1, got {span}")
    n, length = blocks.shape
    return blocks[: n // span * span].reshape(n // span, span * length)


def load_blocks(source: str | os.PathLike, split: str = "validation") -> np.ndarray:
    """Token blocks [n, L] from a `mla data` folder (its `split`) or from a .npy file."""
    p = Path(source)
    if p.suffix == ".npy":
        if not p.is_file():
            raise UserError(f"token blocks file not found: {p}")
        blocks = np.load(p, mmap_mode="r")
    else:
        blocks = open_blocks(p, split)
    if blocks.ndim != 2 or blocks.shape[1] < 2:
        raise UserError(f"{p}: expected token blocks of shape [n_blocks, block_length >= 2], got {blocks.shape}")
    return blocks
