"""Partial RoPE (paper §3.1): which rotary frequency pairs keep their rotation.

Conventions (HF Llama, "rotate_half"): a head of size d_h holds d_h/2 frequency pairs; pair k is the
dims (k, k + d_h/2) and rotates with θ_k = base^(-2k/d_h), k = 0 the fastest. `r` is the number of
pairs kept per head. A *selection* is an integer tensor [layers, n_kv, r] of kept pair indices,
sorted ascending; query heads use the selection of their KV group.
"""

from __future__ import annotations

import torch

from mla.options import ROPE_STRATEGIES as STRATEGIES


def check_r(r: int, head_dim: int) -> None:
    if not 0 <= r <= head_dim // 2:
        raise ValueError(f"r={r} is out of range: it counts kept frequency pairs per head and must be "
                         f"between 0 and d_h/2 = {head_dim // 2}")


def fixed_pairs(strategy: str, r: int, head_dim: int) -> list[int]:
    """Kept pairs of the head-independent strategies `high`, `low`, `uniform`."""
    half = head_dim // 2
    check_r(r, head_dim)
    if strategy == "high":
        return list(range(r))
    if strategy == "low":
        return list(range(half - r, half))
    if strategy == "uniform":
        # S_uniform = {floor(k * d_h / (2r)) : 0 <= k < r}
        return [k * half // r for k in range(r)] if r else []
    raise ValueError(f"unknown partial-RoPE strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")


def select_pairs(strategy: str, r: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 scores: torch.Tensor | None = None) -> torch.Tensor:
    """Kept pair indices [layers, n_kv, r] for any strategy; `scores` [layers, n_kv, d_h/2] for 2-norm."""
    check_r(r, head_dim)
    if strategy == "2-norm":
        if scores is None:
            raise ValueError("strategy '2-norm' needs a scores file from `mla calibrate` (--scores)")
        expected = (num_layers, num_kv_heads, head_dim // 2)
        if tuple(scores.shape) != expected:
            raise ValueError(f"the 2-norm scores have shape {tuple(scores.shape)} but this model needs "
                             f"[layers, n_kv, d_h/2] = {list(expected)}: the scores file belongs to another model")
        top = torch.topk(scores.float(), r, dim=-1).indices if r else scores.new_zeros(*expected[:2], 0).long()
        return torch.sort(top, dim=-1).values.long()
    pairs = torch.tensor(fixed_pairs(strategy, r, head_dim), dtype=torch.long)
    return pairs.expand(num_layers, num_kv_heads, r).clone()


def rope_dims(pairs: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Head dims carrying RoPE, in rotate_half order: [k_1..k_r, k_1+d_h/2..k_r+d_h/2] (last axis 2r)."""
    return torch.cat([pairs, pairs + head_dim // 2], dim=-1)


def nope_dims(pairs: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Head dims without RoPE, ascending (last axis d_h - 2r); same leading shape as `pairs`."""
    lead = pairs.shape[:-1]
    keep = torch.ones(*lead, head_dim, dtype=torch.bool)
    keep.scatter_(-1, rope_dims(pairs, head_dim), False)
    n = head_dim - 2 * pairs.shape[-1]
    return torch.arange(head_dim).expand(*lead, head_dim)[keep].reshape(*lead, n)


def head_permutation(pairs: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Per-head dim order [rope dims | nope dims] (last axis d_h): new position i holds old dim perm[i]."""
    return torch.cat([rope_dims(pairs, head_dim), nope_dims(pairs, head_dim)], dim=-1)
