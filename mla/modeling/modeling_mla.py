"""Llama-family model with Multi-head Latent Attention (MHA2MLA), for transformers.

Self-contained: this file and configuration_mla.py are copied into every saved checkpoint, so a model
loads with `AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)` where only torch and
transformers are installed.

Per layer and token x (after the input RMSNorm), with G = n_h / n_kv query heads per KV head:

    q      = q_proj(x)                   per head [rope (2r) | nope (d_h − 2r)], rows permuted at conversion
    k_rope = RoPE(k_rope_proj(x))        [n_kv, 2r]      cached
    c_kv   = kv_down(x)                  [n_kv · d_kv]   cached (the latent; one vector shared by all heads)
    k_nope = k_up(c_kv)                  [n_kv, d_h − 2r]
    v      = v_up(c_kv)                  [n_kv, d_h]
    attention(q, [k_rope | k_nope], v) with scale 1/√d_h, then o_proj.

With `rope_layout: shared` (rotated partial RoPE, configuration_mla.py) k_rope is ONE head [2m] that every
query head reads, q is per head [rope (2m) | nope (d_h)] and k_nope is d_h wide; the scale stays 1/√d_h.
With `latent_layout: shared` k_up / v_up rebuild n_h keys and values (one per query head, no GQA groups).

RoPE uses the original frequencies of the kept pairs only (partial RoPE), including any scaling of
the source model (llama3, linear, dynamic, yarn: the rotary embedding is built from the same
`rope_parameters`); the other dims get none. Where the scaling also multiplies cos/sin by an attention
factor (yarn, longrope), the conversion folds its square into the query's no-RoPE rows, so every dim
of q·k keeps the factor the original gave it.
The cache holds c_kv and k_rope and nothing else (cache_mla.py: growing, preallocated for `generate`'s
static cache and compiled decoding, or group-quantized). For single-token decode steps the absorbed path
(paper App. B) never expands the cache: queries move into latent space through k_up, attention runs
over c_kv directly, and v_up is applied to the attended latent; with eager attention it returns the
attention probabilities like the expanded path.

Tensor parallelism: no plan (`MLAConfig.base_model_tp_plan` is empty). The attention reshapes by the
global head counts, the absorbed path views k_up/v_up per global head, and every head reads the whole
latent, so sharding heads across ranks would need a different forward; the pipeline plan is Llama's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers import LlamaForCausalLM, LlamaModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaPreTrainedModel,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    eager_attention_forward,
)

from .cache_mla import MLACache, MLAQuantizedCache, MLAStaticCache, check_cache, from_cache_rows, to_cache_rows
from .configuration_mla import MLAConfig


# Whether `torch.compile(fullgraph=True)` captures a decode step without graph breaks (shown with the
# preallocated cache in tests/test_model_api.py)
COMPILES_FULLGRAPH = True


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


class MLAAttention(nn.Module):
    """Multi-head latent attention converted from a pretrained MHA/GQA layer."""

    def __init__(self, config: MLAConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        # heads of the rebuilt keys/values (n_kv, or n_h for a shared latent) and of the cached RoPE key
        self.num_kv_heads = config.num_latent_heads
        self.num_rope_heads = config.num_rope_heads
        self.num_key_value_groups = self.num_heads // self.num_kv_heads
        self.rope_groups = self.num_heads // self.num_rope_heads
        self.rope_dim = config.qk_rope_head_dim
        self.nope_dim = config.qk_nope_head_dim
        self.latent_dim = config.kv_lora_rank
        self.scaling = self.head_dim ** -0.5       # the source's: not the (wider) query's width
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        # latent widths read by the key and value up-projections (halves of c_kv with SVD split)
        self.k_latent = self.latent_dim // 2 if config.latent_split else self.latent_dim
        self.v_latent = self.k_latent

        d, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(d, self.num_heads * (self.rope_dim + self.nope_dim), bias=bias)
        self.k_rope_proj = nn.Linear(d, self.num_rope_heads * self.rope_dim, bias=bias)
        self.kv_down = nn.Linear(d, self.latent_dim, bias=False)
        self.k_up = nn.Linear(self.k_latent, self.num_kv_heads * self.nope_dim, bias=bias)
        self.v_up = nn.Linear(self.v_latent, self.num_kv_heads * self.head_dim, bias=bias)
        o_bias = bias if config.o_proj_bias is None else config.o_proj_bias
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=o_bias)

        # head dims whose cos/sin the kept pairs use, in rotate_half order; derived from the config and
        # built on first use (not a buffer: it must survive meta-device initialisation)
        half = self.head_dim // 2
        self._rope_dims = [list(p) + [k + half for k in p] for p in config.rope_pairs[layer_idx]]
        self._rope_index: dict[torch.device, torch.Tensor] = {}

    def _split_latent(self, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.config.latent_split:
            return c[..., : self.k_latent], c[..., self.k_latent:]
        return c, c

    def _rope_tables(self, position_embeddings, device):
        cos, sin = position_embeddings                    # [B, T, d_h]
        index = self._rope_index.get(device)
        if index is None:
            index = self._rope_index[device] = torch.tensor(self._rope_dims, dtype=torch.long, device=device)
        # [B, T, d_h] -> [B, rope heads, T, 2r]
        cos = cos[..., index].permute(0, 2, 1, 3)
        sin = sin[..., index].permute(0, 2, 1, 3)
        return cos, sin

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                cache=None, **kwargs):
        bsz, q_len, _ = hidden_states.shape
        groups = self.rope_groups

        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, -1).transpose(1, 2)
        q_rope, q_nope = q.split([self.rope_dim, self.nope_dim], dim=-1)
        k_rope = self.k_rope_proj(hidden_states).view(bsz, q_len, self.num_rope_heads, self.rope_dim).transpose(1, 2)
        c_kv = self.kv_down(hidden_states)                 # [B, T, latent]

        if self.rope_dim:
            cos, sin = self._rope_tables(position_embeddings, hidden_states.device)
            k_rope = apply_rope(k_rope, cos, sin)
            q_rope = apply_rope(q_rope, cos.repeat_interleave(groups, dim=1), sin.repeat_interleave(groups, dim=1))

        if cache is not None:  # the cache stores only the latent and the RoPE'd keys, in its own layout (cache_mla.py)
            latent_rows, rope_rows = cache.update(*to_cache_rows(c_kv, k_rope), self.layer_idx)
            c_kv, k_rope = from_cache_rows(latent_rows, rope_rows, self.num_rope_heads)

        if q_len == 1 and self.config.absorb_decode:
            out, probs = self._absorbed(q_rope, q_nope, k_rope, c_kv, attention_mask)
            # what the expanded path returns: eager attention's probabilities, none from the fused kernels
            return out, probs.unsqueeze(2) if self.config._attn_implementation == "eager" else None

        c_k, c_v = self._split_latent(c_kv)
        kv_len = c_kv.shape[1]
        k_nope = self.k_up(c_k).view(bsz, kv_len, self.num_kv_heads, self.nope_dim).transpose(1, 2)
        value = self.v_up(c_v).view(bsz, kv_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.num_rope_heads != self.num_kv_heads:      # a shared RoPE key, or a shared latent's n_h heads
            k_rope = k_rope.repeat_interleave(self.num_kv_heads // self.num_rope_heads, dim=1)
        key = torch.cat([k_rope, k_nope], dim=-1)
        query = torch.cat([q_rope, q_nope], dim=-1)

        # The query and key are wider than the value (RoPE rows + the whole head). Fused kernels (PyTorch's flash
        # attention on the CPU, FlashAttention on GPUs) take one head width: zero columns appended to the value
        # give the same output in those columns' place; one layer's forward and backward at 512 tokens ran 1.85x
        # faster on the CPU than on the unfused path a narrower value falls to (docs/model-api.md).
        pad = query.shape[-1] - value.shape[-1] if self.config._attn_implementation != "eager" else 0
        if pad > 0:
            value = nn.functional.pad(value, (0, pad))
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward)
        out, weights = attention_interface(
            self, query, key, value, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling, **kwargs)
        if pad > 0:
            out = out[..., :self.head_dim]
        return self.o_proj(out.reshape(bsz, q_len, -1).contiguous()), weights

    def _absorbed(self, q_rope, q_nope, k_rope, c_kv, attention_mask) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step in latent space; the cache is never expanded to per-head keys or values.
        Returns the output and the attention probabilities [B, n_h, T]."""
        bsz = q_rope.shape[0]
        n_kv, groups = self.num_kv_heads, self.num_key_value_groups      # heads of k_up / v_up
        c_k, c_v = self._split_latent(c_kv)               # [B, T, latent_k], [B, T, latent_v]
        w_uk = self.k_up.weight.view(n_kv, self.nope_dim, self.k_latent)
        w_uv = self.v_up.weight.view(n_kv, self.head_dim, self.v_latent)

        # latent queries q̃_h = W_uk,gᵀ q_nope,h ; the k_up bias adds q_nope·b to every score of a
        # row, which softmax ignores, so it is left out
        q_lat = torch.einsum("bgjd,gdr->bgjr", q_nope.reshape(bsz, n_kv, groups, self.nope_dim), w_uk)
        scores = torch.matmul(q_lat.reshape(bsz, self.num_heads, self.k_latent), c_k.transpose(1, 2))
        if self.rope_dim:   # each RoPE key head (n_kv, or 1 shared) against the query heads that read it
            rope_scores = torch.matmul(q_rope.reshape(bsz, self.num_rope_heads, self.rope_groups, self.rope_dim),
                                       k_rope.transpose(2, 3))
            scores = scores + rope_scores.reshape(bsz, self.num_heads, -1)
        scores = _masked(scores * self.scaling, attention_mask)   # [B, n_h, T]
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(c_v.dtype)
        attended = torch.matmul(probs, c_v)               # [B, n_h, latent_v]
        out = torch.einsum("bgjr,gdr->bgjd", attended.reshape(bsz, n_kv, groups, self.v_latent), w_uv)
        if self.v_up.bias is not None:                    # probabilities sum to 1, so the bias passes through
            out = out + self.v_up.bias.view(1, n_kv, 1, self.head_dim)
        return self.o_proj(out.reshape(bsz, 1, self.num_heads * self.head_dim)), probs


