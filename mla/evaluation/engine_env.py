"""The engines' own venvs (scripts/vllm-env, scripts/llamacpp-env): each script makes its venv once per machine and
prints its python; with --check it makes nothing and names itself when the venv is missing. Standard library only."""

from __future__ import annotations

import subprocess
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


class EngineEnvMissing(RuntimeError):
    """No finished venv for an engine; the message (the script's own line) names the script to run."""


def env_python(script: Path, install: bool, missing: type[EngineEnvMissing]) -> Path:
    """The python of `script`'s venv. install=True makes the venv when missing (minutes, once per machine);
    otherwise a missing venv raises `missing` with the script's one-line message."""
    args = [str(script)] if install else [str(script), "--check"]
    done = subprocess.run(args, stdout=subprocess.PIPE, stderr=None if install else subprocess.PIPE, text=True)
    if done.returncode != 0:
        message = (done.stderr or "").strip().splitlines()[-1:] or [f"{script} failed"]
        raise missing(message[0])
    return Path(done.stdout.strip().splitlines()[-1])


def missing_engine(engine: str, device: str = "cpu") -> str | None:
    """Why `engine` (vllm, llama.cpp) cannot run on `device` here, as the one line naming the fix, or None. vLLM on
    the CPU: the venv of scripts/vllm-env, on a GPU: vLLM in the project's venv; llama.cpp: the venv of
    scripts/llamacpp-env. Checked, never built."""
    from mla.evaluation import llamacpp_engine, vllm_engine   # lazy: both import this module

    try:
        if engine == "llama.cpp":
            llamacpp_engine.llamacpp_python()
        else:
            vllm_engine.engine_python(device)
    except EngineEnvMissing as exc:
        return str(exc)
    return None
