"""MLflow browsing: runs logged the way the project logs them (mla.tracking) are visible in the
MLflow web UI, loaded by headless Chromium from a real `mlflow server` on 127.0.0.1."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import urllib.request
from pathlib import Path

import pytest
from mlflow_server import mlflow_server

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1400,900"]
RUNS = {"gqa2mla-dkv8-smoke": 8, "gqa2mla-baseline-smoke": None}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A sqlite store with two runs of one experiment, each with a 20-step loss history."""
    from mla import tracking

    folder = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{folder}/mlflow.db"
    run_ids = {}
    for name, d_kv in RUNS.items():
        run_id = tracking.get_or_create_run(uri, "mha2mla-ui-test", name,
                                            tags={"variant": name.split("-")[1]},
                                            params={"d_kv": d_kv or "none", "steps": 20})
        tracking.log_step_metrics(run_id, [{"step": s, "loss": 6.0 - 0.1 * s + (0.3 if d_kv else 0)}
                                           for s in range(1, 21)], tracking_uri=uri)
        tracking.set_terminated(run_id, tracking_uri=uri)
        run_ids[name] = run_id
    from mlflow.tracking import MlflowClient

    experiment_id = MlflowClient(tracking_uri=uri).get_experiment_by_name("mha2mla-ui-test").experiment_id
    return folder, uri, experiment_id, run_ids


@pytest.fixture(scope="module")
def server(store):
    folder, uri, _, _ = store
    with mlflow_server(uri, folder, "--default-artifact-root", str(folder / "artifacts"), start_timeout=120) as base:
        yield base


def chromium(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
                              capture_output=True, text=True, timeout=timeout)


def test_rest_api_lists_the_runs(server, store):
    import json

    _, _, experiment_id, run_ids = store
    req = urllib.request.Request(f"{server}/api/2.0/mlflow/runs/search",
                                 data=json.dumps({"experiment_ids": [experiment_id]}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        found = {run["info"]["run_name"] for run in json.load(r)["runs"]}
    assert found == set(RUNS)


@pytest.mark.skipif(CHROMIUM is None, reason="Debian chromium is not installed (apt-get install chromium)")
def test_runs_page_shows_the_runs_in_chromium(server, store, tmp_path):
    _, _, experiment_id, run_ids = store
    # MLflow 3 opens experiments in GenAI mode (no runs); the training view lists them
    url = f"{server}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"
    dom = chromium("--virtual-time-budget=20000", "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    for name in RUNS:
        assert name in dom.stdout, f"run {name} not in the runs page DOM ({len(dom.stdout)} bytes)"
    shot = tmp_path / "mlflow-runs.png"
    r = chromium("--virtual-time-budget=20000", f"--screenshot={shot}", url)
    assert r.returncode == 0 and shot.stat().st_size > 10_000, r.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    keep = os.environ.get("MLA_SCREENSHOT_DIR")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(keep) / shot.name)
