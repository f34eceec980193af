"""GGUF exports run by a real llama.cpp (llama-cpp-python 0.3.36 built here, scripts/llamacpp-env): the MLA file
computes the MLA checkpoint's logits and greedy tokens, and llama.cpp caches per token and layer only the latent
and the RoPE key (its own log, not our arithmetic); the original's file runs the same way with K and V per
KV head. The first test builds the llama.cpp venv when it is missing (minutes, once per machine), hence `slow`:
the quick tier leaves the engine out."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from export_helpers import ladder_checkpoint

from mla.checkpoint import load_model
from mla.cli import main as mla_main
from mla.evaluation import llamacpp_engine
from mla.evaluation.greedy_agreement import compare, greedy_with_logits
from mla.evaluation.serving_llamacpp import TOLERANCES
from mla.export import engines
from mla.export.llamacpp import read_report
from mla.export.tiny import tiny_source
from mla.tiny_models import tiny_tokenizer

pytestmark = [pytest.mark.llamacpp, pytest.mark.slow, pytest.mark.timeout(1800)]

# bytes per element of llama.cpp's cache types: q8_0 stores 32 values in 34 bytes, q4_0 in 18
TYPE_BYTES = {"f32": 4, "f16": 2, "q8_0": 34 / 32, "q4_0": 18 / 32}
PROMPTS = 16
MAX_TOKENS = 16


def random_prompts(n=PROMPTS, vocab=512, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (int(torch.randint(6, 24, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def export(src, out, *flags):
    assert mla_main(["export", str(src), "--format", "gguf", "--out", str(out), *flags]) == 0
    return out


@pytest.fixture(scope="session")
def llamacpp():
    """The llama.cpp venv's python, built on first use (scripts/llamacpp-env)."""
    return llamacpp_engine.llamacpp_python(install=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random GQA Llama (d_h 64, head scaled up: mla/export/tiny.py), its ladder conversion and their
    GGUF files: the MLA one in f32 and f16 laid out for an f16 cache, in f16 padded for quantized caches; the
    original in f32."""
    folder = tmp_path_factory.mktemp("llamacpp")
    source = tiny_source("llama", num_kv_heads=2, head_dim=64)
    source.save_pretrained(folder / "orig")
    tiny_tokenizer().save_pretrained(folder / "orig")
    from mla.export.tiny import save_ladder_conversion

    mla = save_ladder_conversion(source, folder / "mla", d_kv=6)
    return {"orig": folder / "orig", "mla": mla,
            "f32": export(mla, folder / "mla-f32.gguf", "--type", "f32"),
            "f16": export(mla, folder / "mla-f16.gguf", "--type", "f16"),
            "quantized": export(mla, folder / "mla-q.gguf", "--type", "f16", "--cache-type", "q4_0"),
            "orig_f32": export(folder / "orig", folder / "orig-f32.gguf", "--type", "f32")}


def nll_of(model, block) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([block])).logits[0, :-1]
    return torch.nn.functional.cross_entropy(logits, torch.tensor(block[1:]), reduction="sum").item()


LAYOUTS = {   # the tiny fixture's GQA d_h 64 (a 62-wide key: slots up to 30) is the first case
    "GQA d_h 128 (every 2nd pair on the ladder)": dict(head_dim=128),
    "GQA d_h 32, shared latent": dict(head_dim=32, latent="shared", r=3),
    "GQA d_h 64, split SVD": dict(head_dim=64, svd="split"),
}


@pytest.mark.parametrize("case", [None, *LAYOUTS])
def test_llamacpp_computes_the_mla_models_losses(llamacpp, tiny, tmp_path, case):
    """f32 weights, an f32 cache and llama.cpp's plain attention: its next-token losses are the MLA model's to
    float rounding, for each latent and ladder layout (with flash attention llama.cpp rounds the query to f16:
    the greedy tests below)."""
    if case is None:
        mla, gguf_file = tiny["mla"], tiny["f32"]
    else:
        mla = ladder_checkpoint(tmp_path / "mla", num_kv_heads=2, **LAYOUTS[case])
        gguf_file = export(mla, tmp_path / "mla.gguf", "--type", "f32")
    blocks = random_prompts(4, seed=9)
    run = llamacpp_engine.run(llamacpp, gguf_file, threads=2, cache_type="f32", flash_attn="off", blocks=blocks)
    model = load_model(mla)
    for block, got in zip(blocks, run["blocks"], strict=True):
        assert got["nll"] == pytest.approx(nll_of(model, block), rel=1e-5, abs=1e-4)


@pytest.mark.parametrize("weights", ["f32", "f16"])
def test_llamacpp_greedy_tokens_match_transformers(llamacpp, tiny, weights):
    """llama.cpp as a user runs it (f16 cache, flash attention on the CPU): the same greedy tokens as transformers
    (fp32) on the MLA checkpoint, wherever transformers' own two candidates are not a near-tie."""
    prompts = random_prompts()
    run = llamacpp_engine.run(llamacpp, tiny[weights], threads=2, prompts=prompts, max_tokens=MAX_TOKENS)
    hf_tokens, hf_logits = greedy_with_logits(load_model(tiny["mla"]), prompts, MAX_TOKENS)
    report = compare(hf_tokens, hf_logits, run["tokens"], tolerance=TOLERANCES[weights])
    print(f"\nllama.cpp ({weights} GGUF) vs transformers: {report['prompts_agreeing']}/{report['prompts']} prompts, "
          f"{report['token_agreement']:.0%} of tokens")
    assert report["all_near_ties"], json.dumps(report["differing"], indent=1)
    assert report["prompts_agreeing"] >= 14


@pytest.mark.parametrize(("file", "cache_type"), [("f16", "f16"), ("quantized", "q8_0"), ("quantized", "q4_0")])
def test_llamacpp_caches_only_the_latent_and_the_rope_key(llamacpp, tiny, file, cache_type):
    """The cache llama.cpp allocates, read from its own log: K rows of latent + RoPE per layer in `cache_type`,
    no V cache at all (the values are a view of the latent)."""
    report = read_report(tiny[file])
    run = llamacpp_engine.run(llamacpp, tiny[file], threads=2, cache_type=cache_type)
    kv = run["kv_cache"]
    expected = report["kv_elements_per_token"] * TYPE_BYTES[cache_type]
    assert kv["type_k"] == cache_type and kv["v_mib"] == 0.0 and kv["layers"] == 2
    assert abs(kv["bytes_per_token"] - expected) <= kv["bytes_per_token_resolution"]
    assert expected < 0.5 * report["kv_elements_per_token_original"] * 2     # below half the original's f16 cache


def test_llamacpp_runs_the_original_with_k_and_v_per_kv_head(llamacpp, tiny):
    prompts = random_prompts()
    run = llamacpp_engine.run(llamacpp, tiny["orig_f32"], threads=2, prompts=prompts, max_tokens=MAX_TOKENS)
    kv = run["kv_cache"]
    config = json.loads((tiny["orig"] / "config.json").read_text())
    per_token = 2 * config["num_key_value_heads"] * config["head_dim"] * config["num_hidden_layers"] * 2
    assert abs(kv["bytes_per_token"] - per_token) <= kv["bytes_per_token_resolution"] and kv["v_mib"] > 0
    hf_tokens, hf_logits = greedy_with_logits(load_model(tiny["orig"]), prompts, MAX_TOKENS)
    report = compare(hf_tokens, hf_logits, run["tokens"], tolerance=TOLERANCES["f32"])
    assert report["all_near_ties"] and report["prompts_agreeing"] >= 14, json.dumps(report["differing"])


def test_llamacpp_refuses_a_quantized_cache_where_the_export_table_says(llamacpp, tiny):
    """engines.llamacpp_refusal against the engine: the f16 layout (latent 12) cannot take a q4_0 cache."""
    shape = engines.MLAShape(read_report(tiny["f16"])["kv_lora_rank"], read_report(tiny["f16"])["qk_rope_head_dim"],
                             64, 64)
    assert engines.llamacpp_refusal(shape, "q4_0") is not None
    with pytest.raises(RuntimeError, match="does not divide"):
        llamacpp_engine.run(llamacpp, tiny["f16"], threads=2, cache_type="q4_0")


# ---------------------------------------------------------------- SmolLM2-135M, the default's GQA variants
def default_gqa() -> dict:
    """config.yaml's GQA variants: name -> the conversion options of mla.conversion.convert.convert_model."""
    import yaml

    from mla.study import experiments
    from mla.study.config_schema import validated

    cfg = validated(yaml.safe_load((Path(__file__).parents[1] / "config.yaml").read_text()))
    return {v.name: dict(kv_width=v.kv_width, rope_share=v.rope_share, strategy=v.rope_strategy, whiten=v.whiten,
                         attention_aware=v.attention_aware, rope_fold=v.rope_fold)
            for v in experiments.experiment_variants(cfg, "gqa2mla") if not v.is_baseline}


@pytest.fixture(scope="module")
def smollm2_variants(smollm2_dir, tmp_path_factory):
    """SmolLM2-135M converted at the default's three GQA caches as config.yaml converts them (ladder, per-head
    latents, activation-aware joint SVD; calibrated on pydoc topics; no fit), each exported in f16."""
    from pydoc_data.topics import topics

    from mla.checkpoint import load_tokenizer
    from mla.conversion import calibrate
    from mla.conversion.convert import convert_model

    folder = tmp_path_factory.mktemp("smollm2-llamacpp")
    tok = load_tokenizer(smollm2_dir)
    blocks = [b for b in (torch.tensor(tok(topics[k]).input_ids[:128]) for k in sorted(topics)[:40])
              if len(b) == 128][:16]
    cal = calibrate.calibration_pass(load_model(smollm2_dir), blocks, batch_size=4, covariance=True)
    out = {"orig": export(smollm2_dir, folder / "orig.gguf", "--type", "f16")}
    for name, options in default_gqa().items():
        converted, _ = convert_model(load_model(smollm2_dir), scores=cal, covariances={"covariance": cal["covariance"]},
                                     **options)
        converted.save_pretrained(folder / name)
        tok.save_pretrained(folder / name)
        out[name] = (folder / name, export(folder / name, folder / f"{name}.gguf", "--type", "f16"))
    out["dkv32-q"] = export(folder / "dkv32", folder / "dkv32-q.gguf", "--type", "f16", "--cache-type", "q4_0")
    return out


def test_smollm2_default_variants_in_llamacpp(llamacpp, smollm2_variants, smollm2_dir):
    """Each default GQA variant: greedy tokens as transformers' up to near-ties on 16 prompts of real text, and
    llama.cpp's f16 cache at most 0.40x the original's in the same build; d_kv 32's q4_0 cache at most 0.12x the
    original's f16 cache. (Identical prompts measured here: 15, 16 and 14 of 16; where a path parts depends on the
    CPU's kernels, so the test asks 12 and that every parting be a near-tie.)"""
    from pydoc_data.topics import topics

    from mla.checkpoint import load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    keys = sorted(topics)
    prompts = [tok(topics[k]).input_ids[:32] for k in keys[::len(keys) // PROMPTS][:PROMPTS]]
    assert len(prompts) == PROMPTS
    original = llamacpp_engine.run(llamacpp, smollm2_variants["orig"], threads=2)["kv_cache"]["bytes_per_token"]
    assert original == pytest.approx(2 * 3 * 64 * 30 * 2, abs=3)          # K and V of 3 KV heads, 30 layers, f16
    for name in default_gqa():
        mla_dir, gguf_file = smollm2_variants[name]
        run = llamacpp_engine.run(llamacpp, gguf_file, threads=2, prompts=prompts, max_tokens=MAX_TOKENS)
        hf_tokens, hf_logits = greedy_with_logits(load_model(mla_dir), prompts, MAX_TOKENS)
        agreement = compare(hf_tokens, hf_logits, run["tokens"], tolerance=TOLERANCES["f16"])
        ratio = run["kv_cache"]["bytes_per_token"] / original
        print(f"\n{name}: KV {run['kv_cache']['bytes_per_token']:.0f} B/token = {ratio:.3f}x the original's; greedy "
              f"{agreement['prompts_agreeing']}/{agreement['prompts']}")
        assert agreement["all_near_ties"] and agreement["prompts_agreeing"] >= 12, json.dumps(agreement["differing"])
        assert ratio <= 0.40
    q4 = llamacpp_engine.run(llamacpp, smollm2_variants["dkv32-q"], threads=2, cache_type="q4_0")["kv_cache"]
    assert q4["type_k"] == "q4_0" and q4["bytes_per_token"] / original <= 0.12
    assert np.isfinite(q4["bytes_per_token"])
