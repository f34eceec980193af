"""Process launch for `mla train`: one process, N processes on this node, or N nodes of a SLURM job.

- `--nproc 1 --nodes 1`: runs in this process; sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT
  when no launcher did, so DeepSpeed does not fall back to MPI discovery (which needs mpi4py).
- `--nproc N > 1 --nodes 1`: re-executes `mla train` under torchrun (N processes on this node, rendezvous
  on 127.0.0.1) with the resolved config written to the checkpoint folder; each worker trains.
- `--nodes N > 1`: only inside a SLURM job of exactly N nodes (else one line saying so). One launcher
  per node: `srun --overlap --nodes N --ntasks-per-node 1 torchrun --nnodes N --nproc-per-node P
  --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id JOB_ID`, HOST being the node this command
  runs on (the job's first node when the workflow runs it). World size N x P. On CUDA the step asks for
  `--gres=gpu:P` on each node, as the job did (the finetune rule's `gres`): a step that names no GPUs
  gets none of the job's, and torchrun's P processes would find no device.
  Why these srun flags: Snakemake's slurm-jobstep executor runs the rule inside `srun -n1` (a step on
  one node that holds its CPUs), and removes every SLURM_* variable but the job id. A nested step
  that spans the job's nodes therefore has to be described in full (nodes, tasks, CPUs per task, read
  from `scontrol show job`), from an environment without the outer step's variables, and needs
  `--overlap` to share the first node with the outer step (without it, it waits forever).
- On a machine without CUDA: `DS_ACCELERATOR=cpu` (gloo backend) and DeepSpeed's shared-memory all-reduce op,
  used only for inference, is not JIT-compiled (saves ~77 s on first use).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from mla.errors import UserError

LAUNCHER_ENV = "LOCAL_RANK"


def under_launcher() -> bool:
    return LAUNCHER_ENV in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_environment(cuda: bool) -> None:
    """Before DeepSpeed is imported: CPU accelerator when there is no GPU (or --device cpu)."""
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def leave_process_group() -> None:
    """Wait for every rank, then close torch.distributed: a gloo group left to interpreter exit can abort a rank
    ("terminate called without an active exception") after its work is done, failing the launch."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


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


# ---------------------------------------------------------------- torchrun
def torchrun_command(config_path: str | Path, nproc: int, *, port: int | None = None, nnodes: int = 1,
                     endpoint: str | None = None, rdzv_id: str | None = None) -> list[str]:
    """`torchrun ... -m mla train --config CONFIG`: one node on 127.0.0.1, or one of `nnodes` launchers
    meeting at `endpoint` (HOST:PORT, c10d rendezvous named `rdzv_id`)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    if nnodes == 1:
        cmd += ["--master_addr", "127.0.0.1", "--master_port", str(port or free_port())]
    else:
        cmd += ["--nnodes", str(nnodes), "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint,
                "--rdzv_id", str(rdzv_id)]
    return cmd + ["--module", "mla", "train", "--config", str(config_path)]


def launcher_environment() -> dict:
    env = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def relaunch(config_path: Path, nproc: int, port: int | None) -> int:
    """Run `mla train --config CONFIG` in `nproc` processes under torchrun; returns its exit status."""
    return subprocess.call(torchrun_command(config_path, nproc, port=port), env=launcher_environment())


# ---------------------------------------------------------------- SLURM
@dataclass
class SlurmJob:
    job_id: str
    nodes: list[str]         # host names, first node first
    cpus_per_task: int | None
    here: str | None         # the node this process runs on (SLURMD_NODENAME), if inside a step


def _scontrol(*args: str) -> str:
    try:
        return subprocess.run(["scontrol", *args], capture_output=True, text=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise UserError(f"--nodes > 1: `scontrol {' '.join(args)}` failed ({exc}); is SLURM reachable?") from None


def _field(record: str, name: str) -> str | None:
    m = re.search(rf"(?:^|\s){re.escape(name)}=(\S+)", record)
    return m.group(1) if m else None


def slurm_job(nodes: int) -> SlurmJob:
    """The SLURM job this runs in, which must have exactly `nodes` nodes (checked before any work)."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        raise UserError(f"--nodes {nodes} (train.nodes): several nodes run only inside a SLURM job with {nodes} "
                        "nodes (SLURM_JOB_ID is not set); use --nodes 1 outside SLURM")
    if shutil.which("srun") is None or shutil.which("scontrol") is None:
        raise UserError(f"--nodes {nodes} (train.nodes): srun and scontrol are not on PATH")
    record = _scontrol("show", "job", "-o", job_id)
    have = int(_field(record, "NumNodes") or 0)
    if have != nodes:
        raise UserError(f"--nodes {nodes} (train.nodes): SLURM job {job_id} has {have} node(s); submit it with "
                        f"--nodes={nodes} (the workflow's finetune rule does) or set train.nodes to {have}")
    hosts = _scontrol("show", "hostnames", _field(record, "NodeList")).split()
    cpus = _field(record, "CPUs/Task")
    return SlurmJob(job_id, hosts, int(cpus) if cpus and cpus.isdigit() else None,
                    os.environ.get("SLURMD_NODENAME"))


