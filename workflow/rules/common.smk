# Helpers of the workflow: config validation, names, paths and input functions.
# No science here: every number is computed by the `mla` package that the rules call.

import re
import shlex
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError

from mla.export import engines
from mla.options import CALIBRATED_ROPE_STRATEGIES, DEFAULT_LATENT
from mla.study import budgets, config_file, evaluation_jobs, experiments, reports, serve_check
from mla.study.config_schema import config_problems
from mla.study.train_options import WORKFLOW_NAMES, workflow_options

# `python -m mla` with the interpreter that runs Snakemake: works without activating the venv, and
# SLURM jobs (which rerun Snakemake inside the job) use the same environment.
PYTHON = shlex.quote(sys.executable)
MLA = f"{PYTHON} -m mla"

# Cores per compute job on a local machine: one below 4 cores, else two. Two one-thread jobs do more work per core
# than one two-thread job (measured: docs/results.md), and the default's DAG has independent chains enough to fill
# the cores; with more cores two threads shorten the longest chain (the GQA fits). The priorities below keep
# one-thread jobs from ending the run alone (docs/workflow.md). --set-threads RULE=N changes one rule's; SLURM jobs
# take theirs from workflow/profiles/slurm (set-threads).
def job_threads():
    if workflow.remote_exec or not workflow.local_exec:
        return 2
    try:
        return 1 if workflow.cores < 4 else 2
    except WorkflowError:   # no --cores (a parse without a run)
        return 2


JOB_THREADS = job_threads()

# Order among ready jobs (Snakemake `priority`, higher first): calibration, conversion and fits before anything
# else that is ready, evaluations after everything else, so that the longest chains (conversion -> fit ->
# fine-tuning -> evaluation) start first and the short evaluations fill the cores at the end; calibration and
# conversion share the fits' priority because Snakemake breaks ties by input size (docs/results.md has the runs
# that showed both).
FIRST, LAST = 1, -1


# ---------------------------------------------------------------- config validation
def check_config(cfg):
    """Validate `cfg` in place against the schema (filling defaults); stop with every bad key named."""
    problems = config_problems(cfg)
    if problems:
        lines = "\n".join(f"  config key '{k}': {msg}" for k, msg in problems)
        raise WorkflowError(f"Invalid configuration ({len(problems)} problem(s)); nothing was run:\n{lines}")
    return config_file.normalised(cfg)  # YAML may give 8.0 for 8; wildcards need canonical ints


# ---------------------------------------------------------------- names (all from mla.study.experiments)
def root_model(name):
    """The model whose tokenizer (and data) a model uses: derived models share their parent's."""
    return budgets.root_model(config, name)


def _alternatives(values):
    return "|".join(re.escape(str(v)) for v in sorted(set(values), key=str)) or "(?!)"


def block_length(model):
    return budgets.block_length(config, model)


model_dir = experiments.model_dir


def data_dir(model):
    return f"results/data/{root_model(model)}"


# MLflow settings name where runs are recorded, not what they compute: the rules read these globals in
# their shell commands (never in params), so changing them reruns nothing.
TRACKING_URI = config["mlflow"]["tracking_uri"]
MLFLOW_EXPERIMENT = config["mlflow"]["experiment"]


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
    elif source == "tiny-random":   # the same args as before head_dim existed: params unchanged, nothing reruns
        for key in ("num_kv_heads", "head_dim"):
            if key in model:
                args += [f"--{key.replace('_', '-')}", str(model[key])]
    return " ".join(shlex.quote(a) for a in args)


# ---------------------------------------------------------------- data rules
def data_args(wc):
    d = config["data"]
    return (f"--corpus {shlex.quote(d['corpus'])} --block-length {block_length(wc.model)}"
            f" --train-tokens {budgets.train_tokens(config, wc.model)}"
            f" --validation-tokens {budgets.validation_tokens(config, wc.model)}"
            f" --validation-fraction {d['validation_fraction']} --seed {d['seed']}")


# ---------------------------------------------------------------- calibrate and convert rules
def convert_inputs(wc):
    return {"model": model_dir(wc.model), **experiments.calibration_files(wc.model)}


def convert_args(wc):
    # params depend on wildcards only: Snakemake compares them with the last run (rerun trigger)
    v = STUDY.conversion(wc.model, wc.conversion)
    calib = experiments.calibration_files(wc.model)
    args = ["--rope-strategy", v.rope_strategy, "--svd", v.svd]
    if v.d_kv is not None:
        args += ["--d-kv", v.d_kv]
    if v.r is not None:
        args += ["--r", v.r]
    if v.kv_width is not None:
        args += ["--kv-width", v.kv_width, "--rope-share", v.rope_share]
    if v.latent != DEFAULT_LATENT:
        args += ["--latent", v.latent]
    if v.rope_strategy in CALIBRATED_ROPE_STRATEGIES:
        args += ["--scores", calib["scores"]]
    # whitened: fit the SVD to the covariances; plain: only report the output error on held-out blocks
    args += ["--whiten" if v.whiten else "--covariance", calib["covariance"]]
    if v.attention_aware:
        args += ["--attention-aware"]
    if v.rope_fold != 1:
        args += ["--rope-fold", v.rope_fold]
    return " ".join(shlex.quote(str(a)) for a in args)