def _masked(scores: torch.Tensor, attention_mask) -> torch.Tensor:
    """Apply the mask of one decode step to scores [B, n_h, T]: a 4-D eager/sdpa mask (bool or additive,
    last query row), a 2-D [B, T] padding mask (flash-attention style, 1 = attend), or None."""
    if attention_mask is None:        # nothing padded, and a single new token may see every cached one
        return scores
    kv_len = scores.shape[-1]
    if attention_mask.dim() == 2:
        keep = attention_mask[:, None, :kv_len].bool()
    else:
        mask = attention_mask[:, :, -1, :kv_len]          # [B, 1, T]
        if mask.dtype != torch.bool:
            return scores + mask
        keep = mask
    return scores.masked_fill(~keep, float("-inf"))


class MLADecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: MLAConfig, layer_idx: int):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = MLAAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                position_embeddings=None, **kwargs):
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings=position_embeddings,
            attention_mask=attention_mask, cache=cache, **kwargs)
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class MLAModel(LlamaModel):
    config_class = MLAConfig
    _no_split_modules = ["MLADecoderLayer"]
    _can_record_outputs = {"hidden_states": MLADecoderLayer, "attentions": MLAAttention}
    _can_compile_fullgraph = COMPILES_FULLGRAPH
    _tp_plan = {}

    def __init__(self, config: MLAConfig):
        # LlamaModel.__init__ would first build (and then waste) full Llama attention layers
        LlamaPreTrainedModel.__init__(self, config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(MLADecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                use_cache=None, **kwargs):
        if "past_key_values" in kwargs:    # transformers' former name of `cache`, still accepted by Llama
            legacy = kwargs.pop("past_key_values")
            if legacy is not None and cache is not None:
                raise ValueError("pass the cache once: as `cache` (or its former name `past_key_values`), not both")
            cache = legacy if cache is None else cache
        if not torch.compiler.is_compiling():   # a Python check of types and shapes, once per eager call
            check_cache(cache, self.config)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = MLACache(config=self.config)
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)


