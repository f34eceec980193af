"""MLA checkpoints served by llama.cpp beside their original model, in one build, with the same threads and the
same weight type: KV bytes per token as llama.cpp allocates them, decode and prompt tokens/s at several
contexts, held-out perplexity from llama.cpp's logits beside transformers', greedy agreement with transformers,
for each K cache type (f16, q8_0, q4_0 by default). Ratios come from one run on one machine.

    python benchmarks/bench_llamacpp.py --mla DIR [--mla DIR ...] [--original DIR|smollm2] [--data DIR]
        [--type f16] [--cache-types f16 q8_0 q4_0] [--contexts 512 2048 8192] [--steps 32] [--threads 2]

Each MLA checkpoint (converted with --rope-strategy ladder) is exported with `mla export --format gguf`: once
laid out for f16 caches and, when a block-quantized type is asked, once padded for it; the original once.
Without --data, prompts and blocks are Python's pydoc topics through the original's tokenizer. Needs the
llama.cpp venv: scripts/llamacpp-env (once per machine).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]   # the checkout's package, without installing

from mla.evaluation import serving, serving_llamacpp  # noqa: E402
from mla.evaluation.llamacpp_engine import LlamaCppEnvMissing, llamacpp_python  # noqa: E402
from mla.export import engines, llamacpp  # noqa: E402


def pydoc_rows(original: Path, prompts: int, blocks: int, length: int = 128) -> tuple[list, list]:
    """Prompts (the first 32 tokens) and blocks of `length` tokens from pydoc's topics, spread over them."""
    from pydoc_data.topics import topics

    from mla.checkpoint import load_tokenizer

    tok = load_tokenizer(original)
    rows = [ids[:length] for ids in (tok(topics[k]).input_ids for k in sorted(topics)) if len(ids) >= length]
    step = max(1, len(rows) // max(prompts, blocks))
    spread = rows[::step]
    return [r[:serving.PROMPT_TOKENS] for r in spread[:prompts]], spread[:blocks]


def export_files(mla_dir: Path, folder: Path, weight_type: str, cache_types: list[str]) -> list[Path]:
    layouts = {"f16"} | {"q8_0" for t in cache_types if engines.cache_block(t) > 1}
    files = []
    for layout in sorted(layouts):
        out = folder / f"{mla_dir.name}-{layout}.gguf"
        print(llamacpp.report_line(llamacpp.export_gguf(mla_dir, out, weight_type, cache_type=layout)))
        files.append(out)
    return files


def print_table(name: str, result: dict) -> None:
    print(f"\n{name} ({result['threads']} threads; transformers fp32 on the MLA checkpoint: perplexity "
          f"{result['transformers_mla']['perplexity']:.2f} ± {result['transformers_mla']['perplexity_stderr']:.2f})")
    print("| K cache | KV bytes/token MLA / original (ratio; vs original f16) | decode tok/s MLA / original (ratio) "
          "per context | prompt tok/s ratio | perplexity llama.cpp MLA / original | loss − transformers' | greedy |")
    print("|---|---|---|---|---|---|---|")
    for c in result["cache_types"]:
        decode = "; ".join(f"{d['context']}: {d['export_decode_tokens_per_s']:.1f} / {d['original_decode_tokens_per_s']:.1f} "
                           f"({d['decode_speedup']:.2f}x)" for d in c["decode"])
        prompt = "; ".join(f"{d['prompt_speedup']:.2f}x" for d in c["decode"])
        p, diff, a = c["perplexity"], c["perplexity"]["export_minus_transformers_loss"], c["greedy_agreement"]
        print(f"| {c['cache_type']} | {c['export']['kv_bytes_per_token']:.0f} / {c['original']['kv_bytes_per_token']:.0f} "
              f"({c['kv_bytes_ratio']:.3f}x; {c.get('kv_bytes_ratio_vs_original_f16', float('nan')):.3f}x) | {decode} | "
              f"{prompt} | {p['export']['perplexity']:.2f} ± {p['export']['perplexity_stderr']:.2f} / "
              f"{p['original']['perplexity']:.2f} | {diff['mean']:+.4f} ± {diff['stderr']:.4f} | "
              f"{a['prompts_agreeing']}/{a['prompts']} (near-ties: {a['all_near_ties']}) |")
    for c in result["cache_types"][:1]:
        for side in ("export", "original"):
            m = c[side]["decode_model"]
            if m:
                print(f"  llama.cpp decode time, {side} ({c['cache_type']}): {m['ms_per_call_at_0']:.1f} ms per call "
                      f"+ {m['ms_per_1k_context']:.2f} ms per 1K cached tokens (flash attention: "
                      f"{c[side]['flash_attention']})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mla", type=Path, action="append", required=True, help="MLA checkpoint (ladder layout)")
    p.add_argument("--original", default="smollm2", help="the original checkpoint, or 'smollm2' (cached)")
    p.add_argument("--data", help="`mla data` folder (validation split); default: pydoc topics")
    p.add_argument("--type", default="f16", choices=("f32", "f16", "bf16", "q8_0"), help="weights of both files")
    p.add_argument("--cache-types", nargs="+", default=["f16", "q8_0", "q4_0"])
    p.add_argument("--contexts", nargs="+", type=int, default=[512, 2048, 8192])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--flash-attn", nargs="+", default=["auto"], choices=("auto", "on", "off"),
                   help="llama.cpp's flash attention, each measured (off: unquantized caches only)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)

    try:
        llamacpp_python()
    except LlamaCppEnvMissing as err:
        print(f"bench_llamacpp: {err}", file=sys.stderr)
        return 1
    import torch

    torch.set_num_threads(args.threads)
    if args.original == "smollm2":
        from mla.sources import smollm2_checkpoint
        original = smollm2_checkpoint()
    else:
        original = Path(args.original)
    if args.data:
        prompts, blocks = serving.heldout_prompts(args.data, args.prompts), serving.heldout_blocks(args.data, args.blocks)
    else:
        prompts, blocks = pydoc_rows(original, args.prompts, args.blocks)
    grid = [(args.batch, t) for t in args.contexts]
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-llamacpp-") as tmp:
        original_file = Path(tmp) / "original.gguf"
        print(llamacpp.report_line(llamacpp.export_gguf(original, original_file, args.type)))
        for mla_dir in args.mla:
            files = export_files(mla_dir, Path(tmp), args.type, args.cache_types)
            for flash in args.flash_attn:
                types = args.cache_types if flash != "off" else [t for t in args.cache_types if engines.cache_block(t) == 1]
                results[f"{mla_dir} flash_attn={flash}"] = result = serving_llamacpp.measure(
                    files, original_file, mla_dir, prompts, blocks, grid, args.steps, args.max_tokens, types,
                    args.threads, flash_attn=flash)
                print_table(f"{mla_dir}, flash attention {flash}", result)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
