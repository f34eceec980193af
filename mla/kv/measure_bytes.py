"""KV-cache bytes per token, measured from the cache object after `generate`, vs the formula."""

from __future__ import annotations

from mla.kv.accounting import cache_nbytes, kv_elements_per_token, quantized_bytes_per_token, quantized_cache_bytes
from mla.kv.quantized import is_mla, make_cache


def measure_kv_bytes(model, *, batch: int = 2, prompt_len: int = 16, new_tokens: int = 8, seed: int = 0,
                     quant=None) -> dict:
    """Generate greedily, then read the bytes the returned cache holds.

    bytes_per_token_measured = cache bytes / (batch · cached tokens). Full precision, the formula is
    kv_elements_per_token(config) · element size (2·n_kv·d_h·L for Llama, n_kv·(d_kv + 2r)·L for MLA).
    With `quant` (a mla.kv.quantized.KVQuant) the prompt grows by the full-precision window, so that tokens are
    quantized, and an MLA cache must hold exactly `accounting.quantized_cache_bytes`; transformers' quanto
    cache (original models) is measured without a formula of ours.
    """
    import torch


    if quant is not None:
        prompt_len += quant.residual
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ids = torch.randint(1, vocab, (batch, prompt_len), generator=g).to(next(model.parameters()).device)
    cache = make_cache(model, quant)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True,
                             pad_token_id=model.config.pad_token_id or 0, **({"cache": cache} if cache else {}))
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    if cache is None:
        raise RuntimeError("generate() returned no cache object")
    tokens = int(cache.get_seq_length())
    nbytes = int(cache_nbytes(cache))
    elem = next(model.parameters()).element_size()
    elements = int(kv_elements_per_token(model.config))
    if quant is None:
        formula = elements * elem * batch * tokens
    elif is_mla(model):
        formula = quantized_cache_bytes(model.config, batch=batch, tokens=tokens, nbits=quant.nbits,
                                        group_size=quant.group_size, residual=quant.residual, element_bytes=elem)
    else:
        formula = None
    result = {"cache_class": type(cache).__name__, "batch": batch, "cached_tokens": tokens,
              "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
              "cache_bytes": nbytes, "elements_per_token": elements,
              "bytes_per_token_formula": None if formula is None else formula / (batch * tokens),
              "bytes_per_token_measured": nbytes / (batch * tokens),
              "matches_formula": None if formula is None else nbytes == formula}
    if quant is not None:
        result.update(bits=quant.nbits, group_size=quant.group_size, residual=quant.residual,
                      bytes_per_token_full_precision=elements * elem,
                      bytes_per_quantized_token=quantized_bytes_per_token(model.config, quant.nbits, quant.group_size,
                                                                          elem) if is_mla(model) else None)
    return result
