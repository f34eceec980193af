"""Running the smoke workflow from the tests: the command, the plan it prints, and copies of a finished run.

One finished smoke run (local profile) is made per test session (conftest.py's `finished_smoke`); tests
that only plan (dry runs) use it as it is, tests that run jobs again work on a copy (`copy_run`), and the
SLURM tests reuse its outputs where they only check scheduling."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"
SNAKEMAKE = [sys.executable, "-m", "snakemake"]
# each test job uses one core, so two jobs overlap their start-up (imports) on a 2-core machine
ONE_THREAD = ["--set-threads", *(f"{r}=1" for r in ("download", "data", "calibrate", "convert", "fit", "finetune",
                                                      "evaluate", "evaluate_inference", "export", "serve_bench"))]


def smoke_config() -> dict:
    return yaml.safe_load(SMOKE.read_text())


def smoke_study(cfg: dict | None = None):
    """Variants of the smoke config (or `cfg`) with the paths the workflow gives their jobs (mla.study.experiments)."""
    from mla.study import experiments
    from mla.study.config_schema import validated

    return experiments.Study(validated(cfg or smoke_config()))


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))   # the order of experiments is the figure's panels
    return path


# a hang guard, not a speed limit: on a loaded 2-core machine the smoke run's ~28 jobs take up to ~40 minutes
TIMEOUT = 3600


def snakemake(workdir: Path, *args: str, configfile: Path = SMOKE, timeout: int = TIMEOUT, env: dict | None = None):
    cmd = [*SNAKEMAKE, "-s", str(ROOT / "Snakefile"), "-d", str(workdir), "--configfile", str(configfile),
           "--profile", str(ROOT / "workflow/profiles/local"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
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


def failed_logs(work: Path) -> str:
    return "".join(f"\n--- {p}\n{p.read_text()[-2000:]}" for p in sorted((work / "logs").rglob("*.log"))
                   if "Traceback" in p.read_text())


def run_smoke(work: Path) -> subprocess.CompletedProcess:
    r = snakemake(work, *ONE_THREAD)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:] + failed_logs(work)
    return r


def copy_run(work: Path, to: Path) -> Path:
    """A copy of a finished workflow folder (outputs, logs, Snakemake's records, MLflow store; mtimes kept),
    for a test that runs jobs again without changing the session's run."""
    shutil.copytree(work, to, symlinks=True, ignore=shutil.ignore_patterns("locks", "incomplete"))
    return to
