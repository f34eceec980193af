"""The latent cache layer and its group quantization: round trip, generation, bytes, masks, bad input."""

from __future__ import annotations

import json
import re
import sys

import numpy as np
import pytest
import torch

from mla.cli import main as mla_main
from mla.conversion.convert import convert_model
from mla.errors import UserError
from mla.kv.accounting import _tensor_bytes, cache_nbytes, quantized_cache_bytes
from mla.kv.measure_bytes import measure_kv_bytes
from mla.kv.quantized import KVQuant, make_cache, quantized_cache_losses
from mla.modeling import MLACache, MLAQuantizedCache
from mla.modeling.cache_mla import MLALatentLayer, MLAQuantizedLayer, QuantizedRows, _pack, _unpack
from mla.tiny_models import tiny_llama

GROUP, RESIDUAL = 8, 4


def converted(num_kv_heads=2, d_kv=8, r=2, seed=0):
    torch.manual_seed(seed)
    model, _ = convert_model(tiny_llama(num_kv_heads=num_kv_heads), d_kv=d_kv, r=r, strategy="uniform", svd="joint")
    return model.eval()


def prompt(batch=2, length=20, seed=1):
    return torch.randint(1, 512, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("nbits", [8, 4, 2])
def test_round_trip_error_is_within_half_a_step_of_each_group(nbits):
    x = torch.randn(3, 50, 48) * torch.logspace(-2, 2, 48)          # channels of very different ranges
    q = QuantizedRows.quantize(x, nbits, group_size=16)
    assert q.packed.dtype == torch.uint8 and q.packed.shape == (3, 50, 48 * nbits // 8)
    err = (q.dequantize(torch.float32) - x).abs().view(3, 50, 3, 16)
    step = q.scale.unsqueeze(-1)                                     # one step per group of 16 channels
    assert (err <= step / 2 * (1 + 1e-5) + 1e-6).all()
    assert err.max() > 0.1 * step.min()                              # and it really quantized


def test_constant_groups_round_trip_exactly_and_packing_inverts():
    x = torch.full((2, 5, 16), 3.25)
    assert torch.equal(QuantizedRows.quantize(x, 4, 8).dequantize(torch.float32), x)
    for nbits in (2, 4, 8):
        q = torch.randint(0, 2 ** nbits, (4, 7, 24), dtype=torch.uint8)
        assert torch.equal(_unpack(_pack(q, nbits), nbits), q)


def test_latent_layer_names_its_two_tensors_without_a_head_axis():
    model = converted()
    with torch.no_grad():
        cache = model(prompt(), use_cache=True).cache
    assert isinstance(cache, MLACache) and isinstance(cache.layers[0], MLALatentLayer)
    layer = cache.layers[0]
    assert layer.latent.shape == (2, 20, model.config.kv_lora_rank)
    assert layer.k_rope.shape == (2, 2, 20, model.config.qk_rope_head_dim)


def test_generate_builds_the_quantized_latent_cache_from_cache_config():
    """(Greedy equality with full precision is shown on real weights: test_smollm2.py; a random tiny
    model's top two logits are often closer than any cache error.)"""
    model, p = converted(), prompt()
    with torch.no_grad():
        out = model.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=12, min_new_tokens=12,
                             do_sample=False, return_dict_in_generate=True, cache_implementation="quantized",
                             cache_config={"nbits": 8, "q_group_size": GROUP, "residual_length": RESIDUAL})
    cache = out.cache
    assert isinstance(cache, MLAQuantizedCache) and (cache.nbits, cache.group_size) == (8, GROUP)
    layer = cache.layers[0]
    assert layer.get_seq_length() == 20 + 12 - 1 and layer.latent.shape[1] == RESIDUAL   # the window
    assert layer.quantized[0].tokens == 20 + 12 - 1 - RESIDUAL                            # the rest


def test_logit_error_grows_as_bits_shrink():
    """Teacher-forced decode of the same tokens: the 8-, 4- and 2-bit caches' logit errors (reported)."""
    model, p = converted(), prompt(length=40)
    errors = {}
    with torch.no_grad():
        for bits in (16, 8, 4, 2):
            cache = make_cache(model, KVQuant(bits, GROUP, RESIDUAL))
            cache = model(p[:, :20], cache=cache, use_cache=True).cache
            logits = []
            for i in range(20, 40):
                out = model(p[:, i:i + 1], cache=cache, use_cache=True)
                cache, logits = out.cache, logits + [out.logits[:, -1]]
            errors[bits] = torch.stack(logits)
    err = {b: (errors[b] - errors[16]).abs().max().item() for b in (8, 4, 2)}
    print("max |logit error| vs full precision:", err)
    assert err[8] < err[4] < err[2]
    assert err[8] < 0.05


@pytest.mark.parametrize("nbits,group,residual,r", [(4, 8, 4, 2), (2, 4, 0, 2), (8, 16, 3, 0), (4, 8, 100, 2)])
def test_bytes_held_equal_the_formula_with_scales(nbits, group, residual, r):
    model = converted(r=r)
    res = measure_kv_bytes(model, batch=2, prompt_len=9, new_tokens=6, quant=KVQuant(nbits, group, residual))
    assert res["matches_formula"] is True
    tokens = 9 + residual + 6 - 1
    assert res["cached_tokens"] == tokens
    # the formula by hand: per layer, latent 16 channels and RoPE key 2·2r channels, fp32 scales
    rows = [16, 2 * 2 * r]
    quantized = sum(c * nbits // 8 + 2 * (c // group) * 4 for c in rows if c)
    full = sum(rows) * 4
    window = min(tokens, residual)
    assert res["cache_bytes"] == 2 * 2 * (window * full + (tokens - window) * quantized)   # batch 2, 2 layers


def test_shared_context_copies_and_beam_search_work_on_the_quantized_cache():
    model, p = converted(), prompt(batch=1)
    with torch.no_grad():
        out = model.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=8, num_beams=3, do_sample=False,
                             cache=MLAQuantizedCache(model.config, nbits=8, group_size=GROUP, residual_length=RESIDUAL))
        plain = model.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=8, num_beams=3, do_sample=False)
    assert torch.equal(out, plain)
    cache = MLAQuantizedCache(model.config, nbits=4, group_size=GROUP, residual_length=RESIDUAL)
    with torch.no_grad():
        cache = model(prompt(batch=2), cache=cache, use_cache=True).cache
    before = cache_nbytes(cache)
    layer = cache.layers[0]
    layer.batch_select_indices(torch.tensor([1, 1, 0]))
    assert layer.get_seq_length() == 20 and layer.quantized[0].packed.shape[0] == 3
    assert cache_nbytes(cache) > before


