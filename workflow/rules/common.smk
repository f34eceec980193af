# Helpers of the workflow: config validation, names, paths and input functions.
# No science here: every number is computed by the `mla` package that the rules call.

import hashlib
import json
import re
import shlex
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError

from mla import budgets
from mla.budgets import budget_errors
from mla.config_schema import schema_problems
from mla.training.memory import memory_errors

# `python -m mla` with the interpreter that runs Snakemake: works without activating the venv, and
# SLURM jobs (which rerun Snakemake inside the job) use the same environment.
PYTHON = shlex.quote(sys.executable)
MLA = f"{PYTHON} -m mla"


# ---------------------------------------------------------------- config validation
def _semantic_errors(cfg):
    """Cross-references the schema cannot express."""
    errors = []
    models = cfg["models"]
    for name, model in models.items():
        if model["source"] == "mha-from-gqa":
            parent = model["from"]
            if parent not in models:
                errors.append((f"models.{name}.from", f"'{parent}' is not a key of models"))
            else:
                seen = {name}
                while models.get(parent, {}).get("source") == "mha-from-gqa" and parent not in seen:
                    seen.add(parent)
                    parent = models[parent].get("from")
                if parent in seen:
                    errors.append((f"models.{name}.from", "derivation loop: the chain of `from` comes back to a model"))
    for ename, exp in cfg["experiments"].items():
        if exp["model"] not in models:
            errors.append((f"experiments.{ename}.model", f"'{exp['model']}' is not a key of models"))
        known = set(variants_of(exp))
        for vname in exp["overrides"]:
            if vname not in known:
                errors.append((f"experiments.{ename}.overrides.{vname}",
                               f"no such variant (configured: {', '.join(sorted(known))})"))
        for vname in known:
            t = _train_settings(cfg, ename, vname)
            where = (f"experiments.{ename}.overrides.{vname}" if vname in exp["overrides"]
                     else f"experiments.{ename}.train" if exp["train"] else "train")
            ranks = t["nproc"] * t["nodes"]
            if t["batch_size"] % (t["micro_batch_size"] * ranks):
                errors.append((f"{where}.batch_size", f"{t['batch_size']} is not divisible by "
                               f"micro_batch_size * nproc * nodes = {t['micro_batch_size'] * ranks}"))
            if t["warmup_steps"] + t["decay_steps"] > t["steps"]:
                errors.append((f"{where}.steps", f"warmup_steps + decay_steps = "
                               f"{t['warmup_steps'] + t['decay_steps']} exceeds steps = {t['steps']}"))
    if not errors:  # budgets are arithmetic on models and variants that exist
        errors += budget_errors(cfg)
    if not errors:  # every training job of a GPU config must fit train.gpu_memory_gb (mla.training.memory)
        errors += memory_errors(cfg)
    return list(dict.fromkeys(errors))  # one message per key


def check_config(cfg):
    """Validate `cfg` in place against the schema (filling defaults); stop with every bad key named."""
    problems = schema_problems(cfg)
    if not problems:
        problems = _semantic_errors(cfg)
    if problems:
        lines = "\n".join(f"  config key '{k}': {msg}" for k, msg in problems)
        raise WorkflowError(f"Invalid configuration ({len(problems)} problem(s)); nothing was run:\n{lines}")
    for exp in cfg["experiments"].values():  # YAML may give 8.0 for 8; wildcards need canonical ints
        exp["d_kv"] = [int(d) for d in exp["d_kv"]]
    return cfg


# ---------------------------------------------------------------- names
def variants_of(exp):
    """Variant names of one experiment, most compressed first: dkv8, dkv16, ..., baseline."""
    return budgets.variants(exp)


def evaluated_variants(experiment):
    """Variants with an evaluation: the fine-tuned ones, plus the original model if configured."""
    extra = ["original"] if config["evaluate"]["original"] else []
    return extra + variants_of(config["experiments"][experiment])


