"""One exclusive advisory file lock for what parallel processes (workflow jobs, pytest-xdist workers) must not
do at once: build a shared cache folder, create and migrate an MLflow sqlite store."""

from __future__ import annotations

import fcntl
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def exclusive(lock: Path):
    """Holds an exclusive lock on the file `lock` for the block, waiting for it first (a killed holder releases
    it). The file stays: removing it would let a waiter and a newcomer lock two different files."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield
