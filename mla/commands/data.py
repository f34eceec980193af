"""`mla data`: tokenize and pack a text corpus into train/validation token blocks."""

from __future__ import annotations

from mla.data import build_dataset
from mla.errors import UserError
from mla.options import DEFAULT_VALIDATION_FRACTION, DEFAULT_VALIDATION_TOKENS

HELP = "tokenize a corpus (default: the stdlib's docstrings + sources, offline) into packed train/validation blocks"

EPILOG = """\
corpora: 'pydoc-stdlib' (offline, from the Python that runs this: the standard library's docstrings
0.6 + pydoc's topics 0.1 + its .py files 0.3), 'debian-docs-stdlib' (the documentation's reStructuredText
from Debian's python3.11-doc, or the folder MLA_PYTHON_DOCS names, 0.7 + the .py files 0.3), 'smollm' (the paper's Hub mixture:
fineweb-edu-dedup 0.70, cosmopedia-v2 0.15, python-edu 0.08, open-web-math 0.06, stackoverflow-clean
0.01; needs Hub access, or MLA_HUB_DATASETS_MIRROR / MLA_SWH_CONTENT_URL pointing at local copies, and
--train-tokens), or a YAML/JSON file {name, sources: [{name, weight, kind:
pydoc_topics|python_docstrings|python_docs|python_stdlib|text_files|hub, split_as: SOURCE (optional: split
its documents like another source's, same keys), ...options}]}.
Each split holds exactly budget // block-length blocks, its sources' tokens in the configured shares;
a source that runs dry is reported (manifest and log) and the others fill its share. The output
folder is reused when corpus, tokenizer, block length, budgets, fraction and seed are unchanged; an
interrupted build resumes from its last checkpoint."""


def add_arguments(parser) -> None:
    parser.epilog = EPILOG
    parser.add_argument("--tokenizer", required=True,
                        help="folder with a Hugging Face tokenizer (a model checkpoint folder works)")
    parser.add_argument("--out", required=True, help="output folder (train.bin, validation.bin, manifest.json)")
    parser.add_argument("--corpus", default="pydoc-stdlib", help="named corpus or corpus file (default: %(default)s)")
    parser.add_argument("--block-length", type=int, default=2048, help="tokens per block (default: %(default)s)")
    parser.add_argument("--train-tokens", type=int, default=None,
                        help="training tokens to write, split across sources by weight (default: until a local "
                             "corpus's first source runs dry; required for Hub corpora)")
    parser.add_argument("--validation-tokens", type=int, default=DEFAULT_VALIDATION_TOKENS,
                        help="held-out tokens to write (default: %(default)s)")
    parser.add_argument("--validation-fraction", type=float, default=DEFAULT_VALIDATION_FRACTION,
                        help="share of documents held out for validation, by document hash (default: %(default)s)")
    parser.add_argument("--weight", action="append", default=[], metavar="SOURCE=W",
                        help="override a source's mixture weight (repeatable), e.g. python-stdlib=0.7")
    parser.add_argument("--seed", type=int, default=0,
                        help="document order seed of local sources (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=None,
                        help="tokenizer processes (default: the CPUs this process may use)")
    parser.add_argument("--force", action="store_true", help="rebuild even if OUT holds a different dataset")


def run(args) -> int:
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
        args.corpus, args.tokenizer, args.out, block_length=args.block_length, train_tokens=args.train_tokens,
        validation_tokens=args.validation_tokens,
        validation_fraction=args.validation_fraction, seed=args.seed, workers=args.workers, weights=weights,
        force=args.force,
    )
    s = manifest["splits"]
    print(f"{args.out}: train {s['train']['n_blocks']} blocks, validation {s['validation']['n_blocks']} blocks "
          f"of {manifest['block_length']} tokens")
    return 0
