"""The paper's learning-rate schedule: linear warmup from 0 -> constant -> 1-sqrt decay to 0.

With peak lr, total steps T, warmup W and decay D (decay starts at T - D), the multiplier at
scheduler step s (0-based: step s is the (s+1)-th optimizer update) is

    s < W:           s / W
    W <= s < T - D:  1
    T - D <= s:      1 - sqrt((s - (T - D)) / D), clamped at 0 from s >= T

as in nanotron's `lr_scheduler_builder` (warmup_style linear, decay_style 1-sqrt, min lr 0).
transformers' warmup-stable-decay scheduler (`get_wsd_schedule`) computes exactly these numbers with a
linear warmup, a 1-sqrt decay, min_lr_ratio 0 and a stable phase of T - W - D steps, so the Trainer
builds it from `scheduler_arguments` (tests/test_schedule.py compares the two float for float,
including W = 0 and D = 0).
"""

from __future__ import annotations

from mla.errors import UserError


def check_schedule(total_steps: int, warmup_steps: int, decay_steps: int) -> None:
    if total_steps <= 0:
        raise UserError(f"steps must be > 0, got {total_steps}")
    if warmup_steps < 0 or decay_steps < 0:
        raise UserError(f"warmup and decay steps must be >= 0, got {warmup_steps} and {decay_steps}")
    if warmup_steps + decay_steps > total_steps:
        raise UserError(f"warmup ({warmup_steps}) + decay ({decay_steps}) steps exceed the {total_steps} "
                        f"training steps")


def scheduler_arguments(total_steps: int, warmup_steps: int, decay_steps: int) -> dict:
    """`TrainingArguments` fields for the schedule over `total_steps` (the Trainer's max_steps)."""
    check_schedule(total_steps, warmup_steps, decay_steps)
    return {"lr_scheduler_type": "warmup_stable_decay", "warmup_steps": warmup_steps,
            "lr_scheduler_kwargs": {"num_decay_steps": decay_steps, "warmup_type": "linear",
                                    "decay_type": "1-sqrt", "min_lr_ratio": 0.0}}
