"""The recipe's AdamW: two parameter groups and the optimizer class for the device.

Weight decay (paper-spec §5.1: 0.01 for 135M, 0.1 in the workflow's config) applies to every weight
matrix and embedding, including the MLA-specific ones (q_proj, k_rope_proj, kv_down, k_up, v_up,
o_proj, the MLP, embed_tokens, lm_head). It does not apply to

- the parameters of normalization modules (LlamaRMSNorm: input_layernorm, post_attention_layernorm,
  model.norm; any module whose class name ends in "Norm", and torch's LayerNorm/GroupNorm), and
- biases (any parameter named `bias`, e.g. q_proj.bias with attention_bias=True).

The Trainer builds the optimizer from these groups (no `"optimizer"` block in the DeepSpeed config:
with one, transformers 5.24's `deepspeed_optim_sched` hands DeepSpeed a single flat parameter list
and weight decay would apply to everything). DeepSpeed then wraps the client optimizer, groups intact.
"""

from __future__ import annotations

import torch
from torch import nn

NORM_TYPES = (nn.LayerNorm, nn.GroupNorm)


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, NORM_TYPES) or type(module).__name__.endswith("Norm")


def no_decay_parameter_names(model: nn.Module) -> list[str]:
    """Names (as in `model.named_parameters()`) of the parameters trained without weight decay."""
    names = []
    for module_name, module in model.named_modules():
        for param_name, _ in module.named_parameters(recurse=False):
            if _is_norm(module) or param_name == "bias":
                names.append(f"{module_name}.{param_name}" if module_name else param_name)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    return [n for n in names if n in trainable]


def decay_parameter_names(model: nn.Module) -> list[str]:
    skip = set(no_decay_parameter_names(model))
    return [n for n, p in model.named_parameters() if p.requires_grad and n not in skip]


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """[{params with decay, weight_decay}, {norms and biases, weight_decay 0}] (the Trainer's layout)."""
    decay = set(decay_parameter_names(model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]


def optimizer_class_and_kwargs(cfg, cuda: bool) -> tuple[type, dict]:
    """AdamW for the groups: torch's on CPU (foreach, the reference loop's), fused on CUDA, and
    DeepSpeedCPUAdam on CUDA machines when ZeRO offloads the optimizer state to the CPU."""
    kwargs = {"lr": cfg.lr, "betas": (cfg.adam_beta1, cfg.adam_beta2), "eps": cfg.adam_eps}
    if cuda and cfg.offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam, {**kwargs, "adamw_mode": True}
    if cuda:
        return torch.optim.AdamW, {**kwargs, "fused": True}
    return torch.optim.AdamW, kwargs