def root_model(name):
    """The model whose tokenizer (and data) a model uses: derived models share their parent's."""
    return budgets.root_model(config, name)


def model_label(name):
    return config["models"][name].get("label", name)


def experiment_model(experiment):
    return config["experiments"][experiment]["model"]


def _alternatives(values):
    return "|".join(re.escape(str(v)) for v in sorted(set(values), key=str)) or "(?!)"


# ---------------------------------------------------------------- settings of one variant
def variant_settings(experiment, variant):
    """Everything that determines one variant's model and training run (merged overrides)."""
    exp = config["experiments"][experiment]
    if variant not in variants_of(exp):
        raise WorkflowError(f"experiment '{experiment}' has no variant '{variant}'")
    over = exp["overrides"].get(variant, {})
    s = {
        "experiment": experiment,
        "variant": variant,
        "model": exp["model"],
        "d_kv": int(variant[3:]) if variant.startswith("dkv") else None,
        "r": over.get("r", exp["r"]),
        "rope_strategy": over.get("rope_strategy", exp["rope_strategy"]),
        "svd": over.get("svd", exp["svd"]),
        "train": _train_settings(config, experiment, variant),
        "data": dict(config["data"], block_length=block_length(exp["model"])),
        "sources": _source_chain(exp["model"]),
        "calibrate": config["calibrate"],
    }
    if variant == "baseline":
        for k in ("r", "rope_strategy", "svd"):
            s[k] = None
    return s


def _source_chain(name):
    """The model's source entry and those it derives from (a changed revision changes the hash)."""
    chain = [config["models"][name]]
    while chain[-1]["source"] == "mha-from-gqa":
        chain.append(config["models"][chain[-1]["from"]])
    return chain


def _train_settings(cfg, experiment, variant):
    """Global train recipe < experiment's `train` < the variant's overrides."""
    return budgets.train_settings(cfg, experiment, variant)


def block_length(model):
    return budgets.block_length(config, model)


# How a run is launched, not what it computes (see mla/training/resume.py): kept out of the run's name.
LAUNCH_KEYS = ("nproc", "nodes", "micro_batch_size", "zero_stage", "offload_optimizer", "gradient_checkpointing",
               "save_steps", "device", "gpu_memory_gb")


def settings_hash(experiment, variant):
    """Short hash of what a variant computes (launch settings left out): names its MLflow run."""
    s = variant_settings(experiment, variant)
    s = dict(s, train={k: v for k, v in s["train"].items() if k not in LAUNCH_KEYS})
    blob = json.dumps(s, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:8]


def run_name(experiment, variant):
    return f"{experiment}-{variant}-{settings_hash(experiment, variant)}"


def needs_scores(experiment, variant):
    return variant.startswith("dkv") and variant_settings(experiment, variant)["rope_strategy"] == "2-norm"


# ---------------------------------------------------------------- paths
def model_dir(name):
    return f"results/models/{name}"


def data_dir(model):
    return f"results/data/{root_model(model)}"


def start_checkpoint(experiment, variant):
    """What a fine-tuning run starts from: the converted model, or the original for the baseline."""
    if variant == "baseline":
        return model_dir(experiment_model(experiment))
    return f"results/convert/{experiment}/{variant}"


def finetune_dir(experiment, variant):
    return f"results/finetune/{experiment}/{variant}"


def all_targets():
    targets = []
    for e, exp in config["experiments"].items():
        targets += [f"results/evaluate/{e}/{v}/eval.json" for v in evaluated_variants(e)]
        targets += [f"results/tables/{e}.csv", f"results/tables/{e}.md"]
    return targets + ["results/figures/loss.png", "results/figures/loss.pdf"]


# ---------------------------------------------------------------- download rules
def download_inputs(wc):
    model = config["models"][wc.model]
    if model["source"] == "mha-from-gqa":
        return [model_dir(model["from"])]
    if model["source"] == "local":
        return [model["path"]]
    return []


