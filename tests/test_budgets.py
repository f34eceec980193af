"""Token budgets derived from the experiments: the paper's numbers, overrides, derived models sharing
their root's data, and a cap below the need refused before any job (naming data.max_tokens)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from mla.study.budgets import budget_errors, train_tokens, validation_tokens
from mla.study.config_schema import validated

ROOT = Path(__file__).resolve().parents[1]


def load(name: str) -> dict:
    return yaml.safe_load((ROOT / name).read_text())


def test_paper_budgets_are_the_papers_token_counts():
    cfg = validated(load("configs/paper.yaml"))
    assert train_tokens(cfg, "llama2-7b") == 12_000 * 256 * 4096 == 12_582_912_000
    assert train_tokens(cfg, "smollm-135m") == 12_000 * 64 * 2048 == 1_572_864_000
    assert budget_errors(cfg) == []
    assert validation_tokens(cfg, "llama2-7b") == cfg["data"]["validation_tokens"]


def test_the_old_paper_cap_is_refused_naming_the_key_and_model():
    cfg = load("configs/paper.yaml")
    cfg["data"]["max_tokens"] = 7_000_000_000  # the value paper.yaml shipped with: enough for SmolLM only
    errors = budget_errors(validated(cfg))
    assert [key for key, _ in errors] == ["data.max_tokens"]
    assert "llama2-7b" in errors[0][1] and "12,582,912,000" in errors[0][1]
    cfg["data"]["max_tokens"] = 12_582_912_000  # a cap equal to the need is enough
    assert budget_errors(validated(cfg)) == []


def test_variant_override_and_experiment_recipe_take_precedence():
    cfg = load("configs/paper.yaml")
    cfg["experiments"]["gqa2mla"]["overrides"] = {"dkv16": {"steps": 18_000}}  # v1 ran 135M for 18,000
    assert train_tokens(validated(cfg), "smollm-135m") == 18_000 * 64 * 2048
    del cfg["experiments"]["gqa2mla"]["train"]["batch_size"]  # falls back to the global train.batch_size
    assert train_tokens(validated(cfg), "smollm-135m") == 18_000 * cfg["train"]["batch_size"] * 2048


def test_block_length_of_the_model_or_the_data_default():
    cfg = load("configs/paper.yaml")
    cfg["models"]["smollm-135m"]["block_length"] = 1024
    assert train_tokens(validated(cfg), "smollm-135m") == 12_000 * 64 * 1024
    del cfg["models"]["llama2-7b"]["block_length"]
    assert train_tokens(validated(cfg), "llama2-7b") == 12_000 * 256 * cfg["data"]["block_length"]


def test_derived_models_share_their_roots_data():
    cfg = load("config.yaml")  # gqa2mla on smollm2-135m, mha2mla on its MHA expansion (same tokenizer)
    t = cfg["train"]
    base = t["steps"] * t["batch_size"] * t.get("span", 1) * cfg["data"]["block_length"]
    fit = cfg["experiments"]["gqa2mla"]["fit"]
    fit_tokens = fit["blocks"] * fit.get("span", 1) * cfg["data"]["block_length"]
    assert train_tokens(validated(cfg), "smollm2-135m") == max(base, fit_tokens)   # the GQA fit's sequences
    assert 3 * base > fit_tokens
    # a longer run of the derived model's experiment grows the one data folder both use
    cfg["experiments"]["mha2mla"]["overrides"] = {"dkv32": {"steps": 3 * t["steps"]}}
    cfg = validated(cfg)
    assert train_tokens(cfg, "smollm2-135m") == train_tokens(cfg, "smollm2-135m-mha") == 3 * base
    cfg["data"]["max_tokens"] = 3 * base - 1
    errors = budget_errors(cfg)
    assert errors and errors[0][0] == "data.max_tokens" and "'smollm2-135m'" in errors[0][1]
    assert "experiments.mha2mla dkv32" in errors[0][1]


def test_calibration_samples_count_as_training_blocks_where_a_variant_converts():
    """Every conversion reads the calibration pass (2-norm scores, input covariances); a model with only
    the baseline has none."""
    cfg = load("configs/smoke.yaml")  # tiny-mha derives from tiny-gqa: the same data
    cfg["calibrate"]["samples"] = 500  # more blocks than 4 steps x 2 sequences
    length = cfg["data"]["block_length"]
    assert train_tokens(validated(cfg), "tiny-mha") == 500 * length
    for exp in cfg["experiments"].values():
        exp["d_kv"] = []                # baselines only: no conversion, no calibration
    assert train_tokens(validated(cfg), "tiny-mha") == 4 * 2 * length
    cfg["experiments"]["mha2mla"]["variants"] = {"rope-only": {"svd": "none", "rope_strategy": "uniform"}}
    assert train_tokens(validated(cfg), "tiny-gqa") == 500 * length


def test_validation_budget_is_the_configured_one():
    cfg = load("configs/smoke.yaml")
    cfg["data"]["validation_tokens"] = 12_345
    assert validation_tokens(validated(cfg), "tiny-mha") == 12_345


def test_cap_below_the_need_stops_snakemake_before_any_job(tmp_path):
    cfg = load("configs/paper.yaml")
    cfg["data"]["max_tokens"] = 7_000_000_000
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(cfg))
    work = tmp_path / "work"
    work.mkdir()
    r = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "-d", str(work),
                        "-n", "--cores", "1", "--configfile", str(bad)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    err = r.stdout + r.stderr
    assert r.returncode != 0
    assert "config key 'data.max_tokens'" in err and "12,582,912,000" in err, err[-2000:]
    assert "Job stats" not in err and not (work / "results").exists()
