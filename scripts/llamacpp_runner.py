"""llama.cpp on one GGUF file, run by the llama.cpp venv's python (scripts/llamacpp-env), never by the project's.

That venv has llama-cpp-python and numpy only, so this file imports nothing of the `mla` package. One model
load answers everything a caller asks of it, through llama.cpp's own C API (llama-cpp-python's ctypes layer):

* the K and V cache llama.cpp allocated, as its own log states it (type, MiB, cells), and whether it chose
  flash attention;
* greedy continuations of token-id prompts (token ids in, token ids out);
* teacher-forced next-token negative log-likelihoods of token blocks, from llama.cpp's logits;
* prompt processing and decode tokens/s at BATCHxCONTEXT points: B sequences of T random tokens processed,
  then `steps` tokens decoded per sequence, timed by the wall clock and by llama.cpp's own counters.

    python scripts/llamacpp_runner.py --model FILE.gguf --out RESULT.json [--threads 2] [--cache-type f16]
        [--flash-attn auto|on|off] [--prompts PROMPTS.json --max-tokens 16] [--blocks BLOCKS.json]
        [--bench 1x512 --bench 1x8192 --bench-steps 32]

PROMPTS.json and BLOCKS.json are lists of token-id lists. The result is one JSON object (`main`).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import re
import time

import llama_cpp as L
import numpy as np

CACHE_TYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0", "q5_1": "Q5_1", "q5_0": "Q5_0",
               "q4_1": "Q4_1", "q4_0": "Q4_0", "iq4_nl": "IQ4_NL"}
FLASH_ATTN = {"auto": L.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": L.LLAMA_FLASH_ATTN_TYPE_ENABLED,
              "off": L.LLAMA_FLASH_ATTN_TYPE_DISABLED}
KV_LINE = re.compile(r"llama_kv_cache: size = +([\d.]+) MiB \( *(\d+) cells, +(\d+) layers, +(\d+)/(\d+) seqs\), "
                     r"K \((\w+)\): +([\d.]+) MiB, V \((\w+)\): +([\d.]+) MiB")
LOGS: list[str] = []
# llama.cpp logs its cache in MiB to two decimals: over 4096 cells that resolves 2.6 bytes per token
MIN_CTX = 4096


@L.llama_log_callback
def _collect(level, text, user_data):
    LOGS.append(text.decode(errors="replace"))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="GGUF file")
    parser.add_argument("--out", required=True, help="JSON result file")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--cache-type", default="f16", choices=CACHE_TYPES, help="K (and V) cache type")
    parser.add_argument("--flash-attn", default="auto", choices=FLASH_ATTN)
    parser.add_argument("--ctx", type=int, default=0,
                        help=f"context cells (default: what the requests need, at least {MIN_CTX})")
    parser.add_argument("--prompts", help="JSON file: token-id prompts for greedy continuations")
    parser.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per prompt")
    parser.add_argument("--blocks", help="JSON file: token blocks scored teacher-forced (next-token NLL)")
    parser.add_argument("--bench", action="append", default=[], metavar="BxT",
                        help="speed at B sequences of T prompt tokens (repeatable)")
    parser.add_argument("--bench-steps", type=int, default=32, help="decode steps per sequence")
    return parser.parse_args(argv)


class Engine:
    """One model and one context with room for every request; sequences are cleared between requests."""

    def __init__(self, path: str, threads: int, cache_type: str, flash_attn: str, n_ctx: int, n_seq: int,
                 n_batch: int):
        L.llama_log_set(_collect, ctypes.c_void_p(0))
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {path}:\n{''.join(LOGS[-20:])}")
        params = L.llama_context_default_params()
        params.n_ctx, params.n_seq_max, params.n_batch, params.n_ubatch = n_ctx, n_seq, n_batch, min(n_batch, 512)
        params.n_outputs_max = params.n_outputs_max_per_seq = n_batch
        params.n_threads = params.n_threads_batch = threads
        params.type_k = params.type_v = getattr(L, f"GGML_TYPE_{CACHE_TYPES[cache_type]}")
        params.flash_attn_type = FLASH_ATTN[flash_attn]
        params.kv_unified = True
        params.no_perf = False                           # llama.cpp's own timings (llama_perf_context)
        self.ctx = L.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise SystemExit(f"llama.cpp refused the context:\n{''.join(LOGS[-20:])}")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.n_batch = n_batch
        self.batch = L.llama_batch_init(n_batch, 0, n_seq)

    def clear(self) -> None:
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)

    def decode(self, rows: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) rows."""
        b = self.batch
        b.n_tokens = len(rows)
        for i, (token, pos, seq, logits) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        status = L.llama_decode(self.ctx, b)
        if status != 0:
            raise SystemExit(f"llama_decode returned {status}:\n{''.join(LOGS[-20:])}")

    def prefill(self, tokens: list[int], seq: int = 0, logits: str = "last") -> None:
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start:start + self.n_batch]
            last = start + len(chunk) == len(tokens)
            self.decode([(t, start + i, seq, logits == "all" or (last and i == len(chunk) - 1))
                         for i, t in enumerate(chunk)])

    def logits(self, rows: int) -> np.ndarray:
        """The logits of the last decode's first `rows` outputs, [rows, vocab] (a copy)."""
        return np.ctypeslib.as_array(L.llama_get_logits(self.ctx), shape=(rows, self.n_vocab)).copy()


