"""An MLA checkpoint in the ladder layout rewritten as DeepSeek's attention, at the widths an engine takes
(`Target`): the one computation behind both exports, the DeepSeek-V3 checkpoint (transformers, vLLM) and the
`deepseek2` GGUF (llama.cpp). Per layer, every rewrite exact in real arithmetic (state-dict keys as
transformers' DeepseekV3 names them):

- q_proj: per head [rope (2m, rotate_half order) | nope (d_h)] becomes [nope (qk_nope) | rope (qk_rope)]: the
  no-RoPE rows first, zero-padded, then component i of pair p in the interleaved slot s = key.slot(p)
  (dims 2s, 2s+1), unused slots zero; every row times sqrt((qk_nope + qk_rope)/d_h), since DeepSeek scales
  scores by (qk_nope + qk_rope)^-1/2 and the converted model by d_h^-1/2.
- kv_a_proj_with_mqa: [α·kv_down zero-padded to kv_lora_rank | k_rope_proj in the same slots as the query].
- kv_a_layernorm: weight sqrt(eps)/α, the identity on the latent (mla/export/latent_norm.py).
- kv_b_proj: per query head [k_up rows, zero-padded to qk_nope | v_up rows, zero-padded to v_head] of its
  latent head (a KV head's rows repeated for its GQA group), on the latent's columns (its halves with
  latent_split); divided by κ, the norm weight's rounding.
- o_proj: each head's d_h columns, zero-padded to v_head.
- the MLP, the norms and lm_head (written even when tied) as they are; the residual stream scaled by
  s = sqrt(target eps / source eps) when the target's RMSNorms use another eps (DeepSeek-V3: transformers fixes
  kv_a_layernorm's at 1e-6 and vLLM reads it from rms_norm_eps): an RMSNorm of eps e on s·h equals one of
  eps e/s² on h, so scaling the embeddings, o_proj and down_proj keeps every norm's output.

The RoPE key (`RopeKey`): DeepSeek-V3's 64 dims hold the ladder's 32 slots; a narrower key holds every
`stride`-th slot of the ladder up to the last one used, with its own rope_theta, when the kept components allow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mla.conversion.ladder import ROPE_SLOTS, Ladder
from mla.export import latent_norm
from mla.export.engines import MLAShape, padded

CALIBRATION_TOKENS = (2, 64)       # random token blocks on which the latent's error and the eps change are measured


@dataclass(frozen=True)
class RopeKey:
    """The exported RoPE key: `slots` frequency slots (qk_rope_head_dim = 2·slots), slot j holding the ladder's
    slot stride·j; slot j rotates with theta_key^(-j/slots), theta_key = theta'^(stride·slots/32)."""

    ladder: Ladder
    slots: int
    stride: int = 1

    @property
    def dim(self) -> int:
        return 2 * self.slots

    def slot(self, pair: int) -> int:
        return self.ladder.slot(pair) // self.stride

    def theta(self, source_theta: float) -> float:
        return self.ladder.theta(source_theta) ** (self.stride * self.slots / ROPE_SLOTS)


def deepseek_key(ladder: Ladder) -> RopeKey:
    """DeepSeek-V3's own key: the ladder's 32 slots as they are."""
    return RopeKey(ladder, ROPE_SLOTS)


