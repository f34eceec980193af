"""DeepSeek's RoPE frequency ladder: which frequency pairs of a model its 64-dim RoPE key can hold, and where.

DeepSeek-V3's `k_pe` has qk_rope_head_dim = 64 dims = 32 slots; slot i rotates with theta'^(-2i/64) for one
`rope_theta` theta' shared by every layer. A model of head size d_h rotates pair p with theta^(-2p/d_h), so
pair p fits slot i when p/d_h = i/64 up to the choice of theta':

- d_h <= 64: every pair, slot i = p, theta' = theta^(64/d_h);
- d_h a multiple of 64 (128: Llama-2/3, Mistral, Qwen2.5): every (d_h/64)-th pair, slot p·64/d_h, theta' = theta
  (TransMLA's choice: the ladder spans the model's whole frequency range);
- any other d_h: the 32 fastest pairs, slot p, theta' = theta^(64/d_h).

Each slot holds one rotated component, so a conversion for the DeepSeek format keeps at most one per frequency
(`--rope-strategy ladder`, mla/conversion/rotation.py). Torch-free: the workflow's config check uses it.
"""

from __future__ import annotations

from dataclasses import dataclass

ROPE_SLOTS = 32          # DeepSeek-V3's qk_rope_head_dim 64 holds 32 frequency pairs


@dataclass(frozen=True)
class Ladder:
    """How the frequency pairs of a head of `head_dim` map onto DeepSeek's 32 RoPE slots."""

    head_dim: int
    stride: int           # pair p sits in slot p // stride (p a multiple of stride)
    theta_power: float    # theta' = theta ** theta_power

    @property
    def pairs(self) -> list[int]:
        """The pairs the ladder can hold, fastest first."""
        return [p for p in range(0, self.head_dim // 2, self.stride) if p // self.stride < ROPE_SLOTS]

    def holds(self, pair: int) -> bool:
        return pair in self.pairs

    def slot(self, pair: int) -> int:
        if not self.holds(pair):
            raise ValueError(f"frequency pair {pair} is not on the RoPE ladder of d_h = {self.head_dim}")
        return pair // self.stride

    def theta(self, source_theta: float) -> float:
        """The exported `rope_theta` theta' that makes slot i rotate as the pair it holds."""
        return float(source_theta) ** self.theta_power


def ladder_for(head_dim: int) -> Ladder:
    """The ladder of a model's head size (module docstring): a stride over the pairs when d_h is a multiple of 64
    above it, else every pair from the fastest with theta' rescaled (d_h <= 64 and the uneven sizes alike)."""
    if head_dim > 2 * ROPE_SLOTS and head_dim % (2 * ROPE_SLOTS) == 0:
        return Ladder(head_dim, head_dim // (2 * ROPE_SLOTS), 1.0)
    return Ladder(head_dim, 1, 2 * ROPE_SLOTS / head_dim)
