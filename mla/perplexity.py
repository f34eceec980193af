"""Perplexity / mean next-token loss of a causal LM on packed token blocks (held-out split), with its
standard error: the held-out measure of the evaluation, of the layer-wise fit and of the benchmarks, so it
stands below them all (token blocks come from mla.data.load_blocks).

Blocks are the sampling unit: tokens within a block are correlated, blocks are (nearly) independent
draws of held-out text. So the uncertainty of the mean loss m is the standard error of the per-block
mean losses, SE(m) = sd(block losses) / sqrt(n_blocks) (all blocks hold the same number of tokens, so
m is also their plain mean), and the perplexity's by the delta method: SE(exp m) = exp(m) · SE(m).
"""

from __future__ import annotations

import math

import numpy as np

from mla.stats import evenly_spaced, mean_and_stderr


def per_block_losses(model, blocks: np.ndarray, batch_size: int = 1, max_blocks: int | None = None,
                     max_length: int | None = None) -> tuple[list[float], int]:
    """Each scored block's mean next-token loss (the same blocks, in the same order, as `perplexity` scores:
    paired comparisons of two models take differences of these), and the number of tokens scored."""
    import torch

    n = blocks.shape[0] if max_blocks is None else min(max_blocks, blocks.shape[0])
    if n == 0:
        raise ValueError("no token blocks to evaluate")
    rows = evenly_spaced(blocks.shape[0], n)
    vocab = model.config.vocab_size
    device = next(model.parameters()).device
    block_losses: list[float] = []
    total_tokens = 0
    model.eval()
    with torch.inference_mode():
        for start in range(0, n, batch_size):
            chunk = np.array(blocks[rows[start:start + batch_size]], dtype=np.int64)  # copy off the memmap
            if max_length:
                chunk = chunk[:, :max_length]
            if chunk.max() >= vocab:
                raise ValueError(f"token id {int(chunk.max())} >= the model's vocab size {vocab}: "
                                 "blocks were made with another tokenizer")
            ids = torch.from_numpy(chunk).to(device)
            logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
            block_losses += nll.double().mean(dim=1).tolist()
            total_tokens += ids[:, 1:].numel()
    return block_losses, total_tokens


def perplexity(model, blocks: np.ndarray, batch_size: int = 1, max_blocks: int | None = None,
               max_length: int | None = None, per_block: bool = False) -> dict:
    """Mean cross-entropy (nats/token) of each block's tokens 1.. given the previous ones, exp of it, and
    their standard errors across blocks (see the module docstring).

    Every block is scored independently (no cache carried over). `max_length` truncates blocks;
    `max_blocks` takes that many blocks evenly spaced over the split (`mla data` writes the sources
    interleaved in their shares, so a spread sample keeps the mixture; the first blocks need not).
    The model runs on its own device; the loss is computed in fp32. `per_block` adds each block's mean
    loss ("block_losses", in row order) for paired comparisons of two models on the same blocks.
    """
    block_losses, total_tokens = per_block_losses(model, blocks, batch_size, max_blocks, max_length)
    n = len(block_losses)
    mean, se = mean_and_stderr(block_losses)
    ppl = math.exp(mean)
    out = {"blocks": int(n), "tokens": int(total_tokens), "mean_loss": mean, "mean_loss_stderr": se,
           "perplexity": ppl, "perplexity_stderr": None if se is None else ppl * se,
           "stderr_method": "per-block mean losses: SE = sd/sqrt(blocks); perplexity by the delta method exp(m)*SE(m)"}
    if per_block:
        out["block_losses"] = block_losses
    return out
