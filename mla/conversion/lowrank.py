"""Low-rank initialisation of the latent projections (paper §3.2, as the official code does it).

Per layer, on weights in PyTorch (out x in) layout: M = [W_k,nope ; W_v]. The truncated SVD
M ≈ U_ρ S_ρ V_ρᵀ gives the up-projection U_ρ S_ρ^½ and the down-projection S_ρ^½ V_ρᵀ (the paper writes
Σ^½ on each side; its code puts all of Σ into W_up, the same product).

Balanced factors: every branch ends with `balance_factors`, which rescales each latent channel i so that
‖down row i‖ = ‖up column i‖ (for the plain SVD that is exactly Σ^½ on each side). The function is
unchanged, but Adam's step ignores a weight's scale: with Σ and the whitening's L⁻¹ all on one side, the
factors of SmolLM2's layer 0 differed 279× per channel, the small up-projections moved 18 % in 25
fine-tuning steps and the gradient norm spiked to 733 (docs/conversion.md). mla/conversion/balance.py does the
same to a converted attention module, with its value and key channels too (after conversion, and after a layer
fit, whose Adam steps unbalance it again).

- joint: one SVD of the stacked key-nope and value rows, rank ρ = n_kv·d_kv.
- split: K and V separately, rank ρ/2 each, so the cache size equals joint's at the same d_kv.
- none: no compression (the paper's "partial RoPE only", Table 5): the joint factorisation at the full
  rank min(rows, d) of M, exact up to rounding, so only the partial-RoPE change remains.
SVDs run in fp32 (float64 for tiny matrices is not needed: errors are reported, not hidden).

Activation-aware (whitened) SVD, as in SVD-LLM and MHA2MLA-VLM: with C the second moment of the layer's
attention input x (C = E[x xᵀ], from `mla calibrate --covariance-out`), damped and factorised
C + λI = L Lᵀ (Cholesky), the SVD of M L truncated to rank ρ, U_ρ S_ρ V_ρᵀ, gives up = U_ρ S_ρ and
down = V_ρᵀ L⁻¹. Since A ↦ A L is a bijection on rank-ρ matrices, this is the rank-ρ A that minimises
E‖(M − A) x‖² + λ‖M − A‖²_F: the error of the layer's keys and values on the calibration inputs, which
is what the model sees, instead of the error of the weights.

Attention-aware: `row_weight` R (mla/conversion/readers.py) weighs each output row by what reads it, with
Lᵣ Lᵣᵀ = R + λI: the SVD of Lᵣᵀ M L truncated, up = Lᵣ⁻ᵀ U_ρ S_ρ, down = V_ρᵀ L⁻¹, the rank-ρ A that minimises
E‖Lᵣᵀ (M − A) x‖² (+ the damping terms).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla.conversion import readers
from mla.options import DEFAULT_SVD
from mla.options import SVD_METHODS as METHODS


@dataclass
class LowRankKV:
    down: torch.Tensor          # [ρ, d]          c_kv = x @ down.T
    up_k: torch.Tensor          # [rows_k, ρ_k]   k_nope = c_k @ up_k.T
    up_v: torch.Tensor          # [rows_v, ρ_v]   v = c_v @ up_v.T
    relative_error: float       # ‖M − up·down‖_F / ‖M‖_F
    output_error: float | None = None   # √(tr(E C Eᵀ) / tr(M C Mᵀ)), E = M − up·down, for the given C

    def approximation(self) -> torch.Tensor:
        """The rank-ρ stand-in for M = [W_k,nope ; W_v] that these factors compute."""
        if self.up_k.shape[1] == self.down.shape[0]:                 # joint: both read all of c_kv
            return torch.cat([self.up_k, self.up_v]) @ self.down
        half = self.up_k.shape[1]                                    # split: c_kv = [c_k | c_v]
        return torch.cat([self.up_k @ self.down[:half], self.up_v @ self.down[half:]])


def relative_output_error(m: torch.Tensor, approx: torch.Tensor, covariance: torch.Tensor) -> float:
    """Relative error of the outputs M x against (approx) x over inputs with second moment C."""
    c = covariance.to(torch.float64)
    e, m = (m - approx).to(torch.float64), m.to(torch.float64)
    return float(torch.sqrt(torch.trace(e @ c @ e.T) / torch.trace(m @ c @ m.T)))


def whitening_factor(covariance: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    """Lower-triangular L with L Lᵀ = C + λI, λ = damp · mean(diag C) (keeps L invertible for rank-deficient C)."""
    c = covariance.to(torch.float64)
    c = c + damp * c.diagonal().mean() * torch.eye(c.shape[0], dtype=c.dtype, device=c.device)
    factor, info = torch.linalg.cholesky_ex(c)
    if info.item():
        raise ValueError("the input covariance is not positive definite even after damping; raise the damping")
    return factor


def max_rank(method: str, rows_k: int, rows_v: int, in_features: int) -> int:
    """Largest latent width ρ the SVD can give (beyond it the factorisation is padded with nothing)."""
    if method in ("joint", "none"):
        return min(rows_k + rows_v, in_features)
    if method == "split":
        return 2 * min(rows_k, rows_v, in_features)
    raise ValueError(f"unknown SVD method {method!r}; choose one of {', '.join(METHODS)}")


def channel_scales(up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Per latent channel i, s_i with ‖up[:, i] / s_i‖ = ‖s_i · down[i]‖ (1 where either is zero)."""
    up_norm, down_norm = up.double().norm(dim=0), down.double().norm(dim=1)
    ok = (up_norm > 0) & (down_norm > 0)
    ratio = torch.where(ok, up_norm / torch.where(ok, down_norm, 1.0), 1.0)
    return ratio.sqrt()


