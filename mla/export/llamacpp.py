"""`mla export --format gguf`: a checkpoint as one GGUF file that llama.cpp runs as it is.

- An MLA checkpoint in the ladder layout becomes a dense `deepseek2` model, the attention rewritten as
  mla/export/rewrite.py does for DeepSeek-V3 (one computation): llama.cpp then caches, per token and layer,
  only the latent and the RoPE key (its MLA path: a K-only cache; the values are a view of the latent). The
  widths are the converted model's own: the latent unpadded, the RoPE key as narrow as the kept components
  allow on a ladder of their own (rewrite.narrowest_key), both padded to multiples of 32 only when the file is
  meant for a block-quantized K cache (`--cache-type q8_0|q4_0|...`, engines.llamacpp_refusal). llama.cpp
  normalises the latent with the model's rms_norm_eps, so the identity norm is built on that eps and no
  residual rescaling is needed. The query stays plain (`q_lora_rank` 0: llama.cpp's `wq` path); kv_b_proj
  is split into `attn_k_b` (transposed, for the absorbed query) and `attn_v_b`.
- A plain Llama-family checkpoint (the original model) becomes a `llama` model, its query and key rows
  reordered from transformers' rotate_half pairs to llama.cpp's adjacent pairs: both sides of a comparison
  then run in one engine build with the same weight type.

The file carries the source's tokenizer (token ids unchanged: mla/export/gguf_file.py) and, under the key
`mha2mla.export`, the export's report as JSON. It is written atomically: a refused or failed export leaves
nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mla import atomic, checkpoint, shapes
from mla.conversion.convert import stored_dtype
from mla.errors import UserError
from mla.export import engines, gguf_file
from mla.export.engines import MLAShape, padded
from mla.export.requirements import check_ladder_checkpoint, check_llama_original
from mla.export.rewrite import Target, narrowest_key, rewrite

REPORT_KEY = "mha2mla.export"
DEFAULT_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
# transformers' names of the tensors outside the attention -> GGUF's (blk.N. prefix for layers)
COMMON = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight"}
LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
         "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
         "mlp.down_proj.weight": "ffn_down.weight", "self_attn.o_proj.weight": "attn_output.weight",
         "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
         "self_attn.v_proj.weight": "attn_v.weight", "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
         "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight"}


def gguf_name(name: str) -> str:
    if name in COMMON:
        return COMMON[name]
    _, _, index, rest = name.split(".", 3)            # model.layers.N.rest
    return f"blk.{index}.{LAYER[rest]}"


def mla_target(config: dict, cache_type: str) -> Target:
    """The deepseek2 file's widths for an MLA checkpoint's config.json (refusals before any weight is read)."""
    ladder = check_ladder_checkpoint(config)
    block = engines.cache_block(cache_type)
    key = narrowest_key(ladder, [pairs for (pairs,) in config["rope_pairs"]], block)
    shape = MLAShape(padded(config["kv_lora_rank"], block), key.dim, ladder.head_dim, ladder.head_dim)
    return Target(shape, key, norm_eps=config["rms_norm_eps"])


def weight_type_of(config: dict, weight_type: str | None) -> str:
    name = weight_type or DEFAULT_TYPES.get(stored_dtype(config) or "float32", "f32")
    gguf_file.check_weight_type(name)
    return name


def plan(config: dict, weight_type: str | None, cache_type: str) -> tuple[str, str, Target | None]:
    """Every refusal, on config.json alone; returns the file's architecture, weight type and (deepseek2) widths."""
    weight_type = weight_type_of(config, weight_type)
    if config.get("model_type") == "mla_llama":
        return "deepseek2", weight_type, mla_target(config, cache_type)
    check_llama_original(config)
    engines.cache_block(cache_type)
    return "llama", weight_type, None


