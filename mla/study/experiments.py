"""Experiments -> variants -> jobs: every name, path, setting and identity the workflow uses.

An *experiment* (one panel of the loss figure, one table) lists *variants*. The short form
`d_kv: [8, 16, 32]` gives one variant `dkv<N>` each with the experiment's settings; `variants:` names
any others with their own settings (d_kv, r, rope_strategy, svd, whiten, latent, kv_width, rope_share, steps,
lr, label, paper; kv_width + rope_share give the cache budget instead of d_kv + r, mla/conversion/layout.py);
`overrides:` changes settings of named variants of either kind; `baseline: true` adds the unconverted
model fine-tuned with the same recipe. `fit: {steps, lr, blocks, batch, heldout}` (on an experiment: the
default of its MLA variants; `fit: null` on a variant: none) fits the converted layers to the source's
before fine-tuning (`mla fit`, docs/fitting.md).

Jobs are keyed by what they compute, never by names, so work shared between variants and
experiments runs once:

  conversion  results/convert/<model>/<strategy>-r<r>-<svd>[-white][-dkv<N>][-shared-latent], or
              results/convert/<model>/<strategy>-kv<W>-rope<S·W>-<svd>[-white][-shared-latent] for a width budget
              (model + partial-RoPE + SVD settings; the calibration and data are per model)
  fit         results/fit/<model>/<conversion>/<fit>, fit = `f` + 8 hex of the fit settings
  fine-tune   results/finetune/<model>/<start>/<recipe>, start = a conversion, <conversion>-<fit> or `baseline`,
              recipe = `t` + 8 hex of the training recipe (launch settings such as nproc left out)
  evaluation  results/evaluate/<model>/<start>/<recipe>/{eval,inference}.json, and
              results/evaluate/<model>/original/{eval,inference}.json once per model: quality
              (eval.json) and inference measurements (inference.json), mla.study.evaluation_jobs
  serving     (evaluate.serve, ladder variants) vllm: results/export/<model>/<start>/<recipe> (the DeepSeek-V3
              export); llama.cpp: results/gguf/<model>/<start>/<recipe>/mla-<cache layout>.gguf and
              results/gguf/<model>/original.gguf; results/evaluate/<model>/<start>/<recipe>/serve.json (the engine
              on the export and on the original)

Names, legend labels, the MLflow experiment and the tracking URI are not part of any key: changing
them reruns nothing but the figure and tables.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from fractions import Fraction

from mla.conversion.layout import conflicting_budget
from mla.options import (
    DEFAULT_LATENT,
    DEFAULT_ROPE_STRATEGY,
    DEFAULT_SVD,
    FIT_DEFAULTS,
    LADDER_ROPE_STRATEGY,
    SHARED_ROPE_STRATEGIES,
)
from mla.training.config import TrainConfig

RESERVED_NAMES = ("original", "baseline")
# How a run is launched, not what it computes (mla/training/resume.py keeps these out of its key too).
LAUNCH_KEYS = ("nproc", "nodes", "micro_batch_size", "zero_stage", "offload_optimizer", "gradient_checkpointing",
               "save_steps", "device", "gpu_memory_gb", "gpu_tokens_per_second", "max_job_hours")
VARIANT_KEYS = ("d_kv", "r", "rope_strategy", "rope_fold", "svd", "whiten", "attention_aware", "latent", "kv_width",
                "rope_share", "steps", "lr", "distill", "trainable", "label", "paper", "fit")
RUN_SETTINGS = ("steps", "lr", "distill", "trainable")    # per-variant changes to the training recipe


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
    latent: str = DEFAULT_LATENT             # per_head | shared (mla/conversion/layout.py)
    kv_width: int | None = None              # a budget by cache width instead of d_kv and r ...
    rope_share: str | float | None = None    # ... with this fraction of it given to RoPE dims
    fit: dict | None = field(default=None, hash=False)   # layer-wise fit settings (all keys), None: no fit
    attention_aware: bool = False            # the whitened SVD weighed by the latent's readers (readers.py)
    rope_fold: int = 1                       # adjacent frequency pairs per rotated RoPE component (freqfold.py)

    @property
    def is_baseline(self) -> bool:
        return self.svd is None

    @property
    def conversion(self) -> str | None:
        """Folder name of the conversion this variant starts from (None: the baseline)."""
        if self.is_baseline:
            return None
        latent = "" if self.latent == DEFAULT_LATENT else f"-{self.latent}-latent"
        white = ("-white" if self.whiten else "") + ("-attn" if self.attention_aware else "")
        fold = f"-fold{self.rope_fold}" if self.rope_fold != 1 else ""
        if self.kv_width is not None:
            return (f"{self.rope_strategy}{fold}-kv{self.kv_width}-rope{_rope_dims_text(self)}-{self.svd}{white}"
                    f"{latent}")
        r = "auto" if self.r is None else self.r
        name = f"{self.rope_strategy}{fold}-r{r}-{self.svd}{white}"
        return (name if self.d_kv is None else f"{name}-dkv{self.d_kv}") + latent

    def budget(self) -> dict:
        """The conversion options that size the cache, as mla.conversion.layout.resolve takes them."""
        return {"strategy": self.rope_strategy, "svd": self.svd, "d_kv": self.d_kv, "r": self.r,
                "kv_width": self.kv_width, "rope_share": self.rope_share, "latent": self.latent}

    @property
    def fit_key(self) -> str | None:
        """Folder name of this variant's layer-wise fit (None: not fitted)."""
        return None if self.fit is None else fit_key(self.fit)

    @property
    def start(self) -> str:
        """What fine-tuning starts from: `baseline`, the conversion, or the conversion's fit."""
        if self.fit_key is not None:
            return f"{self.conversion}-{self.fit_key}"
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
    def fit_dir(self) -> str | None:
        return None if self.fit_key is None else fit_dir(self.model, self.conversion, self.fit_key)

    @property
    def start_dir(self) -> str:
        """The checkpoint fine-tuning starts from."""
        if self.is_baseline:
            return model_dir(self.model)
        return self.fit_dir or self.convert_dir

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

    @property
    def export_dir(self) -> str:
        """The fine-tuned checkpoint in the DeepSeek-V3 format (evaluate.serve, ladder variants)."""
        return f"results/export/{self.model}/{self.start}/{self.recipe}"

    @property
    def serve_path(self) -> str:
        """The engine's measurements of the export and of the original model (evaluate.serve)."""
        return f"results/evaluate/{self.model}/{self.start}/{self.recipe}/serve.json"


