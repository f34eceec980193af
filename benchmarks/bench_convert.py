"""Conversion cost on SmolLM2-135M per d_kv: wall time vs loading the model, peak RSS vs fp32 weight bytes.

Each measurement runs in a fresh process (peak RSS is per process). Prints one line per d_kv and a
summary; goal: peak RSS <= 1.5x the fp32 weight bytes.

    .venv/bin/python benchmarks/bench_convert.py [--d-kv 8 16 32]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap

CHILD = textwrap.dedent("""
    import json, resource, sys, time
    t0 = time.perf_counter()
    import torch, transformers, mla.modeling  # noqa: F401
    from mla import checkpoint
    from mla.conversion import convert
    rss_imports = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    mode, src, out, d_kv = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    t1 = time.perf_counter()
    if mode == "load":
        model = checkpoint.load_model(src)
        weight_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    else:
        convert.convert_checkpoint(src, out, d_kv=d_kv, r=4, strategy="uniform")
        weight_bytes = None
    t2 = time.perf_counter()
    print(json.dumps({"seconds": t2 - t1, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "rss_after_imports": rss_imports, "weight_bytes": weight_bytes}))
""")


def measure(mode: str, src: str, out: str, d_kv: int) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, mode, src, out, str(d_kv)], capture_output=True, text=True,
                          check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-kv", type=int, nargs="+", default=[8, 16, 32])
    args = parser.parse_args()
    from mla.sources import smollm2_checkpoint

    src = str(smollm2_checkpoint())
    load = measure("load", src, "", 0)
    weights = load["weight_bytes"]
    print(f"load: {load['seconds']:.2f} s, peak RSS {load['peak_rss'] / 2**20:.0f} MiB "
          f"(imports alone {load['rss_after_imports'] / 2**20:.0f} MiB), fp32 weights {weights / 2**20:.0f} MiB")
    for d_kv in args.d_kv:
        with tempfile.TemporaryDirectory() as tmp:
            conv = measure("convert", src, f"{tmp}/out", d_kv)
        above_imports = conv["peak_rss"] - conv["rss_after_imports"]
        print(f"d_kv={d_kv}: convert+save {conv['seconds']:.2f} s = {conv['seconds'] / load['seconds']:.2f}x load; "
              f"peak RSS {conv['peak_rss'] / 2**20:.0f} MiB = {conv['peak_rss'] / weights:.2f}x weight bytes "
              f"({above_imports / weights:.2f}x above the process's import footprint)")


if __name__ == "__main__":
    main()
