"""The loss figure and the tables of a study, as the specs that `mla plot` and `mla table` draw.

`figure_panels(config)` is what `mla plot --config FILE` draws (one panel per experiment) and
`table_spec(config, experiment)` what `mla table --config FILE --study NAME` tabulates; both are in
the format of the verbs' `--spec` files. The workflow's plot and table rules list the same specs as
`params:` (so a new label or title redraws them, and nothing else) and their files as inputs.
"""

from __future__ import annotations

from mla.study import experiments


def model_label(config: dict, model: str) -> str:
    return config["models"][model].get("label", model)


def figure_panels(config: dict) -> list[dict]:
    """One panel per experiment, in config order: the paper's titles ("MHA2MLA: Llama2-7B") unless given."""
    study = experiments.Study(config)
    panels = []
    for name, exp in config["experiments"].items():
        runs = []
        for v in study.experiment(name):
            run = {"metrics": f"{v.run_dir}/metrics.csv", "label": v.label}
            if v.is_baseline:
                run["baseline"] = True
            else:
                run["conversion"] = f"{v.convert_dir}/conversion.json"
            runs.append(run)
        title = exp.get("title") or f"{exp['kind'].upper()}2MLA: {model_label(config, exp['model'])}"
        panels.append({"title": title, "kind": exp["kind"], "runs": runs})
    return panels


def figure_inputs(config: dict) -> list[str]:
    """The files the figure reads: each run's metrics.csv and each conversion's folder."""
    inputs = []
    for v in experiments.Study(config).variants:
        inputs.append(f"{v.run_dir}/metrics.csv")
        if not v.is_baseline:
            inputs.append(v.convert_dir)
    return list(dict.fromkeys(inputs))


def paper_row(v: experiments.Variant | None) -> str:
    """The paper's row beside a variant: its `paper:` key, else Table 1's row when it uses the paper's
    recipe (S_2-norm, SVD_joint, the d_kv short form), else none."""
    if v is None:
        return "original"
    if v.paper is not None:
        return str(v.paper)
    if v.is_baseline:
        return "baseline"
    recipe = v.rope_strategy == "2-norm" and v.svd == "joint" and v.name == f"dkv{v.d_kv}"
    return "auto" if recipe else "none"   # auto: Table 1's row of this d_kv, if the paper has one


def table_spec(config: dict, experiment: str) -> dict:
    """An experiment's table: the original model (if evaluated), its variants and the baseline, with
    the inference measurements (and vLLM's, evaluate.serve) when evaluate.inference asks for them."""
    study = experiments.Study(config)
    exp = config["experiments"][experiment]
    label = model_label(config, exp["model"])
    inference = dict(study.inference_measured(experiment)) if study.measures_inference else {}
    served = {v.name: v.serve_path for v in study.served(experiment)} if study.measures_inference else {}
    variants = []
    for name, path, v in study.evaluated(experiment):
        row = {"name": name, "eval": path, "paper_row": paper_row(v)}
        if name in inference:
            row["inference"] = inference[name]
        if name in served:
            row["serve"] = served[name]
        if v is not None:
            row.update(label=v.label, metrics=f"{v.run_dir}/metrics.csv", run_json=f"{v.run_dir}/run.json")
            if not v.is_baseline:
                row["conversion"] = f"{v.convert_dir}/conversion.json"
        variants.append(row)
    return {"title": f"{experiment}: {label}", "model": label,
            "paper_model": config["models"][exp["model"]].get("paper", "none"), "variants": variants}


def table_inputs(config: dict, experiment: str) -> dict[str, str]:
    """The files an experiment's table reads, named for the rule (conversions as their folders)."""
    study = experiments.Study(config)
    inputs = {}
    for row, (_, _, v) in zip(table_spec(config, experiment)["variants"], study.evaluated(experiment)):
        name = row["name"]
        inputs[f"eval_{name}"] = row["eval"]
        if "inference" in row:
            inputs[f"inference_{name}"] = row["inference"]
        if "serve" in row:
            inputs[f"serve_{name}"] = row["serve"]
        if v is not None:
            inputs[f"metrics_{name}"] = row["metrics"]
            if not v.is_baseline:
                inputs[f"convert_{name}"] = v.convert_dir
    return inputs
