"""The quantized KV cache measured (paper Table 2): held-out loss decoded against the cache, per bit width.

An MLA model quantizes its latent cache itself (`MLAQuantizedCache`, mla/modeling/cache_mla.py). The
original model uses transformers' `QuantizedCache` with the optimum-quanto backend, as the paper's
comparison rows do; it quantizes 2 or 4 bits per head and channel group and keeps its own
full-precision window, flushed whole when full (KIVI), where ours slides token by token.

Loss with a cache: each held-out block is prefilled up to `scored` + 1 tokens from its end, then the
last `scored` tokens are decoded one at a time against the cache (single-token steps: the absorbed
path for MLA), each predicting the next token. 16 bits means the unquantized cache. Every bit width
scores the same blocks, so beside each loss the paired difference to 16 bits (mean of per-block
differences ± its SE) separates the quantization's effect from the blocks' spread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mla.errors import UserError
from mla.kv.accounting import FULL_PRECISION_BITS


@dataclass(frozen=True)
class KVQuant:
    nbits: int
    group_size: int = 64
    residual: int = 128


def is_mla(model) -> bool:
    return getattr(model.config, "model_type", "") == "mla_llama"


def quanto_missing() -> str | None:
    """Why transformers' quanto-backed cache cannot run here, or None."""
    try:
        import optimum.quanto  # noqa: F401
    except ImportError:
        return ("a quantized cache for the original (non-MLA) model needs optimum-quanto "
                "(pip install optimum-quanto, or this project's [quant] extra)")
    return None


def unsupported(model, nbits: int) -> str | None:
    """Why this model's cache cannot be measured at `nbits` here (original models: optimum-quanto), or None."""
    if nbits == FULL_PRECISION_BITS or is_mla(model):
        return None
    if nbits not in (2, 4):
        return f"optimum-quanto quantizes a cache to 2 or 4 bits, not {nbits}"
    return quanto_missing()


def make_cache(model, quant: KVQuant | None):
    """A fresh cache for one pass: None (the model's own full-precision cache) or a quantized one."""
    if quant is None or quant.nbits == FULL_PRECISION_BITS:
        return None
    if is_mla(model):
        from mla.modeling import MLAQuantizedCache

        try:
            return MLAQuantizedCache(model.config, nbits=quant.nbits, group_size=quant.group_size,
                                     residual_length=quant.residual)
        except ValueError as exc:
            raise UserError(f"quantized cache: {exc}") from None
    reason = unsupported(model, quant.nbits)
    if reason:
        raise UserError(reason)
    from transformers.cache_utils import QuantizedCache

    return QuantizedCache(backend="quanto", config=model.config, nbits=quant.nbits, q_group_size=quant.group_size,
                          residual_length=quant.residual)


def generate_kwargs(model, quant: KVQuant | None) -> dict:
    """`generate()` arguments that build this cache afresh for every call (for callers that generate
    several times, where one cache object cannot serve)."""
    if quant is None or quant.nbits == FULL_PRECISION_BITS:
        return {}
    make_cache(model, quant)          # the same refusals as a direct cache, before any generation
    config = {"nbits": quant.nbits, "q_group_size": quant.group_size, "residual_length": quant.residual}
    if not is_mla(model):
        config["backend"] = "quanto"
    return {"cache_implementation": "quantized", "cache_config": config}


def check_bits(bits: list[int]) -> None:
    from mla.modeling.cache_mla import SUPPORTED_BITS

    for b in bits:
        if b != FULL_PRECISION_BITS and b not in SUPPORTED_BITS:
            raise UserError(f"unsupported cache bit width {b}: choose among 16 (unquantized), 8, 4, 2")


def decoded_loss(model, blocks: np.ndarray, quant: KVQuant | None, *, scored: int, batch_size: int = 8) -> list[float]:
    """Mean NLL of each block's last `scored` tokens, each decoded in one step against the cache."""
    import torch

    if blocks.shape[1] < scored + 2:
        raise UserError(f"blocks of {blocks.shape[1]} tokens cannot score {scored} decoded tokens after a prefix")
    device = next(model.parameters()).device
    prefix = blocks.shape[1] - scored - 1
    losses: list[float] = []
    with torch.inference_mode():
        for start in range(0, len(blocks), batch_size):
            ids = torch.from_numpy(np.array(blocks[start:start + batch_size], dtype=np.int64)).to(device)
            cache = make_cache(model, quant)
            # the prefill's logits are not scored: keep only the last position's ([B, T, vocab] is 2 GB in
            # bf16 for 8 blocks of Llama-2-7B at 4,096 tokens)
            cache = model(input_ids=ids[:, :prefix], cache=cache, use_cache=True, logits_to_keep=1).cache
            nll = []
            for i in range(prefix, prefix + scored):
                out = model(input_ids=ids[:, i:i + 1], cache=cache, use_cache=True)
                cache = out.cache
                nll.append(torch.nn.functional.cross_entropy(out.logits[:, -1].float(), ids[:, i + 1],
                                                             reduction="none"))
            losses += torch.stack(nll, dim=1).double().mean(dim=1).tolist()
    return losses


def quantized_cache_losses(model, blocks: np.ndarray, bits: list[int], *, group_size: int, residual: int,
                           scored: int, max_blocks: int | None = None, batch_size: int = 8, log=print) -> dict:
    """Held-out loss (± SE over blocks) with the cache at each bit width, and its paired difference to 16."""
    from mla.evaluation.perplexity import evenly_spaced, mean_and_stderr

    check_bits(bits)
    n = len(blocks) if max_blocks is None else min(max_blocks, len(blocks))
    chosen = blocks[evenly_spaced(len(blocks), n)]
    widths = sorted(set(bits) | {FULL_PRECISION_BITS}, reverse=True)
    out = {"backend": "mla" if is_mla(model) else "quanto", "group_size": group_size, "residual": residual,
           "blocks": int(n), "scored_tokens_per_block": scored, "prefix_tokens": int(blocks.shape[1] - scored - 1),
           "bits": {}}
    per_block = {}
    for b in widths:
        quant = None if b == FULL_PRECISION_BITS else KVQuant(b, group_size, residual)
        reason = unsupported(model, b)
        if reason:
            out["bits"][str(b)] = {"status": "skipped", "reason": reason}
            log(f"evaluate: {b}-bit cache skipped: {reason}")
            continue
        per_block[b] = decoded_loss(model, chosen, quant, scored=scored, batch_size=batch_size)
        mean, se = mean_and_stderr(per_block[b])
        entry = {"status": "ok", "mean_loss": mean, "mean_loss_stderr": se, "perplexity": math.exp(mean),
                 "perplexity_stderr": None if se is None else math.exp(mean) * se}
        if b != FULL_PRECISION_BITS:
            diff, diff_se = mean_and_stderr(np.subtract(per_block[b], per_block[FULL_PRECISION_BITS]))
            entry.update(loss_change=diff, loss_change_stderr=diff_se)
        out["bits"][str(b)] = entry
        log(f"evaluate: {b}-bit cache: loss {mean:.4f} ± {se or 0:.4f}")
    return out
