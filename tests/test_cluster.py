"""The cluster path without a cluster: the commands and plans a SLURM GPU run is given, checked by arithmetic.

- the nested `srun` of a multi-node job asks for each node's GPUs under CUDA (mla.training.launch);
- SLURM time per fine-tuning submission and the number of submissions, from the run's tokens at a stated
  throughput (mla.training.walltime), for the paper's configuration, by hand;
- the stop before a SLURM job's time limit (mla.training.timelimit): the job's end read from `scontrol`, the
  callback that saves and stops, the record the next submission reads.

The real thing runs in tests/test_slurm.py (a local SLURM cluster: the resubmission loop).
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import yaml
from transformers import TrainerControl, TrainerState

from mla.training import launch, timelimit, walltime

PAPER_LLAMA_TOKENS = 12_000 * 256 * 4096     # 12,582,912,000
PAPER_SMOLLM_TOKENS = 12_000 * 64 * 2048     # 1,572,864,000


# ---------------------------------------------------------------- nested srun (two nodes with GPUs)
def test_nested_srun_asks_for_the_gpus_of_each_node(monkeypatch, tmp_path):
    job = launch.SlurmJob(job_id="77", nodes=["gpu01", "gpu02"], cpus_per_task=32, here="gpu01")
    torchrun = launch.torchrun_command(tmp_path / "c.json", 8, nnodes=2, endpoint="gpu01:29500", rdzv_id="77")
    cuda = launch.srun_command(job, torchrun, gpus_per_node=8)
    assert cuda[:9] == ["srun", "--jobid=77", "--overlap", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1",
                        "--kill-on-bad-exit=1", "--export=ALL", "--cpus-per-task=32"]
    # the step asks for the 8 GPUs the job holds on each node (the finetune rule's --gres=gpu:8), before the launcher
    assert cuda[9] == "--gres=gpu:8" and cuda[10:] == torchrun
    assert not any(a.startswith(("--gres", "--gpus")) for a in launch.srun_command(job, torchrun))   # CPU: none

    # launch_nodes passes it on under CUDA only (scontrol answers the node address; srun is not started)
    calls = []
    monkeypatch.setattr(launch, "_scontrol", lambda *a: "NodeName=gpu01 NodeAddr=10.1.0.1 State=ALLOCATED")
    monkeypatch.setattr(launch.subprocess, "call", lambda cmd, env: calls.append(cmd) or 0)
    assert launch.launch_nodes(tmp_path / "c.json", job, 8, 29500, cuda=True) == 0
    assert launch.launch_nodes(tmp_path / "c.json", job, 8, 29500, cuda=False) == 0
    gpu, cpu = calls
    assert "--gres=gpu:8" in gpu and not any(a.startswith("--gres") for a in cpu)
    assert gpu[gpu.index("--rdzv_endpoint") + 1] == "10.1.0.1:29500" and gpu[gpu.index("--nproc_per_node") + 1] == "8"


# ---------------------------------------------------------------- SLURM time per submission
def test_paper_llama_run_is_planned_as_four_resuming_jobs():
    """12.6B tokens at 3,000 tokens/s on each of 8 GPUs: 524,288 s = 8,738.1 min, x 1.1 = 9,611.9 min of training;
    a 48 h job holds 2,880 - 30 = 2,850 of them: 4 jobs, the last 9,611.9 - 3 x 2,850 + 30 = 1,091.9 -> 1,092 min."""
    plan = walltime.plan_run(PAPER_LLAMA_TOKENS, 8, 3000, 48)
    assert plan.training_minutes == pytest.approx(1.1 * 524_288 / 60)
    assert plan.usable_minutes == 2850 and plan.jobs == 4
    assert plan.retries == 4                                   # 3 resubmissions + 1 spare
    assert [plan.minutes(a) for a in (1, 2, 3, 4)] == [2880, 2880, 2880, 1092]
    assert plan.minutes(5) == 2880                             # a spare submission gets a whole job
    # on 16 GPUs (2 nodes) at the paper's own 7,800 tokens/s: 28 h of tokens, x 1.1 = 30.8 h, one job
    fast = walltime.plan_run(PAPER_LLAMA_TOKENS, 16, PAPER_LLAMA_TOKENS / (28 * 3600 * 16), 48)
    assert fast.jobs == 1 and fast.minutes(1) == 30 + 1848    # ceil(1.1 x 28 x 60) = 1,848


def test_small_runs_and_unplanned_runs():
    # SmolLM-135M: 1.57B tokens at 40,000 tokens/s on 4 GPUs = 9,830.4 s = 163.84 min, x 1.1 = 180.2 -> 211 min
    smol = walltime.plan_run(PAPER_SMOLLM_TOKENS, 4, 40_000, 48)
    assert (smol.jobs, smol.retries, smol.minutes(1)) == (1, 1, 211)
    # no throughput stated: the limit (or 48 h) per job and the profile's retries
    assert walltime.plan_run(PAPER_SMOLLM_TOKENS, 4, None, 12).minutes(1) == 720
    unplanned = walltime.plan_run(PAPER_SMOLLM_TOKENS, 4, None, None)
    assert (unplanned.minutes(1), unplanned.retries) == (walltime.DEFAULT_JOB_MINUTES, None)
    # a throughput without a limit: one job of the whole run
    assert walltime.plan_run(PAPER_LLAMA_TOKENS, 8, 3000, None).minutes(1) == 9642   # ceil(9,611.9 + 30)


def test_paper_config_gives_each_run_its_plan_and_refuses_a_limit_without_room():
    from pathlib import Path

    from mla.study import budgets, experiments
    from mla.study.config_schema import config_problems, validated

    root = Path(__file__).resolve().parents[1]
    cfg = validated(yaml.safe_load((root / "configs/paper.yaml").read_text()))
    plans = {(m, s): budgets.variant_plan(cfg, v) for (m, s, _), v in experiments.Study(cfg).runs().items()}
    for (model, _), plan in plans.items():
        want = (PAPER_LLAMA_TOKENS, 8, 4) if model == "llama2-7b" else (PAPER_SMOLLM_TOKENS, 4, 1)
        assert (plan.tokens, plan.gpus, plan.jobs) == want
    assert max(p.retries for p in plans.values()) == 4          # what the finetune rule's `retries:` becomes
    raw = yaml.safe_load((root / "configs/paper.yaml").read_text())
    raw["train"]["max_job_hours"] = 0.4
    assert any(key == "train.max_job_hours" and "leaves no training time" in msg for key, msg in config_problems(raw))


# ---------------------------------------------------------------- stopping before the time limit
RECORD = ("JobId=42 JobName=finetune UserId=root(0) JobState=RUNNING Reason=None RunTime=00:01:10 TimeLimit=00:10:00 "
          "SubmitTime=2026-12-02T10:00:00 StartTime=2026-12-02T10:00:05 EndTime=2026-12-02T10:10:05 NumNodes=1")


def test_job_end_time_is_read_from_scontrol():
    from datetime import datetime

    end, limit = timelimit.parse_job_times(RECORD)
    assert end == datetime(2026, 12, 2, 10, 10, 5).timestamp() and limit == 600
    assert timelimit.parse_job_times(RECORD.replace("EndTime=2026-12-02T10:10:05", "EndTime=Unknown")) is None
    assert timelimit.parse_job_times("JobId=42 JobState=PENDING StartTime=Unknown EndTime=Unknown") is None
    # margin: two slowest steps, plus a tenth of the limit within [1, 10] minutes, or twice the slowest save
    assert timelimit.stop_margin(1200, 3.0) == 6.0 + 120
    assert timelimit.stop_margin(120, 0.5) == 1.0 + timelimit.STOP_FLOOR_S
    assert timelimit.stop_margin(48 * 3600, 40.0) == 80.0 + timelimit.STOP_MARGIN_S
    assert timelimit.stop_margin(48 * 3600, 40.0, slowest_save_s=420) == 80.0 + 840


def _step(callback, state, seconds=0.0):
    args, control = SimpleNamespace(device="cpu"), TrainerControl()
    callback.on_step_begin(args, state, control)
    callback.step_start -= seconds          # as if the step had taken `seconds`
    return callback.on_step_end(args, state, control)


def test_callback_saves_and_stops_when_the_time_left_is_below_the_margin(tmp_path):
    now = time.time()
    ends = {"end": now + 3600}
    reads = []
    callback = timelimit.TimeLimitCallback(tmp_path / timelimit.STOP_FILE,
                                           read_deadline=lambda: reads.append(1) or (ends["end"], 3600.0))
    state = TrainerState(global_step=3, max_steps=10)
    callback.on_train_begin(SimpleNamespace(device="cpu"), state, TrainerControl())
    control = _step(callback, state, seconds=2.0)
    assert not control.should_training_stop and not (tmp_path / timelimit.STOP_FILE).exists()
    # a periodic checkpoint after a step is timed, and the slowest one widens the margin
    args, control = SimpleNamespace(device="cpu"), TrainerControl(should_save=True)
    callback.on_step_begin(args, state, control)
    callback.on_step_end(args, state, control)
    callback.save_start -= 100.0            # as if the save had taken 100 s
    callback.on_save(args, state, control)
    assert callback.slowest_save >= 100.0 and not control.should_training_stop
    # the limit is lowered (scontrol update) to 5 minutes from now: read again after DEADLINE_REFRESH_S; 300 s left
    # is below the margin, 2 x 2 s + max(2 x 100 s (the slow save), a tenth of the hour)
    ends["end"] = now + 300
    callback.read_at -= timelimit.DEADLINE_REFRESH_S
    state.global_step = 4
    control = _step(callback, state, seconds=2.0)
    assert control.should_save and control.should_training_stop and callback.stopped_at == 4
    assert len(reads) == 2
    record = json.loads((tmp_path / timelimit.STOP_FILE).read_text())
    assert record["step"] == 4 and record["max_steps"] == 10 and record["job_end"] == ends["end"]
    assert timelimit.stopped_step(tmp_path) == 4
    # the run's last step is never a stop: the run finishes there
    last = timelimit.TimeLimitCallback(tmp_path / "other.json", read_deadline=lambda: (time.time() + 1, 3600.0))
    last.on_train_begin(None, state, TrainerControl())
    state.global_step = state.max_steps
    assert not _step(last, state).should_training_stop and not (tmp_path / "other.json").exists()
    # outside SLURM (no end time) nothing stops
    free = timelimit.TimeLimitCallback(tmp_path / "free.json", read_deadline=lambda: None)
    free.on_train_begin(None, state, TrainerControl())
    state.global_step = 5
    assert not _step(free, state, seconds=1e6).should_training_stop
