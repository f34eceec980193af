"""The project's side of llama.cpp: find the llama.cpp venv's python (scripts/llamacpp-env) and run
scripts/llamacpp_runner.py with it on a GGUF file. Standard library only: llama.cpp runs in another process,
from its own venv, so that a native crash ends that process and not the caller."""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

from mla.evaluation.engine_env import SCRIPTS, EngineEnvMissing, env_python

LLAMACPP_ENV = SCRIPTS / "llamacpp-env"
RUNNER = SCRIPTS / "llamacpp_runner.py"


class LlamaCppEnvMissing(EngineEnvMissing):
    """No finished llama.cpp venv; the message names scripts/llamacpp-env."""


def llamacpp_python(install: bool = False) -> Path:
    """The llama.cpp venv's python. install=True builds it when missing (minutes, once per machine); otherwise
    a missing venv raises LlamaCppEnvMissing with scripts/llamacpp-env's one-line message."""
    return env_python(LLAMACPP_ENV, install, LlamaCppEnvMissing)


def run(python: Path, model: str | Path, *, threads: int, cache_type: str = "f16", flash_attn: str = "auto",
        prompts: list[list[int]] | None = None, max_tokens: int = 16, blocks: list[list[int]] | None = None,
        bench: list[tuple[int, int]] = (), steps: int = 32, timeout: float = 1800) -> dict:
    """One runner process on one GGUF file (scripts/llamacpp_runner.py: what it returns). The engine's log tail
    is kept for the error message."""
    with tempfile.TemporaryDirectory(prefix="llamacpp-run-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [str(python), str(RUNNER), "--model", str(model), "--out", str(out), "--threads", str(threads),
               "--cache-type", cache_type, "--flash-attn", flash_attn, "--max-tokens", str(max_tokens)]
        for name, rows in (("prompts", prompts), ("blocks", blocks)):
            if rows:
                (Path(tmp) / f"{name}.json").write_text(json.dumps(rows))
                cmd += [f"--{name}", str(Path(tmp) / f"{name}.json")]
        for batch, context in bench:
            cmd += ["--bench", f"{batch}x{context}"]
        if bench:
            cmd += ["--bench-steps", str(steps)]
        log = Path(tmp) / "engine.log"
        with open(log, "w") as f:
            done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
        if done.returncode != 0 or not out.exists():
            tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-30:])
            raise RuntimeError(f"llamacpp_runner failed (exit {done.returncode}) on {model}:\n{tail}")
        return json.loads(out.read_text())


if __name__ == "__main__":   # a quick look: python -m mla.evaluation.llamacpp_engine -> the venv's python or the error
    import sys

    try:
        print(llamacpp_python())
    except LlamaCppEnvMissing as err:
        sys.exit(str(err))
