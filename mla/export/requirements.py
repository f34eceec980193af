"""Which MLA checkpoints the DeepSeek attention (the DeepSeek-V3 checkpoint, the `deepseek2` GGUF) can express
exactly, checked on config.json alone (before any weight is read or any file written). Each refusal is one
line naming the option to change. The widths each engine takes are mla/export/engines.py's.

DeepSeek's attention has one RoPE key shared by all heads on one frequency ladder, no attention biases, a
SwiGLU MLP and default RoPE (vLLM turns any other rope_type into DeepSeek's yarn).
"""

from __future__ import annotations

from mla.conversion.ladder import ROPE_SLOTS, Ladder, ladder_for
from mla.errors import UserError
from mla.shapes import attention_biases, check_family

LADDER_HINT = "convert with `mla convert --rope-strategy ladder` (workflow key rope_strategy: ladder)"


def check_ladder_checkpoint(config: dict) -> Ladder:
    """Refuse what DeepSeek's attention cannot express; returns the RoPE ladder of the checkpoint's head size."""
    if config.get("model_type") != "mla_llama":
        raise UserError(f"not an MLA checkpoint (model_type {config.get('model_type')!r}): {LADDER_HINT} first")
    head_dim = check_source(config)
    if config.get("rope_layout") != "shared":
        raise UserError(f"rope_layout {config.get('rope_layout')!r} (a RoPE key per KV head, the paper's) has no "
                        f"DeepSeek form: {LADDER_HINT}")
    ladder = ladder_for(head_dim)
    for i, (pairs,) in enumerate(config["rope_pairs"]):
        repeated = sorted({p for p in pairs if pairs.count(p) > 1})
        if repeated:
            raise UserError(f"rope_pairs of layer {i} repeat frequency pairs {repeated}, but DeepSeek's RoPE key "
                            f"holds each frequency once: {LADDER_HINT}")
        off = [p for p in pairs if not ladder.holds(p)]
        if off:
            raise UserError(f"rope_pairs of layer {i} keep pairs {off}, which DeepSeek's ladder of {ROPE_SLOTS} "
                            f"frequencies cannot hold at d_h = {head_dim}: {LADDER_HINT}")
    return ladder


def check_llama_original(config: dict) -> int:
    """What llama.cpp's `llama` architecture takes of an original model (the GGUF export's other side); its d_h."""
    if config.get("model_type") != "llama":
        raise UserError(f"model_type {config.get('model_type')!r}: the GGUF export takes an MLA checkpoint "
                        "(mla_llama, converted with --rope-strategy ladder) or its original Llama checkpoint, "
                        "which llama.cpp runs as its `llama` architecture")
    check_family(config)
    return check_source(config)


def check_source(config: dict) -> int:
    """What the source model itself must be (read from the MLA checkpoint's config.json, or, before any
    conversion, the original model's, as the workflow's config check does): returns its head size."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if any(attention_biases(config)) or config.get("o_proj_bias"):
        raise UserError("attention_bias: DeepSeek's attention has no biases, so a source with q/k/v or o "
                        "biases (Qwen2) cannot be exported")
    if config.get("mlp_bias"):
        raise UserError("mlp_bias: DeepSeek's MLP has no biases")
    act = config.get("hidden_act", "silu")   # absent from the bundled shapes (mla/model_shapes): Llama's default
    if act != "silu":
        raise UserError(f"hidden_act {act!r}: DeepSeek's MLP is SwiGLU with silu (a Llama MLP)")
    if not config.get("rms_norm_eps", 0) > 0:
        raise UserError(f"rms_norm_eps {config.get('rms_norm_eps')}: the latent's identity norm is built on a "
                        "positive eps")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}   # rope_scaling: transformers < 5
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise UserError(f"rope_parameters rope_type {rope.get('rope_type')!r}: the export needs the default RoPE "
                        "(vLLM would run any other type as DeepSeek's yarn; the ladder rescales default "
                        "frequencies only)")
    return head_dim
