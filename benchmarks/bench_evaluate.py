"""Sizing the default run's evaluation: perplexity throughput and spread, local-task time per question.

On the real SmolLM2-135M (fp32, CPU): tokens/s of held-out perplexity at 128-token blocks (batch 1 and
8), the standard deviation of per-block mean losses (how many blocks a standard error needs), and the
seconds per question of the local lm-eval task, with its accuracy and standard error.

    OMP_NUM_THREADS=2 python benchmarks/bench_evaluate.py [--blocks 64] [--docs 32] [--block-length 128]

Blocks are cut from Python's own documentation (pydoc topics, prose) and standard-library sources (code),
the two sources of the offline default corpus, in the default's 70/30 proportion.
"""

from __future__ import annotations

import argparse
import json
import math
import time


def text_blocks(tokenizer, n_blocks: int, length: int, prose_share: float = 0.7, seed: int = 0):
    import random
    import sysconfig
    from pathlib import Path

    import numpy as np
    from pydoc_data.topics import topics

    rng = random.Random(seed)
    prose = list(topics.values())
    code = [p.read_text(encoding="utf-8", errors="ignore")
            for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))]
    rng.shuffle(prose)
    rng.shuffle(code)
    out = []
    for source, share in ((prose, prose_share), (code, 1 - prose_share)):
        want, ids = round(n_blocks * share), []
        for doc in source:
            ids += tokenizer(doc)["input_ids"] + [tokenizer.eos_token_id]
            if len(ids) >= want * length:
                break
        out += [ids[i * length:(i + 1) * length] for i in range(want)]
    rng.shuffle(out)
    return np.array(out, dtype=np.int64)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--block-length", type=int, default=128)
    p.add_argument("--docs", type=int, default=32, help="questions of the local task")
    args = p.parse_args(argv)

    import torch

    from mla.checkpoint import load_model, load_tokenizer
    from mla.evaluation.harness import local_task
    from mla.perplexity import perplexity
    from mla.sources import smollm2_checkpoint

    path = smollm2_checkpoint()
    model, tok = load_model(path).eval(), load_tokenizer(path)
    blocks = text_blocks(tok, args.blocks, args.block_length)
    out = {"threads": torch.get_num_threads(), "block_length": args.block_length, "blocks": len(blocks)}
    perplexity(model, blocks[:2], batch_size=2)                       # warm-up
    for batch in (1, 8):
        t0 = time.perf_counter()
        res = perplexity(model, blocks, batch_size=batch)
        seconds = time.perf_counter() - t0
        out[f"ppl_tokens_per_s_batch{batch}"] = res["tokens"] / seconds
    sd = res["mean_loss_stderr"] * math.sqrt(res["blocks"])
    out.update(mean_loss=res["mean_loss"], perplexity=res["perplexity"], perplexity_stderr=res["perplexity_stderr"],
               block_loss_sd=sd, blocks_for_se_0_02_nats=math.ceil((sd / 0.02) ** 2),
               blocks_for_se_0_05_nats=math.ceil((sd / 0.05) ** 2))
    t0 = time.perf_counter()
    loc = local_task(model, tok, num_docs=args.docs)
    seconds = time.perf_counter() - t0
    out.update(local_docs=loc["n"], local_seconds=seconds, local_seconds_per_question=seconds / loc["n"],
               local_acc_norm=loc["acc_norm"], local_acc_norm_stderr=loc["acc_norm_stderr"])
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
