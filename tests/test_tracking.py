"""MLflow conventions: one run per name, params once, batched step metrics, tags, re-attach, rank 0 only; and the
cluster setup of docs/cluster.md: the workflow logging to a real `mlflow server`."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mla import tracking


@pytest.fixture(scope="module")
def uri(tmp_path_factory):
    # one database for the module: creating the sqlite schema takes seconds
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"


def test_run_is_created_once_and_reattached(uri, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("MLA_SNAKEMAKE_RULE", "finetune")
    tags = {"model": "smollm2-135m", "d_kv": 8, "variant": "d_kv8"}
    params = {"lr": 1e-4, "steps": 10}
    run_id = tracking.get_or_create_run(uri, "exp-a", "smollm2-135m-d_kv8", tags=tags, params=params)
    tracking.log_step_metrics(run_id, [{"step": s, "loss": 10.0 - s, "lr": 1e-4} for s in range(1, 6)])

    # the same job restarted (different SLURM job id): same run, no second run, params kept
    monkeypatch.setenv("SLURM_JOB_ID", "4243")
    again = tracking.get_or_create_run(uri, "exp-a", "smollm2-135m-d_kv8", tags=tags, params=params)
    assert again == run_id
    tracking.log_step_metrics(again, [{"step": s, "loss": 10.0 - s, "lr": 1e-4} for s in range(6, 11)])

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("exp-a")
    runs = client.search_runs([exp.experiment_id])
    assert [r.info.run_id for r in runs] == [run_id]
    run = client.get_run(run_id)
    assert run.data.params == {"lr": "0.0001", "steps": "10"}
    assert run.data.tags["model"] == "smollm2-135m"
    assert run.data.tags["d_kv"] == "8"
    assert run.data.tags["variant"] == "d_kv8"
    assert run.data.tags["snakemake_rule"] == "finetune"
    assert run.data.tags["slurm_job_id"] == "4243"
    assert len(run.data.tags["git_commit"]) == 40
    history = client.get_metric_history(run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, 11))
    assert {m.step: m.value for m in history}[7] == 3.0
    assert tracking.logged_steps(run_id, "loss") == set(range(1, 11))


def test_other_ranks_do_not_log(uri, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("RANK", "1")
    assert tracking.get_or_create_run(uri, "exp-b", "r") is None
    monkeypatch.setenv("RANK", "0")
    run_id = tracking.get_or_create_run(uri, "exp-b", "r")
    monkeypatch.setenv("RANK", "1")
    tracking.log_step_metrics(run_id, [{"step": 1, "loss": 1.0}])
    assert MlflowClient(tracking_uri=uri).get_metric_history(run_id, "loss") == []


def test_large_batches_are_split(uri):
    from mlflow.tracking import MlflowClient

    run_id = tracking.get_or_create_run(uri, "exp-c", "big")
    tracking.log_step_metrics(run_id, [{"step": s, "loss": float(s), "lr": 0.1, "grad_norm": 1.0}
                                       for s in range(400)])  # 1200 points > one log_batch
    client = MlflowClient(tracking_uri=uri)
    assert len(client.get_metric_history(run_id, "grad_norm")) == 400


# ---------------------------------------------------------------- the cluster setup: an MLflow server
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` with its own backend store (sqlite on its local disk) and artifact root, as
    docs/cluster.md starts it."""
    from mlflow_server import mlflow_server as running

    root = tmp_path_factory.mktemp("mlflow-server")
    (root / "store").mkdir()
    with running(f"sqlite:///{root}/store/mlflow.db", root, "--artifacts-destination", str(root / "artifacts")) as uri:
        yield uri, root


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_workflow_logs_its_runs_to_an_mlflow_server(mlflow_server, tmp_path):
    """The smoke workflow, cut to one converted variant, with `mlflow.tracking_uri` = the server's URL: the
    fine-tuning run, its loss history, its tags (model, variant, recipe, rule, commit; the table's study tag),
    params, the evaluation's metrics and the artifacts all reach the server; no sqlite file and no lock file
    appear beside the results (the lock is for sqlite stores only)."""
    from mlflow.tracking import MlflowClient

    from mla.study import experiments
    from mla.study.config_schema import validated

    uri, server_root = mlflow_server
    cfg = yaml.safe_load((ROOT / "configs/smoke.yaml").read_text())
    cfg["mlflow"] = {"experiment": "cluster-smoke", "tracking_uri": uri}
    cfg["experiments"] = {"gqa2mla": {**cfg["experiments"]["gqa2mla"], "d_kv": [8], "baseline": False}}
    cfg["evaluate"].update(mmlu=0, kv_bits=[], needle_lengths=[], decode_grid=[])
    configfile = tmp_path / "server.yaml"
    configfile.write_text(yaml.safe_dump(cfg))
    work = tmp_path / "work"
    cmd = [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "-d", str(work), "--configfile",
           str(configfile), "--profile", str(ROOT / "workflow/profiles/local"), "--cores", "2",
           "results/tables/gqa2mla.csv"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=840,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]

    [v] = experiments.Study(validated(cfg)).variants
    info = json.loads((work / v.run_dir / "run.json").read_text())
    assert info["tracking_uri"] == uri
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(info["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == f"{v.model}/{v.start}/{v.recipe}"
    tags = run.data.tags
    assert (tags["model"], tags["variant"], tags["recipe"], tags["snakemake_rule"]) == \
        (v.model, v.start, v.recipe, "finetune")
    assert len(tags["git_commit"]) == 40 and tags[f"study.{v.experiment}"] == v.label
    assert run.data.params["steps"] == str(cfg["train"]["steps"]) and run.data.params["zero_stage"] == "2"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, cfg["train"]["steps"] + 1))
    rows = list(csv.DictReader(open(work / v.run_dir / "metrics.csv")))
    assert {m.step: m.value for m in history} == pytest.approx({int(r["step"]): float(r["loss"]) for r in rows})
    assert "eval/perplexity" in run.data.metrics
    # artifacts went through the server to its artifact root, not to the jobs' file system
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"metrics.csv", "run.json"} <= names, names
    stored = {p.name for p in (server_root / "artifacts").rglob("*") if p.is_file()}
    assert {"metrics.csv", "run.json"} <= stored
    assert not list((work / "results").rglob("mlflow.db*")) and not list((work / "results").rglob("*.lock"))


def _attach(uri: str, barrier, out) -> None:
    import time

    find = tracking.find_run

    def slow_find(*args):                                 # widen the window between looking and creating
        run = find(*args)
        time.sleep(2)
        return run

    tracking.find_run = slow_find
    tracking.client_for(uri)                              # the store exists before the race starts
    barrier.wait()                                        # every process looks for the run at the same moment
    out.put(tracking.get_or_create_run(uri, "exp-race", "tiny/original"))


def test_parallel_jobs_of_one_run_create_it_once(uri):
    """An original model's quality and inference jobs (and the figure's and tables' summary run) attach to one
    run by name, started in parallel: it is created once, under the store's lock."""
    import multiprocessing

    from mlflow.tracking import MlflowClient

    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_attach, args=(uri, barrier, out)) for _ in range(3)]
    for p in procs:
        p.start()
    ids = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs) and len(set(ids)) == 1
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("exp-race").experiment_id])
    assert [r.info.run_id for r in runs] == ids[:1]
