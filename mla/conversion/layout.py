"""What one converted layer caches and how its heads read it, resolved once from the conversion options and
the model's shape (pure arithmetic, torch-free: the workflow's config check runs it before any job).

Per token and layer the converted model caches the latent c_kv (kv_lora_rank channels) and RoPE'd keys:

- RoPE layout `per_head` (strategies high, low, uniform, 2-norm; paper §3.1): r frequency pairs per KV head,
  a RoPE key of n_kv heads x 2r dims, each read by the query heads of its GQA group.
- RoPE layout `shared` (strategy `rotated`, mla/conversion/rotation.py): m rotated components, ONE RoPE key
  of 2m dims read by every query head (DeepSeek's k_pe). `r` keeps its meaning of cached width: m = n_kv·r
  caches the same 2·n_kv·r dims as the per-head layout. Strategy `ladder` keeps at most one component per
  frequency, on DeepSeek's ladder (mla/conversion/ladder.py), so m is at most the pairs the ladder holds.

The latent layout: `per_head` (the paper's) rebuilds one key and one value per KV head from c_kv, shared by
the query heads of a group; `shared` (DeepSeek's MLA) rebuilds a key and a value for every query head, from
the same c_kv (the up-projections start as each KV head's rows repeated for its query heads, so the function
at conversion is the same; training can then separate the heads). The joint SVD is over all heads' rows in
both (paper Fig. 4), so the latent's width need not be a multiple of n_kv. For an MHA source (n_h = n_kv)
both latent layouts are the same model.

Budget by width: `kv_width` W (elements per token and layer) and `rope_share` S (the fraction of W given to
RoPE dims) instead of d_kv and r. RoPE dims = S·W, which must be a whole number: 2·n_kv·r with a whole r
(per_head) or 2m (shared); the latent takes the rest, kv_lora_rank = W − S·W, any positive width (d_kv =
kv_lora_rank / n_kv is then reported, whole or not). S may be written as a fraction ("1/3").
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from mla import shapes
from mla.conversion.ladder import ladder_for
from mla.errors import UserError
from mla.options import (
    DEFAULT_LATENT,
    LADDER_ROPE_STRATEGY,
    LATENT_LAYOUTS,
    ROPE_STRATEGIES,
    SHARED_ROPE_STRATEGIES,
    SVD_METHODS,
)


class LayoutError(UserError):
    """A conversion option the model's shape cannot hold; `option` is its name (d_kv, r, kv_width, ...)."""

    def __init__(self, option: str, message: str):
        super().__init__(message)
        self.option = option


@dataclass(frozen=True)
class Layout:
    """The cache and head layout of one conversion (the same for every layer)."""

    rope_layout: str          # per_head | shared
    latent: str               # per_head | shared
    rope_components: int      # 2-D RoPE components cached per layer: n_kv·r (per_head) or m (shared)
    kv_lora_rank: int         # latent channels per layer
    svd: str
    heads: int
    kv_heads: int
    head_dim: int
    hidden_cap: int           # the hidden size: the latent's input, a bound on its rank
    budget: str = "d_kv"      # how it was given: d_kv (d_kv and r) or kv_width (kv_width and rope_share)
    ladder: bool = False      # shared layout on DeepSeek's frequency ladder: one component per frequency at most

    @property
    def shared_rope(self) -> bool:
        return self.rope_layout == "shared"

    @property
    def r(self) -> int | None:
        """Pairs per KV head of the per-head layout; for the shared one the equivalent n_kv·r = m when whole."""
        return self.rope_components // self.kv_heads if self.rope_components % self.kv_heads == 0 else None

    @property
    def d_kv(self) -> int | float:
        """The paper's latent size per KV head: kv_lora_rank / n_kv (a float when not whole)."""
        q, rem = divmod(self.kv_lora_rank, self.kv_heads)
        return q if rem == 0 else self.kv_lora_rank / self.kv_heads

    @property
    def rope_heads(self) -> int:
        return 1 if self.shared_rope else self.kv_heads

    @property
    def rope_head_dim(self) -> int:
        """RoPE dims per head of the query and of the cached key: 2m (shared) or 2r (per head)."""
        return 2 * self.rope_components // self.rope_heads

    @property
    def nope_head_dim(self) -> int:
        """No-RoPE dims per head: the full head (shared: the dropped components live in every dim) or d_h − 2r."""
        return self.head_dim if self.shared_rope else self.head_dim - self.rope_head_dim

    @property
    def up_heads(self) -> int:
        """Keys and values rebuilt from the latent: one per query head (shared latent) or per KV head."""
        return self.heads if self.latent == "shared" else self.kv_heads

    @property
    def rope_dims(self) -> int:
        """RoPE'd key channels cached per token and layer."""
        return 2 * self.rope_components

    @property
    def kv_width(self) -> int:
        """Cached elements per token and layer."""
        return self.kv_lora_rank + self.rope_dims

    @property
    def nope_key_rows(self) -> int:
        """Rows of W_k,nope that go into the SVD (before any repetition for a shared latent)."""
        return self.kv_heads * self.nope_head_dim

    @property
    def nope_key_rank(self) -> int:
        """The most rank W_k,nope can have: n_kv·d_h less the 2 dims of each kept component."""
        return self.kv_heads * self.head_dim - self.rope_dims

    def full_rank(self) -> int:
        """The largest useful kv_lora_rank for this SVD: the rank [W_k,nope; W_v] can have."""
        rows_v = self.kv_heads * self.head_dim
        if self.svd == "split":
            return 2 * min(self.nope_key_rank, rows_v, self.hidden_cap)
        return min(self.nope_key_rank + rows_v, self.hidden_cap)

    def describe(self) -> dict:
        """The layout as conversion.json and `mla plan` give it."""
        described = {"rope_layout": self.rope_layout, "latent": self.latent, "rope_components": self.rope_components,
                     "rope_dims_per_layer": self.rope_dims, "latent_per_layer": self.kv_lora_rank,
                     "kv_elements_per_token_layer": self.kv_width, "budget": self.budget}
        if self.ladder:
            described["rope_ladder"] = True
        return described


