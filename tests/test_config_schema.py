"""The workflow's configuration: the JSON schema, the shipped configs, and bad configs that must stop
Snakemake before any job with a message naming the offending key."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = yaml.safe_load((ROOT / "workflow/schemas/config.schema.yaml").read_text())
SNAKEMAKE = [sys.executable, "-m", "snakemake"]
CONFIGS = ["config.yaml", "configs/paper.yaml", "configs/smoke.yaml"]


def walk_objects(schema, path="config"):
    """Yield (path, subschema) for every schema node that describes an object with properties."""
    if not isinstance(schema, dict):
        return
    if "properties" in schema:
        yield path, schema
        for name, sub in schema["properties"].items():
            yield from walk_objects(sub, f"{path}.{name}")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk_objects(schema["additionalProperties"], f"{path}.*")


def test_schema_is_strict_and_documented():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    nodes = list(walk_objects(SCHEMA))
    assert len(nodes) >= 8
    for path, node in nodes:
        assert node.get("additionalProperties") is False, f"{path}: unknown keys must be rejected"
        for name, sub in node["properties"].items():
            assert sub.get("description"), f"{path}.{name} has no description"


@pytest.mark.parametrize("name", CONFIGS)
def test_shipped_configs_are_valid(name):
    cfg = yaml.safe_load((ROOT / name).read_text())
    jsonschema.Draft202012Validator(SCHEMA).validate(cfg)
    for exp in cfg["experiments"].values():
        assert exp["model"] in cfg["models"]


def test_every_key_of_the_default_config_is_commented():
    lines = (ROOT / "config.yaml").read_text().splitlines()
    uncommented = []
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)([A-Za-z0-9_-]+):", line)
        if not m:
            continue
        if "#" not in line and not (i > 0 and lines[i - 1].strip().startswith("#")):
            uncommented.append(line.strip())
    assert not uncommented, f"keys without a comment in config.yaml: {uncommented}"


def test_paper_config_numbers():
    cfg = yaml.safe_load((ROOT / "configs/paper.yaml").read_text())
    models = {m["repo_id"]: m for m in cfg["models"].values()}
    assert set(models) == {"meta-llama/Llama-2-7b-hf", "HuggingFaceTB/SmolLM-135M"}
    exps = {cfg["models"][e["model"]]["repo_id"]: e for e in cfg["experiments"].values()}
    assert exps["meta-llama/Llama-2-7b-hf"]["d_kv"] == [16, 32, 64] and exps["meta-llama/Llama-2-7b-hf"]["r"] == 8
    assert exps["HuggingFaceTB/SmolLM-135M"]["d_kv"] == [8, 16, 32] and exps["HuggingFaceTB/SmolLM-135M"]["r"] == 4
    t = cfg["train"]
    assert (t["steps"], t["lr"], t["precision"], t["zero_stage"]) == (12000, 1e-4, "bf16", 2)
    assert t["nproc"] > 1 and t["device"] == "gpu"
    # the paper's batch sizes (Table 4): 256 sequences for Llama-2-7B, 64 for SmolLM-135M
    assert exps["meta-llama/Llama-2-7b-hf"]["train"]["batch_size"] == 256
    assert exps["HuggingFaceTB/SmolLM-135M"]["train"]["batch_size"] == 64
    assert cfg["models"][exps["meta-llama/Llama-2-7b-hf"]["model"]]["block_length"] == 4096
    assert cfg["evaluate"]["paper_tasks"] == "auto"  # the six lm-eval tasks


def dry_run(workdir: Path, *args: str, configfile: Path | None = None) -> subprocess.CompletedProcess:
    cmd = [*SNAKEMAKE, "-s", str(ROOT / "Snakefile"), "-d", str(workdir), "-n", "--cores", "1", *args]
    if configfile:
        cmd += ["--configfile", str(configfile)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_paper_config_plans_the_full_dag(tmp_path):
    r = dry_run(tmp_path, "-p", "--profile", str(ROOT / "workflow/profiles/slurm"),
                configfile=ROOT / "configs/paper.yaml")
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    counts = dict(re.findall(r"^(\w+)\s+(\d+)$", out, flags=re.M))
    # 2 models from the Hub, data per tokenizer, 2-norm calibration per model, 3 + 3 conversions,
    # 3 + 3 converted runs + 2 baselines fine-tuned and evaluated (+ the 2 originals evaluated)
    assert counts["download"] == "2" and counts["data"] == "2" and counts["calibrate"] == "2"
    assert counts["convert"] == "6" and counts["finetune"] == "8"
    assert int(counts["evaluate"]) >= 8
    assert "--repo-id meta-llama/Llama-2-7b-hf" in out and "--repo-id HuggingFaceTB/SmolLM-135M" in out
    for d in (16, 32, 64):
        assert f"--out results/convert/mha2mla/dkv{d} --d-kv {d}" in out
    # several GPUs per training job: one launcher with --nproc N and a matching GPU request
    assert re.search(r"--nproc 8 .*--precision bf16|--precision bf16 .*--nproc 8", out)
    assert re.search(r"gpu=8", out)
    assert not (tmp_path / "results").exists()  # a dry run writes nothing


BAD_CASES = {
    # name: (mutation of the smoke config, key that the message must name)
    "unknown top-level key": (lambda c: c.update(trian={"steps": 3}), "trian"),
    "unknown nested key": (lambda c: c["train"].update(stpes=3), "stpes"),
    "wrong type": (lambda c: c["train"].update(steps="many"), "train.steps"),
    "d_kv zero": (lambda c: c["experiments"]["gqa2mla"].update(d_kv=[4, 0]), "experiments.gqa2mla.d_kv[1]"),
    "d_kv not an integer": (lambda c: c["experiments"]["gqa2mla"].update(d_kv=[4, 2.5]), "experiments.gqa2mla.d_kv[1]"),
    "missing model source": (lambda c: c["models"]["tiny-gqa"].pop("source"), "models.tiny-gqa"),
    "undefined model": (lambda c: c["experiments"]["mha2mla"].update(model="nope"), "experiments.mha2mla.model"),
    "override of an unknown variant": (lambda c: c["experiments"]["gqa2mla"].update(overrides={"dkv5": {"r": 2}}),
                                       "experiments.gqa2mla.overrides.dkv5"),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_invalid_config_stops_before_any_job(tmp_path, case):
    mutate, key = BAD_CASES[case]
    cfg = yaml.safe_load((ROOT / "configs/smoke.yaml").read_text())
    mutate(cfg)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(cfg))
    work = tmp_path / "work"
    work.mkdir()
    r = dry_run(work, configfile=bad)
    assert r.returncode != 0
    err = r.stdout + r.stderr
    assert "Invalid configuration" in err, err[-2000:]
    assert f"config key '{key}'" in err or (key in err and "config key" in err), err[-2000:]
    assert "rule download" not in err and "Job stats" not in err  # nothing was planned or run
    assert not (work / "results").exists()


def test_missing_source_message_names_the_property(tmp_path):
    cfg = yaml.safe_load((ROOT / "configs/smoke.yaml").read_text())
    del cfg["models"]["tiny-gqa"]["source"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(cfg))
    r = dry_run(tmp_path, configfile=bad)
    assert "config key 'models.tiny-gqa': 'source' is a required property" in r.stdout + r.stderr
