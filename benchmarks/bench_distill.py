"""The cost of distillation and the saving of attention-only training per training step (docs/distillation.md).

In one process, one step of each arm in turn (so that load from other processes hits all arms alike), on the
converted student and its source model as the teacher, with the loss `mla train` computes
(mla.training.distill.token_kl):

    ce         forward, backward, AdamW step of the student (the paper's fine-tuning)
    ce+kl      the teacher's forward (no_grad) first, then the same with + weight·T²·KL
    attn+kl    ce+kl with only the attention parameters trainable (mla.training.trainable)

Prints, per arm, the median wall-clock and CPU (process time, all threads) seconds per step, warm-up step
excluded, and each arm's ratio to `ce` as the mean of the per-round ratios ± its standard error. On a machine
shared with other jobs the CPU figures are the stable ones.

    OMP_NUM_THREADS=2 python benchmarks/bench_distill.py --student MLA_DIR --teacher SOURCE_DIR --data DATA_DIR \\
        [--steps 8] [--batch 4] [--threads 2]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np
import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--student", required=True, help="converted checkpoint (mla convert)")
    p.add_argument("--teacher", required=True, help="its source checkpoint")
    p.add_argument("--data", required=True, help="mla data folder")
    p.add_argument("--steps", type=int, default=8, help="timed steps per arm (after one warm-up step)")
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from mla.checkpoint import load_model
    from mla.data import open_blocks
    from mla.training.distill import Distillation, load_teacher, token_kl
    from mla.training.optimizer import parameter_groups
    from mla.training.trainable import select_trainable

    teacher = Distillation(load_teacher(args.teacher, bf16=False), weight=1.0, temperature=1.0)
    arms = {}
    for name, trainable, distill in (("ce", "all", None), ("ce+kl", "all", teacher), ("attn+kl", "attention", teacher)):
        model = load_model(args.student).train()
        model.config.use_cache = False
        select_trainable(model, trainable)
        opt = torch.optim.AdamW(parameter_groups(model, 0.01), lr=1e-5, betas=(0.9, 0.95), eps=1e-8)
        arms[name] = (model, opt, distill)
    blocks = open_blocks(args.data, "train")

    def step(name: str, ids: torch.Tensor) -> tuple[float, float]:
        model, opt, distill = arms[name]
        t0, c0 = time.perf_counter(), time.process_time()
        target = distill.teacher_logits(ids) if distill else None
        out = model(input_ids=ids, labels=ids)
        loss = out.loss if distill is None else distill.combined(out.loss, token_kl(out.logits, target, ids, 1.0))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, time.process_time() - c0

    wall = {n: [] for n in arms}
    cpu = {n: [] for n in arms}
    for i in range(args.steps + 1):
        ids = torch.from_numpy(np.asarray(blocks[i * args.batch:(i + 1) * args.batch], dtype=np.int64))
        for name in arms:
            w, c = step(name, ids)
            if i:   # the first round warms up allocators and kernels
                wall[name].append(w)
                cpu[name].append(c)
        print(f"round {i}: " + ", ".join(f"{n} {wall[n][-1] if i else 0:.1f} s" for n in arms), flush=True)

    print(f"\n{args.batch} x {blocks.shape[1]} tokens per step, {args.threads} threads, {args.steps} timed rounds")
    print(f"{'arm':8s} {'wall s/step':>12s} {'CPU s/step':>11s} {'wall vs ce':>15s} {'CPU vs ce':>15s}")
    for name in arms:
        cells = [f"{name:8s} {statistics.median(wall[name]):12.2f} {statistics.median(cpu[name]):11.2f}"]
        for series in (wall, cpu):
            ratios = [a / b for a, b in zip(series[name], series["ce"])]
            se = statistics.stdev(ratios) / math.sqrt(len(ratios)) if len(ratios) > 1 else float("nan")
            cells.append(f"{statistics.mean(ratios):8.3f} ± {se:.3f}")
        print(" ".join(cells))


if __name__ == "__main__":
    main()
