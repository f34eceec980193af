"""The project's side of serving with vLLM: find the vLLM venv, run scripts/vllm_runner.py in it, start
`vllm serve` and ask it for completions. Standard library only, so the tests and the benchmark can use it from
the project's venv (whose transformers differs from vLLM's).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from vllm_runner import COMPILATION_CONFIG   # beside this file; its top level imports only the standard library

SCRIPTS = Path(__file__).resolve().parent
VLLM_ENV = SCRIPTS / "vllm-env"
RUNNER = SCRIPTS / "vllm_runner.py"
# 1 GiB of KV cache holds ~450k tokens of a 2-layer test model; vLLM's default would claim far more of a
# machine it shares with other work
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


class VllmEnvMissing(RuntimeError):
    """No finished vLLM venv; the message names scripts/vllm-env."""


def vllm_python(install: bool = False) -> Path:
    """The vLLM venv's python. install=True creates the venv when missing (minutes, once per machine);
    otherwise a missing venv raises VllmEnvMissing with scripts/vllm-env's one-line message."""
    args = [str(VLLM_ENV)] if install else [str(VLLM_ENV), "--check"]
    done = subprocess.run(args, stdout=subprocess.PIPE, stderr=None if install else subprocess.PIPE, text=True)
    if done.returncode != 0:
        message = (done.stderr or "").strip().splitlines()[-1:] or [f"{VLLM_ENV} failed"]
        raise VllmEnvMissing(message[0])
    return Path(done.stdout.strip().splitlines()[-1])


def run_offline(python: Path, model: str | Path, prompts: list[list[int]] | None = None, max_tokens: int = 16,
                bench: tuple[int, int, int] | None = None, timeout: float = 900) -> dict:
    """One offline engine run (scripts/vllm_runner.py): greedy tokens, the KV cache's bytes per token and,
    with bench = (batch, context, steps), decode tokens/s. The engine's log is kept for the error message."""
    with tempfile.TemporaryDirectory(prefix="vllm-run-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [str(python), str(RUNNER), "--model", str(model), "--out", str(out), "--max-tokens", str(max_tokens)]
        if prompts is not None:
            (Path(tmp) / "prompts.json").write_text(json.dumps(prompts))
            cmd += ["--prompts", str(Path(tmp) / "prompts.json")]
        if bench:
            cmd += ["--bench-batch", str(bench[0]), "--bench-context", str(bench[1]), "--bench-steps", str(bench[2])]
        log = Path(tmp) / "engine.log"
        with open(log, "w") as f:
            done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                                  env={**os.environ, **ENGINE_ENV})
        if done.returncode != 0 or not out.exists():
            tail = "".join(log.read_text().splitlines(keepends=True)[-40:])
            raise RuntimeError(f"vllm_runner failed (exit {done.returncode}):\n{tail}")
        return json.loads(out.read_text())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def vllm_server(python: Path, model: str | Path, log_path: Path, timeout: float = 300, max_model_len: int = 2048):
    """vLLM's OpenAI-compatible server for MODEL on a free local port, its engine configured as the offline
    runner's; yields the base URL once /health answers. The server's process group is always ended on exit.
    It is `vllm serve` by its module: vllm-cpu's `vllm` command asks importlib.metadata for a package named
    "vllm" (this one is "vllm-cpu") and exits with PackageNotFoundError before parsing its arguments."""
    port = free_port()
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", str(max_model_len), "--seed", "0",
           "--no-enable-prefix-caching", "--compilation-config", json.dumps(COMPILATION_CONFIG)]
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        # its own session: the API server starts engine processes, and they all go with one killpg
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **ENGINE_ENV})
        try:
            wait_ready(url, proc, log_path, timeout)
            yield url
        finally:
            stop(proc)


def wait_ready(url: str, proc: subprocess.Popen, log_path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode}:\n{tail(log_path)}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        time.sleep(1)
    raise TimeoutError(f"vllm serve not ready after {timeout:.0f} s:\n{tail(log_path)}")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (the server and the engine processes it started), then SIGKILL."""
    for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
            return


def tail(path: Path, lines: int = 40) -> str:
    return "".join(Path(path).read_text(errors="replace").splitlines(keepends=True)[-lines:])


def completions(url: str, model: str | Path, prompts: list[list[int]] | list[str], max_tokens: int,
                timeout: float = 120) -> list[dict]:
    """Greedy completions through the OpenAI-style /v1/completions of token-id or text prompts; each answer's
    `prompt_token_ids` and `token_ids` (vLLM's `return_token_ids`), in the prompts' order. `ignore_eos` as in
    the offline runner."""
    body = {"model": str(model), "prompt": prompts, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            choices = json.load(response)["choices"]
    except urllib.error.HTTPError as err:
        raise RuntimeError(f"/v1/completions answered {err.code}: {err.read().decode(errors='replace')}") from err
    return [{"prompt_token_ids": c["prompt_token_ids"], "token_ids": c["token_ids"]}
            for c in sorted(choices, key=lambda c: c["index"])]


if __name__ == "__main__":   # a quick look: python scripts/vllm_client.py  -> the venv's python or the error
    try:
        print(vllm_python())
    except VllmEnvMissing as err:
        sys.exit(str(err))
