"""Perplexity / mean next-token loss of a causal LM on packed token blocks (held-out split)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np


def load_blocks(source: str | Path, split: str = "validation") -> np.ndarray:
    """Token blocks [n, L] from a `mla data` folder (its `split`) or from a .npy file."""
    from mla.errors import UserError

    p = Path(source)
    if p.suffix == ".npy":
        if not p.is_file():
            raise UserError(f"token blocks file not found: {p}")
        blocks = np.load(p, mmap_mode="r")
    else:
        from mla.data import open_blocks

        blocks = open_blocks(p, split)
    if blocks.ndim != 2 or blocks.shape[1] < 2:
        raise UserError(f"{p}: expected token blocks of shape [n_blocks, block_length >= 2], got {blocks.shape}")
    return blocks


def perplexity(model, blocks: np.ndarray, batch_size: int = 1, max_blocks: int | None = None,
               max_length: int | None = None) -> dict:
    """Mean cross-entropy (nats/token) of each block's tokens 1.. given the previous ones, and exp of it.

    Every block is scored independently (no cache carried over). `max_length` truncates blocks;
    `max_blocks` takes the first blocks only (the split order is already shuffled by `mla data`).
    """
    import torch

    n = blocks.shape[0] if max_blocks is None else min(max_blocks, blocks.shape[0])
    if n == 0:
        raise ValueError("no token blocks to evaluate")
    vocab = model.config.vocab_size
    total_nll, total_tokens = 0.0, 0
    model.eval()
    with torch.inference_mode():
        for start in range(0, n, batch_size):
            chunk = np.array(blocks[start:min(n, start + batch_size)], dtype=np.int64)  # copy off the memmap
            if max_length:
                chunk = chunk[:, :max_length]
            if chunk.max() >= vocab:
                raise ValueError(f"token id {int(chunk.max())} >= the model's vocab size {vocab}: "
                                 "blocks were made with another tokenizer")
            ids = torch.from_numpy(chunk)
            logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                    reduction="sum")
            total_nll += float(nll)
            total_tokens += ids[:, 1:].numel()
    mean = total_nll / total_tokens
    return {"blocks": int(n), "tokens": int(total_tokens), "mean_loss": mean, "perplexity": math.exp(mean)}
