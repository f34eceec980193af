"""Decode speed: tokens/s of the original model vs MLA (absorbed and not) over a batch x context grid.

Each point starts from a cache already holding `context` tokens (random entries of the exact shapes
the model caches: filling it by prefill would cost far more than the decode being measured), then
times `steps` greedy single-token steps after `warmup` untimed ones. Both models get a preallocated
cache (transformers' `StaticCache`, the latent's `MLAStaticCache`) written in place, so no step copies
the whole cache as a growing cache's concatenation does; the quantized latent cache grows (it has no
preallocated form). On a GPU a run of steps is timed with CUDA events after one synchronisation, so the
clock does not stop the queue after every step (a per-step synchronisation measures launch overhead);
on the CPU every step is timed with `perf_counter`. Beside each measurement the memory-bound ceiling: a
decode step that is limited by memory bandwidth reads every weight and the whole cache once, so

    S(B,T) = (W + B·T·kv_orig) / (W' + B·T·kv_mla)

with W, W' the weight bytes one step reads and kv the cache bytes per token (all layers), and the
batch-1 floor: every variant's step time at batch 1 with one cached token, the cost a step has whatever
its cache (launches, weights); a point whose step times are close to the floor cannot show S(B,T).

Before a point allocates anything, the memory it needs — weights of the model and of the original
(the twin counted while it does not exist yet), the caches of every timed variant at B x (T + steps),
and a margin for one step's transients — is compared with the device's free memory; a point that
cannot fit is skipped with the numbers (Llama-2-7B's original at 32 x 4096 in fp32 caches 128 GiB).
"""

from __future__ import annotations

import gc
import statistics
import time

from mla import devices
from mla.kv.accounting import kv_elements_per_token, quantized_cache_bytes
from mla.kv.quantized import make_cache

FIXED_MARGIN = 512 * 2 ** 20   # allocator slack and kernels' workspaces


def weight_bytes(model) -> int:
    """Bytes of the weights a decode step reads: every parameter once; an untied input embedding is
    left out (a step reads only B of its rows)."""
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    return sum(p.numel() * p.element_size() for p in model.parameters() if is_tied(out, emb) or p is not emb)


def is_tied(output_embeddings, emb) -> bool:
    """Whether the output head is the input embedding: the same parameter (tied weights are one object,
    also on the meta device, where every data_ptr is 0) or, for real tensors, the same storage."""
    if output_embeddings is None:
        return False
    head = output_embeddings.weight
    return head is emb or (emb.device.type != "meta" and head.data_ptr() == emb.data_ptr())


def resident_bytes(model) -> int:
    """Bytes the model's parameters and buffers occupy (each shared tensor once); works on meta models."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        key = id(t) if t.device.type == "meta" else t.data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def kv_bytes_per_token(model) -> int:
    return kv_elements_per_token(model.config) * next(model.parameters()).element_size()


def predicted_speedup(w_orig: float, w_mla: float, kv_orig: float, kv_mla: float, batch: int, context: int) -> float:
    """S(B,T) from weight bytes and per-token cache bytes (memory-bound ceiling)."""
    bt = batch * context
    return (w_orig + bt * kv_orig) / (w_mla + bt * kv_mla)


def original_twin(mla_model, device=None):
    """A LlamaForCausalLM with the MLA model's source shapes and random weights (speed only), in the MLA
    model's dtype, built directly on `device` (default: the MLA model's); device="meta" sizes it for free."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = mla_model.config.to_dict()
    for key in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "rope_pairs",
                "latent_split", "absorb_decode", "rope_layout", "latent_layout", "mha2mla", "auto_map", "architectures", "model_type",
                "transformers_version", "dtype", "torch_dtype"):
        cfg.pop(key, None)
    config = LlamaConfig(**cfg)
    first = next(mla_model.parameters())
    with torch.device(device or first.device):
        model = LlamaForCausalLM._from_config(config, dtype=first.dtype)
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


