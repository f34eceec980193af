"""The spread of a run's gradient norms, from its metrics.csv: (median, max). A run whose largest norm is many
times its median took steps that clipping cut short; unbalanced low-rank factors did that to every converted
run before mla/conversion/lowrank.py balanced them (docs/conversion.md)."""

from __future__ import annotations

import csv
import math
import statistics
from pathlib import Path


def spread(metrics_csv: str | Path) -> tuple[float | None, float | None]:
    """(median, max) of the finite `grad_norm` values of a metrics.csv; (None, None) without any."""
    with open(metrics_csv, newline="") as f:
        norms = []
        for row in csv.DictReader(f):
            try:
                value = float(row.get("grad_norm") or "nan")
            except ValueError:
                continue
            if math.isfinite(value):
                norms.append(value)
    return (statistics.median(norms), max(norms)) if norms else (None, None)
