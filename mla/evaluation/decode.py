"""Decode speed: tokens/s of the original model vs MLA (absorbed and not) over a batch x context grid.

Each point starts from a cache already holding `context` tokens (random entries of the exact shapes
the model caches: filling it by prefill would cost far more than the decode being measured), then
times `steps` greedy single-token steps after `warmup` untimed ones. Beside each measurement the
memory-bound ceiling of peers.md §3.4:

    S(B,T) = (W + B·T·kv_orig) / (W' + B·T·kv_mla)

with W, W' the weight bytes one step reads and kv the cache bytes per token (all layers).
"""

from __future__ import annotations

import gc
import time


def weight_bytes(model) -> int:
    """Bytes of the weights a decode step reads: every parameter once; an untied input embedding is
    left out (a step reads only B of its rows)."""
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    tied = out is not None and out.weight.data_ptr() == emb.data_ptr()
    return sum(p.numel() * p.element_size() for p in model.parameters() if tied or p is not emb)


def kv_bytes_per_token(model) -> int:
    from mla.kvcache import kv_elements_per_token

    return kv_elements_per_token(model.config) * next(model.parameters()).element_size()


def predicted_speedup(w_orig: float, w_mla: float, kv_orig: float, kv_mla: float, batch: int, context: int) -> float:
    """S(B,T) from weight bytes and per-token cache bytes (memory-bound ceiling)."""
    bt = batch * context
    return (w_orig + bt * kv_orig) / (w_mla + bt * kv_mla)


def original_twin(mla_model):
    """A LlamaForCausalLM with the MLA model's source shapes and random weights (speed only)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = mla_model.config.to_dict()
    for key in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "rope_pairs",
                "latent_split", "absorb_decode", "mha2mla", "auto_map", "architectures", "model_type",
                "transformers_version"):
        cfg.pop(key, None)
    config = LlamaConfig(**cfg)
    dtype = next(mla_model.parameters()).dtype
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).to(dtype)
    return model.eval()


def parse_grid(text: str) -> list[tuple[int, int]]:
    """'1x256,8x4096' -> [(1, 256), (8, 4096)]."""
    grid = []
    for item in text.split(","):
        b, sep, t = item.strip().lower().partition("x")
        if not sep or not b.isdigit() or not t.isdigit() or int(b) < 1 or int(t) < 1:
            raise ValueError(f"decode grid entry {item!r} is not BATCHxCONTEXT (e.g. 8x4096)")
        grid.append((int(b), int(t)))
    return grid


def filled_cache(model, batch: int, context: int, seed: int = 0):
    """The model's own cache object, with every layer holding `context` random entries per sequence."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.ones(batch, 1, dtype=torch.long)
    with torch.inference_mode():
        cache = model(input_ids=ids, use_cache=True).cache
        for layer in cache.layers:
            for name in ("keys", "values"):
                t = getattr(layer, name)
                shape = list(t.shape)
                shape[-2] = context
                setattr(layer, name, torch.randn(shape, generator=g, dtype=torch.float32).to(t.dtype))
    return cache


class _Stepper:
    """One model with its own pre-filled cache; `run(n)` times n greedy single-token steps."""

    def __init__(self, model, batch: int, context: int, absorb: bool | None = None):
        import torch

        self.model, self.batch, self.absorb = model, batch, absorb
        self.cache = filled_cache(model, batch, context)
        self.ids = torch.ones(batch, 1, dtype=torch.long)
        self.step_seconds: list[float] = []

    def run(self, n: int, record: bool = True) -> None:
        import torch

        if self.absorb is not None:
            self.model.config.absorb_decode = self.absorb
        with torch.inference_mode():
            for _ in range(n):
                t0 = time.perf_counter()
                logits = self.model(input_ids=self.ids, cache=self.cache, use_cache=True).logits
                self.ids = logits[:, -1:].argmax(-1)
                if record:
                    self.step_seconds.append(time.perf_counter() - t0)

    def tokens_per_second(self) -> float:
        """batch / median step time (the median resists other processes' bursts on a shared machine)."""
        times = sorted(self.step_seconds)
        mid = len(times) // 2
        median = times[mid] if len(times) % 2 else (times[mid - 1] + times[mid]) / 2
        return self.batch / median


def decode_tokens_per_second(model, batch: int, context: int, steps: int = 8, warmup: int = 2) -> dict:
    stepper = _Stepper(model, batch, context)
    stepper.run(warmup, record=False)
    stepper.run(steps)
    tps = stepper.tokens_per_second()
    del stepper
    gc.collect()
    return {"tokens_per_second": tps, "step_ms": 1000 * batch / tps}


def decode_grid(model, grid: list[tuple[int, int]], *, steps: int = 8, warmup: int = 2, rounds: int = 2,
                original=None, log=print) -> dict:
    """Measure `model` (absorbed and not, when MLA) and the original (given, or a random twin for MLA).

    At each grid point the variants take turns, `rounds` times `steps // rounds` timed steps each, so a
    burst of load from other processes hits all of them alike; tokens/s = batch / median step time.
    """
    is_mla = getattr(model.config, "model_type", "") == "mla_llama"
    if is_mla and original is None:
        original = original_twin(model)
    w_mla, kv_mla = weight_bytes(model), kv_bytes_per_token(model)
    out = {"steps": steps, "warmup": warmup, "rounds": rounds, "statistic": "batch / median step time",
           "threads": _threads(), "weight_bytes": w_mla, "kv_bytes_per_token": kv_mla, "grid": []}
    if original is not None:
        w_orig, kv_orig = weight_bytes(original), kv_bytes_per_token(original)
        out.update(original_weight_bytes=w_orig, original_kv_bytes_per_token=kv_orig,
                   original_weights="random (same shapes)" if is_mla else "given")
    absorb_before = getattr(model.config, "absorb_decode", None)
    rounds = max(1, min(rounds, steps))
    try:
        for batch, context in grid:
            if is_mla:
                names = {"mla_tps": (model, False), "mla_absorbed_tps": (model, True)}
                if original is not None:
                    names["original_tps"] = (original, None)
            else:
                names = {"model_tps": (model, None)}
            steppers = {k: _Stepper(m, batch, context, absorb) for k, (m, absorb) in names.items()}
            for st in steppers.values():
                st.run(warmup, record=False)
            for r in range(rounds):
                n = steps // rounds + (1 if r < steps % rounds else 0)
                for st in steppers.values():
                    st.run(n)
            point = {"batch": batch, "context": context,
                     **{k: st.tokens_per_second() for k, st in steppers.items()}}
            del steppers
            gc.collect()
            if is_mla and original is not None:
                point["speedup"] = point["mla_tps"] / point["original_tps"]
                point["speedup_absorbed"] = point["mla_absorbed_tps"] / point["original_tps"]
                point["predicted_speedup"] = predicted_speedup(w_orig, w_mla, kv_orig, kv_mla, batch, context)
                point["fraction_of_predicted"] = point["speedup_absorbed"] / point["predicted_speedup"]
            out["grid"].append(point)
            if log:
                log("decode " + " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                         for k, v in point.items()))
    finally:
        if absorb_before is not None:
            model.config.absorb_decode = absorb_before
    return out


def _threads() -> int:
    import torch

    return torch.get_num_threads()
