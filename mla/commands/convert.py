"""`mla convert`: MHA/GQA checkpoint -> MLA checkpoint (+ conversion.json)."""

from mla.options import (
    DEFAULT_LATENT,
    DEFAULT_ROPE_STRATEGY,
    DEFAULT_SVD,
    LATENT_LAYOUTS,
    ROPE_STRATEGIES,
    SVD_METHODS,
)

HELP = "convert a Llama-family checkpoint to Multi-head Latent Attention (partial RoPE + SVD)"


def add_arguments(p):
    p.add_argument("--model", required=True, help="source checkpoint folder")
    p.add_argument("--out", required=True, help="MLA checkpoint folder to write")
    p.add_argument("--d-kv", type=int, help="latent size per KV head (paper's d_kv); not with --svd none")
    p.add_argument("--r", type=int, help="kept RoPE frequency pairs per head (default d_h/16); for rotated and "
                                         "ladder, n_kv·r rotated components: the same cached width")
    p.add_argument("--rope-strategy", default=DEFAULT_ROPE_STRATEGY, choices=ROPE_STRATEGIES,
                   help=f"which pairs keep RoPE (default {DEFAULT_ROPE_STRATEGY}; 2-norm, rotated and ladder need "
                        "--scores). rotated: the best components of each frequency pair mixed across the K/V heads, "
                        "as one RoPE key shared by all query heads; ladder: rotated with at most one component per "
                        "frequency, on DeepSeek's RoPE ladder (what `mla export --format deepseek_v3` needs)")
    p.add_argument("--scores", help="scores file from `mla calibrate` (2-norm scores, and the pair covariances "
                                    "the rotated and ladder strategies need)")
    p.add_argument("--latent", default=DEFAULT_LATENT, choices=LATENT_LAYOUTS,
                   help="per_head (default, the paper's): one key and value per KV head rebuilt from the latent; "
                        "shared: one per query head (DeepSeek's MLA; the same function at conversion)")
    b = p.add_argument_group("budget by cache width (instead of --d-kv and --r)")
    b.add_argument("--kv-width", type=int, metavar="W",
                   help="cached elements per token and layer (latent + RoPE dims)")
    b.add_argument("--rope-share", metavar="S",
                   help="fraction of --kv-width given to RoPE dims, a number or a fraction like 1/3")
    p.add_argument("--svd", default=DEFAULT_SVD, choices=SVD_METHODS,
                   help="joint: one SVD of [W_k,nope; W_v]; split: K and V separately at half width each; "
                        "none: partial RoPE only, K/V at full rank (exact; d_kv follows from the model)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--whiten", metavar="FILE",
                   help="activation-aware SVD: fit the factors to the layer inputs' covariances from "
                        "`mla calibrate --covariance-out FILE` (joint or split)")
    g.add_argument("--covariance", metavar="FILE",
                   help="covariances used only to report each layer's output error (plain SVD)")
    p.add_argument("--rope-fold", type=int, default=1, metavar="F",
                   help="rotated/ladder: each RoPE component mixes F adjacent frequency pairs as well as the K/V "
                        "heads (default 1: none; needs --whiten or --covariance; mla/conversion/freqfold.py)")
    p.add_argument("--attention-aware", action="store_true",
                   help="with --whiten: weigh each key error by the queries that score it and each value error "
                        "by o_proj, K against V balanced (mla/conversion/readers.py)")


def run(args):
    from mla.conversion import convert  # lazy: torch; keeps `mla --help` fast

    report = convert.convert_checkpoint(args.model, args.out, d_kv=args.d_kv, r=args.r,
                                        strategy=args.rope_strategy, scores_path=args.scores, svd=args.svd,
                                        whiten_path=args.whiten, covariance_path=args.covariance,
                                        latent=args.latent, kv_width=args.kv_width, rope_share=args.rope_share,
                                        attention_aware=args.attention_aware, rope_fold=args.rope_fold)
    print(convert.main_report_line(report))
    return 0
