"""The paper's schedule (linear warmup from 0 -> constant -> 1-sqrt decay to 0) is transformers'
warmup-stable-decay scheduler as `mla.training.schedule.scheduler_arguments` configures it: the same
learning rate at every step of whole runs, float for float, edge cases included."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import TrainingArguments
from transformers.optimization import get_scheduler

from mla.cli import UserError
from mla.training.schedule import scheduler_arguments
from train_helpers import paper_lr_multiplier

LR, TOTAL, WARMUP, DECAY = 1e-4, 100, 10, 20  # decay starts at step 80


def trainer_lrs(total=TOTAL, warmup=WARMUP, decay=DECAY, tmp_path="/tmp"):
    """The learning rate of every optimizer step (and one past the end) of the scheduler the Trainer builds
    from the TrainingArguments fields (`Trainer.create_scheduler`: get_scheduler with these arguments)."""
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=total, learning_rate=LR, report_to=[],
                             **scheduler_arguments(total, warmup, decay))
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=LR)
    sched = get_scheduler(args.lr_scheduler_type, optimizer=opt, num_warmup_steps=args.get_warmup_steps(total),
                          num_training_steps=total, scheduler_specific_kwargs=args.lr_scheduler_kwargs)
    out = []
    for _ in range(total + 1):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def paper_lrs(total=TOTAL, warmup=WARMUP, decay=DECAY):
    return [LR * paper_lr_multiplier(s, total, warmup, decay) for s in range(total + 1)]


@pytest.mark.parametrize("total,warmup,decay", [
    (TOTAL, WARMUP, DECAY),   # all three phases
    (10, 0, 3),               # no warmup
    (10, 2, 0),               # no decay: constant to the end, then 0
    (10, 0, 0),               # constant
    (10, 4, 6),               # warmup then immediate decay, no plateau
    (10, 0, 10),              # decay from the first step
    (12_000, 120, 2_400),     # the paper's recipe (configs/paper.yaml)
    (1, 0, 1),
])
def test_transformers_wsd_equals_the_papers_schedule_at_every_step(total, warmup, decay, tmp_path):
    assert trainer_lrs(total, warmup, decay, tmp_path) == paper_lrs(total, warmup, decay)


def test_values_at_chosen_steps_follow_the_formula(tmp_path):
    lrs = trainer_lrs(tmp_path=tmp_path)
    # warmup: lr * s / W, from 0
    assert lrs[0] == 0.0
    assert lrs[1] == pytest.approx(LR * 1 / 10, rel=1e-12)
    assert lrs[9] == pytest.approx(LR * 0.9, rel=1e-12)
    # plateau, then 1-sqrt decay from step 80: lr * (1 - sqrt((s - 80) / 20))
    assert lrs[10] == lrs[79] == lrs[80] == LR
    assert lrs[85] == pytest.approx(0.5 * LR, rel=1e-12)
    assert lrs[99] == pytest.approx(LR * (1 - math.sqrt(19 / 20)), rel=1e-12)
    assert lrs[100] == 0.0   # ends at 0
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:11]))
    assert all(a > b for a, b in zip(lrs[80:100], lrs[81:101]))


@pytest.mark.parametrize("total,warmup,decay,word", [(0, 0, 0, "steps"), (10, 6, 5, "exceed"), (10, -1, 0, ">= 0")])
def test_out_of_range_schedules_are_refused(total, warmup, decay, word):
    with pytest.raises(UserError, match=word):
        scheduler_arguments(total, warmup, decay)