def test_absorbed_decode_with_2d_and_no_mask_equals_the_non_absorbed_path():
    model = converted(d_kv=6)
    attn = model.model.layers[0].self_attn
    cache = MLACache(config=model.config)
    x = torch.randn(2, 7, model.config.hidden_size)
    pos = torch.arange(7)[None].expand(2, -1)
    with torch.no_grad():
        emb = model.model.rotary_emb(x, pos)
        attn(x[:, :6], position_embeddings=tuple(t[:, :6] for t in emb), attention_mask=None, cache=cache)
        step = (x[:, 6:], tuple(t[:, 6:] for t in emb))
        padding = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1] * 7])             # row 0 left-padded by 2
        four_d = torch.zeros(2, 1, 1, 7).masked_fill(padding[:, None, None] == 0, float("-inf"))
        results = {}
        for absorb, mask in ((False, four_d), (True, four_d), (True, padding), (True, padding.bool()),
                             (False, None), (True, None)):
            model.config.absorb_decode = absorb
            c = MLACache(config=model.config)
            c.layers[0].update(cache.layers[0].keys.clone(), cache.layers[0].values.clone())   # the stored layout
            results[absorb, None if mask is None else (mask.dim(), mask.dtype)] = \
                attn(step[0], position_embeddings=step[1], attention_mask=mask, cache=c)[0]
    reference = results[False, (4, torch.float32)]
    for key in ((True, (4, torch.float32)), (True, (2, torch.int64)), (True, (2, torch.bool))):
        assert (results[key] - reference).abs().max().item() <= 1e-5, key
    assert (results[True, None] - results[False, None]).abs().max().item() <= 1e-5
    assert (results[True, None] - reference).abs().max().item() > 1e-3       # the padding mask mattered