def download_args(wc):
    model = config["models"][wc.model]
    source = model["source"]
    args = ["--source", source]
    if source == "hub":
        args += ["--repo-id", model["repo_id"], "--revision", model["revision"]]
    elif source == "local":
        args += ["--path", model["path"]]
    elif source == "mha-from-gqa":
        args += ["--path", model_dir(model["from"])]
    elif source == "tiny-random" and "num_kv_heads" in model:
        args += ["--num-kv-heads", str(model["num_kv_heads"])]
    return " ".join(shlex.quote(a) for a in args)


# ---------------------------------------------------------------- data rules
def data_args(wc):
    d = config["data"]
    return (f"--corpus {shlex.quote(d['corpus'])} --block-length {block_length(wc.model)}"
            f" --train-tokens {budgets.train_tokens(config, wc.model)}"
            f" --validation-tokens {budgets.validation_tokens(config, wc.model)}"
            f" --validation-fraction {d['validation_fraction']} --seed {d['seed']}")


# ---------------------------------------------------------------- convert rules
def convert_inputs(wc):
    variant = f"dkv{wc.d_kv}"
    inputs = {"model": model_dir(experiment_model(wc.experiment))}
    if needs_scores(wc.experiment, variant):
        inputs["scores"] = f"results/calibrate/{experiment_model(wc.experiment)}/scores.pt"
    return inputs


def convert_args(wc):
    # params depend on wildcards only: Snakemake compares them with the last run (rerun trigger)
    variant = f"dkv{wc.d_kv}"
    s = variant_settings(wc.experiment, variant)
    args = f"--rope-strategy {s['rope_strategy']} --svd {s['svd']}"
    if s["r"] is not None:
        args += f" --r {s['r']}"
    if needs_scores(wc.experiment, variant):
        args += f" --scores results/calibrate/{experiment_model(wc.experiment)}/scores.pt"
    return args


# ---------------------------------------------------------------- finetune rules
def finetune_nodes(wc):
    return variant_settings(wc.experiment, wc.variant)["train"]["nodes"]


def finetune_gpus(wc):
    """One node: sbatch --gpus=nproc. Several nodes request theirs per node (finetune_gres)."""
    train = variant_settings(wc.experiment, wc.variant)["train"]
    return train["nproc"] if train["device"] == "gpu" and train["nodes"] == 1 else 0


def finetune_gres(wc):
    """Several nodes: sbatch --gres=gpu:nproc, i.e. nproc GPUs on each node (--gpus would be a job total)."""
    train = variant_settings(wc.experiment, wc.variant)["train"]
    return f"gpu:{train['nproc']}" if train["device"] == "gpu" and train["nodes"] > 1 else ""


def finetune_args(wc):
    s = variant_settings(wc.experiment, wc.variant)
    t = s["train"]
    args = [
        "--steps", t["steps"], "--lr", t["lr"], "--warmup-steps", t["warmup_steps"],
        "--decay-steps", t["decay_steps"], "--global-batch", t["batch_size"],
        "--micro-batch", t["micro_batch_size"], "--weight-decay", t["weight_decay"],
        "--clip", t["max_grad_norm"], "--seed", t["seed"], "--precision", t["precision"],
        "--zero-stage", t["zero_stage"], "--offload" if t["offload_optimizer"] else "--no-offload",
        "--nproc", t["nproc"], "--nodes", t["nodes"], "--save-steps", t["save_steps"],
        "--device", "cuda" if t["device"] == "gpu" else "cpu",
        "--gradient-checkpointing" if t["gradient_checkpointing"] else "--no-gradient-checkpointing",
        "--tracking-uri", config["mlflow"]["tracking_uri"], "--experiment", config["mlflow"]["experiment"],
        "--run-name", run_name(wc.experiment, wc.variant), "--model-name", model_label(s["model"]),
        "--variant", wc.variant, "--tag", f"experiment={wc.experiment}",
        "--tag", f"snakemake_wildcards=experiment={wc.experiment},variant={wc.variant}",
        "--tag", f"settings_hash={settings_hash(wc.experiment, wc.variant)}",
    ]
    if s["d_kv"] is not None:
        args += ["--d-kv", s["d_kv"]]
    return " ".join(shlex.quote(str(a)) for a in args)


