#!/usr/bin/env python3
"""Sum Snakemake's benchmark files per rule: jobs, wall seconds, CPU seconds, peak RSS.

    python scripts/benchmark_summary.py [WORKDIR]      # default: the current directory

Reads WORKDIR/benchmarks/<rule>/<wildcards>.tsv (the `benchmark:` files of the workflow). CPU
seconds are what a dedicated machine would spend; on a shared machine wall seconds are larger.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path


def main(workdir: str = ".") -> int:
    root = Path(workdir) / "benchmarks"
    files = sorted(root.rglob("*.tsv"))
    if not files:
        print(f"no benchmark files under {root}", file=sys.stderr)
        return 1
    rules: dict[str, list[float]] = {}
    for f in files:
        rows = list(csv.DictReader(f.open(), delimiter="\t"))
        if not rows:
            continue
        row = rows[-1]
        rule = f.relative_to(root).parts[0]
        acc = rules.setdefault(rule, [0, 0.0, 0.0, 0.0])
        acc[0] += 1
        acc[1] += float(row["s"])
        acc[2] += float(row.get("cpu_time") or 0)
        acc[3] = max(acc[3], float(row.get("max_rss") or 0))
    print(f"{'rule':<12}{'jobs':>5}{'wall s':>10}{'cpu s':>10}{'max RSS MB':>12}")
    for rule, (n, wall, cpu, rss) in rules.items():
        print(f"{rule:<12}{n:>5}{wall:>10.1f}{cpu:>10.1f}{rss:>12.0f}")
    total = [sum(v[i] for v in rules.values()) for i in range(3)]
    print(f"{'total':<12}{int(total[0]):>5}{total[1]:>10.1f}{total[2]:>10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
