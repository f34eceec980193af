"""Rotated partial RoPE (one RoPE key shared by all query heads), the shared latent and budgets by cache width:
exactness, the cached width, absorbed decode, the (quantized) cache's bytes, calibration files, bad input."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from mla.cli import main as mla_main
from mla import shapes
from mla.conversion import calibrate, freqfold, rotation
from mla.conversion.ladder import ladder_for
from mla.conversion.convert import convert_checkpoint, convert_model
from mla.conversion.layout import LayoutError, resolve
from mla.kv.accounting import cache_nbytes, kv_elements_per_token
from mla.kv.measure_bytes import measure_kv_bytes
from mla.kv.quantized import KVQuant
from mla.modeling import MLAQuantizedCache
from mla.tiny_models import tiny_llama

TOL = 1e-4
ROOT = Path(__file__).resolve().parents[1]


def ids(batch=2, length=12, seed=1):
    return torch.randint(1, 512, (batch, length), generator=torch.Generator().manual_seed(seed))


def calibrated(model, blocks=6):
    """The calibration pass's scores and rotation statistics on random token blocks."""
    return calibrate.calibration_pass(model, list(ids(batch=blocks, length=16, seed=11)), batch_size=3)


def with_biases(model):
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(layer.self_attn, proj).bias.normal_(0, 0.5)
    return model


# ---------------------------------------------------------------- exactness
@pytest.mark.parametrize("latent", ["per_head", "shared"])
@pytest.mark.parametrize("num_kv_heads", [4, 2], ids=["MHA", "GQA"])
def test_rotated_with_every_component_kept_is_the_original(num_kv_heads, latent):
    model = tiny_llama(num_kv_heads=num_kv_heads)
    cal, x = calibrated(model), ids()
    half = model.config.head_dim // 2
    with torch.no_grad():
        converted, report = convert_model(model, d_kv=None, r=half, strategy="rotated", scores=cal, svd="none",
                                          latent=latent)
        err = (converted(x).logits - model(x).logits).abs().max().item()
    assert err <= TOL
    assert converted.config.rope_layout == "shared" and converted.config.latent_layout == latent
    assert converted.config.qk_rope_head_dim == 2 * num_kv_heads * half          # every component: 2m
    assert converted.config.qk_nope_head_dim == converted.config.v_head_dim == model.config.head_dim
    assert len(report["rotated_components_per_layer"][0]) == num_kv_heads * half


def test_rotated_with_biases_is_exact_and_needs_them():
    model = with_biases(tiny_llama(num_kv_heads=2, attention_bias=True))
    cal, x = calibrated(model), ids()
    with torch.no_grad():
        converted, _ = convert_model(model, d_kv=None, r=8, strategy="rotated", scores=cal, svd="none")
        assert (converted(x).logits - model(x).logits).abs().max().item() <= TOL
        converted.model.layers[0].self_attn.k_rope_proj.bias.zero_()
        assert (converted(x).logits - model(x).logits).abs().max().item() > 1e-3


