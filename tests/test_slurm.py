"""The workflow on a real two-node SLURM cluster (munged + slurmctld + one slurmd per node on
localhost, started here from Debian's packages and stopped by PID at the end), through the repository's
slurm profile: a one-variant smoke study runs every rule, and each job of a cluster rule must run as a
SLURM job and complete. Then, on a copy of the session's finished smoke run (local profile, conftest.py:
these tests check scheduling, not the science again), a fine-tuning job with train.nodes: 2 runs as one
2-node SLURM job (srun: one torchrun per node, c10d rendezvous) with the losses of the 1-node run,
`mla train --nodes 2` in a 1-node job stops in one line, and the sbatch options of a 2-node GPU job are
those the executor plugin builds from the rule's resources.

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

from workflow_helpers import copy_run

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"
# every rule that runs as a cluster job (the others are localrules, run on the submitting host)
CLUSTER_RULES = {"download", "data", "calibrate", "convert", "finetune", "evaluate", "evaluate_inference"}
SCRIPT = ROOT / "scripts" / "slurm-local.sh"
BINARIES = ["munged", "mungekey", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "srun", "scontrol"]
MISSING = [b for b in BINARIES if shutil.which(b) is None]
WORKFLOW_TIMEOUT = 780  # hard limit (s) of the whole workflow run; killed with SIGKILL after it

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.slow,
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
    env = {**os.environ, "SLURM_LOCAL_NODES": "2", "SLURM_LOCAL_CPUS": "4", "SLURM_LOCAL_MEM_MB": "6000"}
    start = subprocess.run(["bash", str(SCRIPT), "start", str(state)], capture_output=True, text=True,
                           timeout=120, env=env)
    pids = {}
    try:
        assert start.returncode == 0, start.stdout + start.stderr
        for name, f in (("munged", "munge/munged.pid"), ("slurmctld", "slurmctld.pid"),
                        ("slurmd-node1", "slurmd-node1.pid"), ("slurmd-node2", "slurmd-node2.pid")):
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


def run_workflow(env, work: Path, profile: Path, configfile: Path, *targets: str) -> subprocess.CompletedProcess:
    cmd = ["timeout", "-s", "KILL", str(WORKFLOW_TIMEOUT), sys.executable, "-m", "snakemake",
           "-s", str(ROOT / "Snakefile"), "-d", str(work), "--configfile", str(configfile),
           "--profile", str(profile), *targets]
    return subprocess.run(cmd, capture_output=True, text=True, env={**env, "OMP_NUM_THREADS": "1"},
                          timeout=WORKFLOW_TIMEOUT + 30)


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    return test_profile(tmp_path_factory.mktemp("profile"))


@pytest.fixture(scope="module")
def slurm_run(cluster, profile, tmp_path_factory):
    """A one-variant smoke study (one job of every rule) through the profile: (workdir, result, jobs before it)."""
    state, env = cluster
    tmp = tmp_path_factory.mktemp("slurm")
    config = yaml.safe_load(SMOKE.read_text())
    config["experiments"] = {"gqa2mla": {**config["experiments"]["gqa2mla"], "d_kv": [8], "baseline": False}}
    configfile = tmp / "one-variant.yaml"
    configfile.write_text(yaml.safe_dump(config))
    before = set(squeue_jobs(env))
    work = tmp / "work"
    work.mkdir()
    return work, run_workflow(env, work, profile, configfile), before


@pytest.fixture(scope="module")
def smoke_copy(finished_smoke, tmp_path_factory):
    """A copy of the session's finished smoke run (local profile), for jobs rerun on the cluster."""
    return copy_run(finished_smoke[0], tmp_path_factory.mktemp("smoke-copy") / "work")


def test_every_rule_runs_as_a_slurm_job(cluster, slurm_run):
    state, env = cluster
    work, r, before = slurm_run
    out = r.stdout + r.stderr
    ctld_log = (state / "log/slurmctld.log").read_text()
    assert r.returncode == 0, f"rc={r.returncode}\n{out[-6000:]}\n--- slurmctld.log\n{ctld_log[-3000:]}"

    # jobs Snakemake planned, but the local rules (`all` and the bookkeeping of figures and tables run on
    # the submitting host, not as cluster jobs)
    stats = out.split("Job stats:", 1)[1]
    planned = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", stats, flags=re.M)
               if m.group(1) not in ("all", "total", "plot", "table", "evaluation_data")}
    assert planned == dict.fromkeys(CLUSTER_RULES, 1), planned
    assert all(f"localrule {rule}:" in out for rule in ("plot", "table", "evaluation_data"))

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


