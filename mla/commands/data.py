"""`mla data`: tokenize and pack a text corpus into train/validation token blocks."""

from __future__ import annotations

HELP = "tokenize a corpus (default: Python docs + stdlib, offline) into packed train/validation blocks"

EPILOG = """\
corpora: 'pydoc-stdlib' (offline: pydoc topics 0.7 + standard-library .py files 0.3),
'smollm' (the paper's Hub mixture: fineweb-edu-dedup 0.70, cosmopedia-v2 0.15, python-edu 0.08,
open-web-math 0.06, stackoverflow-clean 0.01; needs Hub access and --max-tokens), or a YAML/JSON
file {sources: [{name, weight, kind: pydoc_topics|python_stdlib|text_files|hub, ...options}]}.
The output folder is reused when corpus, tokenizer, block length, caps and seed are unchanged."""


def add_arguments(parser) -> None:
    parser.epilog = EPILOG
    parser.add_argument("--tokenizer", required=True,
                        help="folder with a Hugging Face tokenizer (a model checkpoint folder works)")
    parser.add_argument("--out", required=True, help="output folder (train.npy, validation.npy, manifest.json)")
    parser.add_argument("--corpus", default="pydoc-stdlib", help="named corpus or corpus file (default: %(default)s)")
    parser.add_argument("--block-length", type=int, default=2048, help="tokens per block (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="cap on training tokens, split across sources by weight (default: all, keeping weights)")
    parser.add_argument("--max-validation-tokens", type=int, default=None,
                        help="cap on validation tokens (default: all held-out documents, keeping weights)")
    parser.add_argument("--validation-fraction", type=float, default=0.05,
                        help="share of documents held out for validation, by document hash (default: %(default)s)")
    parser.add_argument("--weight", action="append", default=[], metavar="SOURCE=W",
                        help="override a source's mixture weight (repeatable), e.g. python-stdlib=0.7")
    parser.add_argument("--seed", type=int, default=0, help="document order seed (default: %(default)s)")
    parser.add_argument("--force", action="store_true", help="rebuild even if OUT holds a different dataset")


def run(args) -> int:
    from mla.cli import UserError
    from mla.data import build_dataset

    weights = {}
    for item in args.weight:
        name, sep, value = item.partition("=")
        try:
            weights[name] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise UserError(f"--weight {item!r}: expected SOURCE=NUMBER")
    manifest = build_dataset(
        args.corpus, args.tokenizer, args.out, block_length=args.block_length,
        max_train_tokens=args.max_tokens, max_validation_tokens=args.max_validation_tokens,
        validation_fraction=args.validation_fraction, seed=args.seed, weights=weights, force=args.force,
    )
    s = manifest["splits"]
    print(f"{args.out}: train {s['train']['n_blocks']} blocks, validation {s['validation']['n_blocks']} blocks "
          f"of {manifest['block_length']} tokens")
    return 0
