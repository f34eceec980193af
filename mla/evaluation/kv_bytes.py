"""KV-cache bytes per token, measured from the cache object after `generate`, vs the formula."""

from __future__ import annotations


def measure_kv_bytes(model, *, batch: int = 2, prompt_len: int = 16, new_tokens: int = 8, seed: int = 0) -> dict:
    """Generate greedily, then read the bytes the returned cache holds.

    bytes_per_token_measured = cache bytes / (batch · cached tokens); the formula is
    kv_elements_per_token(config) · element size (2·n_kv·d_h·L for Llama, n_kv·(d_kv + 2r)·L for MLA).
    """
    import torch

    from mla.kvcache import cache_nbytes, kv_elements_per_token

    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ids = torch.randint(1, vocab, (batch, prompt_len), generator=g).to(next(model.parameters()).device)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True,
                             pad_token_id=model.config.pad_token_id or 0)
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    if cache is None:
        raise RuntimeError("generate() returned no cache object")
    tokens = int(cache.get_seq_length())
    nbytes = int(cache_nbytes(cache))
    elem = next(model.parameters()).element_size()
    elements = int(kv_elements_per_token(model.config))
    measured = nbytes / (batch * tokens)
    return {"cache_class": type(cache).__name__, "batch": batch, "cached_tokens": tokens,
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "cache_bytes": nbytes, "elements_per_token": elements,
            "bytes_per_token_formula": elements * elem, "bytes_per_token_measured": measured,
            "matches_formula": nbytes == elements * elem * batch * tokens}