def smoke_variant(experiment: str, name: str, config: dict | None = None):
    """A variant of the smoke config (or `config`), with the paths the workflow gives its jobs (mla.study.experiments)."""
    from mla.study import experiments
    from mla.study.config_schema import validated

    cfg = validated(config or yaml.safe_load(SMOKE.read_text()))
    return next(v for v in experiments.experiment_variants(cfg, experiment) if v.name == name)


def scontrol_job(job_id: str, env) -> dict:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, env=env,
                         check=True).stdout
    return dict(item.split("=", 1) for item in out.split() if "=" in item)


def test_two_node_finetune_is_one_slurm_job_with_the_losses_of_one_node(cluster, profile, smoke_copy, tmp_path):
    """train.nodes: 2 (x nproc 1, micro batch 1: the smoke run's global batch 2), the finetune job forced (launch
    settings alone replan nothing: tests/test_workflow.py), runs as one SLURM job on two nodes."""
    state, env = cluster
    work = smoke_copy
    v8 = smoke_variant("gqa2mla", "dkv8")
    target = v8.run_dir
    log_path = work / "logs/finetune" / v8.model / v8.start / f"{v8.recipe}.log"
    one_node = [float(r["loss"]) for r in csv.DictReader(open(work / target / "metrics.csv"))]

    config = yaml.safe_load(SMOKE.read_text())
    config["train"].update(nodes=2, micro_batch_size=1)
    configfile = tmp_path / "two-nodes.yaml"
    configfile.write_text(yaml.safe_dump(config))
    before = set(squeue_jobs(env))
    r = run_workflow(env, work, profile, configfile, f"{target}/run.json", "--forcerun", f"{target}/run.json")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:] + log_path.read_text()[-3000:]

    # one SLURM job for the run, on both nodes, one task (launcher) per node
    jobs = {i: c for i, (_, c) in squeue_jobs(env).items() if i not in before}
    [(job_id, comment)] = jobs.items()
    assert comment.startswith(f"rule_finetune_wildcards_{v8.model}_{v8.start}_{v8.recipe}"), comment
    record = scontrol_job(job_id, env)
    assert record["JobState"] == "COMPLETED"
    assert (record["NumNodes"], record["NumTasks"], record["NodeList"]) == ("2", "2", "node[1-2]"), record

    # inside: srun started one torchrun per node, ranks 0 and 1 ran on different nodes
    log = log_path.read_text()
    assert f"srun --jobid={job_id} --overlap --nodes=2 --ntasks=2 --ntasks-per-node=1" in log
    nodes = sorted(m.group(1) for m in re.finditer(r"rank \d+ on (\S+) holds", log))
    assert nodes == ["node1", "node2"], log[-3000:]
    info = json.loads((work / target / "run.json").read_text())
    assert info["world_size"] == 2 and info["config"]["nodes"] == 2
    two_nodes = [float(r["loss"]) for r in csv.DictReader(open(work / target / "metrics.csv"))]
    assert len(two_nodes) == len(one_node) and max(abs(a - b) for a, b in zip(one_node, two_nodes)) <= 1e-5
    assert list((work / f"results/checkpoints/{v8.model}/{v8.start}/{v8.recipe}").iterdir()) == []  # deleted after success


def test_nodes_the_job_does_not_have_stop_in_one_line(cluster, finished_smoke, tmp_path):
    state, env = cluster
    work, _ = finished_smoke
    out = tmp_path / "job.out"
    train = (f"{sys.executable} -m mla train --model {work}/{smoke_variant('gqa2mla', 'dkv8').convert_dir} "
             f"--data {work}/results/data/tiny-gqa --out {tmp_path}/run --nodes 2 --no-mlflow")
    job_id = subprocess.run(["sbatch", "--parsable", "--nodes=1", "--ntasks=1", "--mem=500", "-o", str(out),
                             "--wrap", train], capture_output=True, text=True, env=env, check=True).stdout.strip()
    for _ in range(300):
        if squeue_jobs(env).get(job_id, ("PENDING",))[0] in ("COMPLETED", "FAILED"):
            break
        time.sleep(0.5)
    lines = out.read_text().strip().splitlines()
    assert lines[-1] == (f"mla train: error: --nodes 2 (train.nodes): SLURM job {job_id} has 1 node(s); submit it "
                         "with --nodes=2 (the workflow's finetune rule does) or set train.nodes to 1"), lines
    assert squeue_jobs(env)[job_id][0] == "FAILED"
    assert not (tmp_path / "run").exists()


