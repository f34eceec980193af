"""Training throughput on SmolLM2-135M shapes, fp32, CPU: prints tokens/s and ratios.

1. converted model (MLA, d_kv 16, r 4) vs the unconverted baseline, same bare PyTorch loop
   (goal: ratio >= 0.95);
2. `mla train` (Trainer + DeepSpeed, one process, each ZeRO stage asked for) vs the bare loop on the
   same model and batch (goal: ratio >= 0.85).

Weights: the real SmolLM2-135M from `mla.sources.smollm2_checkpoint()` when it is cached (or --model),
else a random init of the same config (speed does not depend on the values). Timed steps exclude one
warm-up step; `mla train` figures are the median of its per-step tokens/s (metrics.csv) after step 1.

    OMP_NUM_THREADS=2 python benchmarks/bench_train.py [--steps 4] [--stages 0 2] [--profile]
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

    from mla.testing import tiny_tokenizer

    cfg = json.loads((Path(__file__).resolve().parents[1] / "mla" / "shapes" / "smollm-135m.json").read_text())
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_") and k not in ("model_type", "architectures")}
    out = work / "smollm-random"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**cfg)).save_pretrained(out)
    tiny_tokenizer().save_pretrained(out)
    return out


def bare_loop(path: Path, data: Path, steps: int, batch: int, threads: int) -> float:
    """tokens/s of model(ids, labels) -> backward -> clip -> AdamW step over `steps` timed steps."""
    from mla.checkpoint import load_model
    from mla.data import open_blocks
    from mla.training.trainer import BlockDataset

    torch.set_num_threads(threads)
    model = load_model(path).train()
    model.config.use_cache = False
    ds = BlockDataset(open_blocks(data), (steps + 1) * batch, seed=42)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    times = []
    for step in range(steps + 1):
        ids = torch.stack([ds[i]["input_ids"] for i in range(step * batch, (step + 1) * batch)])
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return batch * ids.shape[1] / statistics.median(times[1:])


def mla_train(path: Path, data: Path, out: Path, steps: int, batch: int, stage: int, threads: int,
              profile: Path | None = None) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    prefix = [sys.executable, "-m", "cProfile", "-o", str(profile), "-m", "mla"] if profile else \
        [sys.executable, "-m", "mla"]
    cmd = prefix + ["train", "--model", str(path), "--data", str(data), "--out", str(out), "--steps", str(steps + 1),
                    "--micro-batch", str(batch), "--zero-stage", str(stage), "--warmup-steps", "0",
                    "--decay-steps", "0", "--save-steps", "1000000", "--threads", str(threads), "--no-mlflow"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"mla train failed:\n{proc.stderr[-3000:]}")
    with open(out / "metrics.csv") as f:
        tps = [float(r["tokens_per_second"]) for r in csv.DictReader(f)]
    return statistics.median(tps[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="baseline checkpoint (default: cached SmolLM2-135M, else random init)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per measurement")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--d-kv", type=int, default=16)
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    p.add_argument("--stages", type=int, nargs="*", default=[0, 2])
    p.add_argument("--profile", action="store_true", help="cProfile the first `mla train` run (prints top entries)")
    args = p.parse_args()

    from mla.convert import convert_checkpoint
    from mla.data import build_dataset

    with tempfile.TemporaryDirectory(prefix="bench_train.") as tmp:
        work = Path(tmp)
        base = model_dir(args.model, work)
        mla_dir = work / "mla"
        convert_checkpoint(base, mla_dir, d_kv=args.d_kv, strategy="high")
        data = work / "data"
        build_dataset("pydoc-stdlib", base, data, block_length=args.seq,
                      max_train_tokens=args.seq * args.batch * (args.steps + 2), max_validation_tokens=args.seq,
                      log=lambda *_: None)
        print(f"model {base} | batch {args.batch} x {args.seq} | fp32 | {args.threads} threads | "
              f"{args.steps} timed steps")

        results = {}
        # interleave A/B so that load from other processes hits both sides alike
        results["bare baseline"] = [bare_loop(base, data, args.steps, args.batch, args.threads)]
        results["bare mla"] = [bare_loop(mla_dir, data, args.steps, args.batch, args.threads)]
        for stage in args.stages:
            prof = work / f"stage{stage}.prof" if args.profile and stage == args.stages[-1] else None
            results[f"mla train zero{stage}"] = [mla_train(base, data, work / f"run{stage}", args.steps, args.batch,
                                                           stage, args.threads, prof)]
            if prof:
                import pstats

                print(f"--- cProfile of `mla train --zero-stage {stage}` (cumulative, top 25) ---")
                pstats.Stats(str(prof)).sort_stats("cumulative").print_stats(25)
        results["bare mla"].append(bare_loop(mla_dir, data, args.steps, args.batch, args.threads))
        results["bare baseline"].append(bare_loop(base, data, args.steps, args.batch, args.threads))

        tps = {k: statistics.mean(v) for k, v in results.items()}
        for k, v in results.items():
            print(f"{k:22s} {tps[k]:8.1f} tokens/s  (runs: {', '.join(f'{x:.1f}' for x in v)})")
        print(f"ratio converted/baseline (bare loop): {tps['bare mla'] / tps['bare baseline']:.3f}  (goal >= 0.95)")
        for stage in args.stages:
            print(f"ratio mla train zero{stage} / bare loop: "
                  f"{tps[f'mla train zero{stage}'] / tps['bare baseline']:.3f}  (goal >= 0.85)")


if __name__ == "__main__":
    main()