def step_transient_bytes(model, batch: int, tokens: int) -> int:
    """Upper estimate of one decode step's temporary memory at `tokens` cached tokens: the cache
    update's copy of one layer, the per-layer keys/values an unabsorbed MLA step expands (and a GQA
    expansion to every query head), fp32 attention scores, and the logits."""
    cfg = model.config
    elem = next(model.parameters()).element_size()
    n_h, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    d_h = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_h
    layer_cache = kv_bytes_per_token(model) // cfg.num_hidden_layers
    per_token = 3 * n_kv * d_h if getattr(cfg, "model_type", "") == "mla_llama" else 0  # k_nope, value, key
    if n_kv < n_h:
        per_token += 2 * n_h * d_h                                          # keys/values repeated per query head
    expanded = batch * tokens * elem * per_token
    scores = 3 * batch * n_h * tokens * 4
    logits = 2 * batch * cfg.vocab_size * 4
    return batch * tokens * layer_cache + expanded + scores + logits


def point_memory(model, original, batch: int, context: int, steps: int, warmup: int, *,
                 original_allocated: bool, mla_caches: int, quant=None) -> dict:
    """Bytes a grid point needs, and how many of them are not allocated yet (`to_allocate_bytes`);
    `quant`: one more cache, quantized (mla.kv.quantized.KVQuant), of the model."""
    tokens = context + steps + warmup + 1
    caches = mla_caches * batch * tokens * kv_bytes_per_token(model)
    if quant is not None:
        caches += quantized_cache_bytes(model.config, batch=batch, tokens=tokens, nbits=quant.nbits,
                                        group_size=quant.group_size, residual=quant.residual,
                                        element_bytes=next(model.parameters()).element_size())
    transient = step_transient_bytes(model, batch, tokens)
    weights = resident_bytes(model)
    orig_weights = 0
    if original is not None:
        caches += batch * tokens * kv_bytes_per_token(original)
        transient = max(transient, step_transient_bytes(original, batch, tokens))
        orig_weights = resident_bytes(original)
    margin = transient + FIXED_MARGIN
    to_allocate = caches + margin + (0 if original_allocated else orig_weights)
    return {"weights_bytes": weights, "original_weights_bytes": orig_weights, "caches_bytes": caches,
            "margin_bytes": margin, "need_bytes": weights + orig_weights + caches + margin,
            "to_allocate_bytes": to_allocate}


def preallocated_cache(model, capacity: int):
    """An empty cache preallocated for `capacity` tokens per sequence: the latent's `MLAStaticCache` for an
    MLA model (taken from the model's own module, so remote-code models get theirs), else `StaticCache`."""
    import sys

    from transformers import StaticCache

    own = getattr(sys.modules[type(model).__module__], "MLAStaticCache", None)
    if getattr(model.config, "model_type", "") == "mla_llama" and own is not None:
        return own(model.config, max_cache_len=capacity)
    return StaticCache(config=model.config, max_cache_len=capacity)


def filled_cache(model, batch: int, context: int, seed: int = 0, quant=None, capacity: int | None = None):
    """A cache for `model` (its own, or quantized per `quant`, a mla.kv.quantized.KVQuant; with `capacity`
    and no `quant` one preallocated for that many tokens) whose every layer holds `context` random entries
    per sequence, generated on the model's device in its dtype."""
    import torch


    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.ones(batch, 1, dtype=torch.long, device=device)
    with torch.inference_mode():
        own = model(input_ids=ids, use_cache=True).cache
        shapes = [(tuple(layer.keys.shape), tuple(layer.values.shape), layer.keys.dtype) for layer in own.layers]
        cache = make_cache(model, quant)
        if cache is None and capacity is not None:
            del own
            cache = preallocated_cache(model, capacity)
        elif cache is None:                          # the model's own cache, emptied
            cache = own
            for layer in cache.layers:
                layer.reset()                        # free the one-token entries before the new ones exist
        for i, (k_shape, v_shape, dtype) in enumerate(shapes):
            k_shape, v_shape = list(k_shape), list(v_shape)
            k_shape[-2] = v_shape[-2] = context      # the token axis is second to last in every layout
            cache.update(torch.randn(k_shape, generator=g, dtype=dtype, device=device),
                         torch.randn(v_shape, generator=g, dtype=dtype, device=device), i)
    return cache


