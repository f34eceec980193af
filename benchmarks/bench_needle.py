"""Pass-key retrieval of SmolLM2-135M-Instruct (or any checkpoint) at several context lengths, with
binomial standard errors and the seconds each length took.

    python benchmarks/bench_needle.py                       # SmolLM2-135M-Instruct, 256..2048, 10 samples
    python benchmarks/bench_needle.py --model DIR --lengths 512 4096 --samples 20 --cache-nbits 4

Prints one line per length, then one JSON line with the full result (per-sample answers dropped).
"""

from __future__ import annotations

import argparse
import json

import torch

from mla.checkpoint import load_model, load_tokenizer
from mla.evaluation.needle import needle_accuracy
from mla.kv.quantized import KVQuant, cache_factory, implementation


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint folder (default: the cached SmolLM2-135M-Instruct)")
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048])
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=1)
    # one thread: on a shared 2-core machine two OpenMP threads spin-wait on each other (~9x slower)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache-nbits", type=int, choices=(2, 4, 8),
                   help="quantized KV cache instead of the full-precision one (MLA: the latent cache; original: "
                        "optimum-quanto's procedure in torch, 2 or 4 bits; mla/kv/quantized.py)")
    p.add_argument("--cache-group-size", type=int, default=64, help="channels per scale and zero (default 64)")
    p.add_argument("--cache-residual", type=int, default=128, help="newest tokens in full precision (default 128)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.model is None:
        from mla.sources import smollm2_checkpoint
        args.model = str(smollm2_checkpoint())
    model, tokenizer = load_model(args.model, dtype=torch.float32).eval(), load_tokenizer(args.model)
    quant = KVQuant(args.cache_nbits, args.cache_group_size, args.cache_residual) if args.cache_nbits else None
    out = needle_accuracy(model, tokenizer, lengths=args.lengths, samples=args.samples, seed=args.seed,
                          batch_size=args.batch_size, cache_factory=cache_factory(model, quant))
    for length, r in out["lengths"].items():
        print(f"{length:>6} tokens ({r['prompt_tokens_min']}-{r['prompt_tokens_max']}): "
              f"{100 * r['accuracy']:5.1f} ± {100 * r['stderr']:4.1f} %  (n={r['n']})  {r['seconds']:7.1f} s")
    print(f"  mean: {100 * out['mean']:5.1f} ± {100 * out['mean_stderr']:4.1f} %  total {out['seconds']:.1f} s, "
          f"{args.threads} thread(s)")
    for r in out["lengths"].values():
        r.pop("samples")
    print(json.dumps({**out, "model": args.model, "threads": args.threads,
                      "cache": None if quant is None else vars(quant) | {"implementation": implementation(model)}}))


if __name__ == "__main__":
    main()
