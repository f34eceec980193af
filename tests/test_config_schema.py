"""The workflow config schema as the package applies it (the same validator common.smk uses)."""
import pytest
import yaml

from mla.study.config_schema import config_problems, dotted_key, schema_problems, validated


def _default_config():
    with open("config.yaml") as f:
        return yaml.safe_load(f)


def test_defaults_are_filled_without_touching_the_input():
    cfg = _default_config()
    del cfg["train"]["seed"]
    out = validated(cfg)
    assert "seed" not in cfg["train"]  # the caller's dict is left alone
    assert isinstance(out["train"]["seed"], int)


def test_a_bad_value_is_named_by_its_dotted_key():
    cfg = _default_config()
    cfg["experiments"]["gqa2mla"]["d_kv"] = [8, "sixteen"]
    keys = [key for key, _ in schema_problems(cfg)]
    assert "experiments.gqa2mla.d_kv[1]" in keys
    with pytest.raises(ValueError, match=r"experiments\.gqa2mla\.d_kv\[1\]"):
        validated(cfg)


def test_dotted_key_of_the_top_level():
    assert dotted_key([]) == "<top level>"
    assert dotted_key(["train", "lr"]) == "train.lr"


def test_a_recipe_that_mla_train_would_refuse_is_named_before_any_job():
    cfg = _default_config()
    assert config_problems(cfg) == []
    cfg["train"].update(batch_size=6, micro_batch_size=4)  # not a multiple of micro batch (4) x ranks (1)
    cfg["experiments"]["gqa2mla"]["overrides"] = {"dkv16": {"steps": 4}}  # warmup 2 + decay 3 > 4 steps
    cfg["experiments"]["gqa2mla"]["train"] = {}
    problems = dict(config_problems(cfg))
    assert "not divisible by ranks x micro batch" in problems["train"]
    assert "exceed the 4 training steps" in problems["experiments.gqa2mla.overrides.dkv16"]


def test_the_workflow_recipe_becomes_mla_train_options():
    from mla.study.train_options import workflow_options
    from mla.training.config import parse_options

    train = validated(_default_config())["train"]
    options = workflow_options(dict(train, offload_optimizer=True, zero_stage=2, device="gpu"))
    assert options["global_batch"] == train["batch_size"] and options["clip"] == train["max_grad_norm"]
    assert list(workflow_options(dict(reversed(train.items())))) == list(options)  # one order: the params text
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]  # as the finetune rule writes them
    cfg = parse_options(["--model", "m", "--data", "d", "--out", "o", *argv])
    assert (cfg.offload, cfg.device, cfg.gradient_checkpointing) == (True, "cuda", False)
    assert (cfg.steps, cfg.lr, cfg.weight_decay, cfg.seed) == (train["steps"], train["lr"], train["weight_decay"],
                                                                train["seed"])
