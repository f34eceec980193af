"""Configuration of a Llama-family model whose attention was converted to MLA (MHA2MLA).

Self-contained: this file is copied into every saved checkpoint (`auto_map`), so it may import only
torch and transformers.

Mapping between the paper's names and the fields here (per layer):
    d_kv (latent size per KV head)   kv_lora_rank = n_kv · d_kv  (width of the cached latent c_kv)
    r (kept RoPE frequency pairs)    qk_rope_head_dim = 2r,  qk_nope_head_dim = d_h − 2r
    d_h                              v_head_dim = head_dim
    S (kept pairs, per layer/KV head) rope_pairs[layer][kv_head] = sorted pair indices (len r)

Two RoPE layouts (`rope_layout`):
    per_head   the paper's: a RoPE key per KV head, rope_pairs [layers][n_kv][r] as above
    shared     rotated partial RoPE: ONE RoPE key of 2m dims read by every query head (DeepSeek's k_pe),
               rope_pairs [layers][1][m] = the frequency index of each kept rotated component (a
               frequency appears at most n_kv times); qk_rope_head_dim = 2m, qk_nope_head_dim = d_h
Two latent layouts (`latent_layout`): per_head rebuilds a key and value per KV head from the latent
(shared by the query heads of a GQA group); shared rebuilds one for every query head (no groups).
The softmax scale is d_h^-1/2 in every layout (the source model's), whatever the query's width.

Source families: Llama (any RoPE scaling in `rope_parameters`), Mistral without sliding window, and
Qwen2 (`attention_bias` = q/k/v biases, `o_proj_bias` = False).
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig


@strict
class MLAConfig(LlamaConfig):
    model_type = "mla_llama"
    # No tensor-parallel plan: Llama's names k_proj/v_proj, which MLA replaced, and MLA's forward reshapes by
    # the global head counts (modeling_mla.py). None is how transformers says "no plan" (an empty dict reads as a
    # plan that the model then lacks). Llama's pipeline plan (embed_tokens, layers, norm) holds.
    base_model_tp_plan = None

    kv_lora_rank: int | None = None        # n_kv · d_kv; None -> n_kv · d_h / 2
    qk_rope_head_dim: int | None = None    # 2r; None -> from rope_pairs or d_h / 8
    qk_nope_head_dim: int | None = None    # derived: d_h − 2r
    v_head_dim: int | None = None          # derived: d_h
    rope_pairs: list | None = None         # [layers][n_kv][r]; None -> the r fastest pairs ("high")
    latent_split: bool = False             # SVD split: c_kv = [c_k | c_v], half the width each
    absorb_decode: bool = True             # single-token decode steps use the absorbed path
    rope_layout: str = "per_head"          # per_head | shared (module docstring)
    latent_layout: str = "per_head"        # per_head | shared: k_up / v_up give n_kv or n_h heads
    o_proj_bias: bool | None = None        # None -> attention_bias (Llama); False for Qwen2 (q/k/v biases only)
    mha2mla: dict | None = None            # provenance: d_kv, r, strategy, svd, source model

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        d_h = self.head_dim
        rope_heads = 1 if self.rope_layout == "shared" else self.num_key_value_heads
        if self.rope_pairs is None:
            r = (self.qk_rope_head_dim // 2) if self.qk_rope_head_dim is not None else max(1, d_h // 16)
            self.rope_pairs = [[list(range(r))] * rope_heads] * self.num_hidden_layers
        r = len(self.rope_pairs[0][0]) if self.rope_pairs and self.rope_pairs[0] else 0
        self.qk_rope_head_dim = 2 * r
        self.qk_nope_head_dim = d_h if self.rope_layout == "shared" else d_h - 2 * r
        self.v_head_dim = d_h
        if self.kv_lora_rank is None:
            self.kv_lora_rank = self.num_key_value_heads * d_h // 2

    @property
    def num_rope_heads(self) -> int:
        """Heads of the cached RoPE key: 1 (shared layout) or n_kv."""
        return 1 if self.rope_layout == "shared" else self.num_key_value_heads

    @property
    def num_latent_heads(self) -> int:
        """Keys and values the up-projections rebuild from the latent: n_h (shared latent) or n_kv."""
        return self.num_attention_heads if self.latent_layout == "shared" else self.num_key_value_heads

    def validate_architecture(self):
        super().validate_architecture()
        d_h, n_kv = self.head_dim, self.num_key_value_heads
        for name in ("rope_layout", "latent_layout"):
            if getattr(self, name) not in ("per_head", "shared"):
                raise ValueError(f"{name} must be 'per_head' or 'shared', got {getattr(self, name)!r}")
        heads = self.num_rope_heads
        if len(self.rope_pairs) != self.num_hidden_layers or any(len(l) != heads for l in self.rope_pairs):
            raise ValueError(f"rope_pairs must have shape [num_hidden_layers={self.num_hidden_layers}]"
                             f"[{'1' if heads == 1 and self.rope_layout == 'shared' else 'num_key_value_heads'}="
                             f"{heads}][r]")
        r = self.qk_rope_head_dim // 2
        for layer in self.rope_pairs:
            for pairs in layer:
                if len(pairs) != r or any(not 0 <= p < d_h // 2 for p in pairs):
                    raise ValueError(f"rope_pairs entries must be {r} pair indices in [0, {d_h // 2})")
                # per head each pair once; shared: each frequency once per rotated component, n_kv at most
                most = n_kv if self.rope_layout == "shared" else 1
                if any(pairs.count(p) > most for p in pairs):
                    raise ValueError(f"rope_pairs entries may hold a pair index at most {most} time(s) "
                                     f"({self.rope_layout} layout)")
        if self.kv_lora_rank <= 0 or (self.latent_split and self.kv_lora_rank % 2):
            raise ValueError(f"kv_lora_rank must be positive (and even with latent_split), got {self.kv_lora_rank}")


__all__ = ["MLAConfig"]