def _rope_dims_text(v: Variant) -> str:
    """S·W of a width budget for folder names: whole when valid (the config check refuses the rest)."""
    try:
        dims = Fraction(str(v.rope_share)) * v.kv_width
        return str(dims.numerator) if dims.denominator == 1 else f"{float(dims):g}"
    except (ValueError, ZeroDivisionError):
        return str(v.rope_share)


# ---------------------------------------------------------------- paths and keys
def gguf_path(model: str, start: str, recipe: str, layout: str) -> str:
    """A fine-tuned checkpoint as a GGUF file laid out for a llama.cpp K cache type (evaluate.serve llama.cpp)."""
    return f"results/gguf/{model}/{start}/{recipe}/mla-{layout}.gguf"


def original_gguf(model: str) -> str:
    """The original model as a GGUF file (evaluate.serve llama.cpp): llama.cpp runs both sides of a comparison."""
    return f"results/gguf/{model}/original.gguf"


def model_dir(model: str) -> str:
    return f"results/models/{model}"


def calibration_files(model: str) -> dict[str, str]:
    """The calibrate rule's outputs: 2-norm scores and the attention inputs' covariances, one pass."""
    return {"scores": f"results/calibrate/{model}/scores.pt", "covariance": f"results/calibrate/{model}/covariance.pt"}


def convert_dir(model: str, conversion: str) -> str:
    return f"results/convert/{model}/{conversion}"


def fit_dir(model: str, conversion: str, fit: str) -> str:
    return f"results/fit/{model}/{conversion}/{fit}"


def fit_settings(fit: dict | None) -> dict | None:
    """A `fit:` setting with every default filled in (None: no fit)."""
    return None if fit is None else {k: fit.get(k, v) for k, v in FIT_DEFAULTS.items()}


# fit settings added later: left out of the key at these values, so that earlier fits keep their folders
_FIT_KEY_OMITTED_AT = {"span": 1, "echo": 0, "schedule": "constant"}


def fit_key(settings: dict) -> str:
    full = fit_settings(settings)
    blob = json.dumps({k: v for k, v in full.items() if _FIT_KEY_OMITTED_AT.get(k, object()) != v}, sort_keys=True)
    return "f" + hashlib.sha256(blob.encode()).hexdigest()[:8]


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
    """Global train recipe < experiment's `train` < the variant's own steps/lr/distill/trainable."""
    exp = config["experiments"][experiment]
    train = dict(config["train"], **exp.get("train", {}), **{k: settings[k] for k in RUN_SETTINGS if k in settings})
    return canonical_recipe(train, exp["model"])


