"""Plain vs activation-aware SVD on real weights: held-out loss right after conversion, no fine-tuning.

For each d_kv, the model is converted twice with the same 2-norm partial RoPE (r pairs), once with the
plain SVD of [W_k,nope; W_v] (the paper) and once with the SVD fitted to the attention inputs'
covariance from the calibration blocks (mla.conversion.lowrank). Prints a Markdown table and JSON: mean held-out
loss with its standard error, perplexity, the mean relative output error of the K/V projections on
held-out inputs.

    OMP_NUM_THREADS=2 python benchmarks/bench_whitening.py --model ~/.cache/mla/smollm2-135m \
        --data results/data/smollm2-135m [--samples 128] [--blocks 256] [--d-kv 8 16 32] [--r 4]
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    import torch

    from mla import checkpoint
    from mla.conversion import calibrate
    from mla.conversion.convert import convert_model
    from mla.data import open_blocks
    from mla.perplexity import perplexity

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--samples", type=int, default=128, help="training blocks for scores and covariances")
    p.add_argument("--heldout-cov-blocks", type=int, default=32, help="validation blocks for the output error")
    p.add_argument("--blocks", type=int, default=256, help="validation blocks scored (evenly spaced)")
    p.add_argument("--d-kv", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--r", type=int, default=4)
    p.add_argument("--svd", default="joint", choices=["joint", "split"])
    args = p.parse_args()

    torch.manual_seed(0)
    start = time.perf_counter()
    model = checkpoint.load_model(args.model)
    train, valid = open_blocks(args.data, "train"), open_blocks(args.data, "validation")
    n = min(args.samples, len(train))
    cal = calibrate.calibration_pass(model, (train[i] for i in range(n)), batch_size=8, covariance=True)
    held = calibrate.calibration_pass(model, (valid[i] for i in range(min(args.heldout_cov_blocks, len(valid)))),
                                      batch_size=8, scores=False, covariance=True)
    covs = {"covariance": cal["covariance"], "heldout": held["covariance"]}
    calibration_s = time.perf_counter() - start

    rows = [{"d_kv": None, "svd": "original", **perplexity(model, valid, batch_size=8, max_blocks=args.blocks)}]
    for d_kv in args.d_kv:
        for whiten in (False, True):
            converted, report = convert_model(model, d_kv=d_kv, r=args.r, strategy="2-norm", scores=cal["scores"],
                                              svd=args.svd, covariances=covs, whiten=whiten)
            result = perplexity(converted, valid, batch_size=8, max_blocks=args.blocks)
            rows.append({"d_kv": d_kv, "svd": f"{args.svd}, activation-aware" if whiten else args.svd,
                         "output_error_heldout": report["output_error_mean"],
                         "weight_error": report["reconstruction_error_mean"], **result})
            del converted
    print("| d_kv | SVD | K/V output error (held out) | weight error | held-out loss ± SE | perplexity |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        err = "" if row["d_kv"] is None else f"{row['output_error_heldout']:.3f}"
        werr = "" if row["d_kv"] is None else f"{row['weight_error']:.3f}"
        print(f"| {row['d_kv'] or '—'} | {row['svd']} | {err} | {werr} | "
              f"{row['mean_loss']:.3f} ± {row['mean_loss_stderr']:.3f} | {row['perplexity']:.1f} |")
    print(json.dumps({"samples": n, "calibration_tokens": cal["tokens"], "blocks": rows[0]["blocks"],
                      "tokens_scored": rows[0]["tokens"], "r": args.r, "calibration_s": round(calibration_s, 1),
                      "total_s": round(time.perf_counter() - start, 1),
                      "rows": [{k: v for k, v in r.items() if k != "stderr_method"} for r in rows]}, indent=1))


if __name__ == "__main__":
    main()
