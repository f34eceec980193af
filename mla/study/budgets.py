"""Token budgets that follow from the experiments of a validated workflow config.

The tokens a model's data must hold are not a free knob: every fine-tuning run reads
`steps x batch_size x span x block_length` training tokens (it never repeats a block), calibration reads
`calibrate.samples` training blocks and a layer-wise fit its `fit.blocks` (and `fit.heldout` validation
blocks, which `data.validation_tokens` must hold). Derived models (`source: mha-from-gqa`) use their root model's
tokenizer and therefore its data, so the budget of one data folder is the largest need over every
experiment whose model has that root. `data.max_tokens` is only a cap (null = none): a config whose
cap is below a need is refused before any job runs.

Pure arithmetic on the config dict after schema validation (defaults filled); no I/O. The Snakefile's
config check calls `budget_errors`; the data rule passes `train_tokens` / `validation_tokens` to
`mla data --train-tokens/--validation-tokens`; the finetune rule's SLURM time comes from `variant_plan`
(a run's tokens planned by mla.training.walltime).
"""

from __future__ import annotations

from mla.options import DEFAULT_VALIDATION_TOKENS
from mla.study import experiments
from mla.training import walltime


def root_model(config: dict, model: str) -> str:
    """The model whose tokenizer (and data) `model` uses: derived models share their parent's."""
    return experiments.root_model(config, model)


def block_length(config: dict, model: str) -> int:
    """Tokens per block of `model`'s data: the root model's own block length, else data.block_length."""
    return int(config["models"][root_model(config, model)].get("block_length", config["data"]["block_length"]))


def run_tokens(config: dict, variant) -> int:
    """Training tokens of a variant's fine-tuning run: steps x sequences x span blocks x block length."""
    t = variant.train
    return t["steps"] * t["batch_size"] * t.get("span", 1) * block_length(config, variant.model)


def needs(config: dict, model: str) -> list[tuple[int, str]]:
    """Every training-token need of `model`'s data, as (tokens, why) pairs: one per training run (runs
    shared by several variants count once) and the calibration pass if any variant converts."""
    root = root_model(config, model)
    length = block_length(config, root)
    out, calibrated = [], False
    for v in experiments.Study(config).runs().values():
        if v.model not in config["models"] or root_model(config, v.model) != root:
            continue
        t = v.train
        span = t.get("span", 1)
        what = f"{length} tokens" if span == 1 else f"{span} blocks x {length} tokens"
        out.append((run_tokens(config, v),
                    f"experiments.{v.experiment} {v.name}: {t['steps']} steps x {t['batch_size']} sequences x {what}"))
        calibrated |= v.needs_calibration
    for v in experiments.Study(config).fits().values():
        if root_model(config, v.model) == root:
            span = v.fit["span"]
            what = "blocks" if span == 1 else f"sequences x {span} blocks"
            why = f"experiments.{v.experiment} {v.name}: fit.blocks {v.fit['blocks']} {what} x {length} tokens"
            out.append((v.fit["blocks"] * span * length, why))
    if calibrated:  # calibration (2-norm scores, input covariances) reads calibrate.samples training blocks
        samples = config["calibrate"]["samples"]
        out.append((samples * length, f"calibrate.samples: {samples} blocks x {length} tokens"))
    return out


def train_tokens(config: dict, model: str) -> int:
    """Training tokens `model`'s data must hold: the largest need over its experiments and calibration.

    A model no experiment uses (only a parent of a derived model, say) gets its derived models' needs;
    with no experiment at all the answer is 0.
    """
    return max((tokens for tokens, _ in needs(config, model)), default=0)


def validation_tokens(config: dict, model: str) -> int:
    """Held-out tokens of `model`'s data: the configured budget (one value for every model)."""
    value = config["data"].get("validation_tokens", DEFAULT_VALIDATION_TOKENS)
    return int(value if value is not None else DEFAULT_VALIDATION_TOKENS)


def fit_key_path(config: dict, v) -> str:
    """The config key that gave variant `v` its `fit` (its own entry, an override, or its experiment's)."""
    exp = config["experiments"][v.experiment]
    for part in ("overrides", "variants"):
        if "fit" in ((exp.get(part) or {}).get(v.name) or {}):
            return f"experiments.{v.experiment}.{part}.{v.name}.fit"
    return f"experiments.{v.experiment}.fit"


def fit_errors(config: dict) -> list[tuple[str, str]]:
    """(config key, message) for a fit that asks for more held-out blocks than `data.validation_tokens` give, or
    that repeats more tokens (`echo`) than half its sequence holds."""
    errors = []
    for v in experiments.Study(config).fits().values():
        length = block_length(config, v.model)
        available = validation_tokens(config, v.model) // length
        if v.fit["heldout"] * v.fit["span"] > available:
            what = "blocks" if v.fit["span"] == 1 else f"sequences of {v.fit['span']} blocks"
            errors.append((f"{fit_key_path(config, v)}.heldout",
                           (f"{v.fit['heldout']} held-out {what}, but data.validation_tokens holds {available} "
                            f"blocks of {length} tokens; lower it or raise data.validation_tokens")))
        sequence = v.fit["span"] * length
        if 2 * v.fit["echo"] > sequence:
            errors.append((f"{fit_key_path(config, v)}.echo",
                           f"{v.fit['echo']} tokens cannot be repeated from the first half of a fit sequence of "
                           f"{sequence} tokens (span x data.block_length) in its second: at most {sequence // 2}"))
    return errors


def budget_errors(config: dict) -> list[tuple[str, str]]:
    """(config key, message) for every data folder whose need exceeds the `data.max_tokens` cap, and every
    fit whose held-out blocks the validation split cannot hold."""
    errors = fit_errors(config)
    cap = config["data"].get("max_tokens")
    if cap is None:
        return errors
    roots = dict.fromkeys(root_model(config, e["model"]) for e in config["experiments"].values()
                          if e["model"] in config["models"])
    for root in roots:
        tokens, why = max(needs(config, root), key=lambda need: need[0], default=(0, ""))
        if tokens > cap:
            errors.append(("data.max_tokens",
                           f"{cap:,} is below the {tokens:,} training tokens that model '{root}' needs"
                           f" ({why}); raise the cap or set it to null"))
    return errors


def variant_plan(config: dict, variant) -> walltime.JobPlan:
    """The job plan of a workflow variant's fine-tuning run (config validated, schema defaults filled)."""
    t = variant.train
    return walltime.plan_run(run_tokens(config, variant), t["nproc"] * t.get("nodes", 1), t.get("gpu_tokens_per_second"), t.get("max_job_hours"))