def test_quantized_losses_pair_every_width_with_full_precision():
    torch.manual_seed(0)
    source = tiny_llama(num_kv_heads=2)
    with torch.no_grad():          # attention that moves the loss (at the 0.02 init its effect is ~1e-5 nats)
        for layer in source.model.layers:
            layer.self_attn.v_proj.weight.normal_(0, 0.3)
            layer.self_attn.o_proj.weight.normal_(0, 0.3)
    model, _ = convert_model(source, d_kv=8, r=2, strategy="uniform", svd="joint")
    model.eval()
    blocks = np.random.RandomState(0).randint(1, 512, (6, 40))
    res = quantized_cache_losses(model, blocks, [4, 8, 2], group_size=GROUP, residual=RESIDUAL, scored=8,
                                 log=lambda *_: None)
    assert list(res["bits"]) == ["16", "8", "4", "2"] and res["prefix_tokens"] == 31 and res["blocks"] == 6
    assert abs(res["bits"]["8"]["loss_change"]) < 1e-3
    # 2 bits move each block's loss far more than 8 (the spread of the paired differences; their means are noise)
    assert res["bits"]["2"]["loss_change_stderr"] > 10 * res["bits"]["8"]["loss_change_stderr"]
    assert all(res["bits"][b]["loss_change_stderr"] > 0 for b in ("8", "4", "2"))


