"""What `mla plot` and `mla table` share: where the output goes, what it is made from (a spec file, a workflow
config, or items in command-line order), and the MLflow summary run the output is attached to."""

from __future__ import annotations

import argparse
from pathlib import Path

from mla import tracking


class Ordered(argparse.Action):
    """Keeps the item options in command-line order (args.items), so each attaches to the item started before it
    (a plot's --run to its --panel, a table's --eval to its --variant)."""

    def __call__(self, parser, namespace, values, option_string=None):
        items = getattr(namespace, "items", None) or []
        items.append((self.dest, values))
        namespace.items = items


def add_source_arguments(p: argparse.ArgumentParser, epilog: str, *, out: str, spec: str, config: str) -> None:
    """--out, and the two sources besides the Ordered items (args.items, none by default): --spec and --config."""
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = epilog
    p.add_argument("--out", required=True, help=out)
    p.add_argument("--spec", help=spec)
    p.add_argument("--config", help=config)
    p.set_defaults(items=[])


def add_summary_arguments(p: argparse.ArgumentParser, what: str) -> None:
    """The MLflow summary run that `what` (the figure, the table) is logged to."""
    p.add_argument("--tracking-uri", help=f"MLflow tracking URI: log {what} to a summary run")
    p.add_argument("--experiment", help="MLflow experiment of the summary run (with --tracking-uri)")
    p.add_argument("--summary-run", default="summary", help="name of the summary run (default: summary)")


def log_summary_artifacts(tracking_uri: str, experiment: str, run_name: str, paths: list[Path]) -> None:
    """Attach figures/tables to an experiment-level summary run (mla/tracking.py)."""
    run_id = tracking.get_or_create_run(tracking_uri, experiment, run_name, tags={"variant": "summary"})
    tracking.log_artifacts(run_id, [str(p) for p in paths], tracking_uri=tracking_uri)
    tracking.set_terminated(run_id, tracking_uri=tracking_uri)
