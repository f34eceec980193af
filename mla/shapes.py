"""Model shapes: reading configs, checking the family, counting parameters and KV-cache size.

Parameters are counted as the paper's Table 4 counts them: every weight once, without the output
head (for tied embeddings the head is the embedding, so nothing changes; for Llama-2-7B the untied
head's 131M are left out: 6.74B -> 6.61B). Pure arithmetic on the config: no weights needed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mla.errors import UserError

# model_type -> what differs from Llama's decoder and how the conversion carries it
SUPPORTED_FAMILIES = {
    "llama": "Llama 1/2/3.x; every RoPE scaling transformers implements (llama3, linear, dynamic, yarn, ...)",
    "mistral": "Mistral: a Llama decoder; refused while its sliding window is active",
    "qwen2": "Qwen2/Qwen2.5: q/k/v biases (carried into k_rope_proj, k_up, v_up), no o_proj bias",
}
# model_type -> why the conversion refuses it, and what it would need
REFUSED_FAMILIES = {
    "qwen3": "QK-norm: an RMSNorm on each key head after k_proj is not linear in the latent, so keys can "
             "neither be rebuilt by one up-projection nor absorbed into the query; it would need the norm "
             "folded into the query side or full keys cached",
    "qwen3_moe": "QK-norm (as qwen3) and mixture-of-experts MLPs",
    "gemma": "a different decoder: (1 + w) RMSNorm weights, embeddings scaled by sqrt(hidden_size) and a GeGLU "
             "MLP; the attention would convert, but it needs a Gemma-based MLA model class",
    "gemma2": "attention-logit soft-capping (tanh of the scores, which the absorbed decode would have to "
              "apply in latent space) and interleaved sliding-window layers, besides gemma's decoder",
    "gemma3": "QK-norm (as qwen3), interleaved sliding-window layers and gemma's decoder",
    "gemma3_text": "QK-norm (as qwen3), interleaved sliding-window layers and gemma's decoder",
    "phi3": "fused projections (qkv_proj, gate_up_proj): the converter reads separate q/k/v weights; it would "
            "need the fused matrices split at load, and some variants rotate only part of each head",
    "olmo2": "QK-norm over all heads after k_proj (as qwen3)",
}
NAMED_SHAPES = {
    "llama-2-7b": "llama-2-7b.json", "smollm-135m": "smollm-135m.json",
    "llama-3.1-8b": "llama-3.1-8b.json", "llama-3.2-1b": "llama-3.2-1b.json",
    "qwen2.5-0.5b": "qwen2.5-0.5b.json", "qwen2.5-1.5b": "qwen2.5-1.5b.json", "qwen2.5-7b": "qwen2.5-7b.json",
    "mistral-7b": "mistral-7b-v0.3.json",
}
_SHAPES_DIR = Path(__file__).with_name("model_shapes")


@dataclass(frozen=True)
class Shape:
    """The numbers of a decoder that the conversion arithmetic needs."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    qkv_bias: bool = False        # biases on q_proj, k_proj, v_proj
    o_bias: bool = False          # bias on o_proj
    mlp_bias: bool = False

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads


def read_config(path: str | Path) -> dict:
    """config.json as a dict, from a file, a checkpoint folder, or a named shape (NAMED_SHAPES)."""
    name = str(path)
    if name in NAMED_SHAPES:
        return json.loads((_SHAPES_DIR / NAMED_SHAPES[name]).read_text())
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise UserError(f"no model config at {path}: give a config.json, a checkpoint folder or one of "
                        f"{', '.join(NAMED_SHAPES)}")
    return json.loads(p.read_text())


def sliding_window_active(config: dict) -> bool:
    """Whether any layer attends through a sliding window (Qwen2 keeps a window size it does not use)."""
    if not config.get("sliding_window"):
        return False
    if config.get("model_type") == "qwen2":
        if not config.get("use_sliding_window"):
            return False
        layers = config.get("layer_types")
        return any(t == "sliding_attention" for t in layers) if layers else \
            config.get("max_window_layers", 0) < config.get("num_hidden_layers", 0)
    return True


def check_family(config: dict) -> None:
    """Refuse what the converter cannot convert, naming the reason."""
    family = config.get("model_type")
    if family == "mla_llama":
        raise UserError("this checkpoint is already an MLA model (model_type mla_llama)")
    if family in REFUSED_FAMILIES:
        raise UserError(f"model family {family!r} is not supported: {REFUSED_FAMILIES[family]}")
    if family not in SUPPORTED_FAMILIES:
        raise UserError(f"unknown or unsupported model family {family!r}: MHA2MLA conversion supports "
                        f"{', '.join(SUPPORTED_FAMILIES)} (Llama-style decoders with rotate_half RoPE)")
    if sliding_window_active(config):
        raise UserError(f"sliding-window attention (sliding_window={config['sliding_window']}) is not supported: "
                        "the latent cache keeps every token; set it to null only if the model was trained "
                        "without it")
    for key in ("q_norm", "k_norm", "qk_norm", "use_qk_norm"):
        if config.get(key):
            raise UserError(f"QK-norm ({key}) is not supported: a norm after the key up-projection breaks "
                            "the latent factorisation")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("partial_rotary_factor", 1.0) != 1.0 or config.get("partial_rotary_factor", 1.0) != 1.0:
        raise UserError("models whose RoPE already covers only part of each head are not supported")


def attention_biases(config: dict) -> tuple[bool, bool]:
    """(q/k/v have biases, o_proj has a bias): Qwen2 always biases q/k/v and never o; Llama follows
    `attention_bias` for all four."""
    if config.get("model_type") == "qwen2":
        return True, False
    bias = bool(config.get("attention_bias", False))
    return bias, bias