# ---------------------------------------------------------------- fit rules
def fit_args(wc):
    # the fit settings (all of them, defaults filled in): a change reruns the fit and what starts from it
    settings = dict(STUDY.fit(wc.model, wc.conversion, wc.fit).fit)
    if settings.get("schedule") == "constant":   # added later: left out at its default, so that the params of
        del settings["schedule"]                  # earlier fits (a rerun trigger) stay as they were
    return " ".join(f"--{k} {shlex.quote(str(v))}" for k, v in settings.items())


# ---------------------------------------------------------------- finetune rules
def _run(wc):
    return STUDY.run(wc.model, wc.start, wc.recipe)


def start_checkpoint(wc):
    """What a fine-tuning run starts from: the converted (or fitted) model, or the original for the baseline."""
    return STUDY.start_dir(wc.model, wc.start)


def finetune_teacher(wc):
    """The distillation teacher's checkpoint (a model key's folder), or nothing without distillation."""
    distill = _run(wc).train.get("distill")
    return [model_dir(distill["teacher"])] if distill else []


def finetune_nodes(wc):
    return _run(wc).train["nodes"]


def finetune_gpus(wc):
    """One node: sbatch --gpus=nproc. Several nodes request theirs per node (finetune_gres)."""
    train = _run(wc).train
    return train["nproc"] if train["device"] == "gpu" and train["nodes"] == 1 else 0


def finetune_gres(wc):
    """Several nodes: sbatch --gres=gpu:nproc, i.e. nproc GPUs on each node (--gpus would be a job total)."""
    train = _run(wc).train
    return f"gpu:{train['nproc']}" if train["device"] == "gpu" and train["nodes"] > 1 else ""


# `mla train` options that say how a run is launched, not what it computes (experiments.LAUNCH_KEYS under
# their option names): they reach the job as a resource, read when it starts, like the thread count, so that
# changing them after a run finished reruns nothing (and a killed run resumes under the new launch).
LAUNCH_OPTIONS = {WORKFLOW_NAMES.get(k, k) for k in experiments.LAUNCH_KEYS}


def _flags(options):
    return " ".join(f"--{k.replace('_', '-')} {shlex.quote(str(v))}" for k, v in options.items())


def finetune_args(wc):
    """The recipe: the rule's params, so a changed recipe reruns the job."""
    return _flags({k: v for k, v in workflow_options(_run(wc).train).items() if k not in LAUNCH_OPTIONS})


def finetune_launch_args(wc):
    """How the run is launched (a run shared by variants takes the first one's launch settings)."""
    return _flags({k: v for k, v in workflow_options(_run(wc).train).items() if k in LAUNCH_OPTIONS})


def finetune_runtime(wc, attempt):
    """SLURM minutes of this submission: the run's tokens at train.gpu_tokens_per_second, within
    train.max_job_hours (mla/study/budgets.py, mla/training/walltime.py)."""
    return budgets.variant_plan(config, _run(wc)).minutes(attempt)


def finetune_retries():
    """Resubmissions the longest run needs at train.gpu_tokens_per_second (None: the profile's retries). Inside
    a SLURM job (the jobstep executor reads this file again) none: a retry there would restart the run in the
    allocation whose time just ran out (the job then ends at TIMEOUT); resubmitting is the submitting host's."""
    if workflow.remote_exec:
        return 0
    plans = [budgets.variant_plan(config, v).retries for v in STUDY.runs().values()]
    return max((r for r in plans if r is not None), default=None)


# ---------------------------------------------------------------- evaluate rules
# Each checkpoint's quality and inference jobs take their settings from the config file (`mla evaluate
# --config`); `params:` lists those of each part (mla.study.evaluation_jobs), Snakemake's rerun trigger.
def evaluation_settings(part):
    return lambda wc: evaluation_jobs.settings(config, wc.model, part)


# The evaluation data is fetched by a local rule on the submitting host; the evaluation jobs run offline
# (compute nodes of many clusters have no internet), reading what it fetched.
PREFETCH_MANIFEST = evaluation_jobs.PREFETCH_MANIFEST
EVALUATE_ENV = "HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1"


def prefetch_inputs(part):
    return {"prefetched": PREFETCH_MANIFEST} if evaluation_jobs.needs_prefetch(config, part) else {}


def prefetch_args():
    e = config["evaluate"]
    return (("--mmlu " if e["mmlu"] != 0 else "") + f"--paper-tasks {e['paper_tasks']}"
            + (" --longbench auto" if e["longbench"] == "auto" else ""))


# ---------------------------------------------------------------- serve rules (evaluate.serve)
def serve_args():
    s = evaluation_jobs.serve_settings(config)
    args = (f"--engine {s['engine']} --decode-grid {' '.join(s['decode_grid'])} --decode-steps {s['decode_steps']}"
            f" --prompts {s['prompts']} --max-tokens {s['max_tokens']}")
    if s["engine"] == "llama.cpp":
        args += f" --cache-types {' '.join(s['cache_types'])} --blocks {s['blocks']}"
    return args


def gguf_files(wc):
    """The fine-tuned checkpoint's GGUF files that serve evaluate.serve_cache_types (evaluate.serve llama.cpp)."""
    layouts = engines.gguf_layouts(config["evaluate"]["serve_cache_types"])
    return [experiments.gguf_path(wc.model, wc.start, wc.recipe, layout) for layout in layouts]
