"""Rotated partial RoPE (strategy `rotated`): RoPE kept on the best components of each frequency pair after an
orthogonal mix across the K/V heads, in ONE RoPE key that every query head reads (DeepSeek's k_pe layout).

RoPE (HF "rotate_half": pair k = dims k, k + d_h/2, rotating with θ_k) acts on pair k of every head as the
same 2-D rotation R_k. Stack the K/V heads' pair-k key vectors as the rows of K_k (n_kv x 2); RoPE maps K_k
to K_k R_kᵀ, so any orthogonal U_k (n_kv x n_kv) mixing the heads commutes with it: K̃_k = U_kᵀ K_k is RoPE'd
by the same R_k. Query head h of KV group g(h) scores pair k as q_hᵀ R k_g = Σ_j U_k[g, j] · q_hᵀ R k̃_j, so
component j of pair k is one key k̃_j shared by all query heads, read by head h through the query
U_k[g(h), j]·q_h. Nothing changes until components lose their rotation.

U_k: the eigenvectors of the keys' pair second moment C_k = E_t[K_k K_kᵀ] (from `mla calibrate`), by
eigenvalue λ descending, so that the first components carry most of the keys' energy. The score of
component (k, j), as the 2-norm strategy's (query norm x key norm, summed over the query heads that read
it), is Σ_h |U_k[g(h), j]|·mean‖q_h^[k]‖ · √λ_{k,j}: √λ is the RMS norm of the rotated key component, exact
from C_k without a second pass over the data (the 2-norm strategy uses the mean norm, which would need one).

The top-m components per layer keep RoPE, as a RoPE key of 2m dims ([first dims of the m components |
their second dims], rotate_half order, each rotating with its pair's θ_k). The dropped components join the
no-RoPE keys: per K/V head g, the projection onto the dropped subspace, W_knope[g] = Σ_g' P_k[g, g'] W_k[g']
on pair k's dims, P_k = U_drop U_dropᵀ (d_h rows per head), read by the head's whole unrotated query (d_h).
With every component kept, P = 0 and the model is the original one.

The `ladder` strategy (DeepSeek's format, mla/conversion/ladder.py) keeps at most one component per frequency:
each pair's best-scoring component, then the top-m pairs by that score, among the pairs the ladder holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RotatedLayer:
    """One layer's rotation and the components that keep RoPE. Components live in groups of `fold` adjacent
    frequency pairs (1: one pair, the unfolded rotation); a component's index within its group runs over
    (pair offset o, K/V head g) as o·n_kv + g."""

    basis: torch.Tensor        # [d_h/2 / fold, fold·n_kv, fold·n_kv] U_a, column j = component j (eigenvalue desc.)
    kept: torch.Tensor         # [m, 2] (group a, component j), sorted by slot
    fold: int = 1
    slots: list[int] | None = None   # the frequency pair each kept component rotates with (fold 1: its group)

    @property
    def pairs(self) -> list[int]:
        """The frequency index of each kept component (the model's `rope_pairs` for the shared layout)."""
        return self.kept[:, 0].tolist() if self.slots is None else list(self.slots)

    @property
    def kv_heads(self) -> int:
        return self.basis.shape[1] // self.fold

    def coefficients(self) -> torch.Tensor:
        """[m, fold, n_kv] (float64): kept component (a, j)'s weight on pair a·fold + o of K/V head g."""
        u = self.basis.double()[self.kept[:, 0], :, self.kept[:, 1]]          # [m, fold·n_kv]
        return u.reshape(-1, self.fold, self.kv_heads)

    def dropped_projector(self) -> torch.Tensor:
        """P_a = Σ_{j dropped} u_j u_jᵀ = I − Σ_{j kept} u_j u_jᵀ, [d_h/2 / fold, fold·n_kv, fold·n_kv] (float64)."""
        u = self.basis.double()
        groups, width, _ = u.shape
        keep = torch.zeros(groups, width, dtype=torch.float64)
        keep[self.kept[:, 0], self.kept[:, 1]] = 1.0
        kept_part = torch.einsum("kgj,kj,khj->kgh", u, keep, u)
        return torch.eye(width, dtype=torch.float64).expand(groups, width, width) - kept_part


def pair_second_moment(keys: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Σ over tokens of K_k K_kᵀ: keys [B, T, n_kv·d_h] -> [d_h/2, n_kv, n_kv], summed in fp32 (one batch; no
    fp64 copy of the keys, which for a 7B model's batch would be gigabytes) and returned in fp64 for the caller
    to accumulate."""
    b, t, _ = keys.shape
    x = keys.float().reshape(b * t, -1, 2, head_dim // 2)         # [N, n_kv, (first|second dim), pair]
    return torch.einsum("ngck,nhck->kgh", x, x).double()


def component_scores(pair_covariance: torch.Tensor, query_norms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotation and scores of one layer.

    pair_covariance [d_h/2, n_kv, n_kv] (C_k), query_norms [n_h, d_h/2] (mean ‖q_h^[k]‖) ->
    (basis U [d_h/2, n_kv, n_kv], eigenvalue descending; scores [d_h/2, n_kv])."""
    c = pair_covariance.double()
    c = (c + c.transpose(-1, -2)) / 2
    eigenvalues, vectors = torch.linalg.eigh(c)                     # ascending
    eigenvalues, vectors = eigenvalues.flip(-1), vectors.flip(-1)
    n_h, n_kv = query_norms.shape[0], c.shape[-1]
    group = torch.arange(n_h) // (n_h // n_kv)                      # g(h)
    weights = vectors[:, group, :].abs()                            # [half, n_h, n_kv]: |U_k[g(h), j]|
    reads = torch.einsum("khj,hk->kj", weights, query_norms.double())
    return vectors, reads * eigenvalues.clamp(min=0).sqrt()


def select_components(scores: torch.Tensor, m: int) -> torch.Tensor:
    """The m best (pair, component) of one layer's scores [d_h/2, n_kv], sorted by pair then component."""
    half, n_kv = scores.shape
    if not 0 <= m <= half * n_kv:
        raise ValueError(f"{m} rotated components asked, but a layer has {half * n_kv} (d_h/2 x n_kv)")
    order = torch.argsort(scores.flatten(), descending=True, stable=True)[:m]
    order = torch.sort(order).values
    return torch.stack([order // n_kv, order % n_kv], dim=1)


def select_ladder_components(scores: torch.Tensor, m: int, pairs: list[int]) -> torch.Tensor:
    """The m best pairs among `pairs` (those DeepSeek's ladder holds), each with its best component, from one
    layer's scores [d_h/2, n_kv]; sorted by pair. One component per frequency: a RoPE slot holds one."""
    if not 0 <= m <= len(pairs):
        raise ValueError(f"{m} ladder components asked, but the ladder holds {len(pairs)} frequency pairs")
    best, component = scores.max(dim=1)
    allowed = torch.tensor(pairs, dtype=torch.long)
    order = allowed[torch.argsort(best[allowed], descending=True, stable=True)[:m]]
    order = torch.sort(order).values
    return torch.stack([order, component[order]], dim=1)


def rotate_layers(pair_covariance: torch.Tensor, query_norms: torch.Tensor, m: int,
                  ladder_pairs: list[int] | None = None) -> list[RotatedLayer]:
    """Every layer's rotation and kept components: pair_covariance [L, d_h/2, n_kv, n_kv], query_norms
    [L, n_h, d_h/2] (from `mla calibrate`); with `ladder_pairs`, one component per frequency among them."""
    layers = []
    for c, q in zip(pair_covariance, query_norms):
        basis, scores = component_scores(c, q)
        kept = (select_components(scores, m) if ladder_pairs is None
                else select_ladder_components(scores, m, ladder_pairs))
        layers.append(RotatedLayer(basis, kept))
    return layers


def _per_pair(weight: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Rows [heads·d_h, ...] as [heads, 2, d_h/2, ...] (rotate_half: dim c·d_h/2 + k is pair k's c-th dim)."""
    return weight.double().reshape(heads, 2, head_dim // 2, *weight.shape[1:])


def _kept_pairs(w: torch.Tensor, layer: RotatedLayer) -> torch.Tensor:
    """[heads, 2, m, fold, ...]: for each kept component, the pairs of its group (per head and dim)."""
    group = layer.kept[:, 0]
    index = group[:, None] * layer.fold + torch.arange(layer.fold)                 # [m, fold]
    return w[:, :, index]


def rope_key_rows(w_k: torch.Tensor, layer: RotatedLayer, head_dim: int) -> torch.Tensor:
    """The shared RoPE key's rows [2m, ...]: component (a, j)'s c-th dim = Σ_{o,g} U_a[(o, g), j]·W_k[g, c·d_h/2 +
    a·fold + o]."""
    w = _kept_pairs(_per_pair(w_k, layer.kv_heads, head_dim), layer)         # [n_kv, 2, m, fold, ...]
    rows = torch.einsum("mog,gcmo...->cm...", layer.coefficients(), w)       # [2, m, ...]
    return rows.reshape(-1, *w_k.shape[1:]).to(w_k.dtype)


def rope_query_rows(w_q: torch.Tensor, layer: RotatedLayer, head_dim: int) -> torch.Tensor:
    """Every query head's RoPE rows [n_h, 2m, ...]: Σ_o U_a[(o, g(h)), j]·W_q[h, c·d_h/2 + a·fold + o]."""
    n_kv = layer.kv_heads
    n_h = w_q.shape[0] // head_dim
    group = torch.arange(n_h) // (n_h // n_kv)
    coeff = layer.coefficients()[:, :, group]                                # [m, fold, n_h]
    w = _kept_pairs(_per_pair(w_q, n_h, head_dim), layer)                    # [n_h, 2, m, fold, ...]
    rows = torch.einsum("moh,hcmo...->hcm...", coeff, w)
    return rows.reshape(n_h, -1, *w_q.shape[1:]).to(w_q.dtype)


def nope_key_rows(w_k: torch.Tensor, layer: RotatedLayer, head_dim: int) -> torch.Tensor:
    """The no-RoPE key rows [n_kv·d_h, ...]: each K/V head's keys projected onto the dropped components,
    Σ_{o',g'} P_a[(o, g), (o', g')]·W_k[g', c·d_h/2 + a·fold + o'] (zero where every component is kept)."""
    n_kv, fold = layer.kv_heads, layer.fold
    groups = layer.basis.shape[0]
    proj = layer.dropped_projector().reshape(groups, fold, n_kv, fold, n_kv)   # [a, o, g, o', g']
    w = _per_pair(w_k, n_kv, head_dim).reshape(n_kv, 2, groups, fold, *w_k.shape[1:])
    rows = torch.einsum("aogph,hcap...->gcao...", proj, w)
    return rows.reshape(w_k.shape).to(w_k.dtype)