class MLAForCausalLM(LlamaForCausalLM):
    config_class = MLAConfig
    _no_split_modules = ["MLADecoderLayer"]
    _can_record_outputs = {"hidden_states": MLADecoderLayer, "attentions": MLAAttention}
    _can_compile_fullgraph = COMPILES_FULLGRAPH
    _tp_plan = {}     # no tensor-parallel plan (module docstring), so not even Llama's lm_head entry

    def __init__(self, config: MLAConfig):
        LlamaPreTrainedModel.__init__(self, config)
        self.model = MLAModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        # generate() would build a cache of per-head keys and values; give it the latent cache instead
        kind = generation_config.cache_implementation
        if model_kwargs.get("cache") is None and generation_config.use_cache is not False:
            if kind in (None, "dynamic", "offloaded", "quantized"):
                if kind == "quantized":
                    cache = MLAQuantizedCache.from_cache_config(self.config, generation_config.cache_config)
                else:
                    cache = MLACache(config=self.config, offloading=kind == "offloaded")
                if generation_config.is_assistant:    # an assistant's cache is rolled back after rejected tokens
                    cache.activate_past_recording()
                model_kwargs["cache"] = cache
                return None
            if kind not in ("static", "offloaded_static"):   # sliding/hybrid static caches, paged, ...
                raise ValueError(f"cache_implementation={kind!r} is not supported by this MLA model: use "
                                 "'dynamic', 'offloaded', 'static', 'offloaded_static' or 'quantized' (backend 'mla')")
        # static kinds: transformers sizes the cache and calls `_prepare_static_cache` below
        return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)

    def _prepare_static_cache(self, cache_implementation: str, batch_size: int, max_cache_len: int,
                              prefill_chunk_size, model_kwargs) -> MLAStaticCache:
        """The preallocated latent cache for `generate(cache_implementation="static")`; like transformers'
        static cache it keeps the longest length asked so far, so later calls reuse one compiled graph."""
        length = max(max_cache_len, getattr(self, "_previous_max_cache_length", -1))
        cache = MLAStaticCache(self.config, max_cache_len=length, offloading="offloaded" in cache_implementation)
        if prefill_chunk_size is not None:     # a compiled chunked prefill needs the buffers before it runs
            cache.preallocate(batch_size, self.dtype, self.device)
        self._previous_max_cache_length = length
        return cache

    def save_pretrained(self, *args, **kwargs):
        # transformers writes the saved class's own auto_map entry; the base model loads with AutoModel too
        self.config.auto_map = {**(getattr(self.config, "auto_map", None) or {}), "AutoModel": "modeling_mla.MLAModel"}
        return super().save_pretrained(*args, **kwargs)


MLAConfig.register_for_auto_class()
MLAModel.register_for_auto_class("AutoModel")
MLAForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = ["MLAConfig", "MLAForCausalLM", "MLAModel", "MLAAttention", "MLACache", "MLAStaticCache", "MLAQuantizedCache"]
