"""The smoke workflow end to end with the local profile: every output appears, a second run does
nothing, and changing one d_kv's setting reruns only what depends on it."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"
SNAKEMAKE = [sys.executable, "-m", "snakemake"]
# each test job uses one core, so two jobs overlap their start-up (imports) on a 2-core machine
ONE_THREAD = ["--set-threads", *(f"{r}=1" for r in ("download", "data", "calibrate", "convert", "finetune",
                                                      "evaluate"))]


def snakemake(workdir: Path, *args: str, configfile: Path = SMOKE, timeout: int = 900):
    cmd = [*SNAKEMAKE, "-s", str(ROOT / "Snakefile"), "-d", str(workdir), "--configfile", str(configfile),
           "--profile", str(ROOT / "workflow/profiles/local"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def job_counts(output: str) -> dict[str, int]:
    """The 'Job stats' table Snakemake prints before running (rule -> number of jobs)."""
    block = output.split("Job stats:", 1)[1]
    counts = {}
    for line in block.splitlines()[3:]:
        m = re.match(r"^(\w+)\s+(\d+)$", line.strip())
        if not m:
            break
        counts[m.group(1)] = int(m.group(2))
    return counts


def planned_jobs(output: str) -> set[tuple[str, str]]:
    """(rule, wildcards) of every job in a dry run's listing."""
    jobs = set()
    for block in re.split(r"\n(?=\[.*\]\n(?:local)?rule )", output):
        m = re.search(r"^(?:local)?rule (\w+):", block, flags=re.M)
        if m:
            w = re.search(r"^\s+wildcards: (.*)$", block, flags=re.M)
            jobs.add((m.group(1), w.group(1) if w else ""))
    return jobs


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("smoke")
    r = snakemake(work, *ONE_THREAD)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:] + _failed_logs(work)
    return work, r


def _failed_logs(work: Path) -> str:
    return "".join(f"\n--- {p}\n{p.read_text()[-2000:]}" for p in sorted((work / "logs").rglob("*.log"))
                   if "Traceback" in p.read_text())


