"""MMLU (cloze, the paper's prompt) of an original checkpoint on N stratified test questions: the
number a 135M model's MMLU row can be held against (the paper: SmolLM-135M 29.80).

    python benchmarks/bench_mmlu_original.py --model ~/.cache/mla/smollm2-135m-instruct-fp32 --questions 2000

Prints one JSON line (acc_norm, acc, their SEs, questions, seed, seconds, threads).
"""

from __future__ import annotations

import argparse
import json

import torch

from mla.checkpoint import load_model, load_tokenizer
from mla.evaluation import harness


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--questions", type=int, default=2000)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model), load_tokenizer(args.model)
    result = harness.mmlu_cloze(model, tokenizer, num_questions=args.questions, seed=args.seed,
                                batch_size=args.batch_size)
    print(json.dumps({**result, "threads": args.threads, "model": args.model}))


if __name__ == "__main__":
    main()
