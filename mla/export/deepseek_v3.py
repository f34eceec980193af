"""`mla export --format deepseek_v3`: an MLA checkpoint in the ladder layout rewritten as a DeepSeek-V3 checkpoint
that transformers' DeepseekV3ForCausalLM and vLLM load as they are (no remote code), computing the same function.

Per layer, every rewrite exact (docs/serving.md; the rounding of bf16 aside):

- q_proj: per head [rope (2m, rotate_half order) | nope (d_h)] becomes [nope (d_h) | rope (64)], component i
  of pair p in the interleaved slot s = ladder.slot(p) (dims 2s, 2s+1), unused slots zero; every row times
  sqrt((d_h + 64)/d_h), since DeepSeek scales scores by (d_h + 64)^-1/2 and the converted model by d_h^-1/2.
- kv_a_proj_with_mqa: [α·kv_down zero-padded to 512 | k_rope_proj in the same slots, zero-padded to 64].
- kv_a_layernorm: weight sqrt(eps)/α, the identity on the latent (mla/export/latent_norm.py).
- kv_b_proj: per query head [k_up rows | v_up rows] of its latent head (a KV head's rows repeated for its
  GQA group), on the latent's columns (its halves with latent_split), zero-padded to 512; divided by κ.
- the MLP, the norms and lm_head (written even when tied) as they are.

The eps. transformers fixes the latent norm's eps at 1e-6, vLLM reads it from rms_norm_eps: both compute the
same only with rms_norm_eps 1e-6, which every other RMSNorm then uses too. An RMSNorm of eps e on s·h equals one
of eps e/s² on h, so the export scales the residual stream by s = sqrt(1e-6 / source eps) (the embeddings and
the two projections that add to it, o_proj and down_proj): every RMSNorm then computes exactly what it did with
the source's eps, and the attention and MLP see the same inputs.

The config: every layer dense (first_k_dense_replace = num_hidden_layers; n_routed_experts keeps DeepSeek's
integer, which no dense layer reads), q_lora_rank null, num_key_value_heads = num_attention_heads, rope_theta
= the ladder's theta', rope_interleave true, rms_norm_eps 1e-6, no MTP layers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from mla import atomic, checkpoint, shapes
from mla.conversion.convert import stored_dtype
from mla.conversion.ladder import ROPE_SLOTS, Ladder
from mla.errors import UserError
from mla.export import latent_norm
from mla.export.requirements import MAX_LATENT, check_deepseek_v3

ROPE_DIM = 2 * ROPE_SLOTS          # qk_rope_head_dim
LATENT_NORM_EPS = 1e-6             # transformers' DeepseekV3 kv_a_layernorm eps (not config.rms_norm_eps)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
REPORT = "mha2mla_export.json"
CALIBRATION_TOKENS = (2, 64)       # random token blocks on which the latent's error and the eps change are measured


def export_dtype(config: dict, dtype: str | None) -> torch.dtype:
    """The dtype to write: the one asked, else the checkpoint's own; fp16 is refused (α·c underflows in it)."""
    name = dtype or stored_dtype(config) or "float32"
    if name not in DTYPES:
        raise UserError(f"--dtype {name}: the export writes float32 or bfloat16 (the latent, scaled by α ~1e-10 "
                        "for the identity norm, underflows in float16)")
    return DTYPES[name]


def deepseek_config(mla_config, ladder: Ladder, dtype: torch.dtype):
    """The DeepseekV3Config of the export (module docstring)."""
    from transformers import DeepseekV3Config

    d_h = mla_config.head_dim
    theta = mla_config.rope_parameters["rope_theta"]
    config = DeepseekV3Config(
        vocab_size=mla_config.vocab_size, hidden_size=mla_config.hidden_size,
        intermediate_size=mla_config.intermediate_size, num_hidden_layers=mla_config.num_hidden_layers,
        num_attention_heads=mla_config.num_attention_heads, num_key_value_heads=mla_config.num_attention_heads,
        first_k_dense_replace=mla_config.num_hidden_layers, q_lora_rank=None, kv_lora_rank=MAX_LATENT,
        qk_rope_head_dim=ROPE_DIM, qk_nope_head_dim=d_h, v_head_dim=d_h, hidden_act="silu",
        max_position_embeddings=mla_config.max_position_embeddings, rms_norm_eps=LATENT_NORM_EPS,
        rope_parameters={"rope_type": "default", "rope_theta": ladder.theta(theta)}, rope_interleave=True,
        attention_bias=False, tie_word_embeddings=False, num_mtp_layers=0,
        bos_token_id=mla_config.bos_token_id, eos_token_id=mla_config.eos_token_id,
        pad_token_id=mla_config.pad_token_id, initializer_range=mla_config.initializer_range)
    config.architectures = ["DeepseekV3ForCausalLM"]
    config.rope_theta = config.rope_parameters["rope_theta"]   # also top-level: what transformers < 5 reads
    config.dtype = dtype
    return config


