"""The workflow config's JSON schema, applied with its defaults filled in.

One validator for the Snakefile (`workflow/rules/common.smk`) and for the package code that reads a
workflow config outside Snakemake (the rehearsal, the budget tests), so both see the same defaults.
"""
from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import yaml

from mla.evaluation.report import EvalOptions
from mla.options import (
    DEFAULT_LATENT,
    DEFAULT_ROPE_STRATEGY,
    DEFAULT_SVD,
    DEFAULT_VALIDATION_FRACTION,
    DEFAULT_VALIDATION_TOKENS,
    FIT_DEFAULTS,
    FIT_SCHEDULES,
    LATENT_LAYOUTS,
    MODEL_SOURCES,
    ROPE_STRATEGIES,
    SVD_METHODS,
)
from mla.study import experiments
from mla.study.budgets import budget_errors
from mla.study.kv_check import kv_group_errors
from mla.study.layout_check import layout_errors
from mla.study.memory_check import memory_errors
from mla.study.serve_check import serve_errors
from mla.study.train_options import workflow_train_error
from mla.tracking import DEFAULT_TRACKING_URI
from mla.training.config import TrainConfig
from mla.training.trainable import TRAINABLE
from mla.training.walltime import walltime_errors

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "workflow" / "schemas" / "config.schema.yaml"


# evaluate keys whose default is `mla evaluate`'s (the others are the CPU workflow's own: fewer blocks, a
# smaller decode grid, the paper tasks off)
EVALUATE_DEFAULTS_FROM_CLI = ("local_docs", "mmlu", "mmlu_seed", "paper_limit", "kv_group_size", "kv_residual",
                              "kv_scored", "kv_blocks", "needle_samples", "longbench", "longbench_limit",
                              "decode_steps")


def load_schema() -> dict:
    """The YAML schema with the lists and defaults that the package defines filled in (mla.options for
    the strategies, model sources and fit settings, TrainConfig for the recipe's paper defaults and the
    MLflow experiment, mla.tracking for the store, EvalOptions for the evaluation's)."""
    schema = yaml.safe_load(SCHEMA_PATH.read_text())
    props = schema["properties"]
    experiment = props["experiments"]["additionalProperties"]["properties"]
    for key, enum, default in (("rope_strategy", ROPE_STRATEGIES, DEFAULT_ROPE_STRATEGY),
                               ("svd", SVD_METHODS, DEFAULT_SVD), ("latent", LATENT_LAYOUTS, DEFAULT_LATENT)):
        schema["$defs"]["variant_settings"][key]["enum"] = list(enum)
        experiment[key].update(enum=list(enum), default=default)
    props["models"]["additionalProperties"]["properties"]["source"]["enum"] = list(MODEL_SOURCES)
    for key in ("weight_decay", "seed"):
        props["train"]["properties"][key]["default"] = getattr(TrainConfig, key)
    schema["$defs"]["trainable"]["enum"] = list(TRAINABLE)
    props["mlflow"]["properties"]["experiment"]["default"] = TrainConfig.experiment
    props["mlflow"]["properties"]["tracking_uri"]["default"] = DEFAULT_TRACKING_URI
    for key, value in FIT_DEFAULTS.items():
        schema["$defs"]["fit"]["properties"][key]["default"] = value
    schema["$defs"]["fit"]["properties"]["schedule"]["enum"] = list(FIT_SCHEDULES)
    props["data"]["properties"]["validation_tokens"]["default"] = DEFAULT_VALIDATION_TOKENS
    props["data"]["properties"]["validation_fraction"]["default"] = DEFAULT_VALIDATION_FRACTION
    for key in EVALUATE_DEFAULTS_FROM_CLI:
        props["evaluate"]["properties"][key]["default"] = getattr(EvalOptions, key)
    return schema


def _validator_with_defaults(schema: dict) -> jsonschema.protocols.Validator:
    """A Draft 2020-12 validator that writes each property's `default` into the instance it checks."""
    base = jsonschema.Draft202012Validator
    check_properties = base.VALIDATORS["properties"]

    def properties(validator, props, instance, subschema):
        if isinstance(instance, dict):
            for name, sub in props.items():
                if "default" in sub and name not in instance:
                    instance[name] = copy.deepcopy(sub["default"])
        yield from check_properties(validator, props, instance, subschema)

    return jsonschema.validators.extend(base, {"properties": properties})(schema)


def dotted_key(path) -> str:
    """Dotted config key for a jsonschema error path: experiments.gqa2mla.d_kv[1]."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<top level>"


def schema_problems(cfg: dict) -> list[tuple[str, str]]:
    """Fill `cfg`'s defaults in place; return (dotted key, message) for every schema violation."""
    errors = sorted(_validator_with_defaults(load_schema()).iter_errors(cfg), key=lambda e: list(map(str, e.absolute_path)))
    return [(dotted_key(e.absolute_path), e.message) for e in errors]


def config_problems(cfg: dict) -> list[tuple[str, str]]:
    """Fill `cfg`'s defaults in place; (dotted key, message) for every schema violation, else for every
    cross-reference the schema cannot express."""
    return schema_problems(cfg) or _cross_reference_problems(cfg)


def _cross_reference_problems(cfg: dict) -> list[tuple[str, str]]:
    """Models named and derived without loops, variants, each run's recipe as `mla train` checks it, then
    cache budgets, data budgets, GPU memory, the quantized cache's group sizes and what evaluate.serve
    serves (arithmetic on what exists)."""
    errors = []
    models = cfg["models"]
    for name, model in models.items():
        if model["source"] == "mha-from-gqa":
            parent, seen = model["from"], {name}
            if parent not in models:
                errors.append((f"models.{name}.from", f"'{parent}' is not a key of models"))
                continue
            while models.get(parent, {}).get("source") == "mha-from-gqa" and parent not in seen:
                seen.add(parent)
                parent = models[parent].get("from")
            if parent in seen:
                errors.append((f"models.{name}.from", "derivation loop: the chain of `from` comes back to a model"))
    for ename, exp in cfg["experiments"].items():
        if exp["model"] not in models:
            errors.append((f"experiments.{ename}.model", f"'{exp['model']}' is not a key of models"))
    errors += experiments.variant_errors(cfg)
    if errors:
        return errors
    errors += experiments.teacher_errors(cfg)
    for v in experiments.all_variants(cfg):
        exp = cfg["experiments"][v.experiment]
        where = (f"experiments.{v.experiment}.overrides.{v.name}" if v.name in exp["overrides"]
                 else f"experiments.{v.experiment}.train" if exp["train"] else "train")
        message = workflow_train_error(v.train)
        if message:
            errors.append((where, message))
    for check in (layout_errors, budget_errors, memory_errors, kv_group_errors, walltime_errors, serve_errors):
        if not errors:
            errors += check(cfg)
    return list(dict.fromkeys(errors))  # one message per key


def validated(cfg: dict) -> dict:
    """A copy of `cfg` with its defaults filled in; ValueError naming every bad key if it breaks the schema."""
    cfg = copy.deepcopy(cfg)
    problems = schema_problems(cfg)
    if problems:
        raise ValueError("invalid config: " + "; ".join(f"'{k}': {m}" for k, m in problems))
    return cfg
