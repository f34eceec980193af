"""The spread of a run's gradient norms, from its metrics.csv: (median, max). A run whose largest norm is many
times its median took steps that clipping cut short; unbalanced low-rank factors did that to every converted
run before mla/conversion/lowrank.py balanced them (docs/conversion.md)."""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Iterable
from pathlib import Path


def median_and_max(norms: Iterable) -> tuple[float | None, float | None]:
    """(median, max) of the finite values among `norms` (numbers, or strings as a CSV holds them; empty and
    unparsable ones skipped); (None, None) without any."""
    finite = []
    for value in norms:
        try:
            value = float(value)
        except (TypeError, ValueError):
            continue
        if math.isfinite(value):
            finite.append(value)
    return (statistics.median(finite), max(finite)) if finite else (None, None)


def spread(metrics_csv: str | Path) -> tuple[float | None, float | None]:
    """`median_and_max` of the `grad_norm` column of a metrics.csv."""
    with open(metrics_csv, newline="") as f:
        return median_and_max(row.get("grad_norm") for row in csv.DictReader(f))
