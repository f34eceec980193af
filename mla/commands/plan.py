"""`mla plan`: what a conversion gives (parameters, KV elements, the cache's split between RoPE dims and
latent per layer), or with --train the per-GPU memory of a training job (model states per ZeRO stage,
activations, buffers), from the config alone."""

from mla import shapes
from mla.conversion import layout as layouts
from mla.errors import UserError
from mla.options import DEFAULT_LATENT, LATENT_LAYOUTS, ROPE_STRATEGIES
from mla.training.memory import parse_memory, plan_training, teacher_parameters

HELP = ("print parameter counts and KV-cache size before/after conversion, or (--train) the per-GPU memory of "
        "a training job, as JSON, without loading weights")


def add_arguments(p):
    p.add_argument("--base", required=True,
                   help="config.json, a checkpoint folder, or a named shape: llama-2-7b, smollm-135m, llama-3.1-8b, "
                        "llama-3.2-1b, qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b, mistral-7b")
    p.add_argument("--d-kv", type=int, action="append",
                   help="latent size per KV head (repeatable; default d_h/2, d_h/4, d_h/8); with --train: plan the "
                        "converted model (once)")
    p.add_argument("--r", type=int, help="kept RoPE frequency pairs per head (default d_h/16); rotated: n_kv·r "
                                         "components, the same cached width")
    p.add_argument("--svd", default="joint", choices=["joint", "split"])
    p.add_argument("--rope-strategy", default="high", choices=ROPE_STRATEGIES,
                   help="only its layout matters here: rotated and ladder = one RoPE key shared by all query heads "
                        "(2m dims per layer), any other = a RoPE key per KV head (default)")
    p.add_argument("--latent", default=DEFAULT_LATENT, choices=LATENT_LAYOUTS,
                   help="per_head (default): k_up/v_up rebuild n_kv heads; shared: one per query head")
    p.add_argument("--kv-width", type=int, metavar="W",
                   help="budget by cache width: elements per token and layer (with --rope-share; not with --d-kv/--r)")
    p.add_argument("--rope-share", metavar="S", help="fraction of --kv-width given to RoPE dims (e.g. 1/3)")
    q = p.add_argument_group("quantized latent cache (paper Table 2)")
    q.add_argument("--kv-bits", type=int, action="append", choices=[2, 4, 8],
                   help="also give the cache per token quantized to this many bits (repeatable), against the "
                        "original's 16-bit cache: on element bits alone (the paper's figure) and with the scales "
                        "and zero points")
    q.add_argument("--group-size", type=int, default=64, help="channels per scale and zero point (default 64)")
    q.add_argument("--scale-bytes", type=int, default=2, help="bytes of a scale or zero point (default 2, bf16)")
    g = p.add_argument_group("training memory (--train; per GPU, bytes; see mla/training/memory.py)")
    g.add_argument("--train", action="store_true", help="plan the memory of one training job instead")
    g.add_argument("--nproc", type=int, help="GPUs (processes) per node")
    g.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    g.add_argument("--micro-batch", type=int, help="sequences per GPU per forward pass")
    g.add_argument("--seq", type=int, help="tokens per sequence (block length)")
    g.add_argument("--zero-stage", type=int, default=2, choices=[0, 1, 2, 3], help="DeepSpeed ZeRO stage (default 2)")
    g.add_argument("--gradient-checkpointing", action="store_true", help="keep only each layer's input")
    g.add_argument("--offload", action="store_true", help="optimizer states (and fp32 gradients) on the CPU")
    g.add_argument("--precision", default="bf16", choices=["bf16", "fp32"], help="default bf16")
    g.add_argument("--attention", default="sdpa", choices=["sdpa", "eager"],
                   help="attention kernel (default sdpa: no s x s matrix kept)")
    g.add_argument("--gpu-memory", help="memory of one GPU, e.g. 80GB, 141GB, 80GiB: adds usable_bytes and fits")
    g.add_argument("--teacher", nargs="?", const="", metavar="CONFIG",
                   help="with distillation: a whole teacher per GPU and its logits; without a value the unconverted "
                        "--base model (the workflow's default teacher), else its config.json, folder or named shape")
    g.add_argument("--trainable", default="all", choices=["all", "attention"],
                   help="gradients and optimizer states for every parameter (default) or the attention modules' only")


