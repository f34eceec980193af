"""MLflow conventions: one run per name, params once, batched step metrics, tags, re-attach, rank 0 only."""

from __future__ import annotations

import pytest

from mla.study import tracking


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