def _slot_rows(ladder: Ladder, pairs: list[int]) -> torch.Tensor:
    """Where the converted model's 2m RoPE rows (rotate_half order: the components' first dims, then their
    second dims) go among DeepSeek's 64 interleaved ones: component i of pair p to 2·slot(p) and 2·slot(p) + 1."""
    slot = torch.tensor([ladder.slot(p) for p in pairs], dtype=torch.long)
    return torch.cat([2 * slot, 2 * slot + 1])


def attention_weights(attn, ladder: Ladder, pairs: list[int], norm: latent_norm.IdentityNorm,
                      stream_scale: float, dtype: torch.dtype) -> dict:
    """One layer's DeepSeek-V3 attention weights (state-dict keys under self_attn.), computed in fp64."""
    cfg = attn.config
    n_h, d_h, hidden = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
    rope = _slot_rows(ladder, pairs)
    two_m = len(rope)

    q = attn.q_proj.weight.double().reshape(n_h, two_m + d_h, hidden)
    q_out = q.new_zeros(n_h, d_h + ROPE_DIM, hidden)
    q_out[:, :d_h] = q[:, two_m:]
    q_out[:, d_h + rope] = q[:, :two_m]
    q_out *= math.sqrt((d_h + ROPE_DIM) / d_h)

    latent = cfg.kv_lora_rank
    kv_a = q.new_zeros(MAX_LATENT + ROPE_DIM, hidden)
    kv_a[:latent] = norm.alpha * attn.kv_down.weight.double()
    kv_a[MAX_LATENT + rope] = attn.k_rope_proj.weight.double()

    heads, groups = attn.num_kv_heads, n_h // attn.num_kv_heads     # latent heads of k_up / v_up
    k_up = attn.k_up.weight.double().reshape(heads, d_h, attn.k_latent)
    v_up = attn.v_up.weight.double().reshape(heads, d_h, attn.v_latent)
    v_start = attn.k_latent if cfg.latent_split else 0
    kv_b = q.new_zeros(heads, 2 * d_h, MAX_LATENT)
    kv_b[:, :d_h, :attn.k_latent] = k_up
    kv_b[:, d_h:, v_start:v_start + attn.v_latent] = v_up
    kv_b = kv_b.repeat_interleave(groups, dim=0) / norm.kappa

    out = {"q_proj.weight": q_out.reshape(-1, hidden), "kv_a_proj_with_mqa.weight": kv_a,
           "kv_a_layernorm.weight": torch.full((MAX_LATENT,), norm.weight, dtype=torch.float64),
           "kv_b_proj.weight": kv_b.reshape(-1, MAX_LATENT),
           "o_proj.weight": stream_scale * attn.o_proj.weight.double()}
    return {k: v.to(dtype).contiguous() for k, v in out.items()}


def residual_scale(source_eps: float) -> float:
    """s = sqrt(1e-6 / source eps): the residual stream's scale that keeps every RMSNorm's output (docstring)."""
    return math.sqrt(LATENT_NORM_EPS / source_eps)


@torch.no_grad()
def calibration_forward(model, norms: list[latent_norm.IdentityNorm], seed: int = 0) -> dict:
    """On random tokens: the largest relative error of the identity norm on the real latents, and the largest
    change of the logits if the model's RMSNorms used the export's eps with no rescaled residual stream (what
    the rescaling avoids)."""
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
    errors = [latent_norm.relative_error(c, n.alpha, MAX_LATENT, LATENT_NORM_EPS) for c, n in zip(latents, norms)]
    source_eps = model.config.rms_norm_eps
    rms_norms = [m for m in model.modules() if isinstance(m, LlamaRMSNorm)]
    for m in rms_norms:
        m.variance_epsilon = LATENT_NORM_EPS
    try:
        eps_change = (model(ids).logits - logits).abs().max().item()
    finally:
        for m in rms_norms:
            m.variance_epsilon = source_eps
    return {"latent_error_measured": max(errors), "latent_rms_max": max(c.pow(2).mean(-1).sqrt().max().item()
                                                                        for c in latents),
            "eps_logit_change_unscaled": eps_change, "calibration_tokens": batch * length}