class _Stepper:
    """One model with its own pre-filled cache (preallocated for `capacity` tokens when given); `run(n)`
    times n greedy single-token steps."""

    def __init__(self, model, batch: int, context: int, absorb: bool | None = None, quant=None,
                 capacity: int | None = None):
        import torch

        self.model, self.batch, self.absorb = model, batch, absorb
        self.device = next(model.parameters()).device
        self.cache = filled_cache(model, batch, context, quant=quant, capacity=capacity)
        self.ids = torch.ones(batch, 1, dtype=torch.long, device=self.device)
        # seconds per step: one entry per step (CPU), or the mean step of each timed run (CUDA events)
        self.step_seconds: list[float] = []

    def _step(self) -> None:
        logits = self.model(input_ids=self.ids, cache=self.cache, use_cache=True).logits
        self.ids = logits[:, -1:].argmax(-1)         # stays on the device: no synchronisation

    def run(self, n: int, record: bool = True) -> None:
        import torch


        if self.absorb is not None:
            self.model.config.absorb_decode = self.absorb
        with torch.inference_mode():
            if self.device.type == "cuda":
                devices.synchronize(self.device)     # nothing queued before the run is counted in it
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(n):
                    self._step()
                end.record()
                end.synchronize()                    # the run ends when its last kernel has
                if record and n:
                    self.step_seconds.append(start.elapsed_time(end) / 1000 / n)
                return
            for _ in range(n):
                devices.synchronize(self.device)     # a no-op on the CPU; kept for other devices
                t0 = time.perf_counter()
                self._step()
                devices.synchronize(self.device)
                if record:
                    self.step_seconds.append(time.perf_counter() - t0)

    def tokens_per_second(self) -> float:
        """batch / median step time (the median resists other processes' bursts on a shared machine)."""
        return self.batch / statistics.median(self.step_seconds)


