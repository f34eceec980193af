"""`mla export`: MLA checkpoint -> a checkpoint in another model's format that stock engines load."""

HELP = "export an MLA checkpoint in the DeepSeek-V3 format (transformers, vLLM; no remote code)"
FORMATS = ("deepseek_v3",)


def add_arguments(p):
    p.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="MLA checkpoint folder converted with --rope-strategy ladder (fine-tuned or not)")
    p.add_argument("--format", required=True, choices=FORMATS,
                   help="deepseek_v3: DeepseekV3ForCausalLM, all layers dense, latent padded to 512 + 64 RoPE dims")
    p.add_argument("--out", required=True, help="checkpoint folder to write (replaced atomically)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"),
                   help="weights' dtype (default: the checkpoint's own)")


def run(args):
    from mla.export import deepseek_v3  # lazy: torch; keeps `mla --help` fast

    report = deepseek_v3.export_checkpoint(args.checkpoint, args.out, dtype=args.dtype)
    print(deepseek_v3.report_line(report))
    return 0
