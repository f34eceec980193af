"""The paper's schedule: linear warmup from 0 -> constant -> 1-sqrt decay to 0, as a LambdaLR."""

from __future__ import annotations

import math

import pytest
import torch

from mla.cli import UserError
from mla.training.schedule import lr_multiplier, warmup_constant_sqrt_decay

LR, TOTAL, WARMUP, DECAY = 1e-4, 100, 10, 20  # decay starts at step 80


def lrs_from_scheduler(total=TOTAL, warmup=WARMUP, decay=DECAY, steps=None):
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=LR)
    sched = warmup_constant_sqrt_decay(opt, total, warmup, decay)
    out = []
    for _ in range(steps or total + 1):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_values_at_chosen_steps_follow_the_formula():
    lrs = lrs_from_scheduler()
    # warmup: lr * s / W, from 0
    assert lrs[0] == 0.0
    assert lrs[1] == pytest.approx(LR * 1 / 10, rel=1e-12)
    assert lrs[5] == pytest.approx(LR * 0.5, rel=1e-12)
    assert lrs[9] == pytest.approx(LR * 0.9, rel=1e-12)
    # plateau
    assert lrs[10] == pytest.approx(LR, rel=1e-12)
    assert lrs[79] == pytest.approx(LR, rel=1e-12)
    # 1-sqrt decay: lr * (1 - sqrt((s - 80) / 20))
    assert lrs[80] == pytest.approx(LR, rel=1e-12)
    assert lrs[85] == pytest.approx(LR * (1 - math.sqrt(5 / 20)), rel=1e-12)  # = 0.5 lr
    assert lrs[85] == pytest.approx(0.5 * LR, rel=1e-12)
    assert lrs[95] == pytest.approx(LR * (1 - math.sqrt(15 / 20)), rel=1e-12)
    assert lrs[99] == pytest.approx(LR * (1 - math.sqrt(19 / 20)), rel=1e-12)
    # ends at 0
    assert lrs[100] == 0.0


def test_shape_is_monotone_in_each_phase():
    lrs = lrs_from_scheduler()
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:11]))
    assert len(set(lrs[10:81])) == 1
    assert all(a > b for a, b in zip(lrs[80:100], lrs[81:101]))


def test_no_warmup_no_decay_is_constant():
    assert [lr_multiplier(s, 10, 0, 0) for s in range(10)] == [1.0] * 10


def test_warmup_then_immediate_decay():
    # warmup 4, decay over the 6 remaining steps: no plateau
    m = [lr_multiplier(s, 10, 4, 6) for s in range(11)]
    assert m[:4] == [0.0, 0.25, 0.5, 0.75]
    assert m[4] == 1.0
    assert m[7] == pytest.approx(1 - math.sqrt(3 / 6))
    assert m[10] == 0.0


@pytest.mark.parametrize("total,warmup,decay,word", [(0, 0, 0, "steps"), (10, 6, 5, "exceed"), (10, -1, 0, ">= 0")])
def test_out_of_range_schedules_are_refused(total, warmup, decay, word):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(UserError, match=word):
        warmup_constant_sqrt_decay(opt, total, warmup, decay)