def canonical_recipe(train: dict, model: str) -> dict:
    """`distill`, `trainable` and `span` as the recipe key hashes them: absent when off (no distillation, or
    weight 0; every parameter trains; one block per sequence), so a recipe without them keeps its key; else
    distill in full, the teacher named (the experiment's model unless given) and the numbers as floats (weight 1
    and 1.0 are one recipe)."""
    train = dict(train)
    distill = train.pop("distill", None) or {}
    if distill.get("weight", 0) > 0:
        train["distill"] = {"weight": float(distill["weight"]),
                            "temperature": float(distill.get("temperature", TrainConfig.distill_temperature)),
                            "teacher": distill.get("teacher", model)}
    if train.get("trainable", "all") == "all":
        train.pop("trainable", None)
    if train.get("span", 1) == 1:     # one block per sequence: the recipe keys of runs before train.span
        train.pop("span", None)
    return train


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
        s = {k: exp.get(k) for k in ("r", "rope_strategy", "rope_fold", "svd", "whiten", "attention_aware", "latent",
                                     "fit")}
        if own.get("kv_width") is not None:   # a width budget decides r: the experiment's r is not for it
            s["r"] = None
        s.update({k: v for k, v in own.items() if k in VARIANT_KEYS})
        svd = s["svd"] or DEFAULT_SVD
        out.append(Variant(
            experiment=experiment, name=name, model=exp["model"], kind=kind,
            label=_label(kind, own, name, name == f"dkv{own.get('d_kv')}" and "d_kv" in own),
            d_kv=None if svd == "none" or s.get("d_kv") is None else int(s["d_kv"]),
            r=s["r"], rope_strategy=s["rope_strategy"] or DEFAULT_ROPE_STRATEGY, svd=svd,
            whiten=bool(s["whiten"]) and svd != "none",     # an experiment's whitening skips full-rank variants
            attention_aware=bool(s["attention_aware"]) and bool(s["whiten"]) and svd != "none",
            rope_fold=int(s["rope_fold"] or 1),
            train=train_settings(config, experiment, own), paper=own.get("paper"),
            latent=s["latent"] or DEFAULT_LATENT, rope_share=s.get("rope_share"),
            kv_width=None if s.get("kv_width") is None else int(s["kv_width"]),   # YAML may give 72.0
            fit=fit_settings(s["fit"])))
    if exp.get("baseline", True):
        own = (exp.get("overrides") or {}).get("baseline", {})
        train = train_settings(config, experiment, own)
        if train.get("distill", {}).get("teacher") == exp["model"]:
            # the unconverted model distilled from itself: no signal, only a pull back to where it starts; the
            # baseline stays the plain-CE run (docs/distillation.md)
            train.pop("distill")
        out.append(Variant(experiment=experiment, name="baseline", label=own.get("label", kind), model=exp["model"],
                           kind=kind, d_kv=None, r=None, rope_strategy=None, svd=None, whiten=False,
                           train=train, paper=own.get("paper", "baseline")))
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
            conflict = _budget_conflict(own, svd)
            if conflict is not None:
                errors.append((f"{key}.{conflict[0]}", conflict[1]))
            elif svd != "none" and own.get("d_kv") is None and own.get("kv_width") is None:
                errors.append((f"{key}.d_kv", f"svd: {svd} needs a latent size d_kv (or kv_width and rope_share)"))
            if svd == "none" and whiten:
                errors.append((f"{key}.whiten", "activation-aware SVD needs svd: joint or split"))
            if own.get("attention_aware") and not (svd != "none" and own.get("whiten", exp.get("whiten"))):
                errors.append((f"{key}.attention_aware", "attention-aware SVD needs whiten: true and svd: joint "
                                                         "or split"))
            strategy = own.get("rope_strategy", exp.get("rope_strategy")) or DEFAULT_ROPE_STRATEGY
            if (own.get("rope_fold", exp.get("rope_fold")) or 1) != 1 and strategy not in SHARED_ROPE_STRATEGIES:
                errors.append((f"{key}.rope_fold", f"rope_fold needs rope_strategy rotated or ladder, not {strategy}"))
        baseline_fit = ((exp.get("overrides") or {}).get("baseline") or {}).get("fit")
        if baseline_fit is not None:
            errors.append((f"{where}.overrides.baseline.fit",
                           "the baseline is not converted, so it has no attention layers to fit; remove `fit` there"))
        labels = [v.label for v in experiment_variants(config, ename)] if not errors else []
        for label in {x for x in labels if labels.count(x) > 1}:
            errors.append((where, f"two variants share the legend label '{label}': give each its own `label`"))
    return errors


def _budget_conflict(own: dict, svd: str) -> tuple[str, str] | None:
    """(key, message) when a variant mixes the two ways of giving its cache budget (shape-free; the rest of
    the budget is checked against the model's shape by mla.study.layout_check)."""
    error = conflicting_budget(own.get("d_kv"), own.get("r"), own.get("kv_width"), own.get("rope_share"))
    if error is not None:
        return error.option, str(error)
    if svd == "none" and own.get("kv_width") is not None:
        return "kv_width", (f"kv_width={own['kv_width']} sets the latent's width, but svd none keeps K/V at full "
                            "rank; give r (and no kv_width) with svd none")
    return None


