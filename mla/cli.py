"""Command line entry point: `mla <verb> ...` and `python -m mla <verb> ...`.

Each verb lives in its own module under `mla.commands`, exposing `HELP` (one line),
`add_arguments(parser)` and `run(args) -> int`, optionally `parents()` (argparse parent parsers: `mla
train`'s options come from its config dataclass through transformers.HfArgumentParser). Modules import
torch lazily inside `run`, so `mla --help` and argument errors take well under a second.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# verb -> module; the order is the order of a study (download ... plot)
COMMANDS = {
    "download": "mla.commands.download",
    "plan": "mla.commands.plan",
    "calibrate": "mla.commands.calibrate",
    "convert": "mla.commands.convert",
    "fit": "mla.commands.fit",
    "data": "mla.commands.data",
    "train": "mla.commands.train",
    "export": "mla.commands.export",
    "prefetch": "mla.commands.prefetch",
    "evaluate": "mla.commands.evaluate",
    "serve-bench": "mla.commands.serve_bench",
    "plot": "mla.commands.plot",
    "table": "mla.commands.table",
}


from mla.errors import UserError  # noqa: E402  (re-exported for the command modules)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mla", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    for verb, module_name in COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue  # verb not built yet
        parents = module.parents() if hasattr(module, "parents") else []  # options declared elsewhere
        p = sub.add_parser(verb, help=module.HELP, description=module.HELP, parents=parents)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.verb_args = argv[1:]  # for a verb that parses its options again (`mla train`: over a config file)
    try:
        return int(args._run(args) or 0)
    except UserError as exc:  # bad input: one line, no traceback
        print(f"mla {args.verb}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
