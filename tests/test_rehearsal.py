"""The paper's configuration rehearsed offline: the overlay changes sizes only, the paper config still
plans the paper's jobs, the Hub stand-in serves `mla download` offline, and `scripts/paper-rehearsal`
runs the whole DAG and checks it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import rehearsal  # scripts/rehearsal.py (tests/conftest.py puts scripts/ on the path)
import yaml

from mla.sources import sha256_of
from mla.study import budgets, experiments

ROOT = Path(__file__).resolve().parents[1]
PAPER = ROOT / "configs/paper.yaml"
OVERLAY = ROOT / "configs/paper-rehearsal.yaml"
SNAKEMAKE = [sys.executable, "-m", "snakemake"]

# What the overlay may change: sizes (model names and experiment names as *), nothing that picks a code path.
SIZE_KEYS = {
    "models.*.block_length",
    "data.block_length", "data.max_tokens", "data.validation_tokens",
    "data.validation_fraction",          # a share of documents: 0.001 of billions of tokens, more of a tiny mirror
    "calibrate.samples",
    "experiments.*.d_kv", "experiments.*.r",  # latent sizes and kept RoPE pairs scale with the head dim
    "experiments.*.train.steps", "experiments.*.train.batch_size", "experiments.*.train.micro_batch_size",
    "experiments.*.train.nproc", "experiments.*.train.warmup_steps", "experiments.*.train.decay_steps",
    "experiments.*.overrides.*.steps", "experiments.*.overrides.*.r",
    "train.steps", "train.batch_size", "train.micro_batch_size", "train.nproc", "train.warmup_steps",
    "train.decay_steps", "train.save_steps",
    "evaluate.perplexity_blocks", "evaluate.paper_limit", "evaluate.local_docs", "evaluate.kv_new_tokens",
    "evaluate.decode_grid", "evaluate.decode_steps", "evaluate.mmlu",
    "evaluate.kv_group_size.default", "evaluate.kv_group_size.smollm-135m", "evaluate.kv_residual",
    "evaluate.kv_scored", "evaluate.kv_blocks", "evaluate.needle_lengths", "evaluate.needle_samples",
    "evaluate.longbench_limit",
}
MACHINE_KEYS = {"train.device", "calibrate.device", "evaluate.device"}
NAMED = ("models", "experiments", "overrides")  # their keys are names, matched by *


def leaf_keys(node: dict, path: tuple = ()) -> list[tuple]:
    keys = []
    for k, v in node.items():
        here = (*path, k)
        keys += leaf_keys(v, here) if isinstance(v, dict) else [here]
    return keys


def pattern(key: tuple) -> str:
    return ".".join("*" if i and key[i - 1] in NAMED else part for i, part in enumerate(key))


def dry_run(workdir: Path, *configfiles: Path, extra=()) -> subprocess.CompletedProcess:
    cmd = [*SNAKEMAKE, "-s", str(ROOT / "Snakefile"), "-d", str(workdir), "-n", "-p", "--cores", "2",
           "--configfile", *map(str, configfiles), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def job_counts(out: str) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"^(\w+)\s+(\d+)$", out, flags=re.M)}


def test_overlay_changes_sizes_only():
    paper, overlay = yaml.safe_load(PAPER.read_text()), yaml.safe_load(OVERLAY.read_text())
    keys = leaf_keys(overlay)
    assert keys, "empty overlay"
    outside = sorted(".".join(k) for k in keys if pattern(k) not in SIZE_KEYS | MACHINE_KEYS)
    assert not outside, f"the rehearsal overlay changes more than sizes: {outside}"
    for section in ("models", "experiments"):  # no new model or experiment: the paper's own, shrunk
        assert set(overlay.get(section, {})) <= set(paper[section])
    assert {".".join(k) for k in keys} >= MACHINE_KEYS  # every job on the CPU


def test_overlay_keeps_the_papers_code_paths_at_tiny_size():
    cfg = rehearsal.load_config(PAPER, OVERLAY)
    paper = rehearsal.load_config(PAPER)
    for name, model in paper["models"].items():  # the same Hub sources, by repo id and revision
        assert {k: v for k, v in cfg["models"][name].items() if k != "block_length"} == \
            {k: v for k, v in model.items() if k != "block_length"}
    assert cfg["data"]["corpus"] == "smollm" and cfg["evaluate"]["paper_tasks"] == "auto"
    assert len({budgets.block_length(cfg, m) for m in cfg["models"]}) == 2  # per-model block lengths
    for ename, exp in cfg["experiments"].items():
        assert (exp["rope_strategy"], exp["svd"]) == ("2-norm", "joint")
        for v in experiments.experiment_variants(cfg, ename):
            t = v.train
            assert (t["precision"], t["zero_stage"]) == ("bf16", 2)
            assert t["nproc"] == 2 and t["batch_size"] // (t["micro_batch_size"] * t["nproc"]) >= 2  # accumulation
            assert t["save_steps"] < t["steps"]  # a resume checkpoint is written mid-run
    assert budgets.budget_errors(cfg) == []
    for m in cfg["models"]:  # the validation budget covers the perplexity blocks
        assert budgets.validation_tokens(cfg, m) >= cfg["evaluate"]["perplexity_blocks"] * budgets.block_length(cfg, m)


def test_overlay_plans_the_paper_dag_at_tiny_size(tmp_path):
    r = dry_run(tmp_path, PAPER, OVERLAY)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    out, cfg = r.stdout, rehearsal.load_config(PAPER, OVERLAY)
    counts = job_counts(out)
    exps = cfg["experiments"].values()
    assert counts["download"] == 2 and counts["data"] == 2 and counts["calibrate"] == 2
    assert counts["convert"] == sum(len(e["d_kv"]) for e in exps)
    assert counts["finetune"] == sum(len(e["d_kv"]) + 1 for e in exps)
    assert counts["evaluate"] == counts["finetune"] and counts["evaluate_original"] == 2  # + the two originals
    assert counts["evaluation_data"] == 1   # MMLU, the six tasks and LongBench fetched once, before the offline jobs
    assert "mla prefetch --out results/evaluation-data --mmlu --paper-tasks auto --longbench auto" in out
    evaluations = [line for line in out.splitlines() if " mla evaluate " in line]
    assert evaluations and all("HF_HUB_OFFLINE=1" in line and "--config " in line for line in evaluations)
    assert counts["evaluate_inference"] == counts["evaluate"] and counts["evaluate_inference_original"] == 2
    # the jobs read their settings from the config: LongBench runs offline in the inference job, from what
    # the prefetch staged (the rule's input), and the quality job reads MMLU and the six tasks from it too
    from mla.study import evaluation_jobs
    from mla.study.config_schema import validated

    checked = validated(cfg)
    for model in checked["models"]:
        inference = evaluation_jobs.settings(checked, model, "inference")
        assert (inference["longbench"], inference["longbench_limit"]) == ("auto", 2)
        for part in ("quality", "inference"):
            assert evaluation_jobs.settings(checked, model, part)["prefetched"] == evaluation_jobs.PREFETCH_MANIFEST
    jobs = re.split(r"\n(?=\[.*\]\n)", out)
    inference_jobs = [b for b in jobs if "rule evaluate_inference" in b]
    assert inference_jobs and all("results/evaluation-data/manifest.json" in b for b in inference_jobs)
    # two config files merge (no fallback to config.yaml's models) and sizes come from the overlay
    assert "smollm2-wheel" not in out and "--repo-id meta-llama/Llama-2-7b-hf" in out
    assert "--block-length 64" in out and "--block-length 32" in out
    finetunes = [line for line in out.splitlines() if " mla train " in line]
    assert finetunes and all("--nproc 2 " in line and "--precision bf16" in line and "--zero-stage 2" in line
                             for line in finetunes)


def test_paper_config_still_plans_the_papers_jobs(tmp_path):
    r = dry_run(tmp_path, PAPER)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    out = r.stdout
    counts = job_counts(out)
    assert (counts["download"], counts["data"], counts["calibrate"]) == (2, 2, 2)
    assert (counts["convert"], counts["finetune"], counts["evaluate"], counts["evaluate_original"]) == (6, 8, 8, 2)
    cfg = rehearsal.load_config(PAPER)
    for ename, exp in cfg["experiments"].items():
        for v in experiments.experiment_variants(cfg, ename):
            t = v.train
            line = next(li for li in out.splitlines() if f"--out {v.run_dir} " in li)
            assert ("--steps 12000 " in line and f"--global-batch {t['batch_size']} " in line
                    and f"--micro-batch {t['micro_batch_size']} " in line and f"--nproc {t['nproc']} " in line
                    and "--precision bf16" in line and "--zero-stage 2" in line), line
            if not v.is_baseline:
                assert (f"--out {v.convert_dir} --rope-strategy 2-norm --svd joint --d-kv {v.d_kv} --r {exp['r']}"
                        f" --scores results/calibrate/{v.model}/scores.pt") in out
    # the data of each model holds exactly what its runs consume (12.6B and 1.57B tokens)
    data = {m: next(li for li in out.splitlines() if " mla data " in li and f"--out results/data/{m} " in li)
            for m in ("llama2-7b", "smollm-135m")}
    assert "--block-length 4096" in data["llama2-7b"] and "--train-tokens 12582912000" in data["llama2-7b"]
    assert "--block-length 2048" in data["smollm-135m"] and "--train-tokens 1572864000" in data["smollm-135m"]


def test_rehearsal_cap_below_its_need_is_refused(tmp_path):
    need = budgets.train_tokens(rehearsal.load_config(PAPER, OVERLAY), "llama2-7b")
    cap = tmp_path / "cap.yaml"
    cap.write_text(yaml.safe_dump({"data": {"max_tokens": need - 1}}))
    r = dry_run(tmp_path / "w", PAPER, OVERLAY, cap)
    assert r.returncode != 0
    err = r.stdout + r.stderr
    assert "config key 'data.max_tokens'" in err and f"{need:,}" in err, err[-2000:]
    assert "Job stats" not in err


def test_hub_cache_serves_mla_download_offline(tmp_path):
    snapshots = rehearsal.write_model_cache(tmp_path / "hf", yaml.safe_load(PAPER.read_text()), tmp_path / "build")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    paper = yaml.safe_load(PAPER.read_text())["models"]
    for name, model in paper.items():
        out = tmp_path / "models" / name
        r = subprocess.run([sys.executable, "-m", "mla", "download", "--source", "hub", "--repo-id", model["repo_id"],
                            "--revision", model["revision"], "--out", str(out)],
                           capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        config = json.loads((out / "config.json").read_text())
        mha = config["num_key_value_heads"] == config["num_attention_heads"]
        assert mha == (name == "llama2-7b")  # Llama-2-7B is MHA, SmolLM-135M is GQA
        assert config["dtype"] == rehearsal.HUB_DTYPES[model["repo_id"]]
        for f in ("model.safetensors", "tokenizer.json"):
            assert sha256_of(out / f) == sha256_of(snapshots[name] / f)
    # a revision the cache does not hold stops with one line naming the repo, offline
    r = subprocess.run([sys.executable, "-m", "mla", "download", "--source", "hub", "--repo-id",
                        "HuggingFaceTB/SmolLM-135M", "--revision", "v0.0-missing", "--out", str(tmp_path / "x")],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 2 and "HuggingFaceTB/SmolLM-135M@v0.0-missing" in r.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_paper_rehearsal_runs_and_checks_the_whole_dag(tmp_path):
    work = tmp_path / "rehearsal"
    r = subprocess.run([str(ROOT / "scripts/paper-rehearsal"), str(work)], capture_output=True, text=True,
                       timeout=1700, env={**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    assert "paper-rehearsal: passed" in r.stdout
    # the checker is not vacuous: a paper task skipped in one evaluation fails it, naming the file
    baseline = experiments.experiment_variants(rehearsal.load_config(PAPER, OVERLAY), "gqa2mla")[-1]
    ev = work / baseline.eval_path
    result = json.loads(ev.read_text())
    result["benchmarks"]["paper"] = {"status": "skipped", "reason": "HF_HUB_OFFLINE is set"}
    ev.write_text(json.dumps(result))
    problems = rehearsal.check_outputs(work)
    assert len(problems) == 1 and baseline.eval_path in problems[0] and "skipped" in problems[0]


def test_paper_rehearsal_exits_nonzero_with_the_reason(tmp_path):
    # stand-ins that lack the models (an empty Hugging Face cache): the first download fails offline
    work = tmp_path / "rehearsal"
    work.mkdir()
    (work / "stand-ins.json").write_text(json.dumps({"HF_HOME": str(tmp_path / "empty-hf"), "HF_HUB_OFFLINE": "1",
                                                     "HF_DATASETS_OFFLINE": "1"}))
    r = subprocess.run([str(ROOT / "scripts/paper-rehearsal"), str(work), "--cores", "1"], capture_output=True,
                       text=True, timeout=600, env={**os.environ, "PYTHON": sys.executable})
    assert r.returncode == 1, (r.stdout + r.stderr)[-3000:]
    assert "paper-rehearsal: error: snakemake exited with status" in r.stderr
    assert "cannot download" in r.stdout + r.stderr  # the failed job's log, shown by --show-failed-logs
    assert not (work / "results/evaluate").exists()