def finetune_job_of_dry_run(env, tmp_path, train: dict):
    """The finetune job (threads and resources) Snakemake plans for the smoke config with `train` changes,
    through the repository's slurm profile (--cores 64: threads are not capped by this small machine)."""
    from types import SimpleNamespace

    config = yaml.safe_load(SMOKE.read_text())
    config["train"].update(train)
    configfile = tmp_path / "config.yaml"
    configfile.write_text(yaml.safe_dump(config))
    r = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "-d", str(tmp_path / "w"),
                        "--configfile", str(configfile), "--profile", str(ROOT / "workflow/profiles/slurm"), "-n",
                        "--cores", "64", f"{smoke_variant('gqa2mla', 'dkv8', config).run_dir}/run.json"],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    block = (r.stdout + r.stderr).split("rule finetune:", 1)[1]
    resources = dict(kv.split("=", 1) for kv in re.search(r"resources: (.*)", block).group(1).split(", "))

    class Resources(dict):
        __getattr__ = dict.get

    return SimpleNamespace(resources=Resources({k: int(v) if v.isdigit() else v for k, v in resources.items()}),
                           threads=int(re.search(r"threads: (\d+)", block).group(1)))


def test_sbatch_options_of_a_two_node_gpu_job(cluster, tmp_path):
    """The executor plugin's own sbatch builder on the finetune job's resources, as Snakemake evaluates them
    for train.nodes: 2 x nproc 8 GPUs (dry run: no GPU is needed to build the command)."""
    from snakemake_executor_plugin_slurm.submit_string import get_submit_command
    from snakemake_executor_plugin_slurm.utils import set_gres_string

    state, env = cluster
    params = {"run_uuid": "u", "slurm_logfile": "log", "comment_str": "rule_finetune", "account": "",
              "partition": "", "workdir": str(tmp_path)}
    job = finetune_job_of_dry_run(env, tmp_path, dict(nodes=2, nproc=8, device="gpu", micro_batch_size=1,
                                                      batch_size=16))
    call = get_submit_command(job, params) + set_gres_string(job)
    assert "--nodes=2" in call and "--gres=gpu:8" in call, call  # 8 GPUs on each of the 2 nodes
    assert "--gpus=" not in call and "--ntasks-per-gpu" not in call, call  # neither a job total nor 16 tasks
    assert "--cpus-per-task=32" in call, call  # the profile's finetune threads, for the launcher of each node
    assert job.resources["torch_threads"] == 4  # 32 cores / 8 processes
    # one node, as before: --gpus=nproc
    job = finetune_job_of_dry_run(env, tmp_path, dict(nodes=1, nproc=8, device="gpu", micro_batch_size=1,
                                                      batch_size=8))
    call = get_submit_command(job, params) + set_gres_string(job)
    assert "--nodes=1" in call and "--gpus=8" in call, call
    assert "--gres" not in call and "--ntasks-per-gpu" not in call, call


def _seconds(text: str) -> int:
    """SLURM durations: [D-]HH:MM:SS or MM:SS."""
    days, _, rest = text.rpartition("-")
    parts = [int(x) for x in rest.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0)
    return (int(days) if days else 0) * 86400 + parts[0] * 3600 + parts[1] * 60 + parts[2]