def _rotate_half_to_adjacent(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """A q/k projection's rows per head from transformers' rotate_half pairs (i, i + d/2) to llama.cpp's
    adjacent pairs (2i, 2i + 1)."""
    d = rows.shape[0] // heads
    return rows.reshape(heads, 2, d // 2, -1).transpose(1, 2).reshape(rows.shape)


def _llama_tensors(model) -> tuple[dict, dict]:
    """The original's tensors under GGUF names; it caches what it always did (the report's original count)."""
    cfg = model.config
    s = shapes.shape_of(cfg.to_dict())
    state = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue                                   # llama.cpp reads a missing output as token_embd
        if name.endswith("self_attn.q_proj.weight"):
            tensor = _rotate_half_to_adjacent(tensor, s.heads)
        elif name.endswith("self_attn.k_proj.weight"):
            tensor = _rotate_half_to_adjacent(tensor, s.kv_heads)
        state[gguf_name(name)] = tensor
    return state, {}


def _mla_tensors(model, target: Target) -> tuple[dict, dict]:
    state, report = rewrite(model, target, norm_dtype=torch.float32)
    shape, n_h = target.shape, model.config.num_attention_heads
    out = {}
    for name, tensor in state.items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if name.endswith("kv_b_proj.weight"):
            kv_b = tensor.reshape(n_h, shape.qk_nope_head_dim + shape.v_head_dim, shape.kv_lora_rank)
            layer = name.split(".")[2]
            out[f"blk.{layer}.attn_k_b.weight"] = kv_b[:, :shape.qk_nope_head_dim].transpose(1, 2)
            out[f"blk.{layer}.attn_v_b.weight"] = kv_b[:, shape.qk_nope_head_dim:]
            continue
        out[gguf_name(name)] = tensor
    return out, report


def _hyperparameters(writer, cfg, arch: str, target: Target | None) -> None:
    s = shapes.shape_of(cfg.to_dict())
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    theta = cfg.rope_parameters["rope_theta"]
    if arch == "llama":
        writer.add_head_count_kv(s.kv_heads)
        writer.add_rope_freq_base(theta)
        writer.add_rope_dimension_count(s.head_dim)
        writer.add_key_length(s.head_dim)
        writer.add_value_length(s.head_dim)
        return
    shape = target.shape
    writer.add_head_count_kv(1)                        # the absorbed form: one latent key read by every head
    writer.add_rope_freq_base(target.key.theta(theta))
    writer.add_rope_dimension_count(shape.qk_rope_head_dim)
    writer.add_leading_dense_block_count(cfg.num_hidden_layers)
    writer.add_q_lora_rank(0)
    writer.add_kv_lora_rank(shape.kv_lora_rank)
    writer.add_key_length(shape.cached)
    writer.add_value_length(shape.kv_lora_rank)
    writer.add_key_length_mla(shape.qk_nope_head_dim + shape.qk_rope_head_dim)
    writer.add_value_length_mla(shape.v_head_dim)
    writer.add_expert_feed_forward_length(cfg.intermediate_size)   # read by the loader; no layer is MoE
    writer.add_expert_shared_count(0)


def export_gguf(src: str | Path, out: str | Path, weight_type: str | None = None, cache_type: str = "f16") -> dict:
    """Write `src` (an MLA ladder checkpoint, or the original Llama) as one GGUF file at `out`; returns the report."""
    import gguf

    src, out = checkpoint.require_checkpoint(src), Path(out)
    config = shapes.read_config(src)
    arch, weight_type, target = plan(config, weight_type, cache_type)   # before any weight is read or file written
    vocab = gguf_file.tokenizer_metadata(src, config["vocab_size"])
    model = checkpoint.load_model(src, dtype=torch.float32)
    original = shapes.kv_elements_original(shapes.shape_of(config))
    report = {"format": "gguf", "architecture": arch, "type": weight_type, "cache_type": cache_type,
              "source_checkpoint": str(src), "tokenizer_pre": vocab["pre"],
              "kv_elements_per_token_original": original, "kv_elements_per_token": original}
    tensors, measured = _mla_tensors(model, target) if target else _llama_tensors(model)
    report.update(measured)
    if target:
        report["cache_types"] = engines.engines_report(target.shape)["llamacpp_cache_types"]
    with atomic.staged(out) as tmp:
        writer = gguf.GGUFWriter(tmp, arch, use_temp_file=True)
        writer.add_name(src.name)
        _hyperparameters(writer, model.config, arch, target)
        writer.add_file_type(gguf_file.file_type(weight_type))
        gguf_file.add_tokenizer(writer, vocab)
        writer.add_string(REPORT_KEY, json.dumps(report))
        for name, tensor in tensors.items():
            # the latent rows of kv_a_mqa are scaled by α ~1e-9 for the identity norm: f16 cannot hold them
            data, qtype = gguf_file.encoded(tensor.detach().float().numpy(), weight_type,
                                            keep_f32=name.endswith("attn_kv_a_mqa.weight"))
            writer.add_tensor(name, data, raw_dtype=qtype)
        tensors.clear()
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return report


def read_report(path: str | Path) -> dict:
    """The export report stored in a GGUF file written here."""
    import gguf

    field = gguf.GGUFReader(str(path)).get_field(REPORT_KEY)
    if field is None:
        raise UserError(f"{path} has no {REPORT_KEY} key: not a GGUF file written by `mla export --format gguf`")
    return json.loads(field.contents())


def report_line(report: dict) -> str:
    cached, original = report["kv_elements_per_token"], report["kv_elements_per_token_original"]
    line = (f"gguf {report['architecture']} ({report['type']} weights, for a {report['cache_type']} K cache): "
            f"KV elements per token {cached} vs the original's {original} ({cached / original:.3f}x)")
    if report["architecture"] == "deepseek2":
        line += (f"; latent {report['kv_lora_rank_source']} -> {report['kv_lora_rank']}, "
                 f"{report['rope_components_source']} RoPE components -> {report['qk_rope_head_dim']} dims at "
                 f"rope_theta {report['rope_theta']:g}; latent norm error {report['latent_error_measured']:.1e} "
                 f"(bound {report['latent_error_bound']:.1e}); K cache types {', '.join(report['cache_types'])}")
    return line