def test_original_model_cache_needs_neither_optimum_quanto_nor_a_compiler(monkeypatch):
    """quanto's dequantization compiles its C++/CUDA extension at run time (torch.utils.cpp_extension.load);
    the original's cache must prefill and decode with quanto not importable and any compilation refused."""
    import torch.utils.cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no compiler on this node")

    monkeypatch.setitem(sys.modules, "optimum.quanto", None)           # as if not installed
    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiler)
    model, p = tiny_llama(num_kv_heads=2), prompt(length=12)
    cache = make_cache(model, KVQuant(4, GROUP, RESIDUAL))
    assert type(cache).__name__ == "QuantoTorchCache"
    with torch.no_grad():
        out = model.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=2 * RESIDUAL, do_sample=False,
                             cache=cache, return_dict_in_generate=True)
    layer = out.cache.layers[0]
    assert layer.get_seq_length() == 12 + 2 * RESIDUAL - 1 and layer._quantized_keys is not None
    with pytest.raises(UserError, match="2 or 4 bits, not 8"):
        make_cache(model, KVQuant(8, GROUP, RESIDUAL))
    with pytest.raises(UserError, match="group size 12 does not divide the 32 key"):
        make_cache(model, KVQuant(4, 12, RESIDUAL))        # 2 KV heads x d_h 16 per token


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quanto_procedure_in_torch_equals_optimum_quanto_bit_for_bit(dtype):
    """On the CPU (where quanto runs its compiled C++ unpack): packed bytes, dequantized values and bytes
    held are identical, for groups within a head (8, 16) and spanning tokens (24 of d_h 16, 32)."""
    pytest.importorskip("optimum.quanto")
    from transformers.cache_utils import QuantoQuantizedLayer

    from mla.kv import quanto_torch

    g = torch.Generator().manual_seed(0)
    for bits in (2, 4):
        for group, shape in ((16, (2, 3, 10, 16)), (8, (2, 2, 7, 16)), (24, (1, 3, 8, 16)), (32, (2, 2, 5, 16))):
            x = (torch.randn(shape, generator=g) * torch.logspace(-1, 1, shape[-1])).to(dtype)
            theirs = QuantoQuantizedLayer(nbits=bits, q_group_size=group)._quantize(x.contiguous(), axis=0)
            ours = quanto_torch.quantize(x, bits, group)
            assert torch.equal(ours.packed, theirs._data._data), (bits, group)
            assert torch.equal(ours.scale, theirs._scale) and torch.equal(ours.shift, theirs._shift)
            assert torch.equal(quanto_torch.dequantize(ours), theirs.dequantize()), (bits, group)
            assert ours.nbytes == _tensor_bytes(theirs)
    with pytest.raises(ValueError, match=r"Group size \(12\) must be a divisor of \(30\)"):
        quanto_torch.quantize(torch.zeros(2, 3, 10), 4, 12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_original_cache_decodes_exactly_as_transformers_quanto_cache(dtype):
    """Teacher-forced decode across two window flushes: the same logits, bit for bit, and the same bytes."""
    pytest.importorskip("optimum.quanto")
    from transformers.cache_utils import QuantizedCache

    model, p = tiny_llama(num_kv_heads=2).to(dtype), prompt(length=30)
    caches = {"ours": make_cache(model, KVQuant(2, GROUP, RESIDUAL)),
              "quanto": QuantizedCache(backend="quanto", config=model.config, nbits=2, q_group_size=GROUP,
                                       residual_length=RESIDUAL)}
    logits = {}
    with torch.no_grad():
        for name, cache in caches.items():
            steps = [model(p[:, :20], cache=cache, use_cache=True).logits]
            for i in range(20, 30):
                steps.append(model(p[:, i:i + 1], cache=cache, use_cache=True).logits)
            logits[name] = torch.cat(steps, dim=1)
    assert torch.equal(logits["ours"], logits["quanto"])
    assert cache_nbytes(caches["ours"]) == cache_nbytes(caches["quanto"])


def test_prefill_reads_the_prompt_in_full_precision_in_both_caches():
    """One procedure for the latent cache and the original's: a prefill attends to its prompt unquantized
    (its logits equal the full-precision cache's exactly), and the following step reads it quantized."""
    for model in (converted(), tiny_llama(num_kv_heads=2)):
        p = prompt(length=20)                                # 20 tokens > window of 4: 16 quantized at once
        with torch.no_grad():
            full = model(p[:, :19], use_cache=True)
            quant = model(p[:, :19], cache=make_cache(model, KVQuant(2, GROUP, RESIDUAL)), use_cache=True)
            assert torch.equal(quant.logits, full.logits), type(model).__name__
            step_full = model(p[:, 19:], cache=full.cache, use_cache=True).logits
            step_quant = model(p[:, 19:], cache=quant.cache, use_cache=True).logits
        assert (step_quant - step_full).abs().max() > 1e-3, type(model).__name__


def test_latent_layer_quantizes_only_for_later_steps():
    """A second multi-token update (chunked prefill): its own tokens and the window come back exact,
    the tokens quantized before it come back dequantized, those it quantizes are read so from the next."""
    layer = MLAQuantizedLayer(nbits=2, group_size=4, residual_length=4)
    g = torch.Generator().manual_seed(0)
    first, second = [(torch.randn(1, t, 8, generator=g), torch.randn(1, 2, t, 4, generator=g)) for t in (10, 5)]
    latent, rope = layer.update(*first)
    assert torch.equal(latent, first[0]) and torch.equal(rope, first[1])      # the prefill: exact
    stored = layer._dequantize()[0]
    assert stored.shape[1] == 6 and not torch.equal(stored, first[0][:, :6])
    latent, rope = layer.update(*second)
    assert torch.equal(latent[:, :6], stored)                                # quantized by the earlier step
    assert torch.equal(latent[:, 6:], torch.cat([first[0][:, 6:], second[0]], dim=1))   # window + own: exact
    assert torch.equal(rope[:, :, 10:], second[1])
    assert layer.quantized[0].tokens == 11 and layer.get_seq_length() == 15  # quantized for the next step
    latent, _ = layer.update(torch.zeros(1, 1, 8), torch.zeros(1, 2, 1, 4))
    assert torch.equal(latent[:, :11], layer._dequantize()[0][:, :11])


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("nbits", [8, 4, 2])
def test_bf16_round_trip_errs_by_half_a_step_plus_one_rounding(nbits, device):
    """Scales rounded up, dequantized in fp32, rounded once to bf16: in fp32 |x̂ − x| <= step/2, and the
    bf16 result is that value cast once, so |x̂_bf16 − x| <= step/2 + |x̂|·2^-8 (bf16's unit roundoff).
    The former bf16 arithmetic (q·scale, then + zero, each rounded to bf16) breaks the bound."""
    x = torch.randn(4, 64, 64, generator=torch.Generator().manual_seed(1)).to(device, torch.bfloat16)
    q = QuantizedRows.quantize(x, nbits, group_size=16)
    assert q.scale.dtype == q.zero.dtype == torch.bfloat16
    step = q.scale.float().repeat_interleave(16, dim=-1)
    exact = q.dequantize(torch.float32)
    assert ((exact - x.float()).abs() <= step / 2 * (1 + 1e-6)).all()
    rounded = q.dequantize(torch.bfloat16)
    assert torch.equal(rounded, exact.to(torch.bfloat16))                  # one rounding, nothing else
    bound = step / 2 * (1 + 1e-6) + exact.abs() * 2.0 ** -8
    assert ((rounded.float() - x.float()).abs() <= bound).all()
    assert (exact - x.float()).abs().max() > 0.25 * step.min()             # it really quantized
    groups = _unpack(q.packed, nbits).view(4, 64, 4, 16).to(torch.bfloat16)
    old = (groups * q.scale.unsqueeze(-1) + q.zero.unsqueeze(-1)).view(4, 64, 64)
    if nbits in (8, 4):
        assert ((old.float() - x.float()).abs() > bound).any()


def test_bad_cache_settings_are_refused_with_the_cause():
    model = converted()
    with pytest.raises(UserError, match="unsupported cache bit width 3"):
        make_cache(model, KVQuant(3, GROUP, RESIDUAL))
    with pytest.raises(UserError, match="group size 12 does not divide the 16 channels of the latent"):
        make_cache(model, KVQuant(4, 12, RESIDUAL))
    with pytest.raises(ValueError, match="backend 'quanto' quantizes per-head keys"):
        model.generate(prompt(), max_new_tokens=2, cache_implementation="quantized",
                       cache_config={"backend": "quanto", "nbits": 4})
    with pytest.raises(NotImplementedError):
        MLAQuantizedLayer().crop(-1)


def test_plan_gives_the_papers_quantized_headline(capsys):
    assert mla_main(["plan", "--base", "llama-2-7b", "--d-kv", "64", "--kv-bits", "4"]) == 0
    row = json.loads(capsys.readouterr().out)
    q = row["kv_quantized"][0]
    # Llama-2-7B, d_kv 64, r 8: per head 64 + 16 cached elements at 4 bits against 2·128 at 16 bits
    assert q["kv_reduction_percent_element_bits"] == pytest.approx(100 * (1 - 80 * 4 / (256 * 16)))   # 92.1875
    assert round(q["kv_reduction_percent_element_bits"], 2) == 92.19
    # with a bf16 scale and zero per 64 channels: 0.5 more bits per element
    assert q["kv_reduction_percent_with_scales"] == pytest.approx(100 * (1 - 80 * 4.5 / (256 * 16)), abs=1e-4)
    with pytest.raises(SystemExit):
        mla_main(["plan", "--base", "smollm-135m", "--d-kv", "8", "--kv-bits", "3"])
    capsys.readouterr()
    assert mla_main(["plan", "--base", "smollm-135m", "--d-kv", "8", "--kv-bits", "4"]) == 2
    assert "group size 64 does not divide the 24 channels" in capsys.readouterr().err


def test_quantized_cache_formula_counts_the_window_in_full_precision():
    cfg = converted().config
    full = quantized_cache_bytes(cfg, batch=1, tokens=3, nbits=4, group_size=8, residual=5, element_bytes=4)
    assert full == 3 * 2 * (16 + 8) * 4                       # all three tokens in the window
    longer = quantized_cache_bytes(cfg, batch=1, tokens=7, nbits=4, group_size=8, residual=5, element_bytes=4)
    assert longer - full == 2 * 2 * (16 + 8) * 4 + 2 * 2 * ((16 + 8) // 2 + 2 * 3 * 4)


@pytest.mark.slow
def test_evaluate_writes_cache_widths_pass_keys_and_table_rows(tmp_path):
    from mla.checkpoint import load_model
    from mla.conversion.convert import convert_checkpoint
    from mla.tiny_models import save_tiny_checkpoint

    src = save_tiny_checkpoint(tmp_path / "gqa", num_kv_heads=2)
    convert_checkpoint(src, tmp_path / "mla", d_kv=8, r=2, strategy="uniform")
    np.save(tmp_path / "blocks.npy", np.random.RandomState(0).randint(1, 512, (6, 40)))
    common = ["--blocks", str(tmp_path / "blocks.npy"), "--no-local-task", "--paper-tasks", "off",
              "--kv-group-size", "8", "--kv-residual", "4", "--kv-scored", "8", "--needle", "160",
              "--needle-samples", "2"]
    assert mla_main(["evaluate", "--model", str(tmp_path / "mla"), "--out", str(tmp_path / "mla.json"),
                     "--kv-bits", "16,4,2", "--decode-grid", "1x32", "--decode-steps", "2", *common[:-4],
                     "--needle", "160,4090", "--needle-samples", "2"]) == 0
    assert mla_main(["evaluate", "--model", str(src), "--out", str(tmp_path / "orig.json"),
                     "--kv-bits", "16,8,4", "--decode-grid", "none", *common]) == 0
    ev = json.loads((tmp_path / "mla.json").read_text())
    kvq = ev["kv_quant"]
    assert list(kvq["bits"]) == ["16", "4", "2"] and kvq["backend"] == "mla"
    assert all(kvq["bytes"][b]["matches_formula"] for b in ("4", "2"))
    cfg = load_model(tmp_path / "mla").config
    assert kvq["bytes"]["4"]["bytes_per_quantized_token"] == 2 * ((16 + 8) // 2 + 2 * 3 * 4)     # 2 layers, fp32
    assert kvq["bytes"]["4"]["bytes_per_token_full_precision"] == 2 * (cfg.kv_lora_rank + 8) * 4
    assert set(ev["long_context"]["needle"]) == {"16", "4", "2"}
    assert ev["long_context"]["needle"]["4"]["lengths"]["160"]["n"] == 2
    assert ev["long_context"]["needle_lengths_skipped"] == [4090]     # + 10 generated > 4,096 positions
    point = ev["decode"]["grid"][0]
    assert point["speedup_q4"] == pytest.approx(point["mla_absorbed_q4_tps"] / point["original_tps"])
    orig = json.loads((tmp_path / "orig.json").read_text())["kv_quant"]
    assert orig["backend"] == "quanto" and orig["bits"]["8"]["status"] == "skipped"
    assert orig["bytes"]["4"]["cache_class"] == "QuantoTorchCache" and "quanto_torch" in orig["implementation"]
    assert orig["bytes"]["4"]["bytes_per_token_measured"] < orig["bytes"]["4"]["bytes_per_token_full_precision"]

    assert mla_main(["table", "--variant", "original", "--eval", str(tmp_path / "orig.json"), "--variant", "dkv8",
                     "--eval", str(tmp_path / "mla.json"), "--d-kv", "8", "--out", str(tmp_path / "t")]) == 0
    md = re.sub(" +", " ", (tmp_path / "t.md").read_text())   # cells are padded to align columns
    assert "| dkv8 · 4-bit cache | 8 | -90.62% |" in md          # 62.5 % fewer elements, a quarter of the bits
    assert "| original · 4-bit cache | – | -75.00% |" in md
    assert "dkv8 · 8-bit cache" not in md and "original · 8-bit cache" not in md


def test_workflow_refuses_a_group_size_that_does_not_divide_a_variant_at_parse_time():
    import copy
    from pathlib import Path

    import yaml

    from mla.study.config_schema import validated
    from mla.study.kv_check import kv_group_errors

    cfg = validated(yaml.safe_load((Path(__file__).parents[1] / "config.yaml").read_text()))
    assert kv_group_errors(cfg) == []                          # 8 divides every default width
    bad = copy.deepcopy(cfg)
    bad["evaluate"]["kv_group_size"] = 48
    errors = kv_group_errors(bad)
    assert ("evaluate.kv_group_size", "48 does not divide the 32 channels of the latent of gqa2mla/dkv8 "
            "(smollm2-135m)") in errors
    assert all(key == "evaluate.kv_group_size" for key, _ in errors)
    per_model = copy.deepcopy(cfg)
    per_model["evaluate"]["kv_group_size"] = {"default": 8, "smollm2-135m-mha": 144}
    errors = kv_group_errors(per_model)    # 144 divides the MHA latents 144 and 288, not 72 nor the RoPE key's 72
    assert {k for k, _ in errors} == {"evaluate.kv_group_size.smollm2-135m-mha"} and len(errors) == 4


@CUDA
def test_original_quantized_cache_decodes_on_cuda_without_a_compiler(monkeypatch):
    """On a GPU, where optimum-quanto would build quanto_cuda with nvcc at the first dequantization: the torch
    procedure decodes in bf16 with compilation refused, and its CUDA dequantization equals the CPU's."""
    import torch.utils.cpp_extension

    from mla.kv import quanto_torch

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no compiler on this node")

    monkeypatch.setitem(sys.modules, "optimum.quanto", None)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiler)
    model, p = tiny_llama(num_kv_heads=2).to("cuda", torch.bfloat16), prompt(length=12).cuda()
    with torch.no_grad():
        out = model.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=2 * RESIDUAL, do_sample=False,
                             cache=make_cache(model, KVQuant(4, GROUP, RESIDUAL)), return_dict_in_generate=True)
    q = out.cache.layers[0]._quantized_keys
    on_cpu = quanto_torch.QuantoGroups(q.packed.cpu(), q.scale.cpu(), q.shift.cpu(), q.bits, q.shape)
    assert torch.equal(quanto_torch.dequantize(q).cpu(), quanto_torch.dequantize(on_cpu))
