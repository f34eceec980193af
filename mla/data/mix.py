"""The weighted interleave of one split: which source's document comes next, and how much of it fits.

With a token budget, source i gets a quota of ``weight_i / sum(weights) * budget`` tokens (integers
that sum to the budget); the next document always comes from the source furthest below its quota
(smallest filled fraction), and a document is cut to what its source's quota has left (EOS kept), so
the shares are exact. When a source runs dry, what its quota has left is shared among the others by
weight, and the real shares are reported next to the configured ones. Without a budget the split
takes documents until the first source runs dry, keeping the proportions.

Pure bookkeeping (no I/O), so its state can be saved in a resume checkpoint.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


def allocate(total: int, weights: list[float]) -> list[int]:
    """Integers proportional to `weights` that sum to `total` (largest remainders get the extra ones)."""
    if total <= 0 or not weights:
        return [0] * len(weights)
    exact = [total * w / sum(weights) for w in weights]
    out = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - out[i]), i))
    for i in by_remainder[: total - sum(out)]:
        out[i] += 1
    return out


@dataclass
class SplitPlan:
    names: list[str]
    weights: list[float]
    budget: int | None                      # tokens; None = until the first source runs dry
    quota: list[int] | None = None
    tokens: list[int] = field(default_factory=list)
    documents: list[int] = field(default_factory=list)
    dry: list[bool] = field(default_factory=list)

    def __post_init__(self):
        n = len(self.names)
        if self.quota is None and self.budget is not None:
            self.quota = allocate(self.budget, self.weights)
        self.tokens = self.tokens or [0] * n
        self.documents = self.documents or [0] * n
        self.dry = self.dry or [False] * n

    @property
    def written(self) -> int:
        return sum(self.tokens)

    @property
    def done(self) -> bool:
        if self.budget is None:
            return any(self.dry)
        return self.written >= self.budget or all(self.dry)

    def next_source(self) -> int | None:
        """Index of the source furthest below its share, None when the split is done."""
        if self.done:
            return None
        best, best_key = None, None
        for i in range(len(self.names)):
            if self.dry[i]:
                continue
            if self.quota is None:
                key = self.tokens[i] / self.weights[i]
            elif self.tokens[i] < self.quota[i]:
                key = self.tokens[i] / self.quota[i]
            else:
                continue
            if best_key is None or key < best_key:
                best, best_key = i, key
        return best

    def room(self, i: int) -> int | None:
        """Tokens source i may still add (None: no limit)."""
        return None if self.quota is None else self.quota[i] - self.tokens[i]

    def record(self, i: int, tokens: int) -> None:
        self.tokens[i] += tokens
        self.documents[i] += 1

    def mark_dry(self, i: int) -> None:
        """Source i has no more documents for this split: the others share what its quota had left."""
        if self.dry[i]:
            return
        self.dry[i] = True
        if self.quota is None:
            return
        left = self.quota[i] - self.tokens[i]
        self.quota[i] = self.tokens[i]
        others = [j for j in range(len(self.names)) if not self.dry[j]]
        for j, extra in zip(others, allocate(left, [self.weights[j] for j in others])):
            self.quota[j] += extra

    def shares(self) -> dict[str, dict]:
        """Per source: configured share, real share of the written tokens, and whether it ran dry."""
        total_w, written = sum(self.weights), self.written
        return {n: {"configured_share": round(w / total_w, 6),
                    "share": round(t / written, 6) if written else 0.0,
                    "ran_dry": d}
                for n, w, t, d in zip(self.names, self.weights, self.tokens, self.dry)}

    def state(self) -> dict:
        return asdict(self)