def balance_factors(up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(up / s, s · down) with s = channel_scales(up, down): the same product up @ down, each latent channel's
    up column and down row of equal norm."""
    s = channel_scales(up, down)
    return (up.double() / s).to(up.dtype), (down.double() * s[:, None]).to(down.dtype)


def _largest_ratio(scales: torch.Tensor) -> float:
    s2 = scales ** 2               # ‖up col‖ / ‖down row‖ per channel
    return float(torch.maximum(s2, 1 / s2).max())


def imbalance(up: torch.Tensor, down: torch.Tensor) -> float:
    """The largest per-channel ratio max(‖up col‖/‖down row‖, its inverse): 1 when balanced."""
    return _largest_ratio(channel_scales(up, down))


def _truncated(m: torch.Tensor, rank: int, white: torch.Tensor | None = None,
               left: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Balanced (up, down) of the best rank-`rank` approximation of m, in the norm ‖Lᵣᵀ · L‖ when `white` = L
    (and `left` = Lᵣ) are given."""
    if white is None:
        u, s, vh = torch.linalg.svd(m, full_matrices=False)
        return balance_factors(u[:, :rank] * s[:rank], vh[:rank])
    weighted = m.double() @ white if left is None else left.T @ m.double() @ white
    u, s, vh = torch.linalg.svd(weighted, full_matrices=False)
    # down = V_ρᵀ L⁻¹, i.e. downᵀ solves Lᵀ downᵀ = V_ρ; up = Lᵣ⁻ᵀ U_ρ S_ρ
    down = torch.linalg.solve_triangular(white.T, vh[:rank].T, upper=True).T
    up = u[:, :rank] * s[:rank]
    if left is not None:
        up = torch.linalg.solve_triangular(left.T, up, upper=True)
    up, down = balance_factors(up, down)
    return up.float(), down.float()


def factorize(w_k_nope: torch.Tensor, w_v: torch.Tensor, rank: int, method: str = DEFAULT_SVD,
              covariance: torch.Tensor | None = None, damp: float = 0.01,
              row_weight: torch.Tensor | None = None) -> LowRankKV:
    """Factorise one layer's key-nope rows [rows_k, d] and value rows [rows_v, d] to latent width `rank`.

    With `covariance` (the layer's input second moment [d, d]) the factors are activation-aware (module
    docstring) and `output_error` is reported for that covariance; `row_weight` [rows_k + rows_v, same] (with a
    covariance) weighs the output rows too (attention-aware, mla/conversion/readers.py).
    """
    rows_k, rows_v, d = w_k_nope.shape[0], w_v.shape[0], w_v.shape[1]
    limit = max_rank(method, rows_k, rows_v, d)
    if method == "none" and rank != limit:
        raise ValueError(f"SVD 'none' keeps the full rank {limit} of [W_k,nope; W_v], not {rank}")
    if rank > limit or rank <= 0:
        raise ValueError(f"latent width n_kv·d_kv = {rank} is not possible for SVD '{method}': it must be "
                         f"between 1 and the full rank {limit} of [W_k,nope; W_v]")
    if covariance is not None and tuple(covariance.shape) != (d, d):
        raise ValueError(f"input covariance of shape {tuple(covariance.shape)} does not fit a layer with {d} inputs")
    white = None if covariance is None else whitening_factor(covariance.to(w_v.device), damp)
    if row_weight is not None and white is None:
        raise ValueError("an attention-aware SVD (row_weight) needs the input covariance")
    if row_weight is not None and tuple(row_weight.shape) != (rows_k + rows_v,) * 2:
        raise ValueError(f"row weight of shape {tuple(row_weight.shape)} does not fit {rows_k + rows_v} rows")
    k32, v32 = w_k_nope.float(), w_v.float()
    m = torch.cat([k32, v32])
    if method in ("joint", "none"):
        left = None if row_weight is None else readers.left_factor(row_weight.to(w_v.device))
        up, down = _truncated(m, rank, white, left)
        up_k, up_v, approx = up[:rows_k], up[rows_k:], up @ down
    else:
        if rank % 2:
            raise ValueError(f"SVD 'split' needs an even latent width n_kv·d_kv, got {rank}")
        left_k, left_v = (None, None) if row_weight is None else (
            readers.left_factor(row_weight[:rows_k, :rows_k].to(w_v.device)),
            readers.left_factor(row_weight[rows_k:, rows_k:].to(w_v.device)))
        up_k, down_k = _truncated(k32, rank // 2, white, left_k)
        up_v, down_v = _truncated(v32, rank // 2, white, left_v)
        down = torch.cat([down_k, down_v])
        approx = torch.cat([up_k @ down_k, up_v @ down_v])
    weight_error = float((m - approx).norm() / m.norm())
    out_error = None if covariance is None else relative_output_error(m, approx, covariance.to(m.device))
    return LowRankKV(down, up_k, up_v, weight_error, out_error)