def teacher_errors(config: dict) -> list[tuple[str, str]]:
    """(config key, message) for distillation teachers that are no model, or read another tokenizer than the
    student (another root model: the data and the KL need one vocabulary); and a baseline asked explicitly to
    distil from itself."""
    models, errors = config["models"], []
    for v in all_variants(config):
        exp = config["experiments"][v.experiment]
        own = (exp.get("overrides") or {}).get("baseline") or {} if v.is_baseline else {}
        if (own.get("distill") or {}).get("weight", 0) > 0 and own["distill"].get("teacher", v.model) == v.model:
            errors.append((f"experiments.{v.experiment}.overrides.baseline.distill",
                           ("the baseline would distil from itself (its own start model): remove it, baselines "
                            "train on the cross-entropy only")))
        teacher = (v.train.get("distill") or {}).get("teacher")
        if teacher is None:
            continue
        key = _distill_key(config, v)
        if teacher not in models:
            errors.append((key, f"'{teacher}' is not a key of models"))
        elif root_model(config, teacher) != root_model(config, v.model):
            errors.append((key, (f"teacher '{teacher}' reads the tokenizer of '{root_model(config, teacher)}', "
                                 f"the student '{v.model}' that of '{root_model(config, v.model)}': distillation "
                                 "compares next-token distributions over one vocabulary")))
    return list(dict.fromkeys(errors))


def _distill_key(config: dict, v: Variant) -> str:
    """The config key that gave a variant its `distill` block: its override, its own settings, the experiment's
    `train` or the global `train`."""
    exp = config["experiments"][v.experiment]
    for kind in ("overrides", "variants"):
        if "distill" in ((exp.get(kind) or {}).get(v.name) or {}):
            return f"experiments.{v.experiment}.{kind}.{v.name}.distill.teacher"
    if "distill" in exp.get("train", {}):
        return f"experiments.{v.experiment}.train.distill.teacher"
    return "train.distill.teacher"


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

    def fits(self) -> dict[tuple[str, str, str], Variant]:
        """(model, conversion, fit key) -> the first variant that fits it (they all fit identically)."""
        out = {}
        for v in self.variants:
            if v.fit_key is not None:
                out.setdefault((v.model, v.conversion, v.fit_key), v)
        return out

    def starts(self) -> dict[tuple[str, str], str]:
        """(model, start) -> the checkpoint folder fine-tuning starts from."""
        return {(v.model, v.start): v.start_dir for v in self.variants}

    def fit(self, model: str, conversion: str, fit: str) -> Variant:
        try:
            return self.fits()[(model, conversion, fit)]
        except KeyError:
            raise KeyError(f"no variant fits {model}/{conversion} as {fit}") from None

    def start_dir(self, model: str, start: str) -> str:
        try:
            return self.starts()[(model, start)]
        except KeyError:
            raise KeyError(f"no variant of {model} starts from {start}") from None

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

    def served(self, experiment: str | None = None) -> list[Variant]:
        """The variants evaluate.serve serves (of one experiment, or all): converted with rope_strategy ladder."""
        if not self.config["evaluate"].get("serve", False):
            return []
        return [v for v in (self.experiment(experiment) if experiment else self.variants)
                if not v.is_baseline and v.rope_strategy == LADDER_ROPE_STRATEGY]

    def inference_targets(self) -> list[str]:
        """Every checkpoint's inference.json and each served variant's serve.json (the target `snakemake
        inference`)."""
        paths = [path for e in self.config["experiments"] for _, path in self.inference_measured(e)]
        return list(dict.fromkeys(paths + [v.serve_path for v in self.served()]))

    def targets(self) -> list[str]:
        out = []
        for e in self.config["experiments"]:
            out += [path for _, path, _ in self.evaluated(e)]
            if self.measures_inference:
                out += [path for _, path in self.inference_measured(e)] + [v.serve_path for v in self.served(e)]
            out += [f"results/tables/{e}.csv", f"results/tables/{e}.md"]
        return list(dict.fromkeys(out)) + ["results/figures/loss.png", "results/figures/loss.pdf"]

    def jobs(self) -> dict[str, int]:
        """Training and conversion jobs, and how many variants share them (for messages and tests)."""
        originals = {exp["model"] for exp in self.config["experiments"].values()}
        return {"conversions": len(self.conversions()), "fits": len(self.fits()), "runs": len(self.runs()),
                "variants": len(self.variants),
                "original_evaluations": len(originals) if self.config["evaluate"].get("original", True) else 0}
