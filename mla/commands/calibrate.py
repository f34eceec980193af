"""`mla calibrate`: 2-norm scores of every RoPE frequency pair, from token blocks of the training data."""

HELP = "compute 2-norm partial-RoPE scores (mean ‖q‖·‖k‖ per pair, per layer and KV head) for a model"


def _batch_size(text: str):
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        import argparse

        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {text!r}")
    return int(text)


def add_arguments(p):
    p.add_argument("--model", required=True, help="source checkpoint folder")
    p.add_argument("--data", required=True, help="token-block folder from `mla data`")
    p.add_argument("--samples", type=int, default=1024, help="number of sequences (paper: 1,024)")
    p.add_argument("--batch-size", type=_batch_size, default="auto",
                   help="sequences per forward pass, or 'auto' (default): as many as the device's free memory holds")
    p.add_argument("--device", default="auto",
                   help="auto (CUDA when present, default) | cpu | cuda; bf16 on GPUs that support it, else fp32")
    p.add_argument("--split", default="train", choices=["train", "validation"])
    p.add_argument("--out", required=True, help="scores file to write (.pt)")


def run(args):
    import os
    from pathlib import Path

    import torch

    from mla import calibrate, checkpoint, devices
    from mla.errors import UserError

    if args.samples <= 0:
        raise UserError(f"--samples must be positive, got {args.samples}")
    device = devices.resolve_device(args.device, config_key="calibrate.device")   # before any loading
    from mla.data import open_blocks

    blocks = open_blocks(args.data, args.split)
    if len(blocks) == 0:
        raise UserError(f"{args.data} holds no {args.split} blocks")
    n = min(args.samples, len(blocks))
    if n < args.samples:
        print(f"note: only {n} blocks available, using all of them (asked for {args.samples})")
    dtype = devices.compute_dtype(device)
    model = checkpoint.load_model(args.model, dtype=dtype).to(device)
    block_length = int(blocks.shape[1])
    batch_size = args.batch_size
    if batch_size == "auto":
        free = devices.free_memory_bytes(device)
        batch_size = calibrate.auto_batch_size(model.config, block_length, dtype.itemsize, free, n)
        per_sample = calibrate.activation_bytes_per_sample(model.config, block_length, dtype.itemsize)
        print(f"calibrate: batch size {batch_size} ({devices.gib(per_sample)} per sequence of {block_length} "
              f"tokens, {devices.gib(free)} free on {device})")
    print(f"calibrate: {n} blocks on {devices.describe(device, dtype)}, batches of {batch_size}")
    scores = calibrate.two_norm_scores(model, (blocks[i] for i in range(n)), batch_size=batch_size)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    torch.save({"scores": scores, "samples": n, "block_length": block_length, "model": str(args.model),
                "device": str(device), "dtype": str(dtype).removeprefix("torch."),
                "score": "mean|q|*mean|k| summed over the GQA group"}, tmp)
    os.replace(tmp, out)
    print(f"wrote {out}: scores {list(scores.shape)} from {n} blocks of {block_length} tokens")
    return 0