@torch.no_grad()
def export_model(model, dtype: torch.dtype) -> tuple[object, dict]:
    """The DeepseekV3ForCausalLM of a loaded MLA model (its attention released layer by layer) and a report."""
    from transformers import DeepseekV3ForCausalLM

    cfg = model.config
    ladder = check_deepseek_v3(cfg.to_dict())
    norms = [latent_norm.identity_norm(layer.self_attn.kv_down.weight, layer.input_layernorm.weight, MAX_LATENT,
                                       LATENT_NORM_EPS, dtype) for layer in model.model.layers]
    measured = calibration_forward(model, norms)
    config = deepseek_config(cfg, ladder, dtype)
    scale = residual_scale(cfg.rms_norm_eps)
    state = {}
    for name, tensor in model.state_dict().items():
        if ".self_attn." in name or name == "lm_head.weight":
            continue
        adds_to_residual = name == "model.embed_tokens.weight" or name.endswith("mlp.down_proj.weight")
        state[name] = (scale * tensor.double()).to(dtype) if adds_to_residual else tensor.to(dtype)
    state["lm_head.weight"] = model.lm_head.weight.detach().to(dtype).clone()    # its own tensor, never tied
    slots = []
    for i, layer in enumerate(model.model.layers):
        pairs = cfg.rope_pairs[i][0]
        weights = attention_weights(layer.self_attn, ladder, pairs, norms[i], scale, dtype)
        state.update({f"model.layers.{i}.self_attn.{k}": v for k, v in weights.items()})
        slots.append([ladder.slot(p) for p in pairs])
        layer.self_attn = torch.nn.Identity()
    with torch.device("meta"):
        exported = DeepseekV3ForCausalLM(config)
    missing, unexpected = exported.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise RuntimeError(f"export produced a mismatched state dict: missing {missing}, unexpected {unexpected}")
    exported.model.rotary_emb = type(exported.model.rotary_emb)(config=config)   # buffers outside the meta device
    exported.eval()

    s = shapes.shape_of(cfg.to_dict())
    report = {
        "format": "deepseek_v3", "dtype": str(dtype).removeprefix("torch."),
        "kv_lora_rank_source": cfg.kv_lora_rank, "kv_lora_rank": MAX_LATENT,
        "rope_components_source": cfg.qk_rope_head_dim // 2, "qk_rope_head_dim": ROPE_DIM,
        "rope_theta_source": cfg.rope_parameters["rope_theta"], "rope_theta": config.rope_parameters["rope_theta"],
        "ladder_stride": ladder.stride, "rope_slots_per_layer": slots,
        "query_scale": math.sqrt((s.head_dim + ROPE_DIM) / s.head_dim),
        "rms_norm_eps_source": cfg.rms_norm_eps, "rms_norm_eps": LATENT_NORM_EPS, "residual_scale": scale,
        "latent_norm_alpha_per_layer": [n.alpha for n in norms],
        "latent_norm_weight_per_layer": [n.weight for n in norms],
        "latent_norm_kappa_per_layer": [n.kappa for n in norms],
        "latent_error_bound": max(n.error_bound for n in norms), **measured,
        "kv_elements_per_token_source": s.layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim),
        "kv_elements_per_token": s.layers * (MAX_LATENT + ROPE_DIM),
    }
    return exported, report


def export_checkpoint(src: str | Path, out: str | Path, dtype: str | None = None) -> dict:
    """Read an MLA checkpoint folder, write the DeepSeek-V3 one (+ mha2mla_export.json) atomically to `out`."""
    from transformers import GenerationConfig

    src, out = checkpoint.require_checkpoint(src), Path(out)
    config = shapes.read_config(src)
    check_deepseek_v3(config)                       # before any weight is read or file written
    torch_dtype = export_dtype(config, dtype)
    model = checkpoint.load_model(src, dtype=torch.float32)
    exported, report = export_model(model, torch_dtype)
    report["source_checkpoint"] = str(src)
    if (src / "generation_config.json").is_file():
        exported.generation_config = GenerationConfig.from_pretrained(src)
    with atomic.staged(out, folder=True) as tmp:
        exported.save_pretrained(tmp)
        checkpoint.copy_tokenizer_files(src, tmp)
        (tmp / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    return report


def report_line(report: dict) -> str:
    return (f"deepseek_v3 ({report['dtype']}): latent {report['kv_lora_rank_source']} -> {report['kv_lora_rank']}, "
            f"{report['rope_components_source']} RoPE components -> {report['qk_rope_head_dim']} dims at rope_theta "
            f"{report['rope_theta']:g}; KV/token {report['kv_elements_per_token_source']} -> "
            f"{report['kv_elements_per_token']}; latent norm error {report['latent_error_measured']:.1e} measured "
            f"(bound {report['latent_error_bound']:.1e}); rms_norm_eps {report['rms_norm_eps_source']:g} -> "
            f"{report['rms_norm_eps']:g} with the residual stream scaled by {report['residual_scale']:.4g}")
