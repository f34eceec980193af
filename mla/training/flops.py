"""Model FLOPs of training and the GPUs' peaks: model FLOPs utilisation (MFU) = tokens/s · FLOPs per token / peak.

FLOPs per trained token (forward + backward), the convention of PaLM (Chowdhery et al. 2022, appendix B):

    6·N + 12·L·n_h·d_h·s

N = the parameters that multiply: every parameter once, less an untied input embedding (a lookup; a tied
one is the output head's matrix and counted). 6 = 2 FLOPs per multiply-add, times 3 for the forward and
the two backward products. 12·L·n_h·d_h·s: per layer, QKᵀ and PV take 2·n_h·d_h·s FLOPs each per token
forward (d_h for scores and values; the MLA models of this project keep q/k and v heads of width d_h),
times 3 with the backward; s = sequence length, the full s x s matrix counted although a causal kernel
computes about half of it (so MFU stays comparable with published figures). For SmolLM-135M at 2,048
tokens the attention term is 35 % of the total.

Peaks: dense (no sparsity) bf16 tensor-core FLOP/s from the vendors' datasheets, looked up by GPU name as
whole words ("NVIDIA L40" is an L40, not an L4).
"""

from __future__ import annotations

import re

from mla import shapes
from mla.training.memory import Latent, total_params

# dense bf16 tensor-core peak FLOP/s by model name; the longest name that appears as whole words wins
PEAK_BF16_FLOPS = {"B200": 2250e12, "GH200": 989.4e12, "H200": 989.4e12, "H100": 989.4e12,
                   "H100 NVL": 835e12, "H100 PCIe": 756e12, "H800": 989.4e12, "A100": 312e12, "A800": 312e12,
                   "L40S": 362.05e12, "L40": 181.05e12, "L4": 121e12}


def peak_flops(device_name: str, override_tflops: float | None = None) -> float | None:
    """Peak dense bf16 FLOP/s of a GPU from its name (torch.cuda.get_device_name), or None if unknown."""
    if override_tflops:
        return override_tflops * 1e12
    found = [key for key in PEAK_BF16_FLOPS
             if re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", device_name, re.IGNORECASE)]
    return PEAK_BF16_FLOPS[max(found, key=len)] if found else None


def training_flops_per_token(config: dict, seq: int) -> dict:
    """FLOPs per trained token of a Llama-family (or MHA2MLA) config at sequence length `seq`, by term."""
    s = shapes.shape_of(config)
    latent = None
    if config.get("model_type") == "mla_llama":
        latent = Latent(d_kv=config["kv_lora_rank"] // s.kv_heads, r=config["qk_rope_head_dim"] // 2)
    tied = bool(config.get("tie_word_embeddings", False))
    matmul = total_params(s, latent, tied) - (0 if tied else s.vocab * s.hidden)
    dense, attention = 6 * matmul, 12 * s.layers * s.heads * s.head_dim * seq
    return {"matmul_params": matmul, "dense_flops": dense, "attention_flops": attention,
            "total_flops": dense + attention, "seq": seq,
            "convention": "6·N + 12·L·n_h·d_h·s per token (PaLM, appendix B; full s x s attention counted)"}


def mfu(tokens_per_second: float, flops_per_token: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak (None when the peak is unknown)."""
    return None if not peak else tokens_per_second * flops_per_token / peak
