"""`mla table`: one results table per experiment (CSV + Markdown), beside the paper's Table 1."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mla import tracking
from mla.commands.report_args import Ordered, add_source_arguments, add_summary_arguments, log_summary_artifacts
from mla.errors import UserError
from mla.specfile import read_mapping
from mla.study import config_file, paper_numbers, reports

HELP = "tabulate an experiment's variants (KV memory, params, loss, perplexity, scores, speed) vs the paper."

EPILOG = """\
Variants are given in order; every option after --variant NAME belongs to it:

  mla table --out results/tables/smollm2 --model SmolLM2-135M --paper-model SmolLM-135M \\
      --variant original --eval results/eval/smollm2/original.json \\
      --variant baseline --eval .../baseline.json --metrics results/train/.../baseline/metrics.csv \\
      --variant dkv8 --d-kv 8 --eval .../dkv8.json --conversion .../dkv8/conversion.json \\
                     --metrics .../dkv8/metrics.csv

NAME "original" = the released model, "baseline" = the unconverted model fine-tuned with the same
recipe; any other name is a converted model whose d_kv comes from --d-kv, conversion.json or the
eval JSON. --label names the row in a label column; --paper-row picks the paper's row beside it
(default: the name for original/baseline, else the d_kv: right for S_2-norm + SVD_joint variants only).
--paper-model picks the paper's Table 1 rows (SmolLM-135M, SmolLM-360M, SmolLM-1.7B,
Llama-2-7B); by default it is inferred from --model, and "none" disables the paper columns.
--spec FILE (JSON/YAML) holds {"title", "model", "paper_model", "variants": [{"name", "d_kv",
"eval", "inference", "serve", "conversion", "metrics", "label", "paper_row", "run_json"}]}; relative paths
resolve against the spec's folder. --config FILE --study NAME tabulates experiment NAME of a workflow
config as the workflow does (mla/study/reports.py; paths relative to the working directory), with
MLflow's store and experiment from the config:

  mla table --config config.yaml --study gqa2mla --out results/tables/gqa2mla

Writes OUT.csv and OUT.md.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_source_arguments(p, EPILOG, out="output path stem; writes OUT.csv and OUT.md",
                         spec="JSON/YAML experiment spec (instead of --variant ...)",
                         config="workflow config (YAML): tabulate its experiment --study NAME")
    p.add_argument("--title", help="table title (default: the model name)")
    p.add_argument("--model", help="name of the source model (e.g. SmolLM2-135M)")
    p.add_argument("--paper-model", help="paper Table 1 model to compare with, or 'none'")
    p.add_argument("--variant", action=Ordered, metavar="NAME", help="start a variant")
    p.add_argument("--d-kv", dest="d_kv", action=Ordered, metavar="N", help="latent size per KV head")
    p.add_argument("--eval", action=Ordered, metavar="JSON", help="evaluation JSON of `mla evaluate`")
    p.add_argument("--inference", action=Ordered, metavar="JSON",
                   help="inference measurements of `mla evaluate --part inference` (optional)")
    p.add_argument("--serve", action=Ordered, metavar="JSON",
                   help="an engine's measurements of the variant's export and original (`mla serve-bench`, optional)")
    p.add_argument("--conversion", action=Ordered, metavar="JSON", help="conversion.json of `mla convert`")
    p.add_argument("--metrics", action=Ordered, metavar="CSV", help="training metrics.csv")
    p.add_argument("--label", action=Ordered, metavar="TEXT", help="the variant's legend label (a table column)")
    p.add_argument("--paper-row", dest="paper_row", action=Ordered, metavar="KEY",
                   help="the paper's row beside it: a d_kv, original, baseline, an ablation key such as "
                        "S_high or S_2-norm+SVD_split, or none (default: by name and d_kv)")
    p.add_argument("--run-json", dest="run_json", action=Ordered, metavar="JSON",
                   help="run.json of the variant's training run: with --tracking-uri and --study its MLflow run "
                        "is tagged study.<STUDY> = label")
    p.add_argument("--study", help="name of this table's experiment (the config's): the table of --config, and "
                                   "the runs' tags")
    add_summary_arguments(p, "the table")


def variants_from_items(items) -> list[dict]:
    variants: list[dict] = []
    for key, value in items:
        if key == "variant":
            variants.append({"name": value})
        elif not variants:
            raise UserError(f"--{key.replace('_', '-')} {value!r} comes before any --variant")
        elif key in variants[-1]:
            raise UserError(f"variant {variants[-1]['name']!r}: --{key.replace('_', '-')} given twice")
        else:
            variants[-1][key] = value
    return variants


