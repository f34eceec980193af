"""`mla fit`: train each converted attention layer to reproduce the original layer's outputs (layer-wise
fitting, teacher-forced; mla/conversion/fit.py) and write the fitted MLA checkpoint (+ fit.json)."""

from mla.errors import UserError
from mla.options import FIT_DEFAULTS, FIT_SCHEDULES

HELP = "fit each converted attention layer to the original layer's attention outputs, layer by layer"


def add_arguments(p):
    p.add_argument("--model", required=True, help="MLA checkpoint from `mla convert` (the layers to fit)")
    p.add_argument("--source", required=True, help="the original checkpoint it was converted from (the teacher)")
    p.add_argument("--data", required=True, help="token-block folder from `mla data` (train: fitting, validation: errors)")
    p.add_argument("--out", required=True, help="fitted MLA checkpoint folder to write (with fit.json)")
    p.add_argument("--steps", type=int, default=FIT_DEFAULTS["steps"],
                   help=f"Adam steps per layer (default {FIT_DEFAULTS['steps']})")
    p.add_argument("--lr", type=float, default=FIT_DEFAULTS["lr"], help=f"learning rate, the peak of --schedule (default {FIT_DEFAULTS['lr']})")
    p.add_argument("--blocks", type=int, default=FIT_DEFAULTS["blocks"],
                   help=f"training blocks to fit on, the first of the train split (default {FIT_DEFAULTS['blocks']})")
    p.add_argument("--batch", type=int, default=FIT_DEFAULTS["batch"],
                   help=f"blocks per step (default {FIT_DEFAULTS['batch']})")
    p.add_argument("--heldout", type=int, default=FIT_DEFAULTS["heldout"],
                   help="validation blocks (evenly spaced) for each layer's error and the held-out loss "
                        f"before and after (default {FIT_DEFAULTS['heldout']})")
    p.add_argument("--span", type=int, default=FIT_DEFAULTS["span"],
                   help="consecutive data blocks joined into one fit sequence; --blocks, --batch and --heldout then "
                        f"count sequences (default {FIT_DEFAULTS['span']}: a block each)")
    p.add_argument("--echo", type=int, default=FIT_DEFAULTS["echo"],
                   help="tokens of each training sequence's first half repeated in its second half, so that the "
                        f"fit asks for copying from far back (default {FIT_DEFAULTS['echo']}: none)")
    p.add_argument("--schedule", choices=FIT_SCHEDULES, default=FIT_DEFAULTS["schedule"],
                   help="learning rate over each layer's steps: constant, or cosine decay to 0 "
                        f"(default {FIT_DEFAULTS['schedule']})")
    p.add_argument("--seed", type=int, default=0, help="order in which the steps draw blocks (default 0)")
    p.add_argument("--device", default="auto",
                   help="auto (CUDA when present, default) | cpu | cuda; bf16 on GPUs that support it, else fp32")


def run(args):
    for flag in ("steps", "blocks", "batch", "heldout", "span"):
        if getattr(args, flag) <= 0:
            raise UserError(f"--{flag} must be a positive integer, got {getattr(args, flag)}")
    if args.echo < 0:
        raise UserError(f"--echo must be 0 or more tokens, got {args.echo}")
    if not args.lr > 0:
        raise UserError(f"--lr must be positive, got {args.lr}")
    from mla.conversion import fit  # lazy: torch; keeps `mla --help` fast

    settings = fit.FitSettings(steps=args.steps, lr=args.lr, blocks=args.blocks, batch=args.batch,
                               heldout=args.heldout, seed=args.seed, span=args.span, echo=args.echo,
                               schedule=args.schedule)
    report = fit.fit_checkpoint(args.source, args.model, args.data, args.out, settings, device=args.device)
    print(fit.report_line(report))
    return 0