def shape_of(config: dict) -> Shape:
    heads = config["num_attention_heads"]
    return Shape(
        vocab=config["vocab_size"], hidden=config["hidden_size"], intermediate=config["intermediate_size"],
        layers=config["num_hidden_layers"], heads=heads,
        kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        qkv_bias=attention_biases(config)[0], o_bias=attention_biases(config)[1],
        mlp_bias=bool(config.get("mlp_bias", False)),
    )


def _common_params(s: Shape) -> int:
    """Everything but the K/V projections: embeddings, q/o, MLP, norms (no output head)."""
    ab, ob, mb = int(s.qkv_bias), int(s.o_bias), int(s.mlp_bias)
    q = s.hidden * s.heads * s.head_dim + ab * s.heads * s.head_dim
    o = s.heads * s.head_dim * s.hidden + ob * s.hidden
    mlp = 3 * s.hidden * s.intermediate + mb * (2 * s.intermediate + s.hidden)
    per_layer = q + o + mlp + 2 * s.hidden
    return s.vocab * s.hidden + s.layers * per_layer + s.hidden


def params_original(s: Shape) -> int:
    kv = 2 * (s.hidden * s.kv_heads * s.head_dim + int(s.qkv_bias) * s.kv_heads * s.head_dim)
    return _common_params(s) + s.layers * kv


def params_mla(s: Shape, d_kv: int, r: int, split: bool = False) -> int:
    ab = int(s.qkv_bias)
    rope, nope = 2 * r, s.head_dim - 2 * r
    latent = s.kv_heads * d_kv
    up_in = latent // 2 if split else latent
    kv = (s.hidden * s.kv_heads * rope + ab * s.kv_heads * rope       # k_rope_proj
          + s.hidden * latent                                          # kv_down (no bias)
          + up_in * s.kv_heads * nope + ab * s.kv_heads * nope         # k_up
          + up_in * s.kv_heads * s.head_dim + ab * s.kv_heads * s.head_dim)  # v_up
    return _common_params(s) + s.layers * kv


def params_layout(s: Shape, layout) -> int:
    """Parameters after a conversion of any layout (mla/conversion/layout.py): the query grows by the rotated
    RoPE rows (shared layout: n_h·(2m + d_h) rows), a shared latent's k_up / v_up rebuild n_h heads."""
    ab = int(s.qkv_bias)
    rope_q, nope, up_heads = layout.rope_head_dim, layout.nope_head_dim, layout.up_heads
    q_extra = s.heads * (rope_q + nope - s.head_dim) * (s.hidden + ab)
    rope_k = layout.rope_heads * layout.rope_head_dim
    latent = layout.kv_lora_rank
    up_in = latent // 2 if layout.svd == "split" else latent
    kv = (s.hidden * rope_k + ab * rope_k                                  # k_rope_proj
          + s.hidden * latent                                              # kv_down (no bias)
          + up_in * up_heads * nope + ab * up_heads * nope                 # k_up
          + up_in * up_heads * s.head_dim + ab * up_heads * s.head_dim)    # v_up
    return _common_params(s) + s.layers * (kv + q_extra)


def plan_layout(config: dict, layout) -> dict:
    """`plan` for any layout: the same keys (d_kv may be fractional, r None for a shared RoPE key that is not
    n_kv·r components), and the split of the cache between RoPE dims and latent per layer."""
    s = shape_of(config)
    before, after = params_original(s), params_layout(s, layout)
    kv_before, kv_after = kv_elements_original(s), s.layers * layout.kv_width
    return {
        "model_type": config.get("model_type"), "layers": s.layers, "heads": s.heads, "kv_heads": s.kv_heads,
        "head_dim": s.head_dim, "d_kv": layout.d_kv, "r": layout.r, "kv_lora_rank": layout.kv_lora_rank,
        "params_before": before, "params_after": after,
        "kv_elements_per_token_before": kv_before, "kv_elements_per_token_after": kv_after,
        "kv_ratio": kv_after / kv_before, "kv_reduction_percent": round(100 * (1 - kv_after / kv_before), 4),
        **layout.describe(),
    }


def default_r(head_dim: int) -> int:
    """The paper's default r = d_h / 16 (4 for SmolLM, 8 for Llama-2-7B)."""
    return max(1, head_dim // 16)


def kv_elements_original(s: Shape) -> int:
    """Cached elements per token, summed over layers: K and V of every KV head."""
    return s.layers * 2 * s.kv_heads * s.head_dim


def kv_elements_mla(s: Shape, d_kv: int, r: int) -> int:
    """Cached elements per token, summed over layers: latent n_kv·d_kv plus RoPE'd keys n_kv·2r."""
    return s.layers * s.kv_heads * (d_kv + 2 * r)


def plan(config: dict, d_kv: int, r: int, split: bool = False) -> dict:
    """What a conversion gives, from the config alone."""
    s = shape_of(config)
    before, after = params_original(s), params_mla(s, d_kv, r, split)
    kv_before, kv_after = kv_elements_original(s), kv_elements_mla(s, d_kv, r)
    return {
        "model_type": config.get("model_type"), "layers": s.layers, "heads": s.heads, "kv_heads": s.kv_heads,
        "head_dim": s.head_dim, "d_kv": d_kv, "r": r, "kv_lora_rank": s.kv_heads * d_kv,
        "params_before": before, "params_after": after,
        "kv_elements_per_token_before": kv_before, "kv_elements_per_token_after": kv_after,
        "kv_ratio": kv_after / kv_before, "kv_reduction_percent": round(100 * (1 - kv_after / kv_before), 4),
    }
