"""DeepSeek's `kv_a_layernorm` made the identity on an MHA2MLA latent, which was converted without a norm.

The norm computes w · y / sqrt(ms(y) + eps) on the latent y (ms: the mean square over its K channels, the
padded ones included). The export writes y = α·c (the latent rows of `kv_a_proj_with_mqa` scaled by a tiny α)
and w = sqrt(eps)/α, so the norm gives c / sqrt(1 + α²·ms(c)/eps): c, with a relative error of at most
α²·ms(c)/(2·eps) once eps dominates.

α is chosen from the weights, not from sample text, so the bound holds for every input: the latent is
c = W_down·(γ ⊙ u), where γ ⊙ u is the layer's input RMSNorm output and ‖u‖ ≤ sqrt(d), hence
‖c‖ ≤ σ_max(W_down·diag(γ))·sqrt(d).
α is a power of two (the scaled latent rows then round exactly as before) and the stored weight w's own
rounding, κ = w·α/sqrt(eps) ≠ 1 in bf16, is returned for the caller to fold into the up-projection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

TARGET_ERROR = 2.0 ** -40      # ≈ 9e-13: far below fp32's rounding (6e-8), let alone bf16's (4e-3)


@dataclass(frozen=True)
class IdentityNorm:
    """One layer's α, the norm weight w (as stored) and κ = w·α/sqrt(eps) (1 up to the weight's rounding)."""

    alpha: float
    weight: float
    kappa: float
    latent_norm_bound: float     # ‖c‖ ≤ this for every input
    error_bound: float           # relative error of the latent, for every input


def latent_norm_bound(kv_down: torch.Tensor, input_norm: torch.Tensor) -> float:
    """An upper bound of ‖c‖ over all inputs: σ_max(W_down·diag(γ))·sqrt(d) (module docstring)."""
    w = kv_down.detach().double() * input_norm.detach().double()[None, :]
    return float(torch.linalg.matrix_norm(w, ord=2)) * math.sqrt(kv_down.shape[1])


def identity_norm(kv_down: torch.Tensor, input_norm: torch.Tensor, width: int, eps: float,
                  dtype: torch.dtype) -> IdentityNorm:
    """α and w for one layer: `width` channels normalised (the padded latent), `eps` the engine's, the weight
    stored in `dtype`."""
    bound = max(latent_norm_bound(kv_down, input_norm), 1e-30)
    # error ≤ α²·‖c‖²/(2·width·eps) ≤ TARGET_ERROR, with α rounded down to a power of two
    alpha = 2.0 ** math.floor(math.log2(math.sqrt(2 * width * eps * TARGET_ERROR) / bound))
    weight = float(torch.tensor(math.sqrt(eps) / alpha, dtype=dtype))
    kappa = weight * alpha / math.sqrt(eps)
    return IdentityNorm(alpha, weight, kappa, bound, alpha ** 2 * bound ** 2 / (2 * width * eps))


def relative_error(latent: torch.Tensor, alpha: float, width: int, eps: float) -> float:
    """The largest relative error 1 − 1/sqrt(1 + α²·ms(c)/eps) of the norm on latents [..., channels] (fp64)."""
    ms = latent.double().pow(2).sum(-1) / width
    return float((1 - torch.rsqrt(1 + alpha ** 2 * ms / eps)).max())
