"""`train.span` in the workflow: joined blocks per training sequence change every run (baselines too) and the
data budget, reach `mla train` as --span, and leave the recipe keys of span 1 where they were."""

from __future__ import annotations

from pathlib import Path

import yaml

from mla.study import experiments
from mla.study.budgets import needs, train_tokens
from mla.study.config_schema import config_problems, validated
from mla.study.train_options import workflow_options
from mla.training.config import parse_options

ROOT = Path(__file__).resolve().parents[1]


def smoke() -> dict:
    return yaml.safe_load((ROOT / "configs" / "smoke.yaml").read_text())


def runs(cfg: dict) -> dict[str, str]:
    return {f"{v.experiment}/{v.name}": v.run_dir for v in experiments.Study(validated(cfg)).variants}


def test_span_one_keeps_the_recipe_keys_and_a_longer_span_changes_every_run():
    before = runs(smoke())
    one = smoke()
    one["train"]["span"] = 1
    assert runs(one) == before
    four = smoke()
    four["train"]["span"] = 4
    assert not set(runs(four).values()) & set(before.values())   # the baselines' too: one recipe for all curves


def test_span_reaches_mla_train_and_the_data_budget():
    cfg = smoke()
    cfg["train"].update(span=4, batch_size=1, micro_batch_size=1)
    valid = validated(cfg)
    v = next(v for v in experiments.Study(valid).variants if v.name == "dkv8")
    options = workflow_options(v.train)
    assert options["span"] == 4
    parsed = parse_options(["--model", "m", "--data", "d", "--out", "o",
                            *[f"--{k.replace('_', '-')}={val}" for k, val in options.items()]])
    assert (parsed.span, parsed.global_batch) == (4, 1)
    t, length = valid["train"], valid["data"]["block_length"]
    model = valid["experiments"]["gqa2mla"]["model"]
    run_needs = {tokens for tokens, why in needs(valid, model) if "steps x" in why}
    assert run_needs == {t["steps"] * 1 * 4 * length}
    assert train_tokens(valid, model) >= t["steps"] * 4 * length
    plain = workflow_options(next(v for v in experiments.Study(validated(smoke())).variants if v.name == "dkv8").train)
    assert "span" not in plain


def test_a_span_per_experiment_and_a_bad_span_named_by_key():
    cfg = smoke()
    cfg["experiments"]["gqa2mla"]["train"] = {"span": 2}
    study = experiments.Study(validated(cfg))
    spans = {f"{v.experiment}/{v.name}": v.train.get("span", 1) for v in study.variants}
    assert {s for name, s in spans.items() if name.startswith("gqa2mla/")} == {2}
    assert {s for name, s in spans.items() if name.startswith("mha2mla/")} == {1}
    cfg["train"]["span"] = 0
    assert "train.span" in dict(config_problems(cfg))