def parse_share(value) -> Fraction:
    """A RoPE share as an exact fraction: a number (0.5) or a fraction string ("1/3")."""
    try:
        share = Fraction(str(value).strip())
    except (ValueError, ZeroDivisionError):
        raise LayoutError("rope_share", f"rope_share={value!r} is not a number or a fraction like 1/3") from None
    if not 0 <= share < 1:
        raise LayoutError("rope_share", f"rope_share={value} must be at least 0 and below 1 (the latent needs "
                                        "part of the width)")
    return share


def rope_dims_of(kv_width: int, rope_share) -> int:
    """The RoPE dims S·W of a width budget; refuses a share that does not give a whole number of dims."""
    if not isinstance(kv_width, int) or kv_width <= 0:
        raise LayoutError("kv_width", f"kv_width={kv_width!r} must be a positive integer (elements per token "
                                      "and layer)")
    dims = parse_share(rope_share) * kv_width
    if dims.denominator != 1:
        raise LayoutError("rope_share", f"rope_share={rope_share} of kv_width={kv_width} gives {float(dims):g} "
                                        "RoPE dims, not a whole number (write it as a fraction, e.g. 1/3)")
    return int(dims)


def conflicting_budget(d_kv, r, kv_width, rope_share) -> LayoutError | None:
    """The shape-free rule of the two ways of giving a budget: kv_width with rope_share, or d_kv with r."""
    if kv_width is not None:
        for name, value in (("d_kv", d_kv), ("r", r)):
            if value is not None:
                return LayoutError("kv_width", f"kv_width={kv_width} gives the cache width; leave out {name}={value} "
                                               "(the width and rope_share decide it)")
        if rope_share is None:
            return LayoutError("kv_width", f"kv_width={kv_width} needs rope_share (the fraction of the width "
                                           "given to RoPE dims)")
    elif rope_share is not None:
        return LayoutError("rope_share", f"rope_share={rope_share} needs kv_width (the width it shares)")
    return None


def _check_ladder(layout: Layout, rope_share) -> None:
    """The ladder strategy keeps one component per frequency, on the pairs DeepSeek's RoPE key holds."""
    most = len(ladder_for(layout.head_dim).pairs)
    if layout.rope_components > most:
        if rope_share is not None:
            raise LayoutError("rope_share", f"rope_share={rope_share} asks for {layout.rope_components} RoPE "
                                            f"components, but rope_strategy ladder keeps at most {most} (one per "
                                            f"frequency on DeepSeek's ladder, d_h = {layout.head_dim})")
        raise LayoutError("r", f"r={layout.rope_components // layout.kv_heads} asks for {layout.rope_components} "
                               f"RoPE components (n_kv·r), but rope_strategy ladder keeps at most {most} (one per "
                               f"frequency on DeepSeek's ladder, d_h = {layout.head_dim}); the largest r is "
                               f"{most // layout.kv_heads}")


