"""The quantized KV cache measured (paper Table 2): held-out loss decoded against the cache, per bit width.

An MLA model quantizes its latent cache itself (`MLAQuantizedCache`, mla/modeling/cache_mla.py). The
original model uses transformers' quantized cache with optimum-quanto's procedure, as the paper's
comparison rows do, written in torch (mla/kv/quanto_torch.py: no compiled extension, so it runs on
compute nodes without a compiler); it quantizes 2 or 4 bits per group of consecutive values of a head
and keeps its own full-precision window, flushed whole when full (KIVI), where ours slides token by
token. Both return a prefill's prompt in full precision and quantize it for the later steps only.

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

from mla import shapes
from mla.errors import UserError
from mla.kv.accounting import FULL_PRECISION_BITS
from mla.stats import evenly_spaced, mean_and_stderr


@dataclass(frozen=True)
class KVQuant:
    nbits: int
    group_size: int = 64
    residual: int = 128


def is_mla(model) -> bool:
    return getattr(model.config, "model_type", "") == "mla_llama"


def unsupported(model, nbits: int) -> str | None:
    """Why this model's cache cannot be measured at `nbits` (original models: optimum-quanto's widths), or None."""
    from mla.kv.quanto_torch import QUANTO_BITS  # lazy: torch; keeps `mla --help` fast

    if nbits == FULL_PRECISION_BITS or is_mla(model) or nbits in QUANTO_BITS:
        return None
    return f"optimum-quanto quantizes a cache to 2 or 4 bits, not {nbits}"


def make_cache(model, quant: KVQuant | None):
    """A fresh cache for one pass: None (the model's own full-precision cache) or a quantized one."""
    if quant is None or quant.nbits == FULL_PRECISION_BITS:
        return None
    if is_mla(model):
        from mla.modeling import MLAQuantizedCache  # lazy: torch; keeps `mla --help` fast

        try:
            return MLAQuantizedCache(model.config, nbits=quant.nbits, group_size=quant.group_size,
                                     residual_length=quant.residual)
        except ValueError as exc:
            raise UserError(f"quantized cache: {exc}") from None
    reason = unsupported(model, quant.nbits) or original_group_problem(model.config, quant.group_size)
    if reason:
        raise UserError(f"quantized cache: {reason}")
    from mla.kv.quanto_torch import QuantoTorchCache  # lazy: torch; keeps `mla --help` fast

    try:
        return QuantoTorchCache(model.config, nbits=quant.nbits, q_group_size=quant.group_size,
                                residual_length=quant.residual)
    except ValueError as exc:
        raise UserError(f"quantized cache: {exc}") from None


def original_group_problem(config, group_size: int) -> str | None:
    """Why `group_size` cannot group an original model's keys and values (quanto groups consecutive values
    of a token's heads: the group size must divide n_kv·d_h for every prompt length), or None."""
    s = shapes.shape_of(config if isinstance(config, dict) else config.to_dict())
    width = s.kv_heads * s.head_dim
    if group_size < 1 or width % group_size:
        return f"group size {group_size} does not divide the {width} key (or value) channels of a token (n_kv·d_h)"
    return None


def cache_factory(model, quant: KVQuant | None):
    """A function building this cache afresh for each `generate()` call (one cache object serves one call),
    or None for the model's own full-precision cache; refuses bad settings now, before any generation."""
    if quant is None or quant.nbits == FULL_PRECISION_BITS:
        return None
    make_cache(model, quant)
    return lambda: make_cache(model, quant)


def implementation(model) -> str:
    """Which code quantizes this model's cache (both in torch, without compiled extensions)."""
    if is_mla(model):
        return "MLAQuantizedCache (mla/modeling/cache_mla.py)"
    return "QuantoTorchCache (mla/kv/quanto_torch.py: optimum-quanto 0.2.7's procedure in torch)"


def _dtype(model) -> str:
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def check_bits(bits: list[int]) -> None:
    from mla.modeling.cache_mla import SUPPORTED_BITS  # lazy: torch; keeps `mla --help` fast

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

    check_bits(bits)
    n = len(blocks) if max_blocks is None else min(max_blocks, len(blocks))
    chosen = blocks[evenly_spaced(len(blocks), n)]
    widths = sorted(set(bits) | {FULL_PRECISION_BITS}, reverse=True)
    out = {"backend": "mla" if is_mla(model) else "quanto", "implementation": implementation(model),
           "group_size": group_size,
           "residual": residual, "loss_unit": "nats per decoded token", "dtype": _dtype(model),
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
        what = "unquantized cache" if b == FULL_PRECISION_BITS else f"{b}-bit cache ({out['backend']})"
        log(f"evaluate: {what}, {out['dtype']} model: loss {mean:.4f} ± {se or 0:.4f} nats per decoded token "
            f"over {n} blocks")
    return out