def _time_variants(names: dict, batch: int, context: int, steps: int, warmup: int, rounds: int) -> dict:
    """Tokens/s of each variant (name -> (model, absorb, quant)) at one point: caches preallocated for
    every step (quantized ones grow), `warmup` untimed steps, then `rounds` turns of the timed steps."""
    import torch

    capacity = context + warmup + steps + 1
    steppers = {k: _Stepper(m, batch, context, absorb, q, capacity=None if q else capacity)
                for k, (m, absorb, q) in names.items()}
    for st in steppers.values():
        st.run(warmup, record=False)
    for r in range(rounds):
        n = steps // rounds + (1 if r < steps % rounds else 0)
        for st in steppers.values():
            st.run(n)
    result = {k: st.tokens_per_second() for k, st in steppers.items()}
    device = next(iter(steppers.values())).device
    del steppers
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def decode_grid(model, grid: list[tuple[int, int]], *, steps: int = 8, warmup: int = 2, rounds: int = 2,
                original=None, log=print, free_memory=None, quant=None) -> dict:
    """Measure `model` (absorbed and not, when MLA) and the original (given, or a random twin for MLA);
    with `quant` (a mla.kv.quantized.KVQuant) an MLA model is also timed absorbed with that quantized cache
    (`mla_absorbed_q<bits>_tps`, and `speedup_q<bits>` against the original's full-precision cache).

    At each grid point the variants take turns, `rounds` times `steps // rounds` timed steps each, so a
    burst of load from other processes hits all of them alike; tokens/s = batch / median step time.
    A point whose memory (see `point_memory`) exceeds the device's free memory is skipped: its entry
    holds status "skipped", the reason and the byte counts. `free_memory()` defaults to the device's.
    """
    import torch


    device = next(model.parameters()).device
    free_memory = free_memory or (lambda: devices.free_memory_bytes(device))
    is_mla = getattr(model.config, "model_type", "") == "mla_llama"
    twin_needed = is_mla and original is None
    sized_original = original_twin(model, device="meta") if twin_needed else original
    w_mla, kv_mla = weight_bytes(model), kv_bytes_per_token(model)
    out = {"steps": steps, "warmup": warmup, "rounds": rounds,
           "statistic": "batch / median step time" + (" (of each run's mean step)" if device.type == "cuda" else ""),
           "timing": ("CUDA events around each run of steps, after one synchronisation" if device.type == "cuda" else
                      "perf_counter around each step, with device synchronisation before and after"),
           "cache": "preallocated (StaticCache, MLAStaticCache); the quantized latent cache grows",
           "device": str(device), "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
           "threads": torch.get_num_threads(), "weight_bytes": w_mla, "kv_bytes_per_token": kv_mla, "grid": []}
    if sized_original is not None:
        w_orig, kv_orig = weight_bytes(sized_original), kv_bytes_per_token(sized_original)
        out.update(original_weight_bytes=w_orig, original_kv_bytes_per_token=kv_orig,
                   original_weights="random (same shapes)" if twin_needed else "given")
    absorb_before = getattr(model.config, "absorb_decode", None)
    rounds = max(1, min(rounds, steps))
    try:
        for batch, context in grid:
            mem = point_memory(model, sized_original if is_mla else None, batch, context, steps, warmup,
                               original_allocated=original is not None, mla_caches=2 if is_mla else 1,
                               quant=quant if is_mla else None)
            free = free_memory()
            if mem["to_allocate_bytes"] > free:
                point = {"batch": batch, "context": context, "status": "skipped",
                         "reason": (f"needs {devices.gib(mem['need_bytes'])} ({devices.gib(mem['to_allocate_bytes'])} "
                                    f"not yet allocated: caches {devices.gib(mem['caches_bytes'])}, margin "
                                    f"{devices.gib(mem['margin_bytes'])}) but {devices.gib(free)} is free on {device}"),
                         "free_bytes": free, **mem}
                out["grid"].append(point)
                if log:
                    log(f"decode {batch}x{context}: skipped: {point['reason']}")
                continue
            if twin_needed and original is None:
                original = original_twin(model, device=device)     # materialised once, for the first point that fits
            if is_mla:
                names = {"mla_tps": (model, False, None), "mla_absorbed_tps": (model, True, None)}
                if quant is not None:
                    names[f"mla_absorbed_q{quant.nbits}_tps"] = (model, True, quant)
                if original is not None:
                    names["original_tps"] = (original, None, None)
            else:
                names = {"model_tps": (model, None, None)}
            if "floor" not in out:     # once, before the first point: every variant at batch 1, one cached token
                floor = _time_variants(names, 1, 1, steps, warmup, rounds)
                out["floor"] = {"batch": 1, "context": 1, **{k.replace("_tps", "_step_s"): 1 / v for k, v in floor.items()}}
                if is_mla and original is not None:
                    out["floor"]["predicted_speedup"] = predicted_speedup(w_orig, w_mla, kv_orig, kv_mla, 1, 1)
            point = {"batch": batch, "context": context, "status": "ok",
                     **_time_variants(names, batch, context, steps, warmup, rounds),
                     "need_bytes": mem["need_bytes"], "free_bytes": free}
            # the share of each variant's step that the batch-1 floor already takes (near 1: overhead-bound)
            point["floor_share"] = {k: out["floor"][k.replace("_tps", "_step_s")] * point[k] / batch for k in names}
            if is_mla and original is not None:
                point["speedup"] = point["mla_tps"] / point["original_tps"]
                point["speedup_absorbed"] = point["mla_absorbed_tps"] / point["original_tps"]
                point["predicted_speedup"] = predicted_speedup(w_orig, w_mla, kv_orig, kv_mla, batch, context)
                point["fraction_of_predicted"] = point["speedup_absorbed"] / point["predicted_speedup"]
                if quant is not None:
                    point[f"speedup_q{quant.nbits}"] = point[f"mla_absorbed_q{quant.nbits}_tps"] / point["original_tps"]
            out["grid"].append(point)
            if log:
                log("decode " + " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                         for k, v in point.items() if not k.endswith("_bytes")))
    finally:
        if absorb_before is not None:
            model.config.absorb_decode = absorb_before
    return out
