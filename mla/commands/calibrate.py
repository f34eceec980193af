"""`mla calibrate`: 2-norm scores of every RoPE frequency pair, from token blocks of the training data."""

HELP = "compute 2-norm partial-RoPE scores (mean ‖q‖·‖k‖ per pair, per layer and KV head) for a model"


def add_arguments(p):
    p.add_argument("--model", required=True, help="source checkpoint folder")
    p.add_argument("--data", required=True, help="token-block folder from `mla data`")
    p.add_argument("--samples", type=int, default=1024, help="number of sequences (paper: 1,024)")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--split", default="train", choices=["train", "validation"])
    p.add_argument("--out", required=True, help="scores file to write (.pt)")


def run(args):
    import os
    from pathlib import Path

    import torch

    from mla import calibrate, checkpoint
    from mla.errors import UserError

    if args.samples <= 0:
        raise UserError(f"--samples must be positive, got {args.samples}")
    from mla.data import open_blocks

    blocks = open_blocks(args.data, args.split)
    if len(blocks) == 0:
        raise UserError(f"{args.data} holds no {args.split} blocks")
    n = min(args.samples, len(blocks))
    if n < args.samples:
        print(f"note: only {n} blocks available, using all of them (asked for {args.samples})")
    model = checkpoint.load_model(args.model)
    scores = calibrate.two_norm_scores(model, (blocks[i] for i in range(n)), batch_size=args.batch_size)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    torch.save({"scores": scores, "samples": n, "block_length": int(blocks.shape[1]),
                "model": str(args.model), "score": "mean|q|*mean|k| summed over the GQA group"}, tmp)
    os.replace(tmp, out)
    print(f"wrote {out}: scores {list(scores.shape)} from {n} blocks of {blocks.shape[1]} tokens")
    return 0
