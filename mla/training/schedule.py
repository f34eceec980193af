"""The paper's learning-rate schedule: linear warmup from 0 -> constant -> 1-sqrt decay to 0.

With peak lr, total steps T, warmup W and decay D (decay starts at T - D), the multiplier at
scheduler step s (0-based: step s is the (s+1)-th optimizer update) is

    s < W:           s / W
    W <= s < T - D:  1
    T - D <= s:      1 - sqrt((s - (T - D)) / D), clamped at 0 from s >= T

as in nanotron's `lr_scheduler_builder` (warmup_style linear, decay_style 1-sqrt, min lr 0).
"""

from __future__ import annotations

import math

from mla.errors import UserError


def check_schedule(total_steps: int, warmup_steps: int, decay_steps: int) -> None:
    if total_steps <= 0:
        raise UserError(f"steps must be > 0, got {total_steps}")
    if warmup_steps < 0 or decay_steps < 0:
        raise UserError(f"warmup and decay steps must be >= 0, got {warmup_steps} and {decay_steps}")
    if warmup_steps + decay_steps > total_steps:
        raise UserError(f"warmup ({warmup_steps}) + decay ({decay_steps}) steps exceed the {total_steps} "
                        f"training steps")


def lr_multiplier(step: int, total_steps: int, warmup_steps: int, decay_steps: int) -> float:
    """Factor applied to the peak lr at 0-based scheduler step `step`."""
    if step >= total_steps:
        return 0.0
    if step < warmup_steps:
        return step / warmup_steps
    decay_start = total_steps - decay_steps
    if step < decay_start:
        return 1.0
    return 1.0 - math.sqrt((step - decay_start) / decay_steps)


def warmup_constant_sqrt_decay(optimizer, total_steps: int, warmup_steps: int, decay_steps: int):
    """A `torch.optim.lr_scheduler.LambdaLR` following `lr_multiplier` (the Trainer steps it once per update)."""
    from functools import partial

    from torch.optim.lr_scheduler import LambdaLR

    check_schedule(total_steps, warmup_steps, decay_steps)
    return LambdaLR(optimizer, partial(lr_multiplier, total_steps=total_steps, warmup_steps=warmup_steps,
                                       decay_steps=decay_steps))