@pytest.mark.timeout(1800)
def test_a_run_cut_by_its_time_limit_resumes_in_the_next_submission(cluster, tmp_path):
    """A fine-tuning run longer than its SLURM job: the rule asks for the planned time (train.gpu_tokens_per_second,
    max_job_hours) and the planned resubmissions; once the first job has trained 50 steps its time limit is lowered
    to end 70-130 s later (`scontrol update`, as an administrator would); `mla train` reads the new end within
    30 s and stops with a checkpoint a minute before it (exit status 75: the job FAILS, it is not killed at
    TIMEOUT), Snakemake submits the job again, and the second job resumes from that checkpoint and finishes:
    every step once, one MLflow run, the resume folder deleted. 10,000 tiny steps: the first job cannot finish
    them at the ~70 steps/s of an idle machine, and the second can at the ~10 steps/s of a busy one."""
    state, env = cluster
    work, profile = tmp_path / "work", test_profile(tmp_path)
    work.mkdir()
    steps = 10_000
    config = yaml.safe_load(SMOKE.read_text())
    # periodic checkpoints as in the paper's recipe (each also flushes its rows to MLflow: the stop margin
    # learns how long saving takes from them)
    config["train"].update(steps=steps, save_steps=500, gpu_tokens_per_second=1e6, max_job_hours=1)
    config["data"]["max_tokens"] = None                      # 10,000 steps x 2 x 32 tokens, more than the smoke's cap
    configfile = tmp_path / "long.yaml"
    configfile.write_text(yaml.safe_dump(config))
    v = smoke_variant("gqa2mla", "baseline", config)        # needs only the download and data jobs before it
    # the test profile, but the finetune rule's own runtime (the plan) and retries
    prof = yaml.safe_load((profile / "config.yaml").read_text())
    prof["set-resources"]["finetune"].pop("runtime")
    (tmp_path / "profile-planned").mkdir()
    (tmp_path / "profile-planned/config.yaml").write_text(yaml.safe_dump(prof))
    from mla.study import budgets
    from mla.study.config_schema import validated

    plan = budgets.variant_plan(validated(config), v)
    assert (plan.jobs, plan.retries) == (1, 1)                # one job planned, one spare submission

    before = set(squeue_jobs(env))
    timeout = 1500
    cmd = ["timeout", "-s", "KILL", str(timeout), sys.executable, "-m", "snakemake", "-s",
           str(ROOT / "Snakefile"), "-d", str(work), "--configfile", str(configfile), "--profile",
           str(tmp_path / "profile-planned"), f"{v.run_dir}/run.json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**env, "OMP_NUM_THREADS": "1"})
    ckpt_root = work / f"results/checkpoints/{v.model}/{v.start}/{v.recipe}"
    first, limit_before, deadline = None, None, time.time() + 600
    while first is None and time.time() < deadline and proc.poll() is None:
        running = [i for i, (s, c) in squeue_jobs(env).items()
                   if i not in before and s == "RUNNING" and c.startswith("rule_finetune")]
        trained = sum(len(f.read_text().splitlines()) - 1 for f in ckpt_root.glob("*/metrics.csv"))
        if running and trained >= 50:
            # the job now ends 70-130 s from here; mla train sees it within 30 s and stops a minute before
            first = running[0]
            record = scontrol_job(first, env)
            limit_before = record["TimeLimit"]
            minutes = (_seconds(record["RunTime"]) + 70) // 60 + 1
            subprocess.run(["scontrol", "update", f"JobId={first}", f"TimeLimit={minutes}"], env=env, check=True)
        time.sleep(0.5)
    out, _ = proc.communicate(timeout=timeout + 60)
    assert first is not None, "no finetune job ran:\n" + out[-4000:]
    assert proc.returncode == 0, out[-6000:]
    assert _seconds(limit_before) == 60 * plan.minutes(1)      # the planned SLURM time, not the profile's

    jobs = {i: c for i, (_, c) in squeue_jobs(env).items() if i not in before and c.startswith("rule_finetune")}
    assert len(jobs) == 2 and first == min(jobs, key=int), jobs
    cut, resumed = (scontrol_job(j, env) for j in sorted(jobs, key=int))
    # stopped by mla train before the lowered limit: FAILED with status 75, not TIMEOUT
    assert cut["JobState"] == "FAILED", cut
    start, end = (time.mktime(time.strptime(cut[k], "%Y-%m-%dT%H:%M:%S")) for k in ("StartTime", "EndTime"))
    assert end - start < _seconds(cut["TimeLimit"]), cut
    assert resumed["JobState"] == "COMPLETED" and _seconds(resumed["TimeLimit"]) == 60 * plan.minutes(2)

    info = json.loads((work / v.run_dir / "run.json").read_text())
    stop_step = int(info["resumed_from"].rsplit("-", 1)[1])
    assert 1 <= stop_step < steps, info["resumed_from"]
    rows = list(csv.DictReader(open(work / v.run_dir / "metrics.csv")))
    assert [int(r["step"]) for r in rows] == list(range(1, steps + 1))
    from mlflow.tracking import MlflowClient

    history = MlflowClient(tracking_uri=f"sqlite:///{work}/results/mlflow.db").get_metric_history(
        info["mlflow_run_id"], "loss")
    assert sorted(m.step for m in history) == list(range(1, steps + 1))
    assert list(ckpt_root.iterdir()) == []                     # deleted once the run succeeded
