"""Configuration of a Llama-family model whose attention was converted to MLA (MHA2MLA).

Self-contained: this file is copied into every saved checkpoint (`auto_map`), so it may import only
torch and transformers.

Mapping between the paper's names and the fields here (per layer):
    d_kv (latent size per KV head)   kv_lora_rank = n_kv · d_kv  (width of the cached latent c_kv)
    r (kept RoPE frequency pairs)    qk_rope_head_dim = 2r,  qk_nope_head_dim = d_h − 2r
    d_h                              v_head_dim = head_dim
    S (kept pairs, per layer/KV head) rope_pairs[layer][kv_head] = sorted pair indices (len r)

Source families: Llama (any RoPE scaling in `rope_parameters`), Mistral without sliding window, and
Qwen2 (`attention_bias` = q/k/v biases, `o_proj_bias` = False).
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig


@strict
class MLAConfig(LlamaConfig):
    model_type = "mla_llama"

    kv_lora_rank: int | None = None        # n_kv · d_kv; None -> n_kv · d_h / 2
    qk_rope_head_dim: int | None = None    # 2r; None -> from rope_pairs or d_h / 8
    qk_nope_head_dim: int | None = None    # derived: d_h − 2r
    v_head_dim: int | None = None          # derived: d_h
    rope_pairs: list | None = None         # [layers][n_kv][r]; None -> the r fastest pairs ("high")
    latent_split: bool = False             # SVD split: c_kv = [c_k | c_v], half the width each
    absorb_decode: bool = True             # single-token decode steps use the absorbed path
    o_proj_bias: bool | None = None        # None -> attention_bias (Llama); False for Qwen2 (q/k/v biases only)
    mha2mla: dict | None = None            # provenance: d_kv, r, strategy, svd, source model

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        d_h = self.head_dim
        if self.rope_pairs is None:
            r = (self.qk_rope_head_dim // 2) if self.qk_rope_head_dim is not None else max(1, d_h // 16)
            self.rope_pairs = [[list(range(r))] * self.num_key_value_heads] * self.num_hidden_layers
        r = len(self.rope_pairs[0][0]) if self.rope_pairs and self.rope_pairs[0] else 0
        self.qk_rope_head_dim = 2 * r
        self.qk_nope_head_dim = d_h - 2 * r
        self.v_head_dim = d_h
        if self.kv_lora_rank is None:
            self.kv_lora_rank = self.num_key_value_heads * d_h // 2

    def validate_architecture(self):
        super().validate_architecture()
        d_h, n_kv = self.head_dim, self.num_key_value_heads
        if len(self.rope_pairs) != self.num_hidden_layers or any(len(l) != n_kv for l in self.rope_pairs):
            raise ValueError(f"rope_pairs must have shape [num_hidden_layers={self.num_hidden_layers}]"
                             f"[num_key_value_heads={n_kv}][r]")
        r = self.qk_rope_head_dim // 2
        for layer in self.rope_pairs:
            for pairs in layer:
                if len(pairs) != r or len(set(pairs)) != r or any(not 0 <= p < d_h // 2 for p in pairs):
                    raise ValueError(f"rope_pairs entries must be {r} distinct pair indices in [0, {d_h // 2})")
        if self.kv_lora_rank <= 0 or (self.latent_split and self.kv_lora_rank % 2):
            raise ValueError(f"kv_lora_rank must be positive (and even with latent_split), got {self.kv_lora_rank}")


__all__ = ["MLAConfig"]
