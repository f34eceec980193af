"""Experiments -> variants -> jobs: every name, path, setting and identity the workflow uses.

An *experiment* (one panel of the loss figure, one table) lists *variants*. The short form
`d_kv: [8, 16, 32]` gives one variant `dkv<N>` each with the experiment's settings; `variants:` names
any others with their own settings (d_kv, r, rope_strategy, svd, whiten, steps, lr, label, paper);
`overrides:` changes settings of named variants of either kind; `baseline: true` adds the unconverted
model fine-tuned with the same recipe.

Jobs are keyed by what they compute, never by names, so work shared between variants and
experiments runs once:

  conversion  results/convert/<model>/<strategy>-r<r>-<svd>[-white][-dkv<N>]
              (model + partial-RoPE + SVD settings; the calibration and data are per model)
  fine-tune   results/finetune/<model>/<start>/<recipe>, start = a conversion or `baseline`,
              recipe = `t` + 8 hex of the training recipe (launch settings such as nproc left out)
  evaluation  results/evaluate/<model>/<start>/<recipe>/{eval,inference}.json, and
              results/evaluate/<model>/original/{eval,inference}.json once per model: quality
              (eval.json) and inference measurements (inference.json), mla.study.evaluation_jobs

Names, legend labels, the MLflow experiment and the tracking URI are not part of any key: changing
them reruns nothing but the figure and tables.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from mla.study.options import DEFAULT_ROPE_STRATEGY, DEFAULT_SVD

RESERVED_NAMES = ("original", "baseline")
# How a run is launched, not what it computes (mla/training/resume.py keeps these out of its key too).
LAUNCH_KEYS = ("nproc", "nodes", "micro_batch_size", "zero_stage", "offload_optimizer", "gradient_checkpointing",
               "save_steps", "device", "gpu_memory_gb")
VARIANT_KEYS = ("d_kv", "r", "rope_strategy", "svd", "whiten", "steps", "lr", "label", "paper")
RUN_SETTINGS = ("steps", "lr")              # per-variant changes to the training recipe


@dataclass(frozen=True)
class Variant:
    """One curve of a panel and one row of a table."""

    experiment: str
    name: str
    label: str
    model: str
    kind: str                                # MHA | GQA (of the experiment's source model)
    d_kv: int | None                         # None: the baseline, or svd none (full rank, from the shape)
    r: int | None                            # None: d_h/16 (decided at conversion from the shape)
    rope_strategy: str | None
    svd: str | None                          # None for the baseline
    whiten: bool
    train: dict = field(hash=False, compare=False)
    paper: str | None = None                 # a row of the paper's tables to show beside this variant

    @property
    def is_baseline(self) -> bool:
        return self.svd is None

    @property
    def conversion(self) -> str | None:
        """Folder name of the conversion this variant starts from (None: the baseline)."""
        if self.is_baseline:
            return None
        r = "auto" if self.r is None else self.r
        name = f"{self.rope_strategy}-r{r}-{self.svd}" + ("-white" if self.whiten else "")
        return name if self.d_kv is None else f"{name}-dkv{self.d_kv}"

    @property
    def start(self) -> str:
        return self.conversion or "baseline"

    @property
    def recipe(self) -> str:
        return recipe_key(self.train)

    @property
    def needs_calibration(self) -> bool:
        return not self.is_baseline

    # paths
    @property
    def convert_dir(self) -> str:
        return convert_dir(self.model, self.conversion)

    @property
    def run_dir(self) -> str:
        return run_dir(self.model, self.start, self.recipe)

    @property
    def eval_path(self) -> str:
        """The quality evaluation's JSON (perplexity, benchmarks, pass keys with the full cache)."""
        return f"results/evaluate/{self.model}/{self.start}/{self.recipe}/eval.json"

    @property
    def inference_path(self) -> str:
        """The inference measurements' JSON (decode speed, quantized caches, LongBench)."""
        return f"results/evaluate/{self.model}/{self.start}/{self.recipe}/inference.json"


# ---------------------------------------------------------------- paths and keys
def model_dir(model: str) -> str:
    return f"results/models/{model}"


def calibration_files(model: str) -> dict[str, str]:
    """The calibrate rule's outputs: 2-norm scores and the attention inputs' covariances, one pass."""
    return {"scores": f"results/calibrate/{model}/scores.pt", "covariance": f"results/calibrate/{model}/covariance.pt"}


def convert_dir(model: str, conversion: str) -> str:
    return f"results/convert/{model}/{conversion}"


def run_dir(model: str, start: str, recipe: str) -> str:
    return f"results/finetune/{model}/{start}/{recipe}"