def reference_rotated_logits(model, input_ids, bases, kept):
    """Independent computation of rotated partial RoPE from its definition, on the original weights: per
    layer and pair k, the K/V heads' key pair vectors are mixed by U_kᵀ, query head h reads component j
    through U_k[g(h), j]·q_h, and only the kept (k, j) rotate; causal softmax with scale 1/sqrt(d_h)."""
    cfg = model.config
    d_h, n_h, n_kv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    half, (b, t) = d_h // 2, input_ids.shape
    freqs = cfg.rope_parameters["rope_theta"] ** (-torch.arange(half, dtype=torch.float64) * 2 / d_h)
    angle = torch.arange(t, dtype=torch.float64)[:, None] * freqs[None]          # [T, half]

    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)

    def rotate(x, mask):             # x [..., T, half, n_kv, 2], rotation where mask [half, n_kv]
        cos = torch.where(mask, angle.cos()[:, :, None], torch.ones(()))
        sin = torch.where(mask, angle.sin()[:, :, None], torch.zeros(()))
        return torch.stack([x[..., 0] * cos - x[..., 1] * sin, x[..., 1] * cos + x[..., 0] * sin], dim=-1)

    h = model.model.embed_tokens(input_ids).double()
    causal = torch.full((t, t), float("-inf"), dtype=torch.float64).triu(1)
    for i, layer in enumerate(model.model.layers):
        attn, x = layer.self_attn, rms(h, layer.input_layernorm.weight.double())
        q = (x @ attn.q_proj.weight.double().T).view(b, t, n_h, 2, half)
        k = (x @ attn.k_proj.weight.double().T).view(b, t, n_kv, 2, half)
        v = (x @ attn.v_proj.weight.double().T).view(b, t, n_kv, d_h).transpose(1, 2)
        u = bases[i].double()                                                    # [half, n_kv(g), n_kv(j)]
        mask = torch.zeros(half, n_kv, dtype=torch.bool)
        mask[kept[i][:, 0], kept[i][:, 1]] = True
        k_rot = torch.einsum("kgj,btgck->btkjc", u, k)                          # rotated key components
        group = torch.arange(n_h) // (n_h // n_kv)
        q_rot = torch.einsum("khj,bthck->bhtkjc", u[:, group, :], q)             # head h's queries of them
        scores = torch.einsum("bhtkjc,bskjc->bhts", rotate(q_rot, mask), rotate(k_rot, mask))
        w = torch.softmax(scores / math.sqrt(d_h) + causal, dim=-1)
        out = (w @ v.repeat_interleave(n_h // n_kv, dim=1)).transpose(1, 2).reshape(b, t, n_h * d_h)
        h = h + out @ attn.o_proj.weight.double().T
        x = rms(h, layer.post_attention_layernorm.weight.double())
        mlp = layer.mlp
        h = h + (torch.nn.functional.silu(x @ mlp.gate_proj.weight.double().T) * (x @ mlp.up_proj.weight.double().T)) \
            @ mlp.down_proj.weight.double().T
    return rms(h, model.model.norm.weight.double()) @ model.lm_head.weight.double().T


@pytest.mark.parametrize("num_kv_heads", [4, 2], ids=["MHA", "GQA"])
def test_rotated_partial_rope_at_full_rank_equals_the_reference(num_kv_heads):
    model = tiny_llama(num_kv_heads=num_kv_heads, head_dim=8 if num_kv_heads == 4 else 16)
    cal, x, r = calibrated(model), ids(), 3
    with torch.no_grad():
        converted, report = convert_model(model, d_kv=None, r=r, strategy="rotated", scores=cal, svd="none")
        kept = [torch.tensor(k) for k in report["rotated_components_per_layer"]]
        bases = [rotation.component_scores(c, q)[0] for c, q in zip(cal["pair_covariance"], cal["query_pair_norms"])]
        expected = reference_rotated_logits(model, x, bases, kept)
        got = converted(x).logits
        assert (got.double() - expected).abs().max().item() <= TOL
        assert (got - model(x).logits).abs().max().item() > 10 * TOL          # and something was dropped
    assert all(len(k) == num_kv_heads * r for k in kept)


def test_component_scores_weigh_query_norms_by_the_rotation_and_rms_key_norm():
    # one pair, 2 K/V heads with keys of second moments 4 and 1, uncorrelated: U = I (up to sign)
    cov = torch.tensor([[[4.0, 0.0], [0.0, 1.0]]])
    query_norms = torch.tensor([[1.0], [3.0], [0.5], [2.0]])          # n_h = 4: heads 0, 1 of group 0
    basis, scores = rotation.component_scores(cov, query_norms)
    assert basis.abs().tolist() == [[[1.0, 0.0], [0.0, 1.0]]]
    assert scores.tolist() == [[pytest.approx((1 + 3) * 2), pytest.approx((0.5 + 2) * 1)]]
    # a correlated pair concentrates its energy in the first component: eigenvalues 5 and 0
    basis, scores = rotation.component_scores(torch.tensor([[[4.0, 2.0], [2.0, 1.0]]]), query_norms)
    assert scores[0, 1].item() == pytest.approx(0, abs=1e-6) and scores[0, 0] > 0
    assert rotation.select_components(torch.tensor([[1.0, 5.0], [3.0, 0.5]]), 2).tolist() == [[0, 1], [1, 0]]


# ---------------------------------------------------------------- the ladder (DeepSeek's RoPE frequencies)
def test_ladders_of_each_head_size():
    assert ladder_for(64).pairs == list(range(32)) and ladder_for(64).theta(1e4) == 1e4
    assert ladder_for(32).pairs == list(range(16)) and ladder_for(32).theta(1e4) == pytest.approx(1e8)
    l128 = ladder_for(128)
    assert l128.pairs == list(range(0, 64, 2)) and l128.slot(62) == 31 and l128.theta(5e5) == 5e5
    assert not l128.holds(3)
    assert ladder_for(96).pairs == list(range(32)) and ladder_for(96).theta(1e4) == pytest.approx(1e4 ** (2 / 3))


def test_ladder_selection_keeps_each_pairs_best_component_then_the_best_pairs():
    scores = torch.tensor([[1.0, 0.5], [9.0, 8.0], [2.0, 3.0], [0.0, 0.0]])    # 4 pairs x 2 components
    assert rotation.select_components(scores, 2).tolist() == [[1, 0], [1, 1]]          # pair 1 twice
    assert rotation.select_ladder_components(scores, 2, [0, 1, 2, 3]).tolist() == [[1, 0], [2, 1]]
    assert rotation.select_ladder_components(scores, 2, [0, 2]).tolist() == [[0, 0], [2, 1]]   # the ladder's only
    with pytest.raises(ValueError, match="the ladder holds 2 frequency pairs"):
        rotation.select_ladder_components(scores, 3, [0, 2])


@pytest.mark.parametrize("head_dim", [16, 128])
def test_a_ladder_conversion_never_repeats_a_frequency(head_dim):
    model = tiny_llama(num_kv_heads=2, head_dim=head_dim)
    ladder, cal = ladder_for(head_dim), calibrated(model)
    most = len(ladder.pairs)
    converted, report = convert_model(model, d_kv=6, r=most // 2, strategy="ladder", scores=cal)
    rotated, _ = convert_model(model, d_kv=6, r=most // 2, strategy="rotated", scores=cal)
    for (pairs,) in converted.config.rope_pairs:
        assert len(pairs) == most and len(set(pairs)) == most and all(ladder.holds(p) for p in pairs)
    assert any(len(set(p)) < len(p) for (p,) in rotated.config.rope_pairs)     # the plain layout repeats them
    assert converted.config.mha2mla["rope_strategy"] == "ladder" and converted.config.mha2mla["rope_ladder"]
    assert report["kv_elements_per_token_after"] == 2 * (2 * 6 + 2 * most)


@pytest.mark.parametrize("source", ["MQA", "GQA with equal keys"])
def test_ladder_with_every_allowed_component_kept_is_the_original(source):
    """Exact where one component per frequency holds all of a pair: one K/V head, or K/V heads whose keys are
    equal (the pair covariance has rank 1, so the other components are zero)."""
    model = tiny_llama(num_kv_heads=1 if source == "MQA" else 2)
    if source != "MQA":
        with torch.no_grad():
            for layer in model.model.layers:
                keys = layer.self_attn.k_proj.weight.view(2, -1, model.config.hidden_size)
                keys[1] = keys[0]
    cal, x = calibrated(model), ids()
    half, n_kv = model.config.head_dim // 2, model.config.num_key_value_heads
    with torch.no_grad():
        converted, _ = convert_model(model, d_kv=None, r=half // n_kv, strategy="ladder", scores=cal, svd="none")
        assert (converted(x).logits - model(x).logits).abs().max().item() <= TOL
    assert all(pairs == list(range(half)) for (pairs,) in converted.config.rope_pairs)


# ---------------------------------------------------------------- folded RoPE (mla/conversion/freqfold.py)
def test_folding_by_one_is_the_ladder():
    """F = 1 (moments from the input covariance) keeps the components the calibrated pair covariances keep."""
    model = tiny_llama(num_kv_heads=2, head_dim=16)
    cal = calibrate.calibration_pass(model, list(ids(batch=6, length=16, seed=11)), batch_size=3, covariance=True)
    pairs = ladder_for(16).pairs
    keys = [layer.self_attn.k_proj.weight.data for layer in model.model.layers]
    folded = freqfold.fold_layers(keys, cal["covariance"], cal["query_pair_norms"], 5, 1, 16, pairs)
    ladder = rotation.rotate_layers(cal["pair_covariance"], cal["query_pair_norms"], 5, pairs)
    for f, layer, w_k, cov, pair_cov in zip(folded, ladder, keys, cal["covariance"], cal["pair_covariance"]):
        moments = freqfold.group_second_moments(w_k, cov, 16, 1)
        torch.testing.assert_close(moments / moments.sum(), pair_cov.double() / pair_cov.sum(), rtol=1e-4, atol=1e-7)
        assert f.kept.tolist() == layer.kept.tolist() and f.pairs == layer.pairs


def test_a_folded_ladder_keeps_one_component_per_slot_in_its_own_group():
    model = tiny_llama(num_kv_heads=2, head_dim=16)
    cal = calibrate.calibration_pass(model, list(ids(batch=6, length=16, seed=11)), batch_size=3, covariance=True)
    converted, report = convert_model(model, r=3, strategy="ladder", scores=cal, covariances=cal, rope_fold=2,
                                      d_kv=4)
    assert report["rope_fold"] == 2 and converted.config.mha2mla["rope_fold"] == 2
    for (pairs,), kept in zip(converted.config.rope_pairs, report["rotated_components_per_layer"]):
        assert len(set(pairs)) == len(pairs) == 6 and pairs == sorted(pairs)
        assert all(p // 2 == group for p, (group, _) in zip(pairs, kept))     # a slot of the component's group
        assert len({group for group, _ in kept}) == 4      # every group of 2 pairs before any twice (6 of 8 pairs)


@pytest.mark.parametrize("keys_in", ["one pair per group", "every pair"])
def test_folding_is_exact_where_each_groups_keys_live_in_one_pair(keys_in):
    """MQA with the keys of every odd pair zeroed: each group of 2 pairs has one component, in its even pair,
    which keeps its own rotation, so folding by 2 loses nothing; with keys in both pairs it does lose."""
    model = tiny_llama(num_kv_heads=1, head_dim=16)
    if keys_in == "one pair per group":
        with torch.no_grad():
            for layer in model.model.layers:
                rows = layer.self_attn.k_proj.weight.view(2, 8, -1)          # [dim of the pair, pair, inputs]
                rows[:, 1::2] = 0
    cal, x = calibrate.calibration_pass(model, list(ids(batch=6, length=16, seed=11)), batch_size=3,
                                        covariance=True), ids()
    with torch.no_grad():
        converted, _ = convert_model(model, d_kv=None, r=4, strategy="ladder", scores=cal, svd="none",
                                     covariances=cal, rope_fold=2)
        gap = (converted(x).logits - model(x).logits).abs().max().item()
    if keys_in == "one pair per group":
        assert gap <= TOL and all(pairs == [0, 2, 4, 6] for (pairs,) in converted.config.rope_pairs)
    else:
        assert gap > 100 * TOL


@pytest.mark.parametrize("kwargs,message", [
    ({"strategy": "high", "rope_fold": 2}, "needs --rope-strategy rotated or ladder"),
    ({"strategy": "ladder", "rope_fold": 3}, "must divide the 8 frequency pairs"),
    ({"strategy": "ladder", "rope_fold": 2, "covariances": None}, "needs the input covariances"),
])
def test_bad_folds_are_refused_naming_the_option(kwargs, message):
    from mla.errors import UserError

    model = tiny_llama(num_kv_heads=2, head_dim=16)
    cal = calibrate.calibration_pass(model, list(ids(batch=2, length=16, seed=11)), batch_size=2, covariance=True)
    with pytest.raises(UserError, match=message):
        convert_model(model, d_kv=4, r=1, scores=cal, **{"covariances": cal, **kwargs})


# ---------------------------------------------------------------- the cached width
def test_r_keeps_its_cached_width_for_rotated():
    model = tiny_llama(num_kv_heads=2)
    cal = calibrated(model)
    rotated, rep_rot = convert_model(model, d_kv=6, r=3, strategy="rotated", scores=cal)
    _, rep_ph = convert_model(model, d_kv=6, r=3, strategy="2-norm", scores=cal)
    assert rep_rot["kv_elements_per_token_after"] == rep_ph["kv_elements_per_token_after"] == 2 * 2 * (6 + 2 * 3)
    assert kv_elements_per_token(rotated.config) == rep_rot["kv_elements_per_token_after"]
    assert rotated.config.rope_pairs[0] and len(rotated.config.rope_pairs[0]) == 1          # one RoPE head
    assert len(rotated.config.rope_pairs[0][0]) == 2 * 3                                     # n_kv·r components
    assert rep_rot["rope_dims_per_layer"] == rep_ph["rope_dims_per_layer"] == 12
    assert rep_rot["params_after_counted"] == rep_rot["params_after"]


# ---------------------------------------------------------------- the shared latent
@pytest.mark.parametrize("strategy", ["uniform", "rotated"])
def test_shared_latent_is_the_same_function_and_exact_at_full_rank(strategy):
    model = tiny_llama(num_kv_heads=2)
    cal, x = calibrated(model), ids()
    with torch.no_grad():
        kw = dict(strategy=strategy, scores=cal)
        shared, rep = convert_model(model, d_kv=6, r=2, latent="shared", **kw)
        per_head, _ = convert_model(model, d_kv=6, r=2, **kw)
        assert (shared(x).logits - per_head(x).logits).abs().max().item() <= 1e-5
        attn = shared.model.layers[0].self_attn
        n_h, d_h = model.config.num_attention_heads, model.config.head_dim
        assert attn.v_up.weight.shape == (n_h * d_h, 12) and attn.num_key_value_groups == 1
        assert rep["params_after_counted"] == rep["params_after"]
        full, _ = convert_model(model, d_kv=None, r=d_h // 2, svd="none", latent="shared", **kw)
        assert (full(x).logits - model(x).logits).abs().max().item() <= TOL


def test_shared_latent_of_an_mha_model_is_the_per_head_model():
    model = tiny_llama(num_kv_heads=4)
    shared, _ = convert_model(model, d_kv=6, r=2, strategy="uniform", latent="shared")
    per_head, _ = convert_model(model, d_kv=6, r=2, strategy="uniform")
    for (name, a), (_, b) in zip(shared.state_dict().items(), per_head.state_dict().items()):
        assert torch.equal(a, b), name


def test_sdpa_with_the_value_padded_to_the_query_width_equals_eager_with_gradients():
    """The shared layout's query and key are wider than the value (RoPE rows + the whole head); the fused path
    pads the value with zero columns (modeling_mla). Logits and every gradient must equal eager attention's,
    causal and with a left-padding mask."""
    model = with_biases(tiny_llama(num_kv_heads=2, attention_bias=True))
    converted, _ = convert_model(model, d_kv=6, r=2, strategy="rotated", scores=calibrated(model))
    cfg = converted.config
    assert cfg.qk_rope_head_dim + cfg.qk_nope_head_dim > cfg.v_head_dim        # the case the padding is for
    x = ids(batch=2, length=9)
    mask = torch.ones_like(x)
    mask[0, :3] = 0                                                             # left padding
    results = {}
    for attn in ("eager", "sdpa"):
        converted.config._attn_implementation = attn
        converted.zero_grad()
        logits = converted(x, attention_mask=mask).logits
        logits[mask.bool()].square().mean().backward()
        results[attn] = (logits.detach(), {n: p.grad.clone() for n, p in converted.named_parameters()})
    (eager, g_eager), (sdpa, g_sdpa) = results["eager"], results["sdpa"]
    assert (eager - sdpa)[mask.bool()].abs().max().item() <= TOL
    for name, grad in g_eager.items():
        assert torch.allclose(grad, g_sdpa[name], atol=1e-5, rtol=1e-4), name


# ---------------------------------------------------------------- decode and cache, every layout
LAYOUTS = [("rotated", "per_head", "joint"), ("rotated", "shared", "joint"), ("rotated", "shared", "split"),
           ("uniform", "shared", "joint"), ("rotated", "per_head", "split")]


@pytest.mark.parametrize("strategy,latent,svd", LAYOUTS)
def test_absorbed_decode_equals_expanded_for_every_layout(strategy, latent, svd):
    model = with_biases(tiny_llama(num_kv_heads=2, attention_bias=True))
    converted, _ = convert_model(model, d_kv=6, r=2, strategy=strategy, scores=calibrated(model), svd=svd,
                                 latent=latent)
    prompt = ids(batch=3, length=7)
    with torch.no_grad():
        nxt = converted(prompt).logits[:, -1].argmax(-1, keepdim=True)
        step = {}
        for absorb in (True, False):
            converted.config.absorb_decode = absorb
            cache = converted(prompt, use_cache=True).cache
            step[absorb] = converted(nxt, cache=cache, use_cache=True).logits
        recomputed = converted(torch.cat([prompt, nxt], dim=1)).logits[:, -1:]
    assert (step[True] - step[False]).abs().max().item() <= TOL
    assert (step[False] - recomputed).abs().max().item() <= TOL


@pytest.mark.parametrize("strategy,latent", [("rotated", "per_head"), ("rotated", "shared"), ("uniform", "shared")])
def test_cache_bytes_equal_the_formula_full_and_quantized(strategy, latent):
    model = tiny_llama(num_kv_heads=2)
    converted, report = convert_model(model, kv_width=20, rope_share="2/5", strategy=strategy, latent=latent,
                                      scores=calibrated(model))
    assert report["kv_lora_rank"] == 12 and report["rope_dims_per_layer"] == 8
    per_token = 2 * (12 + 8)                                        # 2 layers x (latent + RoPE dims)
    assert kv_elements_per_token(converted.config) == report["kv_elements_per_token_after"] == per_token
    full = measure_kv_bytes(converted, batch=2, prompt_len=9, new_tokens=6)
    assert full["matches_formula"] and full["cache_bytes"] == 2 * full["cached_tokens"] * per_token * 4
    quant = measure_kv_bytes(converted, batch=2, prompt_len=9, new_tokens=6, quant=KVQuant(4, 4, 3))
    assert quant["matches_formula"] is True
    rows = [12, 8]                                                    # latent, RoPE key (1 head x 2m or 2 x 2r)
    quantized = sum(c * 4 // 8 + 2 * (c // 4) * 4 for c in rows)
    tokens, window = quant["cached_tokens"], 3
    assert quant["cache_bytes"] == 2 * 2 * (window * sum(rows) * 4 + (tokens - window) * quantized)


def test_shared_rope_key_is_cached_once_and_quantized_by_its_real_width():
    model = tiny_llama(num_kv_heads=2)
    converted, _ = convert_model(model, d_kv=4, r=3, strategy="rotated", scores=calibrated(model))
    with torch.no_grad():
        cache = converted(ids(), use_cache=True).cache
    assert cache.layers[0].k_rope.shape == (2, 1, 12, 12)            # [B, 1 head, T, 2m = 2·n_kv·r]
    with pytest.raises(ValueError, match="does not divide the 12 channels of the RoPE key"):
        MLAQuantizedCache(converted.config, nbits=4, group_size=8)   # 8 divides the latent (8), not 2m = 12
    MLAQuantizedCache(converted.config, nbits=4, group_size=4)


def test_greedy_generation_with_the_latent_cache_equals_recomputation():
    model = tiny_llama(num_kv_heads=2)
    converted, _ = convert_model(model, d_kv=6, r=2, strategy="rotated", scores=calibrated(model), latent="shared")
    prompt = ids(batch=2, length=5)
    with torch.no_grad():
        out = converted.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                                 min_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True)
        seq = prompt
        for step in range(12):
            logits = converted(seq, use_cache=False).logits[:, -1]
            assert (logits - out.logits[step]).abs().max().item() <= TOL, step
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    assert cache_nbytes(out.cache) == 2 * (5 + 12 - 1) * kv_elements_per_token(converted.config) * 4


# ---------------------------------------------------------------- budgets by width
def test_width_budget_splits_the_cache():
    smollm = shapes.read_config("smollm-135m")                       # n_kv 3, d_h 64
    for share, rope, latent in (("1/3", 24, 48), ("1/2", 36, 36), ("2/3", 48, 24), ("5/6", 60, 12)):
        per_head = resolve(smollm, strategy="2-norm", svd="joint", kv_width=72, rope_share=share)
        rotated = resolve(smollm, strategy="rotated", svd="joint", kv_width=72, rope_share=share)
        assert (per_head.rope_dims, per_head.kv_lora_rank, per_head.r) == (rope, latent, rope // 6)
        assert (rotated.rope_components, rotated.kv_lora_rank) == (rope // 2, latent)
    paper = resolve(smollm, strategy="2-norm", svd="joint", d_kv=16, r=4)
    assert paper.kv_width == 72 and shapes.plan_layout(smollm, paper)["params_after"] == 129_642_048
    odd = resolve(smollm, strategy="rotated", svd="joint", kv_width=71, rope_share="24/71")   # any latent width
    assert (odd.rope_components, odd.kv_lora_rank, odd.r) == (12, 47, 4) and odd.d_kv == pytest.approx(47 / 3)


def test_plan_shows_the_split(capsys):
    assert mla_main(["plan", "--base", "smollm-135m", "--kv-width", "72", "--rope-share", "2/3",
                     "--rope-strategy", "rotated", "--latent", "shared"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert (row["rope_dims_per_layer"], row["latent_per_layer"], row["rope_components"]) == (48, 24, 24)
    assert row["kv_elements_per_token_after"] == 30 * 72 and row["rope_layout"] == "shared"
    s = shapes.shape_of(shapes.read_config("smollm-135m"))
    # the query grows by the rotated RoPE rows, the up-projections rebuild 9 heads instead of 3
    extra_q = 30 * 9 * 48 * 576
    up = 30 * 24 * 9 * (64 + 64)
    k_rope, down = 30 * 576 * 48, 30 * 576 * 24
    kv_before = 30 * 2 * 576 * 3 * 64
    assert row["params_after"] - row["params_before"] == extra_q + up + k_rope + down - kv_before
    assert s.heads == 9


# ---------------------------------------------------------------- calibration files and checkpoints
def test_calibrate_writes_the_rotation_statistics_and_convert_reads_them(tiny_checkpoint, tmp_path, monkeypatch,
                                                                          capsys):
    import mla.data

    blocks = np.random.default_rng(0).integers(1, 512, size=(6, 16), dtype=np.int64)
    monkeypatch.setattr(mla.data, "open_blocks", lambda data_dir, split="train": blocks, raising=False)
    scores = tmp_path / "scores.pt"
    assert mla_main(["calibrate", "--model", str(tiny_checkpoint), "--data", str(tmp_path), "--samples", "4",
                     "--batch-size", "2", "--out", str(scores)]) == 0
    saved = torch.load(scores, weights_only=True)
    assert saved["pair_covariance"].shape == (2, 8, 2, 2) and saved["query_pair_norms"].shape == (2, 4, 8)
    # the second moment by hand, from the first layer's keys over the 4 blocks (64 tokens)
    from mla.checkpoint import load_model

    model = load_model(tiny_checkpoint)
    captured = []
    hook = model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda m, a, kw: captured.append(m.k_proj(kw.get("hidden_states", a[0] if a else None))), with_kwargs=True)
    with torch.no_grad():
        model.model(input_ids=torch.as_tensor(blocks[:4]), use_cache=False)
    hook.remove()
    k = captured[0].reshape(64, 2, 2, 8).double()                     # [tokens, n_kv, (first|second), pair]
    expected = torch.einsum("ngck,nhck->kgh", k, k) / 64
    torch.testing.assert_close(saved["pair_covariance"][0].double(), expected, rtol=1e-4, atol=1e-6)
    # the per-head query norms summed over a group against the keys' are the 2-norm scores
    k_norms = calibrate.pair_norms(captured[0], 16).reshape(4, 16, 2, 8).mean(1).mean(0)
    torch.testing.assert_close(calibrate.group_scores(saved["query_pair_norms"][:1], k_norms[None]),
                               saved["scores"][:1], rtol=1e-4, atol=1e-6)

    out = tmp_path / "rot"
    assert mla_main(["convert", "--model", str(tiny_checkpoint), "--out", str(out), "--d-kv", "6", "--r", "2",
                     "--rope-strategy", "rotated", "--scores", str(scores)]) == 0
    report = json.loads((out / "conversion.json").read_text())
    assert report["rope_layout"] == "shared" and len(report["rotated_components_per_layer"][1]) == 4
    assert json.loads((out / "config.json").read_text())["rope_pairs"][1] == \
        [[k for k, _ in report["rotated_components_per_layer"][1]]]
    capsys.readouterr()
    old = tmp_path / "old.pt"
    torch.save({"scores": saved["scores"]}, old)                     # a scores file from before the rotation
    assert mla_main(["convert", "--model", str(tiny_checkpoint), "--out", str(tmp_path / "x"), "--d-kv", "6",
                     "--rope-strategy", "rotated", "--scores", str(old)]) == 2
    err = capsys.readouterr().err
    assert "needs the keys' pair covariances" in err and "run `mla calibrate` again" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "x").exists()


def test_rotated_shared_latent_checkpoint_loads_without_the_mla_package(tiny_checkpoint, tmp_path):
    from mla.checkpoint import load_model

    model = load_model(tiny_checkpoint)
    scores = tmp_path / "scores.pt"
    cal = calibrated(model)
    torch.save(cal, scores)
    out = tmp_path / "mla"
    convert_checkpoint(tiny_checkpoint, out, d_kv=None, kv_width=16, rope_share="1/2", strategy="rotated",
                       scores_path=scores, latent="shared")
    prompt = ids(batch=1).tolist()
    with torch.no_grad():
        expected = load_model(out)(torch.tensor(prompt)).logits
    code = textwrap.dedent(f"""
        import sys, json, torch
        sys.modules["mla"] = None          # any import of the package raises ImportError
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True, dtype=torch.float32)
        with torch.no_grad():
            logits = model(torch.tensor({prompt})).logits
            cache = model(torch.tensor({prompt}), use_cache=True).cache
        print(json.dumps({{"cls": type(model).__name__, "logits": logits.flatten().tolist(),
                          "rope": list(cache.layers[0].k_rope.shape), "layout": model.config.rope_layout}}))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["cls"] == "MLAForCausalLM" and result["layout"] == "shared"
    assert result["rope"] == [1, 1, 12, 8]                           # one RoPE head of 2m = 8 dims
    assert (torch.tensor(result["logits"]).view_as(expected) - expected).abs().max().item() <= 1e-5


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("argv,message", [
    (["--kv-width", "16", "--rope-share", "1/2", "--d-kv", "4"], "kv_width=16 gives the cache width; leave out d_kv=4"),
    (["--kv-width", "16", "--rope-share", "1/2", "--r", "2"], "leave out r=2"),
    (["--kv-width", "16"], "kv_width=16 needs rope_share"),
    (["--rope-share", "1/2", "--d-kv", "4"], "rope_share=1/2 needs kv_width"),
    (["--kv-width", "16", "--rope-share", "0.3"], "gives 4.8 RoPE dims, not a whole number"),
    (["--kv-width", "18", "--rope-share", "1/3"], "6 RoPE dims, which is not 2·n_kv·r for a whole r"),
    (["--kv-width", "15", "--rope-share", "1/5", "--rope-strategy", "rotated"], "3 RoPE dims: an odd number"),
    (["--kv-width", "72", "--rope-share", "1/2", "--rope-strategy", "rotated"],
     "asks for 18 rotated components, but the model has 16"),
    (["--kv-width", "72", "--rope-share", "1/2"], "asks for 9 frequency pairs per head, but the model has 8"),
    (["--kv-width", "16", "--rope-share", "1"], "must be at least 0 and below 1"),
    (["--kv-width", "96", "--rope-share", "1/12"],
     "kv_width=96 gives a latent of 88 channels, but [W_k,nope; W_v] has rank at most 56"),
    (["--kv-width", "16", "--rope-share", "1/2", "--svd", "none"], "svd none keeps K/V at full rank"),
    (["--d-kv", "4", "--r", "9", "--rope-strategy", "rotated"], "r=9 is out of range"),
    (["--d-kv", "4", "--r", "5", "--rope-strategy", "ladder"], "rope_strategy ladder keeps at most 8"),
    (["--kv-width", "36", "--rope-share", "1/2", "--rope-strategy", "ladder"],
     "rope_share=1/2 asks for 9 RoPE components, but rope_strategy ladder keeps at most 8"),
])
def test_bad_budgets_stop_with_one_line_naming_the_option(tiny_checkpoint, tmp_path, capsys, argv, message):
    scores = tmp_path / "s.pt"
    torch.save({"scores": torch.rand(2, 2, 8)}, scores)
    argv = ["convert", "--model", str(tiny_checkpoint), "--out", str(tmp_path / "o"), "--scores", str(scores)] + argv
    if "--rope-strategy" not in argv:
        argv += ["--rope-strategy", "high"]
    assert mla_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_layout_errors_name_their_option():
    """The option a LayoutError names is the config key the workflow's check reports (layout_check)."""
    tiny = tiny_llama(num_kv_heads=2).config.to_dict()
    cases = {"kv_width": dict(kv_width=8, rope_share="1/2", d_kv=2), "rope_share": dict(kv_width=8, rope_share="7/8"),
             "r": dict(d_kv=4, r=9), "d_kv": dict(d_kv=40, r=2), "latent": dict(d_kv=4, latent="grouped")}
    for option, kwargs in cases.items():
        with pytest.raises(LayoutError) as info:
            resolve(tiny, strategy="rotated", svd="joint", **kwargs)
        assert info.value.option == option, (option, str(info.value))


# ---------------------------------------------------------------- the workflow's variants
def smoke_config(**variants) -> dict:
    """configs/smoke.yaml (tiny GQA: n_kv 2, d_h 16, hidden 64) with these variants in its gqa2mla experiment."""
    cfg = yaml.safe_load((ROOT / "configs" / "smoke.yaml").read_text())
    cfg["experiments"]["gqa2mla"]["variants"] = variants
    return cfg


def test_variants_name_their_layout_and_budget():
    from mla.study import experiments
    from mla.study.config_schema import validated

    cfg = validated(smoke_config(rot={"rope_strategy": "rotated", "kv_width": 20, "rope_share": "2/5", "whiten": True},
                       shared={"d_kv": 4, "latent": "shared"}))
    by_name = {v.name: v for v in experiments.experiment_variants(cfg, "gqa2mla")}
    rot, shared = by_name["rot"], by_name["shared"]
    assert rot.conversion == "rotated-kv20-rope8-joint-white" and rot.r is None      # the experiment's r: not its
    assert shared.conversion == "2-norm-r1-joint-dkv4-shared-latent"
    assert by_name["dkv4"].conversion == "2-norm-r1-joint-dkv4"                       # unchanged default names
    assert rot.budget() == {"strategy": "rotated", "svd": "joint", "d_kv": None, "r": None, "kv_width": 20,
                            "rope_share": "2/5", "latent": "per_head"}


@pytest.mark.parametrize("variant,key,message", [
    ({"kv_width": 20, "rope_share": 0.5, "d_kv": 4}, "variants.bad.kv_width", "leave out d_kv=4"),
    ({"kv_width": 20}, "variants.bad.kv_width", "needs rope_share"),
    ({"d_kv": 4, "rope_share": 0.5}, "variants.bad.rope_share", "needs kv_width"),
    ({"kv_width": 20, "rope_share": 0.3}, "variants.bad.rope_share", "gives 6 RoPE dims, which is not 2·n_kv·r"),
    ({"kv_width": 20, "rope_share": 0.33}, "variants.bad.rope_share", "gives 6.6 RoPE dims, not a whole number"),
    ({"kv_width": 80, "rope_share": "1/2", "rope_strategy": "rotated"}, "variants.bad.rope_share",
     "asks for 20 rotated components, but the model has 16"),
    ({"kv_width": 80, "rope_share": 0.1}, "variants.bad.kv_width", "gives a latent of 72 channels"),
    ({"kv_width": 20, "rope_share": 0.2, "svd": "none"}, "variants.bad.kv_width", "svd none keeps K/V at full rank"),
    ({"kv_width": 20, "rope_share": "1"}, "variants.bad.rope_share", "below 1"),
    ({"d_kv": 4, "r": 9, "rope_strategy": "rotated"}, "variants.bad.r", "r=9 is out of range"),
    ({"d_kv": 4, "latent": "grouped"}, "variants.bad.latent", "'grouped' is not one of"),
    ({"d_kv": 4, "rope_fold": 2}, "variants.bad.rope_fold", "needs rope_strategy rotated or ladder, not 2-norm"),
    ({"d_kv": 4, "attention_aware": True}, "variants.bad.attention_aware", "needs whiten: true"),
])
def test_bad_budgets_are_named_before_any_job(variant, key, message):
    from mla.study.config_schema import config_problems

    problems = config_problems(smoke_config(bad=variant))
    assert len(problems) == 1, problems
    assert problems[0][0] == f"experiments.gqa2mla.{key}" and message in problems[0][1], problems


def test_the_convert_rule_passes_the_layout_and_budget(tmp_path):
    cfg = smoke_config(rot={"rope_strategy": "rotated", "kv_width": 20, "rope_share": "2/5", "latent": "shared",
                            "whiten": True, "attention_aware": True, "rope_fold": 2})
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    r = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "-d", str(tmp_path),
                        "--configfile", str(tmp_path / "c.yaml"), "-n", "-p", "--cores", "1",
                        "results/convert/tiny-gqa/rotated-fold2-kv20-rope8-joint-white-attn-shared-latent"],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    command = next(line for line in (r.stdout + r.stderr).splitlines() if " convert " in line and "--kv-width" in line)
    for part in ("--rope-strategy rotated", "--kv-width 20 --rope-share 2/5", "--latent shared",
                 "--scores results/calibrate/tiny-gqa/scores.pt", "--attention-aware", "--rope-fold 2"):
        assert part in command, command


# ---------------------------------------------------------------- real weights
@pytest.mark.slow
def test_rotated_rope_loses_less_than_per_head_2norm_on_smollm2(smollm2_dir):
    """SmolLM2-135M, partial RoPE only (K/V at full rank), 48 cached RoPE dims per layer: 24 rotated components
    in one shared key against the paper's 2-norm r = 8 per KV head. Calibration on 16 blocks of Python's
    documentation, loss change on 32 held-out blocks (other topics) of 128 tokens, paired per block."""
    from pydoc_data.topics import topics

    from mla.checkpoint import load_model, load_tokenizer
    from mla.perplexity import per_block_losses
    from mla.stats import mean_and_stderr

    model, tok = load_model(smollm2_dir), load_tokenizer(smollm2_dir)
    keys = sorted(topics)
    calib_ids = tok("\n\n".join(topics[k] for k in keys[:40])).input_ids
    held_ids = tok("\n\n".join(topics[k] for k in keys[-40:])).input_ids
    calib = np.array(calib_ids[:16 * 128]).reshape(16, 128)
    held = np.array(held_ids[:32 * 128]).reshape(32, 128)
    cal = calibrate.calibration_pass(model, list(torch.as_tensor(calib)), batch_size=8)
    original, _ = per_block_losses(model, held, batch_size=8)
    changes = {}
    for strategy in ("2-norm", "rotated"):
        converted, report = convert_model(model, r=8, strategy=strategy, scores=cal, svd="none")
        assert report["rope_dims_per_layer"] == 48
        losses, _ = per_block_losses(converted, held, batch_size=8)
        changes[strategy] = [a - b for a, b in zip(losses, original)]
        del converted
    gain, gain_se = mean_and_stderr([a - b for a, b in zip(changes["2-norm"], changes["rotated"])])
    summary = {s: mean_and_stderr(c) for s, c in changes.items()}
    print(f"loss change at 48 RoPE dims: 2-norm per head {summary['2-norm']}, rotated {summary['rotated']}; "
          f"rotated gains {gain:.3f} ± {gain_se:.3f} (original {np.mean(original):.3f})")
    assert gain > 5 * gain_se and summary["rotated"][0] < summary["2-norm"][0]


@pytest.mark.slow
def test_attention_aware_svd_and_folded_rope_lose_less_on_smollm2(smollm2_dir):
    """SmolLM2-135M (GQA), calibration on 32 blocks of Python's documentation, loss change on 32 held-out blocks
    (other topics) of 128 tokens, paired per block: at 48 ladder RoPE dims + a 72-wide latent the
    attention-aware SVD against the activation-aware one; with the latent at full rank (only the RoPE change),
    24 RoPE dims folded by 2 against unfolded."""
    from pydoc_data.topics import topics

    from mla.checkpoint import load_model, load_tokenizer
    from mla.perplexity import per_block_losses
    from mla.stats import mean_and_stderr

    model, tok = load_model(smollm2_dir), load_tokenizer(smollm2_dir)
    keys = sorted(topics)
    calib = np.array(tok("\n\n".join(topics[k] for k in keys[:80])).input_ids[:32 * 128]).reshape(32, 128)
    held = np.array(tok("\n\n".join(topics[k] for k in keys[-40:])).input_ids[:32 * 128]).reshape(32, 128)
    cal = calibrate.calibration_pass(model, list(torch.as_tensor(calib)), batch_size=8, covariance=True)
    original, _ = per_block_losses(model, held, batch_size=8)

    def change(**options):
        converted, _ = convert_model(model, strategy="ladder", scores=cal, covariances=cal, **options)
        losses, _ = per_block_losses(converted, held, batch_size=8)
        return [a - b for a, b in zip(losses, original)]

    width = dict(kv_width=120, rope_share="2/5", whiten=True)
    comparisons = {"attention-aware SVD": (change(**width), change(**width, attention_aware=True)),
                   "RoPE folded by 2": (change(r=4, svd="none"), change(r=4, svd="none", rope_fold=2))}
    for name, (before, after) in comparisons.items():
        gain, se = mean_and_stderr([a - b for a, b in zip(before, after)])
        print(f"{name}: loss change {mean_and_stderr(before)} -> {mean_and_stderr(after)}, gain {gain:.3f} ± {se:.3f}")
        assert gain > 3 * se, name