def resolve(config: dict, *, strategy: str, svd: str, d_kv: int | None = None, r: int | None = None,
            kv_width: int | None = None, rope_share=None, latent: str = DEFAULT_LATENT) -> Layout:
    """Check the options against the model `config` (a config.json dict) and give the layout they mean."""
    shapes.check_family(config)
    s = shapes.shape_of(config)
    if strategy not in ROPE_STRATEGIES:
        raise LayoutError("rope_strategy", f"unknown rope_strategy {strategy!r}; choose one of "
                                           f"{', '.join(ROPE_STRATEGIES)}")
    if svd not in SVD_METHODS:
        raise LayoutError("svd", f"unknown svd {svd!r}; choose one of {', '.join(SVD_METHODS)}")
    if latent not in LATENT_LAYOUTS:
        raise LayoutError("latent", f"unknown latent {latent!r}; choose one of {', '.join(LATENT_LAYOUTS)}")
    conflict = conflicting_budget(d_kv, r, kv_width, rope_share)
    if conflict is not None:
        raise conflict
    shared = strategy in SHARED_ROPE_STRATEGIES
    half = s.head_dim // 2
    ladder = strategy == LADDER_ROPE_STRATEGY
    common = dict(rope_layout="shared" if shared else "per_head", latent=latent, svd=svd, heads=s.heads,
                  kv_heads=s.kv_heads, head_dim=s.head_dim, hidden_cap=s.hidden, ladder=ladder)
    if kv_width is not None:
        if svd == "none":
            raise LayoutError("kv_width", f"kv_width={kv_width} sets the latent's width, but svd none keeps K/V at "
                                          "full rank; give r (and no kv_width) with svd none")
        dims = rope_dims_of(kv_width, rope_share)
        if shared and dims % 2:
            raise LayoutError("rope_share", f"rope_share={rope_share} of kv_width={kv_width} gives {dims} RoPE "
                                            "dims: an odd number, but each rotated component takes 2")
        if not shared and dims % (2 * s.kv_heads):
            raise LayoutError("rope_share", f"rope_share={rope_share} of kv_width={kv_width} gives {dims} RoPE "
                                            f"dims, which is not 2·n_kv·r for a whole r (n_kv = {s.kv_heads}); "
                                            f"use a multiple of {2 * s.kv_heads}")
        components = dims // 2
        if components > s.kv_heads * half:
            what = "rotated components" if shared else "frequency pairs per head"
            have = s.kv_heads * half if shared else half
            want = components if shared else components // s.kv_heads
            raise LayoutError("rope_share", f"rope_share={rope_share} of kv_width={kv_width} asks for {want} "
                                            f"{what}, but the model has {have}")
        rank = kv_width - dims         # >= 1: parse_share keeps the share below 1
        layout = Layout(rope_components=components, kv_lora_rank=rank, budget="kv_width", **common)
        if ladder:
            _check_ladder(layout, rope_share)
    else:
        r = shapes.default_r(s.head_dim) if r is None else r
        if not 0 <= r <= half:
            raise LayoutError("r", f"r={r} is out of range: it counts kept frequency pairs per head and must be "
                                   f"between 0 and d_h/2 = {half}")
        layout = Layout(rope_components=s.kv_heads * r, kv_lora_rank=1, **common)
        if ladder:
            _check_ladder(layout, None)
        if svd == "none":
            full = layout.full_rank()
            if not shared and full % s.kv_heads:
                raise LayoutError("svd", f"--svd none: the full rank {full} of [W_k,nope; W_v] is not a multiple "
                                         f"of the {s.kv_heads} KV heads; give --svd joint with --d-kv "
                                         f"{full // s.kv_heads}")
            if d_kv is not None and d_kv * s.kv_heads != full:
                shown = full // s.kv_heads if full % s.kv_heads == 0 else f"{full}/{s.kv_heads}"
                raise LayoutError("d_kv", f"--svd none keeps K/V at full rank, d_kv {shown} here; leave out "
                                          f"--d-kv {d_kv}")
            return Layout(rope_components=s.kv_heads * r, kv_lora_rank=full, **common)
        if d_kv is None:
            raise LayoutError("d_kv", f"--svd {svd} needs --d-kv (the latent size per KV head)")
        if d_kv <= 0:
            raise LayoutError("d_kv", f"d_kv must be a positive integer, got {d_kv}")
        layout = Layout(rope_components=s.kv_heads * r, kv_lora_rank=s.kv_heads * d_kv, **common)
    full = layout.full_rank()
    if layout.kv_lora_rank > full:
        if layout.budget == "d_kv":
            raise LayoutError("d_kv", f"d_kv={d_kv} is larger than full rank: n_kv·d_kv = {layout.kv_lora_rank} but "
                                      f"[W_k,nope; W_v] has rank at most {full} here (n_kv={s.kv_heads}, "
                                      f"d_h={s.head_dim}, r={r}, hidden={s.hidden}, svd={svd}); the largest d_kv "
                                      f"is {full // s.kv_heads}")
        raise LayoutError("kv_width", f"kv_width={kv_width} gives a latent of {layout.kv_lora_rank} channels, but "
                                      f"[W_k,nope; W_v] has rank at most {full} here (svd={svd}); the largest "
                                      f"kv_width at rope_share={rope_share} is {full + layout.rope_dims}")
    if svd == "split" and layout.kv_lora_rank % 2:
        key = "kv_width" if layout.budget == "kv_width" else "d_kv"
        raise LayoutError(key, f"--svd split needs an even n_kv·d_kv, got {layout.kv_lora_rank}")
    return layout