def original_eval_path(model: str) -> str:
    return f"results/evaluate/{model}/original/eval.json"


def original_inference_path(model: str) -> str:
    return f"results/evaluate/{model}/original/inference.json"


def recipe_settings(train: dict) -> dict:
    """What a training run computes: the recipe without the launch settings."""
    return {k: v for k, v in sorted(train.items()) if k not in LAUNCH_KEYS}


def recipe_key(train: dict) -> str:
    blob = json.dumps(recipe_settings(train), sort_keys=True)
    return "t" + hashlib.sha256(blob.encode()).hexdigest()[:8]


# ---------------------------------------------------------------- from the config
def root_model(config: dict, model: str) -> str:
    """The model whose tokenizer (and data) `model` uses: derived models share their parent's."""
    models, seen = config["models"], set()
    while models[model]["source"] == "mha-from-gqa" and model not in seen:
        seen.add(model)
        model = models[model]["from"]
    return model


def train_settings(config: dict, experiment: str, settings: dict) -> dict:
    """Global train recipe < experiment's `train` < the variant's own steps/lr."""
    exp = config["experiments"][experiment]
    return dict(config["train"], **exp.get("train", {}), **{k: settings[k] for k in RUN_SETTINGS if k in settings})


def declared_settings(experiment: dict) -> dict[str, dict]:
    """{variant name: its own settings} in order: the d_kv short form, then `variants`, with `overrides` applied."""
    declared = {f"dkv{int(d)}": {"d_kv": int(d)} for d in sorted(experiment.get("d_kv", []))}
    for name, settings in (experiment.get("variants") or {}).items():
        declared[name] = dict(settings)
    for name, over in (experiment.get("overrides") or {}).items():
        if name in declared:
            declared[name] = {**declared[name], **over}
    return declared


def _label(kind: str, settings: dict, name: str, declared_by_d_kv: bool) -> str:
    if "label" in settings:
        return str(settings["label"])
    return f"{kind}2MLA d_kv = {settings['d_kv']}" if declared_by_d_kv else name


def experiment_variants(config: dict, experiment: str) -> list[Variant]:
    """The variants of one experiment in config order (the d_kv short form first), the baseline last."""
    exp = config["experiments"][experiment]
    kind = exp.get("kind", "GQA").upper()
    out = []
    for name, own in declared_settings(exp).items():
        s = {k: exp.get(k) for k in ("r", "rope_strategy", "svd", "whiten")}
        s.update({k: v for k, v in own.items() if k in VARIANT_KEYS})
        svd = s["svd"] or DEFAULT_SVD
        out.append(Variant(
            experiment=experiment, name=name, model=exp["model"], kind=kind,
            label=_label(kind, own, name, name == f"dkv{own.get('d_kv')}" and "d_kv" in own),
            d_kv=None if svd == "none" or s.get("d_kv") is None else int(s["d_kv"]),
            r=s["r"], rope_strategy=s["rope_strategy"] or DEFAULT_ROPE_STRATEGY, svd=svd,
            whiten=bool(s["whiten"]) and svd != "none",     # an experiment's whitening skips full-rank variants
            train=train_settings(config, experiment, own), paper=own.get("paper")))
    if exp.get("baseline", True):
        own = (exp.get("overrides") or {}).get("baseline", {})
        out.append(Variant(experiment=experiment, name="baseline", label=own.get("label", kind), model=exp["model"],
                           kind=kind, d_kv=None, r=None, rope_strategy=None, svd=None, whiten=False,
                           train=train_settings(config, experiment, own), paper=own.get("paper", "baseline")))
    return out


def all_variants(config: dict) -> list[Variant]:
    return [v for e in config["experiments"] for v in experiment_variants(config, e)]