# ---------------------------------------------------------------- evaluate rules
def evaluate_args(wc):
    e = config["evaluate"]
    args = ["--variant", wc.variant,
            "--tracking-uri", config["mlflow"]["tracking_uri"],
            "--paper-tasks", e["paper_tasks"], "--kv-new-tokens", e["kv_new_tokens"],
            "--decode-grid", ",".join(e["decode_grid"]) or "none", "--decode-steps", e["decode_steps"]]
    if e["perplexity_blocks"] is not None:
        args += ["--max-blocks", e["perplexity_blocks"]]
    if e["local_task"]:
        args += ["--local-docs", e["local_docs"], "--validation-fraction", config["data"]["validation_fraction"]]
    else:
        args += ["--no-local-task"]
    if e["paper_limit"] is not None:
        args += ["--paper-limit", e["paper_limit"]]
    if wc.variant == "original":  # not trained: its own MLflow run in the same experiment
        args += ["--experiment", config["mlflow"]["experiment"], "--run-name", f"{wc.experiment}-original"]
    return " ".join(shlex.quote(str(a)) for a in args)


def evaluate_inputs(wc):
    inputs = {"data": data_dir(experiment_model(wc.experiment)), "store": "results/mlflow.ready"}
    if wc.variant == "original":
        inputs["model"] = model_dir(experiment_model(wc.experiment))
    else:
        inputs["model"] = f"{finetune_dir(wc.experiment, wc.variant)}/final"
        inputs["run"] = f"{finetune_dir(wc.experiment, wc.variant)}/run.json"
    return inputs


# ---------------------------------------------------------------- figures rules
def plot_args(wc):
    args = []
    for e, exp in config["experiments"].items():
        # the paper's panel titles: method and model, e.g. "MHA2MLA: Llama2-7B"
        args += ["--panel", f"{exp['kind'].upper()}2MLA: {model_label(exp['model'])}", "--kind", exp["kind"]]
        for v in variants_of(exp):
            key = "baseline" if v == "baseline" else v[3:]
            args += ["--run", f"{key}={finetune_dir(e, v)}/metrics.csv"]
    return " ".join(shlex.quote(a) for a in args)


def mlflow_summary_args():
    m = config["mlflow"]
    return f"--tracking-uri {shlex.quote(m['tracking_uri'])} --experiment {shlex.quote(m['experiment'])}"


def table_inputs(wc):
    inputs = {}
    for v in evaluated_variants(wc.experiment):
        inputs[f"eval_{v}"] = f"results/evaluate/{wc.experiment}/{v}/eval.json"
        if v != "original":
            inputs[f"metrics_{v}"] = f"{finetune_dir(wc.experiment, v)}/metrics.csv"
        if v.startswith("dkv"):
            inputs[f"convert_{v}"] = f"results/convert/{wc.experiment}/{v}"
    return inputs


def table_args(wc):
    exp = config["experiments"][wc.experiment]
    model = config["models"][exp["model"]]
    args = ["--title", f"{wc.experiment}: {model_label(exp['model'])}", "--model", model_label(exp["model"]),
            "--paper-model", model.get("paper", "none")]
    for v in evaluated_variants(wc.experiment):
        args += ["--variant", v, "--eval", f"results/evaluate/{wc.experiment}/{v}/eval.json"]
        if v != "original":
            args += ["--metrics", f"{finetune_dir(wc.experiment, v)}/metrics.csv"]
        if v.startswith("dkv"):
            args += ["--d-kv", v[3:], "--conversion", f"results/convert/{wc.experiment}/{v}/conversion.json"]
    return " ".join(shlex.quote(a) for a in args)
