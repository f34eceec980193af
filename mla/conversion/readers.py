"""Attention-aware SVD: the latent's errors weighed by what reads them (`--attention-aware`, with `--whiten`).

The activation-aware SVD (mla/conversion/lowrank.py) finds the rank-ρ A closest to M = [W_k,nope ; W_v] in
E‖(M − A) x‖²: every key and value channel counts alike. The attention does not read them alike. A key error
e_k of K/V head g changes the score of query head h by q_hᵀ e_k, so it costs E[(q_hᵀ e_k)²] = e_kᵀ Q_g e_k
summed over g's query heads, Q_g = Σ_h W_q,h C W_q,hᵀ (C = E[x xᵀ], the same input covariance, since the
query reads the same normed input). A value error e_v of head g reaches the residual stream through o_proj:
‖W_o,h e_v‖² summed over g's query heads, O_g = Σ_h W_o,hᵀ W_o,h. So the SVD minimises

    E‖R^½ (M − A) x‖²,   R = blockdiag(κ·Q_1 … κ·Q_n_kv, O_1 … O_n_kv),

the SVD of Lᵣᵀ M Lₓ with Lᵣ Lᵣᵀ = R + λI and Lₓ Lₓᵀ = C + λI, truncated and mapped back. Scores and residual
outputs are in different units; κ sets the keys' weighted error energy of M x itself, tr(κ·Q M_k C M_kᵀ),
equal to the values', tr(O M_v C M_vᵀ): neither side's errors dominate by their units alone (TransMLA balances
K against V before its PCA for the same reason, in unweighted norms).

On real SmolLM2-135M (GQA, 64 held-out blocks), right after conversion at 48 RoPE + 72 latent per layer this
takes the held-out loss from 4.54 to 4.17 (docs/conversion.md). Query and key biases are left out of Q (the
input's mean is not calibrated): a model with biases gets the weight of its bias-free part.
"""

from __future__ import annotations

import torch

DAMP = 1e-3          # λ of R, relative to its mean diagonal: keeps Lᵣ invertible where a gram is rank-deficient


def key_grams(query_nope: torch.Tensor, covariance: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Q_g [n_kv, w, w]: the second moment of the no-RoPE queries that read K/V head g's w key rows.
    query_nope [n_h, w, d]: each query head's rows that score the no-RoPE key, aligned with its rows."""
    q = query_nope.double()
    per_head = torch.einsum("hid,de,hje->hij", q, covariance.double(), q)
    return per_head.reshape(kv_heads, -1, *per_head.shape[1:]).sum(dim=1)


def value_grams(o_proj: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """O_g [n_kv, d_h, d_h]: Σ over g's query heads of W_o,hᵀ W_o,h (o_proj [d, n_h·d_h])."""
    w = o_proj.double().reshape(o_proj.shape[0], heads, -1)
    per_head = torch.einsum("dhi,dhj->hij", w, w)
    return per_head.reshape(kv_heads, -1, *per_head.shape[1:]).sum(dim=1)


def row_weight(query_nope: torch.Tensor, o_proj: torch.Tensor, k_nope: torch.Tensor, w_v: torch.Tensor,
               covariance: torch.Tensor) -> torch.Tensor:
    """R [rows_k + rows_v, same] for the rows [k_nope ; w_v] of one layer (module docstring), float64."""
    heads, kv_heads = query_nope.shape[0], w_v.shape[0] // (o_proj.shape[1] // query_nope.shape[0])
    keys, values = key_grams(query_nope, covariance, kv_heads), value_grams(o_proj, heads, kv_heads)
    c = covariance.double()
    m_k = k_nope.double().reshape(kv_heads, keys.shape[1], -1)
    m_v = w_v.double().reshape(kv_heads, values.shape[1], -1)
    key_energy = torch.einsum("gij,gjd,de,gie->", keys, m_k, c, m_k)
    value_energy = torch.einsum("gij,gjd,de,gie->", values, m_v, c, m_v)
    kappa = value_energy / key_energy if key_energy > 0 else torch.ones((), dtype=torch.float64)
    return torch.block_diag(*(kappa * keys), *values)


def left_factor(weight: torch.Tensor) -> torch.Tensor:
    """Lower-triangular Lᵣ with Lᵣ Lᵣᵀ = R + λI (λ = DAMP · mean diag R)."""
    r = weight.double()
    r = (r + r.T) / 2 + DAMP * r.diagonal().mean() * torch.eye(r.shape[0], dtype=torch.float64, device=r.device)
    return torch.linalg.cholesky(r)
