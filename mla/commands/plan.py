"""`mla plan`: what a conversion gives (parameters, KV elements), from the config alone."""

HELP = "print parameter counts and KV-cache size before/after conversion as JSON, without loading weights"


def add_arguments(p):
    p.add_argument("--base", required=True,
                   help="config.json, a checkpoint folder, or a named shape: llama-2-7b, smollm-135m")
    p.add_argument("--d-kv", type=int, action="append",
                   help="latent size per KV head (repeatable; default d_h/2, d_h/4, d_h/8)")
    p.add_argument("--r", type=int, help="kept RoPE frequency pairs per head (default d_h/16)")
    p.add_argument("--svd", default="joint", choices=["joint", "split"])


def run(args):
    import json

    from mla import convert, partial_rope, shapes

    config = shapes.read_config(args.base)
    s = shapes.shape_of(config)
    r = partial_rope.default_r(s.head_dim) if args.r is None else args.r
    d_kvs = args.d_kv or [s.head_dim // 2, s.head_dim // 4, s.head_dim // 8]
    rows = []
    for d_kv in d_kvs:
        convert.resolve_options(config, d_kv, r, "high", args.svd)
        rows.append(shapes.plan(config, d_kv, r, split=args.svd == "split"))
    print(json.dumps(rows if len(rows) > 1 else rows[0], indent=2))
    return 0
