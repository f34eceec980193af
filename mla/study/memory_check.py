"""The workflow's GPU-memory check: every training job of a GPU config planned by mla.training.memory before
any job is submitted, with the cheapest change that makes the largest one fit."""

from __future__ import annotations

import sys
from pathlib import Path

from mla import shapes
from mla.conversion.layout import resolve
from mla.errors import UserError
from mla.options import SHARED_ROPE_STRATEGIES
from mla.study import experiments
from mla.study.model_configs import model_config
from mla.training.memory import GB, parse_memory, plan_training, teacher_parameters


def _job_plans(config: dict, ename: str, cfg_model: dict, train: dict, seq: int, gpu_bytes: int,
               results: str | Path = "results") -> dict:
    """Plan of every variant of one experiment: {variant: plan}."""
    # lazy: torch; only GPU configs get here, not every Snakefile parse
    from mla.conversion.convert import full_rank_d_kv

    s = shapes.shape_of(cfg_model)
    common = dict(nproc=train["nproc"], nodes=train.get("nodes", 1), micro_batch=train["micro_batch_size"], seq=seq,
                  zero_stage=train["zero_stage"], gradient_checkpointing=bool(train.get("gradient_checkpointing", False)),
                  offload=bool(train.get("offload_optimizer", False)), precision=train["precision"],
                  gpu_memory_bytes=gpu_bytes)
    plans = {}
    for v in experiments.experiment_variants(config, ename):
        own = dict(common, trainable=v.train.get("trainable", "all"), teacher_params=_teacher_params(config, v, results))
        if v.is_baseline:
            plans[v.name] = plan_training(cfg_model, **own)
            continue
        if v.kv_width is not None or v.rope_strategy in SHARED_ROPE_STRATEGIES:
            # planned as the per-head layout of the same cache width, rounded up: the shared RoPE key's wider
            # query (n_h·2m more rows) and a shared latent's n_h-head up-projections are not counted
            layout = resolve(cfg_model, **v.budget())
            d_kv, r = -(-layout.kv_lora_rank // s.kv_heads), -(-layout.rope_components // s.kv_heads)
            plans[v.name] = plan_training(cfg_model, d_kv=d_kv, r=r, svd=v.svd, **common)
            continue
        r = shapes.default_r(s.head_dim) if v.r is None else v.r
        d_kv = v.d_kv if v.svd != "none" else full_rank_d_kv(cfg_model, r)
        plans[v.name] = plan_training(cfg_model, d_kv=d_kv, r=r, svd=v.svd, **own)
    return plans


def _teacher_params(config: dict, variant, results: str | Path) -> int | None:
    """The distillation teacher's parameter count of a variant's run (None: no distillation); a teacher whose
    config is not at hand is counted as the source model (the same tokenizer, so usually the same family)."""
    distill = variant.train.get("distill")
    if not distill:
        return None
    teacher = model_config(config, distill["teacher"], results) or model_config(config, variant.model, results)
    return teacher_parameters(teacher) if teacher else None


def _describe(p: dict) -> str:
    g = p["gb"]
    teacher = f" + teacher {g['teacher']}" if g["teacher"] else ""
    return (f"{g['total']} GB per GPU (params {g['params']} + gradients {g['gradients']} + optimizer "
            f"{g['optimizer']}{teacher} + activations {g['activations']} + buffers {g['buffers']} GB)")


def memory_errors(config: dict, results: str | Path = "results") -> list[tuple[str, str]]:
    """(config key, message) for every experiment of a GPU config whose training jobs cannot fit
    `train.gpu_memory_gb` (one message per experiment, for its largest job). `config` is the validated
    workflow config (schema defaults filled); model shapes come from `model_config`."""
    gpu_gb = config["train"].get("gpu_memory_gb")
    if gpu_gb is None:
        return []
    errors = []
    for ename, exp in config["experiments"].items():
        train = dict(config["train"], **exp.get("train", {}))
        if train.get("device") != "gpu":
            continue
        cfg_model = model_config(config, exp["model"], results)
        if cfg_model is None:
            print(f"warning: no config.json at hand for model '{exp['model']}' (experiment {ename}): its training "
                  "jobs are not checked against train.gpu_memory_gb", file=sys.stderr)
            continue
        root = config["models"][experiments.root_model(config, exp["model"])]
        seq = root.get("block_length", config.get("data", {}).get("block_length", 128)) * train.get("span", 1)
        try:
            plans = _job_plans(config, ename, cfg_model, train, seq, parse_memory(gpu_gb), results)
        except UserError as exc:
            errors.append((f"experiments.{ename}", str(exc)))
            continue
        too_big = {v: p for v, p in plans.items() if not p["fits"]}
        if not too_big:
            continue
        variant, worst = max(too_big.items(), key=lambda kv: kv[1]["total_bytes"])
        where = f"experiments.{ename}.train" if exp.get("train") else "train"
        key, advice = _advice(cfg_model, worst, where, train)
        st = worst["settings"]
        others = sorted(set(too_big) - {variant})
        errors.append((key, (
            f"training job {ename}/{variant} cannot fit one GPU: it needs {_describe(worst)}, over the "
            f"{worst['usable_bytes'] / GB:.1f} GB usable of train.gpu_memory_gb = {gpu_gb} (90 %) -- "
            f"{st['world_size']} GPU(s), ZeRO-{st['zero_stage']}{' + offload' if st['offload'] else ''}, "
            f"{st['precision']}, micro-batch {st['micro_batch']} x {st['seq']} tokens, gradient checkpointing "
            f"{'on' if st['gradient_checkpointing'] else 'off'}"
            + (f" (also too big: {', '.join(others)})" if others else "") + f"; {advice}")))
    return errors


def _replan(cfg_model: dict, plan: dict, **change) -> dict:
    """`plan` again with some of its settings changed."""
    st, mla = dict(plan["settings"]), plan["model"]["mla"]
    st.pop("world_size")
    st.update(change)
    extra = {"d_kv": mla["d_kv"], "r": mla["r"], "svd": mla["svd"]} if mla else {}
    return plan_training(cfg_model, gpu_memory_bytes=plan["gpu_memory_bytes"], **st, **extra)


def _largest_micro_batch(cfg_model: dict, plan: dict, per_rank: int, **change) -> dict | None:
    """The plan with the largest micro-batch below the current one that divides the per-rank batch and fits."""
    for m in range(plan["settings"]["micro_batch"] - 1, 0, -1):
        if per_rank % m == 0:
            new = _replan(cfg_model, plan, micro_batch=m, **change)
            if new["fits"]:
                return new
    return None


def _advice(cfg_model: dict, plan: dict, where: str, train: dict) -> tuple[str, str]:
    """(key to change, what to set): the changes that make the job fit, the cheapest first."""
    st = plan["settings"]
    per_rank = train["batch_size"] // st["world_size"]
    options = []   # (config key, description, new plan)
    if not st["gradient_checkpointing"]:
        checkpointed = _replan(cfg_model, plan, gradient_checkpointing=True)
        options.append(("train.gradient_checkpointing", "set train.gradient_checkpointing: true", checkpointed))
    smaller = _largest_micro_batch(cfg_model, plan, per_rank)
    if smaller:
        options.append((f"{where}.micro_batch_size",
                        f"set {where}.micro_batch_size: {smaller['settings']['micro_batch']}", smaller))
    if not st["gradient_checkpointing"] and not checkpointed["fits"]:
        both = _largest_micro_batch(cfg_model, plan, per_rank, gradient_checkpointing=True)
        if both:
            options.append(("train.gradient_checkpointing", "set train.gradient_checkpointing: true and "
                            f"{where}.micro_batch_size: {both['settings']['micro_batch']}", both))
    if st["zero_stage"] < 3:
        options.append(("train.zero_stage", "set train.zero_stage: 3", _replan(cfg_model, plan, zero_stage=3)))
    if not st["offload"] and st["zero_stage"] > 0:
        options.append(("train.offload_optimizer", "set train.offload_optimizer: true",
                        _replan(cfg_model, plan, offload=True)))
    fitting = [(k, f"{d} ({o['gb']['total']} GB)") for k, d, o in options if o["fits"]]
    if not fitting:
        return (f"{where}.micro_batch_size", "no change of gradient_checkpointing, micro_batch_size, zero_stage or "
                "offload_optimizer alone fits: use more GPUs (nproc, nodes) or GPUs with more memory")
    return fitting[0][0], "to fit: " + " or ".join(d for _, d in fitting)