def load_spec(path: str) -> dict:
    p = Path(path)
    data = read_mapping(p, "--spec file")
    if not isinstance(data.get("variants"), list):
        raise UserError(f"{p}: expected a mapping with a 'variants' list")
    for v in data["variants"]:
        for key in ("eval", "inference", "serve", "conversion", "metrics"):
            if v.get(key) and not Path(v[key]).is_absolute():
                v[key] = str(p.parent / v[key])
    return data


def _paper_key(key: str, paper_model: str | None, variant: str | None):
    """--paper-row KEY as paper_numbers knows it (int d_kv, name) or None; an unknown key is an error."""
    if key.lower() == "none" or paper_model is None:
        return None
    value = int(key) if key.isdigit() else key
    if value not in paper_numbers.known_rows(paper_model):
        raise UserError(f"variant {variant!r}: --paper-row {key!r} is not a row of the paper for {paper_model} "
                        f"(known: {', '.join(map(str, paper_numbers.known_rows(paper_model)))}, or none)")
    return value


def run(args) -> int:
    # lazy: pandas; keeps `mla --help` fast
    from mla.study.tables import AUTO, MMLU_CLOZE, TableInputError, Variant, build_table, table_notes, write_table

    if sum(map(bool, (args.spec, args.items, args.config))) > 1:
        raise UserError("give one of --spec, --config or --variant ...")
    if args.config:
        spec = _spec_from_config(args)
    else:
        spec = load_spec(args.spec) if args.spec else {"variants": variants_from_items(args.items)}
    if not spec["variants"]:
        raise UserError("nothing to tabulate: give --spec FILE or at least one --variant")
    model = args.model or spec.get("model")
    paper_model = args.paper_model or spec.get("paper_model")
    if paper_model is None:
        paper_model = paper_numbers.paper_model(model)
    elif str(paper_model).lower() == "none":
        paper_model = None
    elif paper_numbers.paper_model(paper_model) is None:
        raise UserError(f"--paper-model {paper_model!r} is not in the paper's Table 1 "
                        f"(known: {', '.join(paper_numbers.TABLE1)}, or 'none')")
    else:
        paper_model = paper_numbers.paper_model(paper_model)

    variants = []
    for v in spec["variants"]:
        try:
            d_kv = None if v.get("d_kv") in (None, "") else int(v["d_kv"])
        except ValueError:
            raise UserError(f"variant {v.get('name')!r}: d_kv {v['d_kv']!r} is not an integer") from None
        paper_key = v.get("paper_row", AUTO)
        if paper_key is not None and paper_key != AUTO:
            paper_key = _paper_key(str(paper_key), paper_model, v.get("name"))
        variants.append(Variant(name=str(v["name"]), d_kv=d_kv, label=v.get("label"), paper_row=paper_key,
                                **{k: Path(v[k]) for k in ("eval", "inference", "serve", "conversion", "metrics")
                                   if v.get(k)}))
    try:
        header, rows = build_table(variants, paper_model)
    except TableInputError as exc:
        raise UserError(str(exc)) from None
    title = args.title or spec.get("title") or model
    notes = table_notes(paper_model, model, variants, any_mmlu_cloze=MMLU_CLOZE in header,
                        any_cache_rows="cache bits" in header, any_served="served at BxT" in header)
    paths = write_table(header, rows, args.out, title=title, notes=notes)
    print(paths[1].read_text())
    if args.tracking_uri:
        if not args.experiment:
            raise UserError("--tracking-uri needs --experiment")

        log_summary_artifacts(args.tracking_uri, args.experiment, args.summary_run, paths)
        if args.study:
            tag_runs(args.tracking_uri, args.study, spec["variants"])
    return 0


def _spec_from_config(args) -> dict:
    """The table of experiment --study of --config (mla.study.reports.table_spec); MLflow from the config."""
    cfg = config_file.load(args.config)
    if args.study not in cfg["experiments"]:
        raise UserError(f"--study {args.study!r}: not an experiment of {args.config} "
                        f"({', '.join(cfg['experiments'])})")
    args.tracking_uri = args.tracking_uri or cfg["mlflow"]["tracking_uri"]
    args.experiment = args.experiment or cfg["mlflow"]["experiment"]
    return reports.table_spec(cfg, args.study)


def tag_runs(tracking_uri: str, study: str, variants: list[dict]) -> None:
    """Tag each variant's (possibly shared) training run with the experiment and label it appears under."""
    for v in variants:
        if not v.get("run_json"):
            continue
        run_id = json.loads(Path(v["run_json"]).read_text()).get("mlflow_run_id")
        tracking.set_tags(run_id, {f"study.{study}": v.get("label") or v["name"]}, tracking_uri=tracking_uri)
