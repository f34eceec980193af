"""Fault injection for the resume tests, kept out of the package: `mla train --callback
fault_injection:KillAtStep` with this folder on PYTHONPATH and MLA_TEST_KILL_AT_STEP=N in the
environment (train_helpers.run_train(kill_at_step=N) sets up all three); every rank loads it. `mla fit`'s
resume test passes StopAfterLayer(N) as the fit's `on_layer_done` hook."""

from __future__ import annotations

import os
import signal

from transformers import TrainerCallback

STEP_ENV = "MLA_TEST_KILL_AT_STEP"


class KillAtStep(TrainerCallback):
    """SIGKILL this process (no cleanup, like a node failure) once step N has been logged."""

    def __init__(self):
        self.step = int(os.environ[STEP_ENV])

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.global_step >= self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class InjectedFault(RuntimeError):
    """Raised by StopAfterLayer: the job dies between two layers of `mla fit`."""


class StopAfterLayer:
    """`on_layer_done` hook of mla.conversion.fit: raise once layer N has been fitted and kept, as a job
    killed between layers would stop (the kept layers are all that survives)."""

    def __init__(self, layer: int):
        self.layer = layer

    def __call__(self, layer: int) -> None:
        if layer >= self.layer:
            raise InjectedFault(f"injected fault after layer {layer}")
