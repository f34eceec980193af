"""Summary statistics that several stages report with: a mean with its standard error, and an even spread of
sample rows (the held-out blocks that perplexity, the fit's held-out loss and the quantized-cache losses score)."""

from __future__ import annotations

import math

import numpy as np


def mean_and_stderr(values) -> tuple[float, float | None]:
    """Mean and its standard error sd/sqrt(n) (sample sd, n - 1); SE None for fewer than 2 values."""
    x = np.asarray(values, dtype=np.float64)
    mean = float(x.mean())
    if len(x) < 2:
        return mean, None
    return mean, float(x.std(ddof=1) / math.sqrt(len(x)))


def evenly_spaced(total: int, n: int) -> np.ndarray:
    """n distinct row indices spread evenly over range(total), first and last included (n <= total)."""
    return np.unique(np.linspace(0, total - 1, n).round().astype(np.int64)) if n < total else np.arange(total)
