"""Stopping a fine-tuning run with a checkpoint before its SLURM job's time limit.

SLURM ends a job at its time limit (SIGTERM, SIGKILL after KillWait), and everything since the last periodic
checkpoint is lost (Llama-2-7B at save_steps 500 on 8 GPUs: hours). Inside a SLURM job (SLURM_JOB_ID set),
rank 0 of `mla train` reads the job's end time (`scontrol show job`: EndTime, again every
DEADLINE_REFRESH_S, so a limit changed with `scontrol update` is followed) and, after each optimizer step,
asks to stop once the time left is below the margin: two of the slowest steps seen so far, plus the time to
write the checkpoint and leave -- twice the slowest checkpoint seen, and at least a tenth of the job's time
limit, bounded by STOP_FLOOR_S and STOP_MARGIN_S (a minute of Python teardown and the MLflow rows since the
last save; ten minutes, a Llama-2-7B ZeRO-2 checkpoint on a slow file system). One all-reduce
per step makes every rank stop after the same step. The Trainer then writes a checkpoint as at a save step,
`STOP_FILE` in the checkpoint folder records the step, and `mla train` exits with EXIT_STOPPED (75,
EX_TEMPFAIL): the next submission of the same command resumes from that checkpoint (mla.training.walltime
plans how many submissions a run needs).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from datetime import datetime
from pathlib import Path

from transformers import TrainerCallback

STOP_MARGIN_S = 600          # time to write the stop checkpoint and exit, at most (unless a save took longer)
STOP_FLOOR_S = 60            # ... and at least
DEADLINE_REFRESH_S = 30      # rank 0 re-reads the job's end time at most this often (one scontrol call)
STOP_FILE = "time-limit-stop.json"
EXIT_STOPPED = 75            # EX_TEMPFAIL: not done, run again


def parse_job_times(record: str) -> tuple[float, float] | None:
    """(end time as epoch seconds, time limit in seconds) from a `scontrol show job -o` record; None for a job
    without a limit. SLURM prints local times without a zone (StartTime=2026-12-02T10:11:12)."""
    fields = dict(item.split("=", 1) for item in record.split() if "=" in item)
    try:
        start, end = (datetime.strptime(fields[k], "%Y-%m-%dT%H:%M:%S").timestamp() for k in ("StartTime", "EndTime"))
    except (KeyError, ValueError):   # EndTime=Unknown, TimeLimit=UNLIMITED, a pending job
        return None
    return (end, end - start) if end > start else None


def job_end_time() -> tuple[float, float] | None:
    """(end, limit) of the SLURM job this process runs in; None outside SLURM or when scontrol cannot say."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        return None
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_job_times(out.stdout) if out.returncode == 0 else None


def stop_margin(limit_s: float, slowest_step_s: float, slowest_save_s: float = 0.0) -> float:
    """Seconds before the job's end at which a run stops: room for two more steps, the checkpoint and the exit."""
    leave = min(STOP_MARGIN_S, max(STOP_FLOOR_S, 0.1 * limit_s))
    return 2 * slowest_step_s + max(2 * slowest_save_s, leave)


class TimeLimitCallback(TrainerCallback):
    """Stop with a checkpoint before the SLURM job's end (see the module docstring). `read_deadline` gives
    (end, limit) or None; rank 0 calls it, the other ranks only join the per-step all-reduce."""

    def __init__(self, stop_file: Path, read_deadline=job_end_time, rank_zero: bool = True):
        self.stop_file, self.read_deadline, self.rank_zero = Path(stop_file), read_deadline, rank_zero
        self.deadline, self.read_at, self.slowest, self.step_start = None, -1e18, 0.0, None
        self.slowest_save, self.save_start = 0.0, None
        self.stopped_at: int | None = None

    def _refresh(self, now: float) -> None:
        if self.rank_zero and now - self.read_at >= DEADLINE_REFRESH_S:
            self.deadline, self.read_at = self.read_deadline(), now

    def on_train_begin(self, args, state, control, **kwargs):
        self._refresh(time.time())

    def on_step_begin(self, args, state, control, **kwargs):
        self.step_start = time.time()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.time()
        if self.step_start is not None:
            self.slowest = max(self.slowest, now - self.step_start)
        self._refresh(now)
        stop = False
        if self.deadline is not None and state.global_step < state.max_steps:
            end, limit = self.deadline
            stop = end - now < stop_margin(limit, self.slowest, self.slowest_save)
        if control.should_save:   # a periodic checkpoint follows this step: time it (on_save)
            self.save_start = now
        if _agree(stop, args.device):
            control.should_save = True
            control.should_training_stop = True
            self.stopped_at = state.global_step
            if state.is_world_process_zero:
                self.stop_file.write_text(json.dumps({
                    "step": state.global_step, "max_steps": state.max_steps, "stopped_at": now,
                    "job_end": self.deadline[0] if self.deadline else None,
                    "slowest_step_s": round(self.slowest, 3), "slurm_job_id": os.environ.get("SLURM_JOB_ID")}) + "\n")
        return control

    def on_save(self, args, state, control, **kwargs):
        if self.save_start is not None:
            self.slowest_save = max(self.slowest_save, time.time() - self.save_start)
            self.save_start = None


def _agree(stop: bool, device) -> bool:
    """Whether any rank asks to stop (an all-reduce MAX of one number; each rank alone without a group)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return stop
    flag = torch.tensor([1.0 if stop else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def stopped_step(checkpoint_dir: str | Path) -> int | None:
    """The step a run stopped at before its time limit (None: it did not stop early)."""
    f = Path(checkpoint_dir) / STOP_FILE
    return json.loads(f.read_text())["step"] if f.is_file() else None
