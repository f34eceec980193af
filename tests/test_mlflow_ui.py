"""MLflow browsing: runs logged the way the project logs them (mla.study.tracking) are visible in the
MLflow web UI, loaded by headless Chromium from a real `mlflow server` on 127.0.0.1."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1400,900"]
RUNS = {"gqa2mla-dkv8-smoke": 8, "gqa2mla-baseline-smoke": None}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A sqlite store with two runs of one experiment, each with a 20-step loss history."""
    from mla.study import tracking

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
    port = free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    log = open(folder / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri,
                             "--default-artifact-root", str(folder / "artifacts"), "--host", "127.0.0.1",
                             "--port", str(port), "--workers", "1"],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, (folder / "server.log").read_text()[-3000:]
            assert time.time() < deadline, "mlflow server not healthy after 120 s"
            time.sleep(0.5)
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)  # stops uvicorn and its workers
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


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
