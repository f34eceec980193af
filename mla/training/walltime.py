"""SLURM time of the fine-tuning jobs: the plan's tokens at a stated throughput, split into jobs that fit the
cluster's time limit and resume one another.

A run trains steps x global batch x block length tokens (mla.study.budgets). At `gpu_tokens_per_second`
tokens per second per GPU (the workflow's `train` key; scripts/gpu-check's training part measures it) on
nproc x nodes GPUs its training takes

    training = THROUGHPUT_SLACK x tokens / (tokens/s per GPU x GPUs)

and every SLURM job adds JOB_OVERHEAD_MINUTES (imports, loading the model, DeepSpeed's start, loading the
resume checkpoint, the stop margin of mla.training.timelimit, the final save). With `max_job_hours` (the
partition's time limit, `sinfo -o %l`) a longer run is split: every job gets the limit, stops with a
checkpoint shortly before it, and the next submission resumes (Snakemake's retries of the finetune rule,
`retries` below); the last job gets only what is left. Without a stated throughput a job gets the limit,
else 48 hours, and the profile's retries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

THROUGHPUT_SLACK = 1.1          # the stated throughput is a measurement on another day: 10 % spare
JOB_OVERHEAD_MINUTES = 30       # per job: start, resume, stop margin, final save (Llama-2-7B: minutes each)
DEFAULT_JOB_MINUTES = 48 * 60   # without a stated limit: what the slurm profile asked before
SPARE_SUBMISSIONS = 1           # one submission more than planned (slower GPUs, a failed node)


@dataclass(frozen=True)
class JobPlan:
    """How one fine-tuning run is split into SLURM jobs."""

    tokens: int
    gpus: int
    training_minutes: float | None   # None: no throughput stated
    limit_minutes: int | None        # the longest job the cluster allows (None: no limit stated)

    @property
    def usable_minutes(self) -> float | None:
        """Training minutes one job of the limit holds."""
        return None if self.limit_minutes is None else self.limit_minutes - JOB_OVERHEAD_MINUTES

    @property
    def jobs(self) -> int:
        """Submissions the run needs at the stated throughput (1 when it cannot be planned)."""
        if self.training_minutes is None or self.usable_minutes is None:
            return 1
        return max(1, _whole_minutes(self.training_minutes / self.usable_minutes))

    @property
    def retries(self) -> int | None:
        """Resubmissions after the first job (None: not planned, the profile's `retries` applies)."""
        return None if self.training_minutes is None else self.jobs - 1 + SPARE_SUBMISSIONS

    def minutes(self, attempt: int = 1) -> int:
        """SLURM time limit (sbatch -t, minutes) of submission `attempt` (1 = the first)."""
        if self.training_minutes is None:
            return self.limit_minutes or DEFAULT_JOB_MINUTES
        if self.limit_minutes is None:    # no limit stated: the whole run in one job
            return _whole_minutes(self.training_minutes + JOB_OVERHEAD_MINUTES)
        left = self.training_minutes - (attempt - 1) * self.usable_minutes
        if left <= 0:   # more submissions than planned: the throughput was optimistic, give a whole job
            return self.limit_minutes
        return min(self.limit_minutes, _whole_minutes(left + JOB_OVERHEAD_MINUTES))


def _whole_minutes(x: float) -> int:
    """Rounded up, ignoring float noise below a microsecond (28 h x 60 x 1.1 is 1848.0000000000002)."""
    return math.ceil(round(x, 6))


def plan_run(tokens: int, gpus: int, tokens_per_gpu_second: float | None, max_job_hours: float | None) -> JobPlan:
    training = None
    if tokens_per_gpu_second:
        training = THROUGHPUT_SLACK * tokens / (tokens_per_gpu_second * gpus) / 60
    limit = None if max_job_hours is None else int(max_job_hours * 60)
    return JobPlan(tokens=tokens, gpus=gpus, training_minutes=training, limit_minutes=limit)


def walltime_errors(config: dict) -> list[tuple[str, str]]:
    """(config key, message) when a job of `train.max_job_hours` could not hold any training after its overhead."""
    hours = config["train"].get("max_job_hours")
    if hours is not None and hours * 60 <= JOB_OVERHEAD_MINUTES:
        return [("train.max_job_hours", f"{hours} h leaves no training time: every fine-tuning job spends "
                 f"{JOB_OVERHEAD_MINUTES} minutes starting, resuming and saving (mla.training.walltime); give "
                 "the partition's time limit in hours, e.g. 48")]
    return []
