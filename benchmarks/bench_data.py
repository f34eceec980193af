"""`mla data` throughput and memory at 10M and 100M tokens with the real SmolLM2 tokenizer.

The corpus is realistic text repeated: copies (symlinks) of the Python documentation's reStructuredText
(Debian's python3.11-doc; pydoc topics written to files when it is missing), read as a `text_files`
source, tokenized by N worker processes and written as 2048-token blocks. Each size runs in a fresh
process; peak RSS = main process + its largest worker (ru_maxrss of RUSAGE_SELF + RUSAGE_CHILDREN).
Goal: tokens/s scales with the workers, peak RSS does not grow with the tokens.

    .venv/bin/python benchmarks/bench_data.py [--tokens 10000000 100000000] [--workers N] [--tokenizer DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

CHILD = textwrap.dedent("""
    import json, resource, sys, time
    from mla.data import build_dataset
    from mla.data.tokenize import tokenizer_info
    args = json.loads(sys.argv[1])
    tokenizer_info(args["tokenizer_path"])  # imports transformers: not part of the measurement
    before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    m = build_dataset(**args, log=lambda *_: None)
    seconds = time.perf_counter() - start
    written = sum(s["tokens"] for s in m["splits"].values())
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    print(json.dumps({"seconds": seconds, "tokens": written,
                      "documents_read": sum(s["documents_read"] for s in m["sources"].values()),
                      "self_kb": me.ru_maxrss, "children_kb": kids.ru_maxrss,
                      "main_cpu": me.ru_utime + me.ru_stime - before.ru_utime - before.ru_stime,
                      "workers_cpu": kids.ru_utime + kids.ru_stime}))
""")

DOCS = Path("/usr/share/doc/python3.11/html/_sources")
DOC_TOKENS = 2_865_208  # SmolLM2 tokens of those 497 files (+ EOS each), measured


def make_corpus(work: Path, tokens: int) -> Path:
    files = sorted(DOCS.rglob("*.rst.txt")) if DOCS.is_dir() else []
    per_copy = DOC_TOKENS
    if not files:  # pydoc topics as files: ~113k tokens per copy
        from pydoc_data.topics import topics

        base = work / "topics"
        base.mkdir()
        for key in sorted(topics):
            (base / f"{key}.txt").write_text(topics[key])
        files, per_copy = sorted(base.glob("*.txt")), 113_109
    copies = tokens // per_copy + 2
    root = work / "corpus"
    for c in range(copies):
        folder = root / f"copy{c:04d}"
        folder.mkdir(parents=True)
        for i, f in enumerate(files):
            (folder / f"{i:04d}.txt").symlink_to(f)
    corpus = work / "corpus.yaml"
    corpus.write_text(f"name: docs-repeated\nsources:\n  - name: docs\n    weight: 1\n    kind: text_files\n"
                      f"    root: {root}\n    glob: '*/*.txt'\n")
    return corpus


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[10_000_000, 100_000_000])
    p.add_argument("--workers", type=int, default=None, help="default: the CPUs this process may use")
    p.add_argument("--tokenizer", default=str(Path.home() / ".cache/mla/smollm2-135m-instruct-fp32"))
    p.add_argument("--block-length", type=int, default=2048)
    args = p.parse_args()
    from mla.data.build import default_workers

    workers = args.workers or default_workers()
    print(f"tokenizer {args.tokenizer} | {workers} workers | blocks of {args.block_length} | "
          f"corpus: {'python3.11-doc' if DOCS.is_dir() else 'pydoc topics'} repeated | load: {os.getloadavg()[0]:.1f}")
    for tokens in args.tokens:
        with tempfile.TemporaryDirectory(prefix="bench_data.") as tmp:
            work = Path(tmp)
            corpus = make_corpus(work, tokens)
            request = {"corpus": str(corpus), "tokenizer_path": args.tokenizer, "out_dir": str(work / "out"),
                       "block_length": args.block_length, "train_tokens": tokens,
                       "validation_tokens": max(tokens // 100, args.block_length), "validation_fraction": 0.01,
                       "workers": workers}
            proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(request)], capture_output=True, text=True,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
            if proc.returncode != 0:
                sys.exit(proc.stderr[-3000:])
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            rate = r["tokens"] / r["seconds"]
            peak = (r["self_kb"] + r["children_kb"]) / 1024
            print(f"{r['tokens']:>12,} tokens written in {r['seconds']:7.1f} s: {rate:>10,.0f} tokens/s, "
                  f"{rate / workers:>9,.0f} tokens/s per worker process | peak RSS {peak:,.0f} MiB "
                  f"(main {r['self_kb'] / 1024:,.0f} + largest worker {r['children_kb'] / 1024:,.0f}) | "
                  f"{r['documents_read']:,} documents read")
            # The main process reads, splits, mixes and writes; workers tokenize. Their CPU seconds per token
            # say how many workers one main process can feed (the paper's 12.6B tokens on a 32-core node).
            main_rate, worker_rate = r["tokens"] / r["main_cpu"], r["tokens"] / r["workers_cpu"]
            feeds = main_rate / worker_rate
            hours = {n: 12_582_912_000 / (min(n, feeds) * worker_rate) / 3600 for n in (16, 32)}
            print(f"{'':>12}  CPU: main process {main_rate:,.0f} tokens per CPU second, a worker {worker_rate:,.0f}:"
                  f" one main process feeds ~{feeds:.0f} workers; Llama-2-7B's 12.6B tokens (if these rates hold) "
                  + ", ".join(f"~{h:.1f} h on {n} cores" for n, h in hours.items()))


if __name__ == "__main__":
    main()