def kv_cache() -> dict:
    """The K/V cache as llama.cpp's log states it (its own numbers, printed to 0.01 MiB)."""
    line = next((m for m in map(KV_LINE.search, LOGS) if m), None)
    if line is None:
        raise SystemExit("no llama_kv_cache size line in llama.cpp's log")
    total, cells, layers, seqs, _, type_k, k_mib, type_v, v_mib = line.groups()
    flash = next((("enabled" in s) for s in LOGS if "Flash Attention" in s and "resolve_fused_ops" in s), None)
    return {"cells": int(cells), "layers": int(layers), "seqs": int(seqs), "type_k": type_k, "k_mib": float(k_mib),
            "type_v": type_v, "v_mib": float(v_mib), "mib": float(total),
            "bytes_per_token": (float(k_mib) + float(v_mib)) * 2 ** 20 / int(cells),
            "bytes_per_token_resolution": 0.01 * 2 ** 20 / int(cells), "flash_attention": flash}


def greedy(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    out = []
    for prompt in prompts:
        engine.clear()
        engine.prefill(prompt)
        chosen = []
        for step in range(max_tokens):
            chosen.append(int(engine.logits(1)[0].argmax()))
            if step + 1 < max_tokens:
                engine.decode([(chosen[-1], len(prompt) + step, 0, True)])
        out.append(chosen)
    return out


def block_nll(engine: Engine, blocks: list[list[int]]) -> list[dict]:
    """Per block: the summed next-token NLL (nats) and its token count, from llama.cpp's logits (fp64 softmax)."""
    out = []
    for block in blocks:
        engine.clear()
        engine.prefill(block, logits="all")
        logits = engine.logits(len(block))[:-1].astype(np.float64)
        top = logits.max(-1, keepdims=True)
        logz = np.log(np.exp(logits - top).sum(-1)) + top[:, 0]
        nll = logz - logits[np.arange(len(block) - 1), block[1:]]
        out.append({"nll": float(nll.sum()), "tokens": len(block) - 1,
                    "argmax_hits": int((logits.argmax(-1) == np.array(block[1:])).sum())})
    return out


def speed(engine: Engine, batch: int, context: int, steps: int, seed: int = 0) -> dict:
    """B sequences of T random tokens processed (prompt tokens/s), then `steps` decode steps of one token per
    sequence (decode tokens/s), on a cleared cache; llama.cpp's own counters beside the wall clock."""
    rng = random.Random(seed)
    engine.clear()
    L.llama_perf_context_reset(engine.ctx)
    start = time.perf_counter()
    for seq in range(batch):
        engine.prefill([rng.randrange(1, engine.n_vocab) for _ in range(context)], seq=seq)
    prompt_s = time.perf_counter() - start
    start = time.perf_counter()
    for step in range(steps):
        engine.decode([(rng.randrange(1, engine.n_vocab), context + step, seq, True) for seq in range(batch)])
        engine.logits(batch)
    decode_s = time.perf_counter() - start
    perf = L.llama_perf_context(engine.ctx)
    return {"batch": batch, "context": context, "steps": steps, "prompt_s": prompt_s, "decode_s": decode_s,
            "prompt_tokens_per_s": batch * context / prompt_s, "decode_tokens_per_s": batch * steps / decode_s,
            "llama_prompt_ms": perf.t_p_eval_ms, "llama_prompt_tokens": perf.n_p_eval,
            "llama_decode_ms": perf.t_eval_ms, "llama_decode_calls": perf.n_eval}


def main(argv=None) -> None:
    args = parse_args(argv)
    prompts = json.load(open(args.prompts)) if args.prompts else []
    blocks = json.load(open(args.blocks)) if args.blocks else []
    points = [tuple(int(x) for x in p.split("x")) for p in args.bench]
    seqs = max([b for b, _ in points] + [1])
    needed = max([len(p) + args.max_tokens for p in prompts] + [len(b) for b in blocks]
                 + [b * (t + args.bench_steps) for b, t in points] + [MIN_CTX])
    n_ctx = args.ctx or -(-needed // 256) * 256
    n_batch = max([len(b) for b in blocks] + [512])
    start = time.perf_counter()
    engine = Engine(args.model, args.threads, args.cache_type, args.flash_attn, n_ctx, seqs, n_batch)
    result = {"engine": "llama.cpp", "llama_cpp_python": L.__version__, "load_s": time.perf_counter() - start,
              "threads": args.threads, "cache_type": args.cache_type, "n_ctx": n_ctx, "kv_cache": kv_cache(),
              "system_info": L.llama_print_system_info().decode()}
    if prompts:
        result["tokens"] = greedy(engine, prompts, args.max_tokens)
    if blocks:
        result["blocks"] = block_nll(engine, blocks)
    if points:
        speed(engine, 1, 64, 4)                           # warm-up: first calls allocate and pick kernels
        result["bench"] = [speed(engine, b, t, args.bench_steps) for b, t in points]
    with open(args.out + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(args.out + ".tmp", args.out)               # a killed run leaves no half-written result


if __name__ == "__main__":
    main()
