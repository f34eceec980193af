"""MLflow conventions of the project, in one place.

- one experiment per configuration, one run per (model, variant), found again by its run name: a
  restarted job re-attaches to its run instead of creating a second one;
- params logged once (a re-attached run only gets the params it does not have yet);
- per-step metrics logged in batches (`MlflowClient.log_batch`, step= from each row);
- tags: git commit, SLURM job id and Snakemake rule when present, plus the caller's (model, d_kv, variant);
- only rank 0 logs (the functions here are no-ops on other ranks).

The tracking URI defaults to ``sqlite:///results/mlflow.db`` (relative to the working directory);
artifacts of a sqlite store go next to the database file, under ``mlartifacts/``.
"""

from __future__ import annotations

import os
import subprocess
import time
from contextlib import nullcontext
from pathlib import Path

from mla import locks

DEFAULT_TRACKING_URI = "sqlite:///results/mlflow.db"
MAX_BATCH = 1000  # MLflow's limit of metrics per log_batch call

_clients: dict[str, object] = {}  # run id -> MlflowClient of the URI it was opened with


def is_rank_zero() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _sqlite_path(uri: str) -> Path | None:
    if uri.startswith("sqlite:///"):
        return Path(uri[len("sqlite:///"):])
    return None


def _store_lock(db: Path):
    """The exclusive lock beside a sqlite store, for what parallel jobs must not do at once."""
    return locks.exclusive(db.with_name(db.name + ".lock"))


def client_for(tracking_uri: str | None = None):
    """A client of the store at `tracking_uri`. A sqlite store is opened under a file lock: MLflow's
    first use of a new database migrates its schema, and parallel jobs doing that at once collide
    ("table _alembic_tmp_... already exists")."""
    from mlflow.tracking import MlflowClient

    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI
    db = _sqlite_path(uri)
    if db is None:
        return MlflowClient(tracking_uri=uri)
    with _store_lock(db):
        client = MlflowClient(tracking_uri=uri)
        client.search_experiments(max_results=1)     # creates (and migrates) the database inside the lock
    return client


def _client(run_id: str, tracking_uri: str | None):
    if tracking_uri is not None or run_id not in _clients:
        _clients[run_id] = client_for(tracking_uri)
    return _clients[run_id]


def git_commit() -> str | None:
    """HEAD of the repository holding this package (None outside a git checkout)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def default_tags() -> dict[str, str]:
    """git commit, SLURM job id and Snakemake rule (from $MLA_SNAKEMAKE_RULE / $SNAKEMAKE_RULE) when present."""
    tags = {}
    commit = git_commit()
    if commit:
        tags["git_commit"] = commit
    if os.environ.get("SLURM_JOB_ID"):
        tags["slurm_job_id"] = os.environ["SLURM_JOB_ID"]
    rule = os.environ.get("MLA_SNAKEMAKE_RULE") or os.environ.get("SNAKEMAKE_RULE")
    if rule:
        tags["snakemake_rule"] = rule
    return tags


def _experiment_id(client, name: str, uri_db: Path | None) -> str:
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    location = (uri_db.parent.resolve() / "mlartifacts" / name).as_uri() if uri_db else None
    try:
        return client.create_experiment(name, artifact_location=location)
    except Exception:  # created concurrently by another job
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def find_run(client, experiment_id: str, run_name: str):
    escaped = run_name.replace("'", "\\'")
    runs = client.search_runs([experiment_id], filter_string=f"tags.`mlflow.runName` = '{escaped}'",
                              order_by=["attributes.start_time ASC"], max_results=5)
    return runs[0] if runs else None


def get_or_create_run(tracking_uri: str | None, experiment: str, run_name: str, tags: dict | None = None,
                      params: dict | None = None) -> str | None:
    """Run id of `run_name` in `experiment`, created if absent (None on ranks other than 0)."""
    if not is_rank_zero():
        return None
    from mlflow.entities import Param, RunTag

    client = client_for(tracking_uri)
    db = _sqlite_path(client.tracking_uri)
    all_tags = {**default_tags(), **{k: str(v) for k, v in (tags or {}).items() if v is not None}}
    # found or created under the store's lock: two jobs of one run (an original model's quality and inference
    # evaluations, the figure's and the tables' summary run) must not both create it
    with _store_lock(db) if db else nullcontext():
        exp_id = _experiment_id(client, experiment, db)
        run = find_run(client, exp_id, run_name)
        created = run is None
        if created:
            run = client.create_run(exp_id, run_name=run_name, tags=all_tags)
    if created:
        have = {}
    else:
        client.update_run(run.info.run_id, status="RUNNING")
        have = run.data.params
    run_id = run.info.run_id
    _clients[run_id] = client
    new_params = [Param(k, str(v)) for k, v in (params or {}).items() if k not in have]
    changed = sorted(k for k, v in (params or {}).items() if k in have and have[k] != str(v))
    if changed:
        all_tags["params_changed_on_resume"] = ",".join(changed)
    for i in range(0, max(len(new_params), 1), 100):
        client.log_batch(run_id, params=new_params[i:i + 100],
                         tags=[RunTag(k, v) for k, v in all_tags.items()] if i == 0 else [])
    return run_id


def logged_steps(run_id: str, key: str = "loss", tracking_uri: str | None = None) -> set[int]:
    """Steps already holding a point of metric `key` (used to avoid duplicates after a restart)."""
    if run_id is None:
        return set()
    return {m.step for m in _client(run_id, tracking_uri).get_metric_history(run_id, key)}


def log_step_metrics(run_id: str | None, rows: list[dict], tracking_uri: str | None = None) -> None:
    """Log rows like {"step": 3, "loss": 2.1, "lr": 1e-4, ...} as step-indexed metrics, in batches."""
    if run_id is None or not rows or not is_rank_zero():
        return
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    metrics = [Metric(k, float(v), now, int(row["step"]))
               for row in rows for k, v in row.items() if k != "step" and v is not None and v != ""]
    client = _client(run_id, tracking_uri)
    for i in range(0, len(metrics), MAX_BATCH):
        client.log_batch(run_id, metrics=metrics[i:i + MAX_BATCH])


def log_metrics(run_id: str | None, metrics: dict, step: int | None = None, tracking_uri: str | None = None) -> None:
    """Log scalar summary metrics (one point each, at `step` or 0)."""
    if run_id is None or not is_rank_zero():
        return
    log_step_metrics(run_id, [{"step": step or 0, **metrics}], tracking_uri)


def log_artifacts(run_id: str | None, paths, artifact_path: str | None = None, tracking_uri: str | None = None) -> None:
    if run_id is None or not is_rank_zero():
        return
    client = _client(run_id, tracking_uri)
    for p in [paths] if isinstance(paths, (str, os.PathLike)) else paths:
        p = Path(p)
        if p.is_dir():
            client.log_artifacts(run_id, str(p), artifact_path)
        elif p.is_file():
            client.log_artifact(run_id, str(p), artifact_path)


def set_tags(run_id: str | None, tags: dict, tracking_uri: str | None = None) -> None:
    """Add or replace tags of an existing run (e.g. the experiments and labels a shared run appears under)."""
    if run_id is None or not is_rank_zero():
        return
    from mlflow.entities import RunTag

    _client(run_id, tracking_uri).log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])


def set_terminated(run_id: str | None, status: str = "FINISHED", tracking_uri: str | None = None) -> None:
    if run_id is None or not is_rank_zero():
        return
    _client(run_id, tracking_uri).set_terminated(run_id, status=status)