def node_address(node: str) -> str:
    """The address SLURM reaches `node` at (NodeAddr; on real clusters usually the host name)."""
    return _field(_scontrol("show", "node", "-o", node), "NodeAddr") or node


def rendezvous_endpoint(job: SlurmJob, port: int | None) -> str:
    """HOST:PORT of the c10d store: this node with a port free here when this process runs on a node of the
    job (the first node, under the workflow), else the first node with a port derived from the job id."""
    if job.here in job.nodes:
        return f"{node_address(job.here)}:{port or free_port()}"
    return f"{node_address(job.nodes[0])}:{port or 20000 + int(job.job_id) % 20000}"


def srun_command(job: SlurmJob, launcher: list[str], gpus_per_node: int = 0) -> list[str]:
    """One `launcher` per node of the job, as a step overlapping the step this runs in; with
    `gpus_per_node` the step takes that many of the job's GPUs on each node."""
    n = len(job.nodes)
    cmd = ["srun", f"--jobid={job.job_id}", "--overlap", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1",
           "--kill-on-bad-exit=1", "--export=ALL"]
    if job.cpus_per_task:
        cmd.append(f"--cpus-per-task={job.cpus_per_task}")
    if gpus_per_node:
        cmd.append(f"--gres=gpu:{gpus_per_node}")
    return cmd + launcher


def step_environment() -> dict:
    """This environment without the variables of the step we run in (they would pin srun to it)."""
    keep = {"SLURM_JOB_ID", "SLURM_CONF"}
    env = {k: v for k, v in launcher_environment().items()
           if not (k.startswith(("SLURM_", "SRUN_", "SBATCH_")) and k not in keep)}
    return env


def launch_nodes(config_path: Path, job: SlurmJob, nproc: int, port: int | None, cuda: bool) -> int:
    """`srun` one torchrun per node of `job` (with `nproc` GPUs each on CUDA); returns srun's exit status."""
    endpoint = rendezvous_endpoint(job, port)
    launcher = torchrun_command(config_path, nproc, nnodes=len(job.nodes), endpoint=endpoint, rdzv_id=job.job_id)
    cmd = srun_command(job, launcher, gpus_per_node=nproc if cuda else 0)
    print(f"mla train: {len(job.nodes)} nodes x {nproc} processes, rendezvous {endpoint}: {' '.join(cmd)}",
          file=sys.stderr, flush=True)
    return subprocess.call(cmd, env=step_environment())


def slurm_node_count_error(nodes: int) -> str | None:
    """At workflow start: why this SLURM cluster cannot give a job of `nodes` nodes (None when it can)."""
    if shutil.which("sinfo") is None:
        return (f"{nodes} nodes per training job need a SLURM cluster (sinfo is not on PATH): run with the slurm "
                "profile on the cluster's login node, or set 1")
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %R"], capture_output=True, text=True, check=True,
                             timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{nodes} nodes per training job: `sinfo` failed ({exc})"
    per_partition: dict[str, set[str]] = {}
    for line in out.splitlines():
        if line.split():
            node, partition = line.split()[:2]
            per_partition.setdefault(partition, set()).add(node)
    largest = max((len(v) for v in per_partition.values()), default=0)
    if nodes > largest:
        return f"{nodes} nodes per training job, but the largest SLURM partition has {largest} (sinfo)"
    return None
