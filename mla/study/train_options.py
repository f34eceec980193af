"""A workflow `train` block (config.yaml's `train`, an experiment's, a variant's override) as the options of
`mla train`: the same names where they agree, WORKFLOW_NAMES where they do not, the teacher as its model
folder; and the message `mla train` would stop with, so that a bad recipe stops the workflow at parse time."""

from __future__ import annotations

from mla.errors import UserError
from mla.study.experiments import model_dir
from mla.training.config import TrainConfig, resolve


# the workflow's `train` keys (config.yaml) that are `mla train` options under another name
WORKFLOW_NAMES = {"batch_size": "global_batch", "micro_batch_size": "micro_batch", "max_grad_norm": "clip",
                  "offload_optimizer": "offload"}


def workflow_options(train: dict) -> dict:
    """The `mla train` options (TrainConfig fields) of a workflow `train` block; keys that only the workflow
    reads (gpu_memory_gb) are left out."""
    given = {WORKFLOW_NAMES.get(k, k): v for k, v in train.items()}
    given["device"] = "cuda" if train["device"] == "gpu" else "cpu"
    distill = given.pop("distill", None) or {}
    if distill.get("weight", 0) > 0:  # `distill: {weight, temperature, teacher}`, the teacher a model key
        given.update(distill_weight=distill["weight"], teacher=model_dir(distill["teacher"]) if "teacher" in distill
                     else "", **({"distill_temperature": distill["temperature"]} if "temperature" in distill else {}))
    # in TrainConfig's order, whatever the block's: the flags are a rule's params, and Snakemake reruns a job
    # whose params text changed
    return {name: given[name] for name in TrainConfig.field_names() if name in given}


def workflow_train_error(train: dict) -> str | None:
    """The message `mla train` would stop with for a workflow `train` block (None: it would start), so that
    a bad recipe stops the workflow before any job, checked by the same code."""
    cfg = TrainConfig(model="-", data="-", out="-", **workflow_options(train))
    cfg.world_size = cfg.nproc * cfg.nodes
    try:
        resolve(cfg)
    except UserError as exc:
        return str(exc)
    return None
