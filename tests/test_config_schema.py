"""The workflow config schema as the package applies it (the same validator common.smk uses)."""
import pytest
import yaml

from mla.config_schema import dotted_key, schema_problems, validated


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
