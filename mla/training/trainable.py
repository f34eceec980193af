"""Which parameters train: all of them (the paper's full-parameter fine-tuning, App. C), or only the attention modules' (`--trainable attention`,
docs/distillation.md): every decoder layer's `self_attn.*` — for MLA q_proj, k_rope_proj, kv_down, k_up, v_up,
o_proj (mla/modeling/modeling_mla.py), for the baseline q/k/v/o_proj. Embeddings, MLPs, norms and the output head
are frozen: they get no gradient and no optimizer state (mla/training/optimizer.py groups only parameters that
require a gradient), so they stay bit-identical."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mla.errors import UserError

if TYPE_CHECKING:   # torch-free at import: the workflow's schema reads TRAINABLE at every parse
    from torch import nn

TRAINABLE = ("all", "attention")
ATTENTION_MODULE = "self_attn"


def is_attention_parameter(name: str) -> bool:
    return ATTENTION_MODULE in name.split(".")


def elements(p: nn.Parameter) -> int:
    """A parameter's elements, also when it is a ZeRO-3 partition (whose local tensor is empty)."""
    return getattr(p, "ds_numel", p.numel())


def select_trainable(model: nn.Module, trainable: str) -> dict:
    """Set requires_grad per `trainable`; returns {"mode", "trainable_parameters", "parameters"} (elements)."""
    if trainable not in TRAINABLE:
        raise UserError(f"--trainable must be one of {', '.join(TRAINABLE)}, got {trainable!r}")
    named = list(model.named_parameters())
    if trainable == "attention":
        if not any(is_attention_parameter(n) for n, _ in named):
            raise UserError(f"--trainable attention: the model has no parameters under a '{ATTENTION_MODULE}' module")
        for name, p in named:
            p.requires_grad_(is_attention_parameter(name))
    return {"mode": trainable, "trainable_parameters": sum(elements(p) for _, p in named if p.requires_grad),
            "parameters": sum(elements(p) for _, p in named)}
