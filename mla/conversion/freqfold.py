"""Folded rotated RoPE (`--rope-fold F`): each kept RoPE component mixes F adjacent frequency pairs as well as
the K/V heads, so a narrow RoPE key carries more of the keys' positional energy (TransMLA's FreqFold idea,
written for this package's rotated layout, mla/conversion/rotation.py).

The rotated layout mixes the K/V heads within one frequency pair k, which commutes with RoPE exactly. Folding
mixes the n_kv·F vectors of a group a of F adjacent pairs {a·F, …, a·F + F − 1} by the eigenvectors U_a of
their second moment (both dims of a pair are samples of one 2-D vector, so U_a acts alike on both), and lets
each kept component rotate with one pair of its group, its slot: the pair that carries most of the
component's weight. For that component the other pairs' rotation is replaced by the slot's, exact only where
the frequencies agree over the distances attention reads: adjacent pairs differ in frequency by θ^(2/d_h)
(1.43× for SmolLM2), so a small F trades a little rotation error for much more of the key in fewer dims. The
dropped components lose their rotation, as in the unfolded layout.

The second moments come from the input covariance, E[K Kᵀ] = W_k C W_kᵀ (the key's bias left out), so no
second calibration pass is needed. Scores as in rotation.component_scores (query norm read through the basis,
times the component's RMS), over the group's pairs. With the ladder (DeepSeek's format) every slot holds one
component: a group keeps at most as many components as it has ladder pairs, each in a pair of its own.

On real SmolLM2-135M (GQA), with the latent at full rank so that only the RoPE change shows, 24 RoPE dims
lose 1.24 nats unfolded and 0.70 with F = 2; 12 dims lose 1.97 unfolded and 1.39 with F = 4
(docs/conversion.md).
"""

from __future__ import annotations

import torch

from mla.conversion.rotation import RotatedLayer


def group_second_moments(w_k: torch.Tensor, covariance: torch.Tensor, head_dim: int, fold: int) -> torch.Tensor:
    """[d_h/2 / F, F·n_kv, F·n_kv]: E[K_a K_aᵀ] of each group's vectors (index o·n_kv + g), from W_k [n_kv·d_h, d]
    and the input covariance C [d, d], both dims of each pair summed."""
    half = head_dim // 2
    n_kv = w_k.shape[0] // head_dim
    groups = half // fold
    k = w_k.double().reshape(n_kv, 2, groups, fold, -1)                          # [g, c, a, o, d]
    kc = torch.einsum("gcaod,de->gcaoe", k, covariance.double())
    moments = torch.einsum("gcaoe,hcape->aogph", kc, k)                          # [a, o, g, o', g']
    return moments.reshape(groups, fold * n_kv, fold * n_kv)


def group_scores(moments: torch.Tensor, query_norms: torch.Tensor, fold: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(basis U [groups, F·n_kv, F·n_kv], eigenvalue descending; scores [groups, F·n_kv]): each component's
    query norm read through the basis, Σ_h Σ_o |U_a[(o, g(h)), j]|·mean‖q_h^[a·F + o]‖, times its RMS √λ."""
    c = (moments + moments.transpose(-1, -2)) / 2
    eigenvalues, vectors = torch.linalg.eigh(c)
    eigenvalues, vectors = eigenvalues.flip(-1), vectors.flip(-1)
    groups, width, _ = vectors.shape
    n_h, n_kv = query_norms.shape[0], width // fold
    g_of_h = torch.arange(n_h) // (n_h // n_kv)
    weights = vectors.reshape(groups, fold, n_kv, width)[:, :, g_of_h].abs()    # [a, o, h, j]
    norms = query_norms.double().reshape(n_h, groups, fold)                      # [h, a, o]
    reads = torch.einsum("aohj,hao->aj", weights, norms)
    return vectors, reads * eigenvalues.clamp(min=0).sqrt()


def select_folded(basis: torch.Tensor, scores: torch.Tensor, m: int, fold: int,
                  ladder_pairs: list[int] | None) -> tuple[torch.Tensor, list[int]]:
    """The m kept components and their slots, sorted by slot: every group's best component first (by score),
    then every group's second best, and so on, so that the key spreads over the frequencies before it doubles
    up in the strong slow ones (scores favour them, while their rotation matters least over short distances).
    With the ladder, a group offers as many components as it has ladder pairs, and each takes the free ladder
    pair of its group that carries most of its weight; without it, each its heaviest pair."""
    groups, width = scores.shape
    n_kv = width // fold
    share = basis.reshape(groups, fold, n_kv, width).pow(2).sum(dim=2)           # [a, o, j]: weight per pair
    offered = []                                             # (rank in its group, −score, group, component)
    for a in range(groups):
        slots = width if ladder_pairs is None else sum(1 for p in range(a * fold, (a + 1) * fold) if p in ladder_pairs)
        best = torch.argsort(scores[a], descending=True, stable=True)[:slots].tolist()
        offered += [(rank, -float(scores[a, j]), a, j) for rank, j in enumerate(best)]
    if not 0 <= m <= len(offered):
        raise ValueError(f"{m} RoPE components asked, but folding by {fold} offers {len(offered)}")
    chosen = [(score, a, j) for _, score, a, j in sorted(offered)[:m]]
    taken: set[int] = set()
    picks = []
    for _, a, j in chosen:                                   # best first: the stronger component picks its slot
        candidates = [a * fold + o for o in range(fold)]
        if ladder_pairs is not None:
            candidates = [p for p in candidates if p in ladder_pairs and p not in taken]
        slot = max(candidates, key=lambda p: float(share[a, p - a * fold, j]))
        taken.add(slot)
        picks.append((slot, a, j))
    picks.sort()
    kept = torch.tensor([[a, j] for _, a, j in picks], dtype=torch.long).reshape(-1, 2)
    return kept, [slot for slot, _, _ in picks]


def fold_layers(key_weights: list[torch.Tensor], covariances: torch.Tensor, query_norms: torch.Tensor, m: int,
                fold: int, head_dim: int, ladder_pairs: list[int] | None = None) -> list[RotatedLayer]:
    """Every layer's folded rotation and kept components: k_proj weights per layer, input covariances
    [L, d, d] and query_norms [L, n_h, d_h/2] (from `mla calibrate`)."""
    if fold < 1 or (head_dim // 2) % fold:
        raise ValueError(f"rope fold {fold} does not divide the {head_dim // 2} frequency pairs of a head")
    layers = []
    for w_k, cov, norms in zip(key_weights, covariances, query_norms):
        basis, scores = group_scores(group_second_moments(w_k, cov, head_dim, fold), norms, fold)
        kept, slots = select_folded(basis, scores, m, fold, ladder_pairs)
        layers.append(RotatedLayer(basis, kept, fold=fold, slots=slots))
    return layers
