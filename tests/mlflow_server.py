"""A real `mlflow server` for the tests that browse or log over HTTP (test_tracking, test_mlflow_ui)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def mlflow_server(backend_uri: str, folder: Path, *artifact_args: str, start_timeout: float = 180):
    """Start `mlflow server` on a free local port with `backend_uri` as its store, wait for /health, yield
    its URL; stop it by its own process group (uvicorn and its workers) at the end. `artifact_args` are the
    artifact options (`--artifacts-destination DIR` as docs/cluster.md, or `--default-artifact-root DIR`).
    The server's log goes to folder/server.log and is shown if it dies or never answers."""
    port = free_port()
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", backend_uri, *artifact_args,
           "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    log_path = Path(folder) / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + start_timeout
            while True:
                try:
                    with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                assert proc.poll() is None, log_path.read_text()[-3000:]
                assert time.time() < deadline, f"mlflow server not healthy after {start_timeout:.0f} s"
                time.sleep(0.5)
            yield base
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
