"""`mla calibrate`: 2-norm scores of every RoPE frequency pair, from token blocks of the training data."""

from mla import atomic, checkpoint, devices
from mla import data as data_folder  # open_blocks looked up when called: tests stand in for it
from mla.errors import UserError

HELP = ("compute 2-norm partial-RoPE scores (mean ‖q‖·‖k‖ per pair, per layer and KV head) for a model, with the "
        "keys' pair covariances across K/V heads that the rotated strategy needs")


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
    p.add_argument("--covariance-out", metavar="FILE",
                   help="also write every layer's attention-input second moment E[x xᵀ] from the same pass "
                        "(for `mla convert --whiten`), plus one from held-out blocks (error reports)")
    p.add_argument("--heldout-samples", type=int, default=32,
                   help="validation blocks for the held-out covariance (default 32; 0: none)")


def run(args):
    from mla.conversion import calibrate  # lazy: torch; keeps `mla --help` fast

    if args.samples <= 0:
        raise UserError(f"--samples must be positive, got {args.samples}")
    if args.heldout_samples < 0:
        raise UserError(f"--heldout-samples must be 0 or more, got {args.heldout_samples}")
    device = devices.resolve_device(args.device, config_key="calibrate.device")   # before any loading

    blocks = data_folder.open_blocks(args.data, args.split)
    if len(blocks) == 0:
        raise UserError(f"{args.data} holds no {args.split} blocks")
    n = min(args.samples, len(blocks))
    if n < args.samples:
        print(f"note: only {n} blocks available, using all of them (asked for {args.samples})")
    dtype = devices.compute_dtype(device)
    model = checkpoint.load_model(args.model, dtype=dtype).to(device)
    block_length = int(blocks.shape[1])
    batch_size = args.batch_size
    want_cov = args.covariance_out is not None
    if batch_size == "auto":
        free = devices.free_memory_bytes(device) - (calibrate.covariance_bytes(model.config) if want_cov else 0)
        batch_size = calibrate.auto_batch_size(model.config, block_length, dtype.itemsize, free, n)
        per_sample = calibrate.activation_bytes_per_sample(model.config, block_length, dtype.itemsize)
        print(f"calibrate: batch size {batch_size} ({devices.gib(per_sample)} per sequence of {block_length} "
              f"tokens, {devices.gib(free)} free on {device})")
    print(f"calibrate: {n} blocks on {devices.describe(device, dtype)}, batches of {batch_size}")
    result = calibrate.calibration_pass(model, (blocks[i] for i in range(n)), batch_size=batch_size,
                                       covariance=want_cov)
    scores = result["scores"]
    if want_cov:
        _write_covariances(args, model, result, batch_size)
    out = _save_atomically({"scores": scores, "samples": n, "block_length": block_length, "model": str(args.model),
                            "device": str(device), "dtype": str(dtype).removeprefix("torch."),
                            "score": "mean|q|*mean|k| summed over the GQA group",
                            # for --rope-strategy rotated (mla/conversion/rotation.py)
                            "query_pair_norms": result["query_pair_norms"],
                            "pair_covariance": result["pair_covariance"]}, args.out)
    print(f"wrote {out}: scores {list(scores.shape)} from {n} blocks of {block_length} tokens")
    return 0


def _save_atomically(obj: dict, path: str):
    """torch.save through mla.atomic: a killed job leaves no half-written file."""
    import torch


    with atomic.staged(path) as tmp:
        torch.save(obj, tmp)
    return path


def _write_covariances(args, model, result: dict, batch_size: int) -> None:
    """The covariance file: fit (the calibration blocks) and held-out (validation blocks) second moments."""
    from mla.conversion import calibrate  # lazy: torch; keeps `mla --help` fast

    heldout, heldout_tokens = None, 0
    if args.heldout_samples:
        valid = data_folder.open_blocks(args.data, "validation")
        m = min(args.heldout_samples, len(valid))
        if m:
            held = calibrate.calibration_pass(model, (valid[i] for i in range(m)), batch_size=batch_size,
                                              scores=False, covariance=True)
            heldout, heldout_tokens = held["covariance"], held["tokens"]
        else:
            print("note: no validation blocks, so the covariance file has no held-out part")
    cov = result["covariance"]
    out = _save_atomically({"covariance": cov, "tokens": result["tokens"], "heldout": heldout,
                            "heldout_tokens": heldout_tokens, "layers": cov.shape[0], "hidden_size": cov.shape[1],
                            "model": str(args.model),
                            "moment": "E[x x^T] of each layer's attention input (after input_layernorm)"},
                           args.covariance_out)
    print(f"wrote {out}: covariances {list(cov.shape)} from {result['tokens']} tokens"
          + (f", held-out from {heldout_tokens}" if heldout is not None else ""))