def run(args):
    import json


    config = shapes.read_config(args.base)
    if args.train:
        return _run_train(args, config)
    for flag in ("nproc", "micro_batch", "seq", "gpu_memory", "teacher"):
        if getattr(args, flag) is not None:
            raise UserError(f"--{flag.replace('_', '-')} plans a training job: add --train")
    if args.trainable != "all":
        raise UserError("--trainable plans a training job: add --train")


    s = shapes.shape_of(config)
    budget = dict(strategy=args.rope_strategy, svd=args.svd, latent=args.latent)
    if args.kv_width is not None or args.rope_share is not None:
        if args.d_kv and args.kv_width is not None:
            raise UserError(f"--kv-width {args.kv_width} gives the cache width; leave out --d-kv")
        plans = [layouts.resolve(config, kv_width=args.kv_width, rope_share=args.rope_share, r=args.r, **budget)]
    else:
        r = shapes.default_r(s.head_dim) if args.r is None else args.r
        d_kvs = args.d_kv or [s.head_dim // 2, s.head_dim // 4, s.head_dim // 8]
        plans = [layouts.resolve(config, d_kv=d_kv, r=r, **budget) for d_kv in d_kvs]
    rows = []
    for layout in plans:
        row = shapes.plan_layout(config, layout)
        if args.kv_bits:
            row["kv_quantized"] = [_quantized(s, layout, bits, args.group_size, args.scale_bytes)
                                   for bits in args.kv_bits]
        rows.append(row)
    print(json.dumps(rows if len(rows) > 1 else rows[0], indent=2))
    return 0


def _quantized(s, layout, bits: int, group_size: int, scale_bytes: int) -> dict:
    """The converted cache per token at `bits`, against the original's 16-bit K and V (long-context limit:
    every token quantized, the full-precision window left out)."""
    # lazy: torch; keeps `mla --help` fast
    from mla.modeling.cache_mla import cached_widths, check_quantization, quantized_bytes_per_token

    rows = cached_widths(layout.kv_lora_rank, layout.rope_dims)
    try:
        check_quantization(bits, group_size, rows)
    except ValueError as exc:
        raise UserError(f"--kv-bits {bits} --group-size {group_size}: {exc}") from None
    before_bytes = shapes.kv_elements_original(s) * 2
    element_bytes = s.layers * layout.kv_width * bits / 8
    with_overhead = s.layers * sum(quantized_bytes_per_token(c, bits, group_size, scale_bytes)
                                   for c in rows.values() if c)
    return {"bits": bits, "group_size": group_size, "scale_bytes": scale_bytes,
            "bytes_per_token_before_16bit": before_bytes,
            "bytes_per_token_element_bits": element_bytes,
            "kv_reduction_percent_element_bits": round(100 * (1 - element_bytes / before_bytes), 4),
            "bytes_per_token_with_scales": with_overhead,
            "kv_reduction_percent_with_scales": round(100 * (1 - with_overhead / before_bytes), 4)}


def _run_train(args, config) -> int:
    import json


    for flag in ("nproc", "micro_batch", "seq"):
        if getattr(args, flag) is None:
            raise UserError(f"--train needs --{flag.replace('_', '-')}")
    if args.d_kv and len(args.d_kv) > 1:
        raise UserError("--train plans one model: give --d-kv once")
    d_kv = args.d_kv[0] if args.d_kv else None
    r = args.r
    if d_kv is not None:   # the same checks as the conversion (family, rank, r range)
        from mla.conversion import convert  # lazy: torch; keeps `mla --help` fast

        r, _ = convert.resolve_options(config, d_kv, r, "high", args.svd)
    elif r is not None:
        raise UserError("--r needs --d-kv (it plans the converted model)")
    teacher_params = None
    if args.teacher is not None:
        teacher_params = teacher_parameters(shapes.read_config(args.teacher) if args.teacher else config)
    plan = plan_training(config, nproc=args.nproc, nodes=args.nodes, micro_batch=args.micro_batch, seq=args.seq,
                         zero_stage=args.zero_stage, gradient_checkpointing=args.gradient_checkpointing,
                         offload=args.offload, precision=args.precision, d_kv=d_kv, r=r, svd=args.svd,
                         attention=args.attention, trainable=args.trainable, teacher_params=teacher_params,
                         gpu_memory_bytes=parse_memory(args.gpu_memory) if args.gpu_memory else None)
    print(json.dumps(plan, indent=2))
    return 0