def narrowest_key(ladder: Ladder, pairs_per_layer: list[list[int]], block: int = 1) -> RopeKey:
    """The narrowest key that holds every layer's kept pairs on one geometric ladder (one rope_theta for all
    layers): a stride that divides every used slot, up to the last; its width padded to a multiple of `block`."""
    used = sorted({ladder.slot(p) for pairs in pairs_per_layer for p in pairs}) or [0]
    stride = math.gcd(*used) or 1
    slots = used[-1] // stride + 1
    return RopeKey(ladder, padded(2 * slots, max(block, 2)) // 2, stride)


@dataclass(frozen=True)
class Target:
    """What one engine takes: the widths, the RoPE key, the eps its kv_a_layernorm uses and the eps of every
    other RMSNorm (the residual stream is rescaled when it is not the source's)."""

    shape: MLAShape
    key: RopeKey
    norm_eps: float
    rms_norm_eps: float | None = None      # None: the source's own

    def residual_scale(self, source_eps: float) -> float:
        return 1.0 if self.rms_norm_eps is None else math.sqrt(self.rms_norm_eps / source_eps)


def _slot_rows(key: RopeKey, pairs: list[int]) -> torch.Tensor:
    """Where the converted model's 2m RoPE rows (rotate_half order: the components' first dims, then their
    second dims) go in the exported key: component i of pair p to 2·slot(p) and 2·slot(p) + 1."""
    slot = torch.tensor([key.slot(p) for p in pairs], dtype=torch.long)
    return torch.cat([2 * slot, 2 * slot + 1])


def attention_weights(attn, target: Target, pairs: list[int], norm: latent_norm.IdentityNorm,
                      stream_scale: float) -> dict[str, torch.Tensor]:
    """One layer's DeepSeek attention weights (keys under self_attn.), in fp64."""
    cfg, shape = attn.config, target.shape
    n_h, d_h, hidden = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
    nope, rope_dim, v_dim, width = shape.qk_nope_head_dim, shape.qk_rope_head_dim, shape.v_head_dim, shape.kv_lora_rank
    rope = _slot_rows(target.key, pairs)
    two_m = len(rope)

    q = attn.q_proj.weight.double().reshape(n_h, two_m + d_h, hidden)
    q_out = q.new_zeros(n_h, nope + rope_dim, hidden)
    q_out[:, :d_h] = q[:, two_m:]
    q_out[:, nope + rope] = q[:, :two_m]
    q_out *= math.sqrt((nope + rope_dim) / d_h)

    kv_a = q.new_zeros(width + rope_dim, hidden)
    kv_a[:cfg.kv_lora_rank] = norm.alpha * attn.kv_down.weight.double()
    kv_a[width + rope] = attn.k_rope_proj.weight.double()

    heads, groups = attn.num_kv_heads, n_h // attn.num_kv_heads     # latent heads of k_up / v_up
    k_up = attn.k_up.weight.double().reshape(heads, d_h, attn.k_latent)
    v_up = attn.v_up.weight.double().reshape(heads, d_h, attn.v_latent)
    v_start = attn.k_latent if cfg.latent_split else 0
    kv_b = q.new_zeros(heads, nope + v_dim, width)
    kv_b[:, :d_h, :attn.k_latent] = k_up
    kv_b[:, nope:nope + d_h, v_start:v_start + attn.v_latent] = v_up
    kv_b = kv_b.repeat_interleave(groups, dim=0) / norm.kappa

    o = attn.o_proj.weight.double().reshape(hidden, n_h, d_h)
    o_out = o.new_zeros(hidden, n_h, v_dim)
    o_out[..., :d_h] = stream_scale * o

    return {"q_proj.weight": q_out.reshape(-1, hidden), "kv_a_proj_with_mqa.weight": kv_a,
            "kv_a_layernorm.weight": torch.full((width,), norm.weight, dtype=torch.float64),
            "kv_b_proj.weight": kv_b.reshape(-1, width), "o_proj.weight": o_out.reshape(hidden, -1)}


@torch.no_grad()
def calibration_forward(model, norms: list[latent_norm.IdentityNorm], target: Target, seed: int = 0) -> dict:
    """On random tokens: the largest relative error of the identity norm on the real latents, and, where the
    target changes the eps, the largest change of the logits had the residual stream not been rescaled."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    batch, length = CALIBRATION_TOKENS
    ids = torch.randint(0, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))
    latents = []
    hooks = [layer.self_attn.kv_down.register_forward_hook(lambda mod, args, out: latents.append(out))
             for layer in model.model.layers]
    try:
        logits = model(ids).logits
    finally:
        for h in hooks:
            h.remove()
    width = target.shape.kv_lora_rank
    errors = [latent_norm.relative_error(c, n.alpha, width, target.norm_eps) for c, n in zip(latents, norms)]
    measured = {"latent_error_measured": max(errors),
                "latent_rms_max": max(c.pow(2).mean(-1).sqrt().max().item() for c in latents),
                "calibration_tokens": batch * length}
    if target.rms_norm_eps is not None:
        source_eps = model.config.rms_norm_eps
        rms_norms = [m for m in model.modules() if isinstance(m, LlamaRMSNorm)]
        for m in rms_norms:
            m.variance_epsilon = target.rms_norm_eps
        try:
            measured["eps_logit_change_unscaled"] = (model(ids).logits - logits).abs().max().item()
        finally:
            for m in rms_norms:
                m.variance_epsilon = source_eps
    return measured


@torch.no_grad()
def rewrite(model, target: Target, norm_dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict]:
    """The whole model's weights in DeepSeek's layout (fp64 attention, the rest as loaded; transformers'
    DeepseekV3 names, lm_head always its own tensor) and what the rewrite chose and measured. Each layer's
    attention is released once rewritten. `norm_dtype`: what kv_a_layernorm's weight is stored in."""
    cfg = model.config
    norms = [latent_norm.identity_norm(layer.self_attn.kv_down.weight, layer.input_layernorm.weight,
                                       target.shape.kv_lora_rank, target.norm_eps, norm_dtype)
             for layer in model.model.layers]
    measured = calibration_forward(model, norms, target)
    scale = target.residual_scale(cfg.rms_norm_eps)
    state = {}
    for name, tensor in model.state_dict().items():
        if ".self_attn." in name or name == "lm_head.weight":
            continue
        adds_to_residual = name == "model.embed_tokens.weight" or name.endswith("mlp.down_proj.weight")
        state[name] = scale * tensor.double() if adds_to_residual and scale != 1.0 else tensor
    state["lm_head.weight"] = model.lm_head.weight.detach().clone()      # its own tensor, never tied
    slots = []
    for i, layer in enumerate(model.model.layers):
        pairs = cfg.rope_pairs[i][0]
        weights = attention_weights(layer.self_attn, target, pairs, norms[i], scale)
        state.update({f"model.layers.{i}.self_attn.{k}": v for k, v in weights.items()})
        slots.append([target.key.slot(p) for p in pairs])
        layer.self_attn = torch.nn.Identity()
    shape = target.shape
    report = {
        "kv_lora_rank_source": cfg.kv_lora_rank, "kv_lora_rank": shape.kv_lora_rank,
        "rope_components_source": cfg.qk_rope_head_dim // 2, "qk_rope_head_dim": shape.qk_rope_head_dim,
        "qk_nope_head_dim": shape.qk_nope_head_dim, "v_head_dim": shape.v_head_dim,
        "rope_theta_source": cfg.rope_parameters["rope_theta"],
        "rope_theta": target.key.theta(cfg.rope_parameters["rope_theta"]),
        "ladder_stride": target.key.ladder.stride, "rope_key_stride": target.key.stride,
        "rope_slots_per_layer": slots,
        "query_scale": math.sqrt((shape.qk_nope_head_dim + shape.qk_rope_head_dim) / cfg.head_dim),
        "rms_norm_eps_source": cfg.rms_norm_eps, "rms_norm_eps": target.rms_norm_eps or cfg.rms_norm_eps,
        "latent_norm_eps": target.norm_eps, "residual_scale": scale,
        "latent_norm_alpha_per_layer": [n.alpha for n in norms],
        "latent_norm_weight_per_layer": [n.weight for n in norms],
        "latent_norm_kappa_per_layer": [n.kappa for n in norms],
        "latent_error_bound": max(n.error_bound for n in norms), **measured,
        "kv_elements_per_token_source": cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim),
        "kv_elements_per_token": cfg.num_hidden_layers * shape.cached,
    }
    return state, report
