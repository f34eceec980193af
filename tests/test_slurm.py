"""The smoke workflow on a real one-node SLURM cluster (munged + slurmctld + slurmd on localhost,
started here from Debian's packages and stopped by PID at the end), through the repository's
slurm profile: every job must run as a SLURM job and complete.

CI installs the packages (.ci/run: apt-get install slurmctld slurmd slurm-client munge); the test
skips only when those binaries are absent or it is not root."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"
SCRIPT = ROOT / "scripts" / "slurm-local.sh"
BINARIES = ["munged", "mungekey", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "srun", "scontrol"]
MISSING = [b for b in BINARIES if shutil.which(b) is None]
WORKFLOW_TIMEOUT = 780  # hard limit (s) of the whole workflow run; killed with SIGKILL after it

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.timeout(960),
    pytest.mark.skipif(bool(MISSING), reason=f"SLURM binaries not installed: {', '.join(MISSING)} "
                       "(apt-get install slurmctld slurmd slurm-client munge)"),
    pytest.mark.skipif(os.geteuid() != 0, reason="a local SLURM cluster needs root (slurmd, munge user)"),
]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def cluster():
    # not under pytest's tmp folders: those are private to root, and munged runs as user munge
    state = Path(tempfile.mkdtemp(prefix="mla-slurm-"))
    env = {**os.environ, "SLURM_LOCAL_CPUS": "4", "SLURM_LOCAL_MEM_MB": "12000"}
    start = subprocess.run(["bash", str(SCRIPT), "start", str(state)], capture_output=True, text=True,
                           timeout=120, env=env)
    pids = {}
    try:
        assert start.returncode == 0, start.stdout + start.stderr
        for name, f in (("munged", "munge/munged.pid"), ("slurmctld", "slurmctld.pid"), ("slurmd", "slurmd.pid")):
            pids[name] = int((state / f).read_text())
            assert pid_alive(pids[name]), name
        yield state, {**os.environ, "SLURM_CONF": str(state / "slurm.conf")}
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop", str(state)], timeout=60)
        for name, pid in pids.items():
            for _ in range(50):
                if not pid_alive(pid):
                    break
                time.sleep(0.2)
            else:  # the script failed to stop it: do it here, by PID
                os.kill(pid, 9)
        assert not any(pid_alive(p) for p in pids.values())
        shutil.rmtree(state, ignore_errors=True)


def test_profile_status_checks_work_without_accounting():
    profile = yaml.safe_load((ROOT / "workflow/profiles/slurm/config.yaml").read_text())
    assert profile["executor"] == "slurm"
    # sacct (the plugin's default) fails without slurmdbd and Snakemake would wait forever
    assert profile["slurm-status-command"] == "squeue"
    assert "cpus_per_task" not in profile["default-resources"]  # would override every rule's threads


def test_profile(tmp_path: Path) -> Path:
    """The repository's slurm profile, with resources scaled down to this one small node."""
    profile = yaml.safe_load((ROOT / "workflow/profiles/slurm/config.yaml").read_text())
    profile.update({"jobs": 4, "latency-wait": 5, "retries": 0, "slurm-init-seconds-before-status-checks": 5,
                    "slurm-keep-successful-logs": True})
    profile["default-resources"].update({"runtime": 20, "mem_mb": 1500})
    profile["default-resources"].pop("slurm_partition", None)  # the cluster's default partition
    profile["set-resources"] = {rule: {"runtime": 20, "mem_mb": 1500} for rule in profile["set-resources"]}
    profile["set-threads"] = {rule: 1 for rule in profile["set-threads"]}
    folder = tmp_path / "profile"
    folder.mkdir()
    (folder / "config.yaml").write_text(yaml.safe_dump(profile))
    return folder


test_profile.__test__ = False  # a helper, not a test


def squeue_jobs(env) -> dict[str, tuple[str, str]]:
    """SLURM job id -> (state, comment) of every job the controller still remembers (MinJobAge=600)."""
    out = subprocess.run(["squeue", "-h", "--states=all", "-o", "%i|%T|%k"], capture_output=True, text=True,
                         env=env, check=True).stdout
    return {i: (s, c) for i, s, c in (line.split("|", 2) for line in out.splitlines() if line)}


def test_smoke_workflow_runs_every_job_on_slurm(cluster, tmp_path):
    state, env = cluster
    before = set(squeue_jobs(env))
    work = tmp_path / "work"
    work.mkdir()
    cmd = ["timeout", "-s", "KILL", str(WORKFLOW_TIMEOUT), sys.executable, "-m", "snakemake",
           "-s", str(ROOT / "Snakefile"), "-d", str(work), "--configfile", str(SMOKE),
           "--profile", str(test_profile(tmp_path))]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**env, "OMP_NUM_THREADS": "1"},
                       timeout=WORKFLOW_TIMEOUT + 30)
    out = r.stdout + r.stderr
    ctld_log = (state / "log/slurmctld.log").read_text()
    assert r.returncode == 0, f"rc={r.returncode}\n{out[-6000:]}\n--- slurmctld.log\n{ctld_log[-3000:]}"

    # jobs Snakemake planned (all but the local target rule `all`)
    stats = out.split("Job stats:", 1)[1]
    planned = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", stats, flags=re.M)
               if m.group(1) not in ("all", "total")}
    assert planned.get("finetune") and planned.get("convert")

    # every one of them is a SLURM job that completed, named by the plugin's comment rule_<rule>_...
    jobs = {i: v for i, v in squeue_jobs(env).items() if i not in before}
    states = {i: s for i, (s, _) in jobs.items()}
    assert set(states.values()) == {"COMPLETED"}, states
    per_rule: dict[str, int] = {}
    for _, comment in jobs.values():
        m = re.match(r"rule_(\w+?)_wildcards_", comment) or re.match(r"rule_(\w+)$", comment)
        assert m, comment
        per_rule[m.group(1)] = per_rule.get(m.group(1), 0) + 1
    assert per_rule == planned, (per_rule, planned)

    # the controller's job-completion record agrees, and each job left its SLURM log (kept on success)
    record = (state / "log/jobcomp.txt").read_text()
    for job_id in jobs:
        assert re.search(rf"JobId={job_id} .*JobState=COMPLETED", record), job_id
    logs = {p.stem for p in (work / ".snakemake/slurm_logs").rglob("*.log")}
    assert set(jobs) <= logs

    # the outputs exist, and the training runs were tracked from inside their SLURM jobs
    assert (work / "results/figures/loss.png").stat().st_size > 1000
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{work}/results/mlflow.db")
    run_files = list((work / "results/finetune").rglob("run.json"))
    assert len(run_files) == planned["finetune"]
    for f in run_files:
        tags = client.get_run(json.loads(f.read_text())["mlflow_run_id"]).data.tags
        assert tags.get("slurm_job_id") in jobs, (f, tags.get("slurm_job_id"))
