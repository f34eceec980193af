"""Training throughput on SmolLM2-135M shapes, fp32, CPU: prints tokens/s and ratios.

1. converted model (MLA, d_kv 16, r 4) vs the unconverted baseline, same bare PyTorch loop
   (goal: ratio >= 0.95);
2. `mla train` (Trainer + DeepSpeed, one process, each ZeRO stage asked for) vs the bare loop on the
   same model and batch (goal: ratio >= 0.85).

Both wall-clock tokens/s and tokens per CPU-second (process time of all threads) are printed: on a
machine shared with other jobs the CPU figures are the stable ones (run with --threads 1 there).

Weights: the real SmolLM2-135M from `mla.sources.smollm2_checkpoint()` when it is cached (or --model),
else a random init of the same config (speed does not depend on the values). Timed steps exclude one
warm-up step; `mla train` figures are medians over its steps after step 1 (metrics.csv, run.json).

    OMP_NUM_THREADS=2 python benchmarks/bench_train.py [--steps 4] [--stages 0 2] [--breakdown]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def model_dir(arg: str | None, work: Path) -> Path:
    if arg:
        return Path(arg)
    from mla import sources

    cached = sources.cache_dir() / "smollm2-135m-instruct-fp32"
    if (cached / "config.json").is_file():
        return cached
    # random init of the embedded SmolLM-135M shape, with the tiny tokenizer (data only needs ids < vocab)
    from transformers import LlamaConfig, LlamaForCausalLM

    from mla.tiny_models import tiny_tokenizer

    cfg = json.loads((Path(__file__).resolve().parents[1] / "mla" / "shapes" / "smollm-135m.json").read_text())
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_") and k not in ("model_type", "architectures")}
    out = work / "smollm-random"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**cfg)).save_pretrained(out)
    tiny_tokenizer().save_pretrained(out)
    return out


def bare_ab(paths: dict[str, Path], data: Path, steps: int, batch: int, threads: int) -> dict[str, dict]:
    """Bare loop (forward, backward, clip, AdamW step) for several models in one process, alternating
    one step of each so that load from other processes hits all alike. Returns per model the median
    wall-clock and CPU (process time, all threads) seconds per step, warm-up step excluded."""
    from mla.checkpoint import load_model
    from mla.data import open_blocks
    from mla.training.trainer import BlockDataset

    torch.set_num_threads(threads)
    ds = BlockDataset(open_blocks(data), (steps + 1) * batch, seed=42)
    runs = {}
    for name, path in paths.items():
        model = load_model(path).train()
        model.config.use_cache = False
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
        runs[name] = (model, opt, [], [])
    for step in range(steps + 1):
        ids = torch.stack([ds[i]["input_ids"] for i in range(step * batch, (step + 1) * batch)])
        for model, opt, wall, cpu in runs.values():
            t0, c0 = time.perf_counter(), time.process_time()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    return {name: {"wall": statistics.median(w[1:]), "cpu": statistics.median(c[1:])}
            for name, (_, _, w, c) in runs.items()}


def mla_train(path: Path, data: Path, out: Path, steps: int, batch: int, stage: int, threads: int,
              breakdown: bool = False) -> dict:
    """`mla train` in a subprocess; median wall and CPU seconds per step after step 1 (from its outputs)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "mla", "train", "--model", str(path), "--data", str(data), "--out", str(out),
           "--steps", str(steps + 1), "--micro-batch", str(batch), "--zero-stage", str(stage), "--warmup-steps", "0",
           "--decay-steps", "0", "--save-steps", "1000000", "--threads", str(threads), "--no-mlflow"]
    if breakdown:
        override = out.with_name(out.name + ".ds.json")
        override.write_text(json.dumps({"wall_clock_breakdown": True, "steps_per_print": 1}))
        cmd += ["--deepspeed", str(override)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"mla train failed:\n{proc.stderr[-3000:]}")
    if breakdown:
        print(f"--- DeepSpeed wall-clock breakdown, ZeRO-{stage} (ms per step) ---")
        for line in (proc.stdout + proc.stderr).splitlines():
            if "time (ms)" in line:
                print("  " + line.split("|", 1)[-1].strip())
    with open(out / "metrics.csv") as f:
        tps = [float(r["tokens_per_second"]) for r in csv.DictReader(f)]
    info = json.loads((out / "run.json").read_text())
    tokens = batch * int(json.loads((data / "manifest.json").read_text())["block_length"])
    return {"wall": tokens / statistics.median(tps[1:]), "cpu": statistics.median(info["cpu_seconds_per_step"][1:])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="baseline checkpoint (default: cached SmolLM2-135M, else random init)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per measurement")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--d-kv", type=int, default=16)
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    p.add_argument("--stages", type=int, nargs="*", default=[0, 2])
    p.add_argument("--breakdown", action="store_true", help="print DeepSpeed's per-step wall-clock breakdown")
    args = p.parse_args()

    from mla.conversion.convert import convert_checkpoint
    from mla.data import build_dataset

    with tempfile.TemporaryDirectory(prefix="bench_train.") as tmp:
        work = Path(tmp)
        base = model_dir(args.model, work)
        mla_dir = work / "mla"
        convert_checkpoint(base, mla_dir, d_kv=args.d_kv, strategy="high")
        data = work / "data"
        build_dataset("pydoc-stdlib", base, data, block_length=args.seq,
                      train_tokens=args.seq * args.batch * (args.steps + 2), validation_tokens=args.seq,
                      log=lambda *_: None)
        print(f"model {base} | batch {args.batch} x {args.seq} | fp32 | {args.threads} threads | "
              f"{args.steps} timed steps")

        tokens = args.batch * args.seq
        bare = bare_ab({"baseline": base, "mla": mla_dir}, data, args.steps, args.batch, args.threads)
        runs = {"bare loop, baseline": bare["baseline"], f"bare loop, MLA d_kv {args.d_kv}": bare["mla"]}
        for stage in args.stages:
            runs[f"mla train ZeRO-{stage}, baseline"] = mla_train(base, data, work / f"run{stage}", args.steps,
                                                                  args.batch, stage, args.threads, args.breakdown)
        print(f"{'':34s} {'tokens/s (wall)':>16s} {'tokens/CPU-s':>14s}")
        for name, r in runs.items():
            print(f"{name:34s} {tokens / r['wall']:16.1f} {tokens / r['cpu']:14.1f}")

        def ratio(a, b):
            return f"wall {b['wall'] / a['wall']:.3f}, CPU {b['cpu'] / a['cpu']:.3f}"

        print(f"ratio converted / baseline (bare loop): {ratio(bare['mla'], bare['baseline'])}  (goal >= 0.95)")
        for stage in args.stages:
            print(f"ratio mla train ZeRO-{stage} / bare loop: "
                  f"{ratio(runs[f'mla train ZeRO-{stage}, baseline'], bare['baseline'])}  (goal >= 0.85)")

if __name__ == "__main__":
    main()