def variant_errors(config: dict) -> list[tuple[str, str]]:
    """(config key, message) for variants the schema cannot judge: names, d_kv, whitening, overrides."""
    errors = []
    for ename, exp in config["experiments"].items():
        where = f"experiments.{ename}"
        declared, named = declared_settings(exp), exp.get("variants") or {}
        for name in named:
            if name in RESERVED_NAMES:
                errors.append((f"{where}.variants.{name}", f"'{name}' is reserved (the unconverted model's rows)"))
            elif name in {f"dkv{int(d)}" for d in exp.get("d_kv", [])}:
                errors.append((f"{where}.variants.{name}", f"'{name}' is already a variant of the d_kv list"))
        known = set(declared) | ({"baseline"} if exp.get("baseline", True) else set())
        for name in exp.get("overrides") or {}:
            if name not in known:
                errors.append((f"{where}.overrides.{name}",
                               f"no such variant (configured: {', '.join(sorted(known)) or 'none'})"))
        if not declared and not exp.get("baseline", True):
            errors.append((where, "no variants: give d_kv, variants or baseline: true"))
        for name, own in declared.items():
            key = f"{where}.variants.{name}" if name in named else f"{where}.overrides.{name}"
            svd = own.get("svd", exp.get("svd")) or DEFAULT_SVD
            whiten = own.get("whiten", False)          # only asked of this variant itself
            if svd == "none" and own.get("d_kv") is not None and name in named:
                errors.append((f"{key}.d_kv", "svd: none keeps K/V at full rank; d_kv follows from the model"))
            if svd != "none" and own.get("d_kv") is None:
                errors.append((f"{key}.d_kv", f"svd: {svd} needs a latent size d_kv"))
            if svd == "none" and whiten:
                errors.append((f"{key}.whiten", "activation-aware SVD needs svd: joint or split"))
        labels = [v.label for v in experiment_variants(config, ename)] if not errors else []
        for label in {x for x in labels if labels.count(x) > 1}:
            errors.append((where, f"two variants share the legend label '{label}': give each its own `label`"))
    return errors


# ---------------------------------------------------------------- the jobs
@dataclass
class Study:
    """All variants of a validated config and the jobs they need (each job once)."""

    config: dict
    variants: list[Variant] = field(init=False)

    def __post_init__(self):
        self.variants = all_variants(self.config)

    def experiment(self, name: str) -> list[Variant]:
        return [v for v in self.variants if v.experiment == name]

    def conversions(self) -> dict[tuple[str, str], Variant]:
        """(model, conversion) -> the first variant that uses it (they all convert identically)."""
        out = {}
        for v in self.variants:
            if not v.is_baseline:
                out.setdefault((v.model, v.conversion), v)
        return out

    def runs(self) -> dict[tuple[str, str, str], Variant]:
        """(model, start, recipe) -> the first variant that trains it; its launch settings are used."""
        out = {}
        for v in self.variants:
            out.setdefault((v.model, v.start, v.recipe), v)
        return out

    def conversion(self, model: str, conversion: str) -> Variant:
        try:
            return self.conversions()[(model, conversion)]
        except KeyError:
            raise KeyError(f"no variant converts {model} to {conversion}") from None

    def run(self, model: str, start: str, recipe: str) -> Variant:
        try:
            return self.runs()[(model, start, recipe)]
        except KeyError:
            raise KeyError(f"no variant trains {model}/{start}/{recipe}") from None

    def evaluated(self, experiment: str) -> list[tuple[str, str, Variant | None]]:
        """(row name, eval.json, variant) of an experiment's table: the original model first if configured."""
        rows = []
        if self.config["evaluate"].get("original", True):
            model = self.config["experiments"][experiment]["model"]
            rows.append(("original", original_eval_path(model), None))
        return rows + [(v.name, v.eval_path, v) for v in self.experiment(experiment)]

    def inference_measured(self, experiment: str) -> list[tuple[str, str]]:
        """(row name, inference.json) of an experiment's checkpoints, in the order of `evaluated`."""
        return [(name, original_inference_path(self.config["experiments"][experiment]["model"]) if v is None
                 else v.inference_path) for name, _, v in self.evaluated(experiment)]

    @property
    def measures_inference(self) -> bool:
        """evaluate.inference: the inference measurements are part of `all` and of the tables."""
        return bool(self.config["evaluate"].get("inference", False))

    def inference_targets(self) -> list[str]:
        """Every checkpoint's inference.json (the target `snakemake inference`)."""
        return list(dict.fromkeys(path for e in self.config["experiments"] for _, path in self.inference_measured(e)))

    def targets(self) -> list[str]:
        out = []
        for e in self.config["experiments"]:
            out += [path for _, path, _ in self.evaluated(e)]
            if self.measures_inference:
                out += [path for _, path in self.inference_measured(e)]
            out += [f"results/tables/{e}.csv", f"results/tables/{e}.md"]
        return list(dict.fromkeys(out)) + ["results/figures/loss.png", "results/figures/loss.pdf"]

    def jobs(self) -> dict[str, int]:
        """Training and conversion jobs, and how many variants share them (for messages and tests)."""
        originals = {exp["model"] for exp in self.config["experiments"].values()}
        return {"conversions": len(self.conversions()), "runs": len(self.runs()), "variants": len(self.variants),
                "original_evaluations": len(originals) if self.config["evaluate"].get("original", True) else 0}
