"""Decode speed of MLA vs the original model at SmolLM2-135M shapes (CPU, fp32, random weights).

Goal: at batch 8, context 4096, d_kv = 8 — where cache bytes exceed weight bytes — MLA
(absorbed decode) >= 2x the original's tokens/s and >= 0.7 of the predicted memory-bound ceiling
S(B,T) = (W + B·T·kv_orig) / (W' + B·T·kv_mla) (mla/evaluation/decode.py).

    OMP_NUM_THREADS=2 python benchmarks/bench_decode.py [--grid 1x1024,8x4096] [--d-kv 8] [--steps 8]
        [--profile]     # per-op time of one decode step at the last grid point (where the time goes)

Speed does not depend on the weights' values, so the original is a random Llama with SmolLM2-135M's
config and the MLA model its conversion (SVD of random weights). Each point starts from a cache
already holding `context` random entries and times `steps` single-token steps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                    rms_norm_eps=1e-5, rope_parameters={"rope_theta": 100000.0, "rope_type": "default"},
                    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)


def build_models(d_kv: int, r: int | None):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from mla.conversion.convert import convert_model

    torch.manual_seed(0)
    original = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).eval()
    mla, report = convert_model(original, d_kv=d_kv, r=r, strategy="high")
    return original, mla.eval(), report


def profile_step(model, batch: int, context: int, label: str, rows: int = 12) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from mla.evaluation.decode import filled_cache

    cache = filled_cache(model, batch, context)
    ids = torch.ones(batch, 1, dtype=torch.long)
    with torch.inference_mode():
        model(input_ids=ids, cache=cache, use_cache=True)          # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(input_ids=ids, cache=cache, use_cache=True)
    print(f"\n--- one decode step, {label}, batch {batch}, context {context} (self CPU time) ---")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grid", default="1x1024,8x1024,8x4096", help="BATCHxCONTEXT list")
    p.add_argument("--d-kv", type=int, default=8)
    p.add_argument("--r", type=int, default=None, help="kept RoPE pairs (default d_h/16 = 4)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=4, help="variants take turns this many times per point")
    p.add_argument("--profile", action="store_true", help="profile one step at the last grid point")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)

    import torch

    from mla.evaluation.decode import decode_grid, parse_grid

    grid = parse_grid(args.grid)
    t0 = time.perf_counter()
    original, mla, report = build_models(args.d_kv, args.r)
    print(f"SmolLM2-135M shapes, fp32, torch threads {torch.get_num_threads()} "
          f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}); d_kv={args.d_kv} r={report['r']}; "
          f"KV elements/token {report['kv_elements_per_token_before']} -> {report['kv_elements_per_token_after']}; "
          f"models built in {time.perf_counter() - t0:.1f}s; load average {os.getloadavg()[0]:.1f}")
    res = decode_grid(mla, grid, steps=args.steps, warmup=args.warmup, rounds=args.rounds, original=original,
                      log=None)
    w, w0 = res["weight_bytes"], res["original_weight_bytes"]
    kv, kv0 = res["kv_bytes_per_token"], res["original_kv_bytes_per_token"]
    print(f"weight bytes: original {w0 / 1e6:.1f} MB, MLA {w / 1e6:.1f} MB; cache bytes/token: original "
          f"{kv0} B, MLA {kv} B (ratio {kv0 / kv:.2f}); cache = weights at B·T = {w0 / kv0:.0f} (original)")
    head = (f"{'B':>3} {'T':>6} {'cache/W':>8} {'orig tok/s':>11} {'MLA tok/s':>10} {'MLA abs tok/s':>14} "
            f"{'speedup':>8} {'abs speedup':>12} {'pred S(B,T)':>12} {'abs/pred':>9} {'floor share orig/abs':>21}")
    floor = res.get("floor") or {}
    if floor:   # the batch-1 floor: a step's cost with one cached token (launches, weights)
        print(f"batch-1 floor (1 cached token): original {floor['original_step_s'] * 1e3:.2f} ms/step, MLA absorbed "
              f"{floor['mla_absorbed_step_s'] * 1e3:.2f} ms/step, MLA {floor['mla_step_s'] * 1e3:.2f} ms/step; "
              f"S(1,1) = {floor['predicted_speedup']:.2f}x; cache: {res['cache']}; timing: {res['timing']}")
    print(head)
    for g in res["grid"]:
        ratio = g["batch"] * g["context"] * kv0 / w0
        print(f"{g['batch']:>3} {g['context']:>6} {ratio:>8.2f} {g['original_tps']:>11.1f} {g['mla_tps']:>10.1f} "
              f"{g['mla_absorbed_tps']:>14.1f} {g['speedup']:>7.2f}x {g['speedup_absorbed']:>11.2f}x "
              f"{g['predicted_speedup']:>11.2f}x {g['fraction_of_predicted']:>9.2f} "
              f"{g['floor_share']['original_tps']:>10.2f}/{g['floor_share']['mla_absorbed_tps']:.2f}")
    goal = next((g for g in res["grid"] if (g["batch"], g["context"]) == (8, 4096)), None)
    if goal:
        print(f"goal @ B=8 T=4096 d_kv={args.d_kv}: absorbed speedup {goal['speedup_absorbed']:.2f}x (goal >= 2), "
              f"fraction of predicted {goal['fraction_of_predicted']:.2f} (goal >= 0.7)")
    if args.profile:
        b, t = grid[-1]
        profile_step(original, b, t, "original")
        mla.config.absorb_decode = True
        profile_step(mla, b, t, "MLA absorbed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "report": {k: report[k] for k in ("d_kv", "r")}, **res}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
