"""`mla plot`: the paper's loss-vs-step figures (one panel per experiment) as PNG and PDF."""

from __future__ import annotations

import argparse
from pathlib import Path

from mla.commands.report_args import Ordered, add_source_arguments, add_summary_arguments, log_summary_artifacts
from mla.errors import UserError
from mla.specfile import read_mapping
from mla.study import config_file, figures, reports

HELP = "draw loss-vs-step figures (MHA2MLA / GQA2MLA panels) from training metrics.csv files."

EPILOG = """\
Panels are given either as a spec file or on the command line, in order:

  mla plot --out results/figures/loss \\
      --panel "SmolLM-135M" --kind GQA \\
          --run 8=results/train/smollm/dkv8/metrics.csv \\
          --run 16=results/train/smollm/dkv16/metrics.csv \\
          --run baseline=results/train/smollm/baseline/metrics.csv \\
      --panel "Llama-2-7B" --kind MHA --run 16=... --run 32=... --run 64=... --run baseline=...

Every --kind/--run belongs to the --panel before it. RUN is D_KV=PATH (a converted run with that
latent size per KV head), baseline=PATH (the fine-tuned unconverted model, drawn in black) or
NAME=PATH (a converted run of a sweep; give --label). Legend labels: "GQA2MLA d_kv = 8", ..., "GQA"
(kind GQA) or "MHA2MLA d_kv = 16", ..., "MHA"; --label TEXT after a --run replaces its label, and
--conversion JSON (the run's conversion.json) adds the KV-cache saving to it, e.g. "(−87.50 % KV)".

--spec FILE (JSON or YAML) holds the same as {"panels": [{"title": ..., "kind": "GQA",
"runs": [{"d_kv": 8, "metrics": PATH}, {"baseline": true, "metrics": PATH}]}]}; relative paths
resolve against the spec file's folder. --config FILE draws a workflow config's figure as the
workflow does (one panel per experiment, mla/study/reports.py), with MLflow's store and experiment
from the config:

  mla plot --config config.yaml --out results/figures/loss

Writes OUT.png and OUT.pdf.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_source_arguments(p, EPILOG, out="output path stem; writes OUT.png and OUT.pdf",
                         spec="JSON/YAML panel spec (instead of --panel/--kind/--run)",
                         config="workflow config (YAML): one panel per experiment")
    p.add_argument("--panel", action=Ordered, metavar="TITLE", help="start a panel titled TITLE (model name)")
    p.add_argument("--kind", action=Ordered, metavar="MHA|GQA", help="architecture of the panel's source model")
    p.add_argument("--run", action=Ordered, metavar="D_KV=PATH|baseline=PATH|NAME=PATH",
                   help="a run of the current panel")
    p.add_argument("--label", action=Ordered, metavar="TEXT", help="legend label of the run before it")
    p.add_argument("--conversion", action=Ordered, metavar="JSON",
                   help="conversion.json of the run before it: its KV saving goes into the legend")
    p.add_argument("--smoothing", type=float, default=0.9,
                   help="EMA weight of the smoothed curve in [0, 1) (default 0.9)")
    add_summary_arguments(p, "the figure")


def panels_from_items(items: list[tuple[str, str]]) -> list[dict]:
    panels: list[dict] = []
    for key, value in items:
        if key == "panel":
            panels.append({"title": value, "runs": []})
            continue
        if not panels:
            raise UserError(f"--{key} {value!r} comes before any --panel")
        if key == "kind":
            panels[-1]["kind"] = value
        elif key in ("label", "conversion"):
            if not panels[-1]["runs"]:
                raise UserError(f"--{key} {value!r} comes before any --run of its panel")
            panels[-1]["runs"][-1][key] = value
        else:
            name, sep, path = value.partition("=")
            if not sep or not path:
                raise UserError(f"--run {value!r}: expected D_KV=PATH or baseline=PATH")
            if name.strip().lower() in ("baseline", "mha", "gqa", "original"):
                panels[-1]["runs"].append({"baseline": True, "metrics": path})
            else:
                try:
                    panels[-1]["runs"].append({"d_kv": int(name), "metrics": path})
                except ValueError:  # a named run of a sweep: its label is its name unless --label follows
                    panels[-1]["runs"].append({"label": name.strip(), "metrics": path})
    return panels


def load_spec(path: str) -> list[dict]:
    p = Path(path)
    data = read_mapping(p, "--spec file")
    if not isinstance(data.get("panels"), list):
        raise UserError(f"{p}: expected a mapping with a 'panels' list")
    for panel in data["panels"]:
        for run in panel.get("runs", []) if isinstance(panel, dict) else []:
            if "metrics" in run and not Path(run["metrics"]).is_absolute():
                run["metrics"] = str(p.parent / run["metrics"])
    return data["panels"]


def run(args) -> int:
    if sum(map(bool, (args.spec, args.items, args.config))) > 1:
        raise UserError("give one of --spec, --config or --panel/--kind/--run")
    if args.config:
        cfg = config_file.load(args.config)
        specs = reports.figure_panels(cfg)
        args.tracking_uri = args.tracking_uri or cfg["mlflow"]["tracking_uri"]
        args.experiment = args.experiment or cfg["mlflow"]["experiment"]
    else:
        specs = load_spec(args.spec) if args.spec else panels_from_items(args.items)
    if not specs:
        raise UserError("nothing to plot: give --spec FILE or at least one --panel with --run")
    try:
        panels = [figures.panel_from_dict(s) for s in specs]
        fig = figures.loss_figure(panels, smoothing=args.smoothing)
    except figures.FigureInputError as exc:
        raise UserError(str(exc)) from None
    paths = figures.save_figure(fig, args.out)
    for path in paths:
        print(path)
    if args.tracking_uri:
        if not args.experiment:
            raise UserError("--tracking-uri needs --experiment")
        log_summary_artifacts(args.tracking_uri, args.experiment, args.summary_run, paths)
    return 0