def test_smoke_workflow_produces_every_output(smoke_run):
    work, r = smoke_run
    cfg = yaml.safe_load(SMOKE.read_text())
    counts = job_counts(r.stdout + r.stderr)
    assert counts["finetune"] == sum(len(e["d_kv"]) + 1 for e in cfg["experiments"].values())
    assert counts["convert"] == sum(len(e["d_kv"]) for e in cfg["experiments"].values())
    res = work / "results"
    for name in ("loss.png", "loss.pdf"):
        assert (res / "figures" / name).stat().st_size > 1000
    assert (res / "figures/loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for e, exp in cfg["experiments"].items():
        assert (res / f"tables/{e}.csv").is_file() and (res / f"tables/{e}.md").is_file()
        variants = [f"dkv{d}" for d in exp["d_kv"]] + ["baseline"]
        table = (res / f"tables/{e}.md").read_text()
        for v in variants:
            rows = list(csv.DictReader((res / f"finetune/{e}/{v}/metrics.csv").open()))
            assert [int(row["step"]) for row in rows][-1] == cfg["train"]["steps"]
            assert all(float(row["loss"]) > 0 for row in rows)
            ev = json.loads((res / f"evaluate/{e}/{v}/eval.json").read_text())
            assert ev  # the evaluation JSON exists and is not empty
            assert (res / f"finetune/{e}/{v}/final/config.json").is_file()
        for d in exp["d_kv"]:
            conv = json.loads((res / f"convert/{e}/dkv{d}/conversion.json").read_text())
            assert conv["kv_elements_per_token_after"] < conv["kv_elements_per_token_before"]
            assert str(d) in table
    # every rule logged and the heavy ones benchmarked
    for rule in ("download", "data", "convert", "finetune", "evaluate", "plot", "table"):
        assert list((work / "logs" / rule).rglob("*.log")), rule
    for rule in ("download", "data", "convert", "finetune", "evaluate"):
        assert list((work / "benchmarks" / rule).rglob("*.tsv")), rule


def test_smoke_workflow_tracks_runs_in_mlflow(smoke_run):
    from mlflow.tracking import MlflowClient

    work, _ = smoke_run
    cfg = yaml.safe_load(SMOKE.read_text())
    client = MlflowClient(tracking_uri=f"sqlite:///{work}/results/mlflow.db")
    exp = client.get_experiment_by_name(cfg["mlflow"]["experiment"])
    assert exp is not None
    runs = client.search_runs([exp.experiment_id], max_results=100)
    by_name = {run.info.run_name: run for run in runs}
    for e, ex in cfg["experiments"].items():
        for v in [f"dkv{d}" for d in ex["d_kv"]] + ["baseline"]:
            info = json.loads((work / f"results/finetune/{e}/{v}/run.json").read_text())
            run = client.get_run(info["mlflow_run_id"])
            assert run.info.run_name in by_name and run.info.run_name.startswith(f"{e}-{v}-")
            assert run.data.tags.get("snakemake_rule") == "finetune"
            history = client.get_metric_history(run.info.run_id, "loss")
            assert sorted(m.step for m in history) == list(range(1, cfg["train"]["steps"] + 1))
            assert "eval/perplexity" in run.data.metrics  # the evaluation was logged to the same run


def test_report_holds_the_figure_and_the_tables(smoke_run, tmp_path):
    work, _ = smoke_run
    report = tmp_path / "report.zip"
    r = snakemake(work, "--report", str(report))
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    import zipfile

    names = zipfile.ZipFile(report).namelist()
    assert any(n.endswith("loss.png") for n in names), names
    cfg = yaml.safe_load(SMOKE.read_text())
    for e in cfg["experiments"]:
        assert any(n.endswith(f"{e}.csv") for n in names), names
    assert any(n.endswith("report.html") for n in names)


def test_second_run_does_nothing_and_a_changed_d_kv_reruns_only_its_jobs(smoke_run, tmp_path):
    work, _ = smoke_run
    again = snakemake(work, "-n")
    assert again.returncode == 0
    assert "Nothing to be done" in again.stdout + again.stderr, (again.stdout + again.stderr)[-3000:]

    cfg = yaml.safe_load(SMOKE.read_text())
    exp_name = "gqa2mla"
    d_kv = cfg["experiments"][exp_name]["d_kv"][0]
    cfg["experiments"][exp_name]["overrides"] = {f"dkv{d_kv}": {"r": 2}}
    changed = tmp_path / "changed.yaml"
    changed.write_text(yaml.safe_dump(cfg))
    untouched = {p: p.stat().st_mtime_ns for p in (work / "results/finetune").rglob("metrics.csv")}

    plan = snakemake(work, "-n", configfile=changed)
    assert plan.returncode == 0, plan.stderr[-3000:]
    jobs = planned_jobs(plan.stdout + plan.stderr)
    wild = f"experiment={exp_name}, d_kv={d_kv}"
    var = f"experiment={exp_name}, variant=dkv{d_kv}"
    assert jobs == {("convert", wild), ("finetune", var), ("evaluate", var),
                    ("table", f"experiment={exp_name}"), ("plot", ""), ("all", "")}, jobs

    rerun = snakemake(work, *ONE_THREAD, configfile=changed)
    assert rerun.returncode == 0, (rerun.stdout + rerun.stderr)[-4000:]
    counts = job_counts(rerun.stdout + rerun.stderr)
    assert counts == {"convert": 1, "finetune": 1, "evaluate": 1, "table": 1, "plot": 1, "all": 1, "total": 6}
    for p, mtime in untouched.items():
        rerun_expected = p.parent.name == f"dkv{d_kv}" and p.parent.parent.name == exp_name
        assert (p.stat().st_mtime_ns != mtime) == rerun_expected, p
    conv = json.loads((work / f"results/convert/{exp_name}/dkv{d_kv}/conversion.json").read_text())
    assert conv["r"] == 2  # the new setting reached the conversion

