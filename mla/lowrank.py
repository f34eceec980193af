"""Low-rank initialisation of the latent projections (paper §3, as the official code does it).

Per layer, on weights in PyTorch (out x in) layout: M = [W_k,nope ; W_v]. The truncated SVD
M ≈ U_ρ S_ρ V_ρᵀ gives the down-projection V_ρᵀ (orthonormal rows, no singular values) and the
up-projection U_ρ S_ρ (Σ entirely in W_up; the paper writes Σ^½ on each side, same product).

- joint: one SVD of the stacked key-nope and value rows, rank ρ = n_kv·d_kv.
- split: K and V separately, rank ρ/2 each, so the cache size equals joint's at the same d_kv.
SVDs run in fp32 (float64 for tiny matrices is not needed: errors are reported, not hidden).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

METHODS = ("joint", "split")


@dataclass
class LowRankKV:
    down: torch.Tensor          # [ρ, d]          c_kv = x @ down.T
    up_k: torch.Tensor          # [rows_k, ρ_k]   k_nope = c_k @ up_k.T
    up_v: torch.Tensor          # [rows_v, ρ_v]   v = c_v @ up_v.T
    relative_error: float       # ‖M − up·down‖_F / ‖M‖_F


def max_rank(method: str, rows_k: int, rows_v: int, in_features: int) -> int:
    """Largest latent width ρ the SVD can give (beyond it the factorisation is padded with nothing)."""
    if method == "joint":
        return min(rows_k + rows_v, in_features)
    if method == "split":
        return 2 * min(rows_k, rows_v, in_features)
    raise ValueError(f"unknown SVD method {method!r}; choose one of {', '.join(METHODS)}")


def _truncated(m: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    u, s, vh = torch.linalg.svd(m, full_matrices=False)
    return u[:, :rank] * s[:rank], vh[:rank], s


def factorize(w_k_nope: torch.Tensor, w_v: torch.Tensor, rank: int, method: str = "joint") -> LowRankKV:
    """Factorise one layer's key-nope rows [rows_k, d] and value rows [rows_v, d] to latent width `rank`."""
    rows_k, rows_v, d = w_k_nope.shape[0], w_v.shape[0], w_v.shape[1]
    limit = max_rank(method, rows_k, rows_v, d)
    if rank > limit or rank <= 0:
        raise ValueError(f"latent width n_kv·d_kv = {rank} is not possible for SVD '{method}': it must be "
                         f"between 1 and the full rank {limit} of [W_k,nope; W_v]")
    k32, v32 = w_k_nope.float(), w_v.float()
    m = torch.cat([k32, v32])
    norm = m.norm()
    if method == "joint":
        up, down, _ = _truncated(m, rank)
        err = (m - up @ down).norm() / norm
        return LowRankKV(down, up[:rows_k], up[rows_k:], float(err))
    if rank % 2:
        raise ValueError(f"SVD 'split' needs an even latent width n_kv·d_kv, got {rank}")
    half = rank // 2
    up_k, down_k, _ = _truncated(k32, half)
    up_v, down_v, _ = _truncated(v32, half)
    resid = torch.cat([k32 - up_k @ down_k, v32 - up_v @ down_v])
    return LowRankKV(torch.cat([down_k, down_v]), up_k, up_v, float(resid.norm() / norm))
