"""Process launch for `mla train`.

- `--nproc 1`: runs in this process; sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT when no launcher
  did, so DeepSpeed does not fall back to MPI discovery (which needs mpi4py).
- `--nproc N > 1`: re-executes `mla train` under torchrun (N processes on this node) with the resolved config
  written to the checkpoint folder; each worker sees LOCAL_RANK and trains.
- On a machine without CUDA: `DS_ACCELERATOR=cpu` (gloo backend) and DeepSpeed's shared-memory all-reduce op,
  used only for inference, is not JIT-compiled (saves ~77 s on first use).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

LAUNCHER_ENV = "LOCAL_RANK"


def under_launcher() -> bool:
    return LAUNCHER_ENV in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_environment(cuda: bool) -> None:
    """Before DeepSpeed is imported: CPU accelerator when there is no GPU."""
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def skip_shm_build() -> None:
    """DeepSpeed 0.19.8 builds `deepspeed_shm_comm` in every TorchBackend; training never uses it."""
    import deepspeed
    import deepspeed.ops

    if deepspeed.__version__ == "0.19.8" and isinstance(getattr(deepspeed.ops, "__compatible_ops__", None), dict):
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def single_process_environment(port: int | None) -> None:
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port or free_port()))


def relaunch(config_path: Path, nproc: int, port: int | None) -> int:
    """Run `mla train --config CONFIG` in `nproc` processes under torchrun; returns its exit status."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(port or free_port()),
           "--module", "mla", "train", "--config", str(config_path)]
    env = dict(os.environ)
    env.pop("RANK", None), env.pop("WORLD_SIZE", None), env.pop("LOCAL_RANK", None)
    return subprocess.call(cmd, env=env)
