"""Balanced weights of a converted attention: every product of two trained factors with equal norms on each side.

An MLA attention computes the same function under three rescalings, one per channel of what passes between
two of its weights:

- latent channel ℓ: kv_down row ℓ × s, the k_up / v_up columns that read ℓ ÷ s;
- value channel (h, i): v_up row (h, i) (and its bias) × s, o_proj's input column i of every query head
  that reads K/V head h ÷ s (the attention only mixes tokens, so the channel passes through it);
- key channel (h, i): k_up row (h, i) (and its bias) × s, q_proj's no-RoPE row i of every query head that
  reads K/V head h ÷ s (the score q·k is unchanged).

Adam's step has about the same size for every weight whatever its scale, so where one side of such a
product is much smaller than the other, fine-tuning moves it by a large fraction of itself. The SVD balances
the latent (mla/conversion/lowrank.py), but nothing balanced the other two: SmolLM2's layer 0 at GQA d_kv 8
came out of the fit with v_up 15× smaller than k_up and 3× smaller than o_proj (mean |w|), and in the
default's fine-tuning its gradient norm went from 5.5 to 110 in one step, v_up's gradient the largest;
balanced in all three, the same steps gave 9.1 there and 47 at most (docs/conversion.md).

`balance_attention` brings all three to balance: the scales that minimise the sum of the five weights' mean
squares (kv_down, k_up, v_up, o_proj, q_proj) over the three groups of rescalings, found by balancing each
group in turn. That minimum is unique (a convex function of the log-scales) and is where each channel's two
sides have equal mean squares: each side's squared norm divided by its matrix's size. Mean squares, not norms,
because Adam moves every element by about the learning rate: at a fixed product, the two factors change least
relative to themselves when their elements are of one size (by norms, o_proj's 1,728-element columns would
end 7× smaller per element than before). The RoPE rows are left as they are.
"""

from __future__ import annotations

import torch

from mla.conversion import partial_rope

ROUNDS = 1000           # passes over the three groups (on per-channel sums: microseconds each)
TOLERANCE = 1e-4        # stop when every channel's two sides differ by at most this ratio minus 1


def _ratio(grow: torch.Tensor, shrink: torch.Tensor) -> torch.Tensor:
    """Per channel, the scale s that balances the two sides' weighted squared norms: grow·s² = shrink/s²
    (1 where either side is zero)."""
    ok = (grow > 0) & (shrink > 0)
    return torch.where(ok, (shrink / torch.where(ok, grow, 1.0)) ** 0.25, 1.0)


def _largest(s: torch.Tensor) -> float:
    """The largest ratio of the two sides' RMS (either way round) that scales s would remove."""
    s2 = s ** 2
    return float(torch.maximum(s2, 1 / s2).max()) if s.numel() else 1.0


# ---------------------------------------------------------------- the three groups: (grow side, shrink side)
def _latent_readers(attn) -> list[tuple[torch.nn.Linear, slice]]:
    """The up-projections and the latent channels each reads (SVD split: halves of c_kv)."""
    rank = attn.kv_down.weight.shape[0]
    k_width = attn.k_up.weight.shape[1]
    if k_width == rank:
        return [(attn.k_up, slice(0, rank)), (attn.v_up, slice(0, rank))]
    return [(attn.k_up, slice(0, k_width)), (attn.v_up, slice(k_width, rank))]


def _size(weight: torch.Tensor) -> int:
    return weight.numel()


def _mean_square(linear: torch.nn.Linear, dim) -> torch.Tensor:
    """Per channel, the squared norm of a weight's slice, divided by the weight's size (see the objective)."""
    w = linear.weight.detach().double()
    return w.pow(2).sum(dim=dim) / _size(w)


def _latent_norms(attn) -> tuple[torch.Tensor, torch.Tensor]:
    down = _mean_square(attn.kv_down, 1)
    up = torch.zeros_like(down)
    for linear, channels in _latent_readers(attn):
        up[channels] += _mean_square(linear, 0)
    return down, up


def _scale_latent(attn, s: torch.Tensor) -> None:
    _scale_rows(attn.kv_down, s)
    for linear, channels in _latent_readers(attn):
        linear.weight.copy_((linear.weight.double() / s[channels]).to(linear.weight.dtype))


def _query_heads(attn) -> tuple[int, int]:
    """(K/V heads of k_up / v_up, query heads per K/V head)."""
    return attn.num_kv_heads, attn.num_heads // attn.num_kv_heads


def _value_channel_squares(attn, o_proj_weight: torch.Tensor) -> torch.Tensor:
    """Per value channel (K/V head h, dim i), the squared norm of o_proj's input column i of h's query heads."""
    n_kv, groups = _query_heads(attn)
    o = o_proj_weight.detach().double().view(o_proj_weight.shape[0], n_kv, groups, attn.head_dim)
    return o.pow(2).sum(dim=(0, 2)).reshape(-1)


def _value_norms(attn) -> tuple[torch.Tensor, torch.Tensor]:
    o = attn.o_proj.weight
    return _mean_square(attn.v_up, 1), _value_channel_squares(attn, o) / _size(o)


def _scale_values(attn, s: torch.Tensor) -> None:
    n_kv, groups = _query_heads(attn)
    _scale_rows(attn.v_up, s)
    o = attn.o_proj.weight
    per_column = (1 / s).view(n_kv, 1, attn.head_dim).expand(n_kv, groups, attn.head_dim).reshape(-1)
    o.copy_((o.double() * per_column).to(o.dtype))


def _query_nope(attn) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q_proj's weight [n_kv, groups, nope, d] and bias [n_kv, groups, nope] viewed at the no-RoPE rows."""
    n_kv, groups = _query_heads(attn)
    width = attn.rope_dim + attn.nope_dim
    w = attn.q_proj.weight.view(n_kv, groups, width, -1)[:, :, attn.rope_dim:]
    b = attn.q_proj.bias
    return w, None if b is None else b.view(n_kv, groups, width)[:, :, attn.rope_dim:]


def _key_norms(attn) -> tuple[torch.Tensor, torch.Tensor]:
    q, _ = _query_nope(attn)
    q_sq = q.detach().double().pow(2).sum(dim=(1, 3)) / _size(attn.q_proj.weight)
    return _mean_square(attn.k_up, 1), q_sq.reshape(-1)


def _scale_keys(attn, s: torch.Tensor) -> None:
    n_kv, _ = _query_heads(attn)
    _scale_rows(attn.k_up, s)
    w, b = _query_nope(attn)
    per_row = (1 / s).view(n_kv, 1, attn.nope_dim)
    w.copy_((w.double() * per_row[..., None]).to(w.dtype))
    if b is not None:
        b.copy_((b.double() * per_row).to(b.dtype))


def _scale_rows(linear: torch.nn.Linear, s: torch.Tensor) -> None:
    linear.weight.copy_((linear.weight.double() * s[:, None]).to(linear.weight.dtype))
    if linear.bias is not None:
        linear.bias.copy_((linear.bias.double() * s).to(linear.bias.dtype))


GROUPS = {"latent": (_latent_norms, _scale_latent),
          "value": (_value_norms, _scale_values),
          "key": (_key_norms, _scale_keys)}


# ---------------------------------------------------------------- public
def imbalances(attn) -> dict[str, float]:
    """Per group, the largest per-channel ratio of the two sides' norms (either way round): 1 when balanced."""
    return {name: _largest(_ratio(*norms(attn))) for name, (norms, _) in GROUPS.items()}


def attention_imbalance(attn) -> float:
    """The largest of `imbalances`."""
    return max(imbalances(attn).values())


def _balancing_scales(attn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The latent, value and key scales of the balanced point, found on the weights' squared entries (the
    up-projections, small) and per-channel sums (the rest), so that a round costs the same for any model size."""
    rank = attn.kv_down.weight.shape[0]
    (k_up, k_cols), (v_up, v_cols) = _latent_readers(attn)
    k2 = k_up.weight.detach().double().pow(2) / _size(k_up.weight)          # [key channels, latent read]
    v2 = v_up.weight.detach().double().pow(2) / _size(v_up.weight)          # [value channels, latent read]
    down2 = _mean_square(attn.kv_down, 1)
    _, o2 = _value_norms(attn)
    _, q2 = _key_norms(attn)
    a = torch.ones(rank, dtype=torch.float64, device=k2.device)
    b = torch.ones(v2.shape[0], dtype=torch.float64, device=k2.device)
    c = torch.ones(k2.shape[0], dtype=torch.float64, device=k2.device)

    def up_side(a):          # each latent channel's up-projection columns, after the value and key scales
        up = torch.zeros(rank, dtype=torch.float64, device=k2.device)
        up[k_cols] += (c[:, None] ** 2 * k2).sum(0)
        up[v_cols] += (b[:, None] ** 2 * v2).sum(0)
        return up / a ** 2

    for _ in range(ROUNDS):
        a = _ratio(down2, up_side(torch.ones_like(a)))
        b = _ratio((v2 / a[v_cols] ** 2).sum(1), o2)
        c = _ratio((k2 / a[k_cols] ** 2).sum(1), q2)
        latent = _ratio(down2 * a ** 2, up_side(a))        # what a latent pass would still change
        if _largest(latent) <= 1 + TOLERANCE:
            break
    return a, b, c


@torch.no_grad()
def balance_attention(attn) -> float:
    """Rescale a converted attention module's weights in place to the balanced point (module docstring): the
    same function. Returns the imbalance it had (`attention_imbalance` before)."""
    before = attention_imbalance(attn)
    a, b, c = _balancing_scales(attn)
    _scale_latent(attn, a)
    _scale_values(attn, b)
    _scale_keys(attn, c)
    return before


# ---------------------------------------------------------------- the layer fit's starting scale
def _source_query_nope_rows(attn, source_attn) -> torch.Tensor:
    """[n_h, nope]: the source q_proj row behind each no-RoPE row of the converted query."""
    d_h, n_h = attn.head_dim, attn.num_heads
    heads = torch.arange(n_h)[:, None] * d_h
    if attn.config.rope_layout == "shared":           # the whole source head, in order
        return heads + torch.arange(attn.nope_dim)
    source_kv = source_attn.k_proj.weight.shape[0] // d_h
    pairs = torch.as_tensor(attn.config.rope_pairs[attn.layer_idx])               # [source K/V heads, r]
    return heads + partial_rope.nope_dims(pairs, d_h).repeat_interleave(n_h // source_kv, dim=0)


def _quotient(current: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """current / target per channel (1 where either is zero): the scale that takes one side to its target."""
    ok = (current > 0) & (target > 0)
    return torch.where(ok, current / torch.where(ok, target, 1.0), 1.0)


@torch.no_grad()
def at_source_scale(attn, source_attn) -> None:
    """Rescale a converted attention (the same function) to the scale the conversion's SVD gives it: o_proj and
    the query's no-RoPE rows as the source has them (per value / key channel, their norms), each latent
    channel's down row and up columns of equal norm. The layer fit starts here: its learning rate was chosen
    at this scale, and fitting from the balanced point fitted worse (docs/conversion.md)."""
    n_kv, groups = _query_heads(attn)
    src_o = _value_channel_squares(attn, source_attn.o_proj.weight).sqrt()
    _scale_values(attn, _quotient(_value_channel_squares(attn, attn.o_proj.weight).sqrt(), src_o))
    rows = _source_query_nope_rows(attn, source_attn).to(source_attn.q_proj.weight.device)
    src_q = source_attn.q_proj.weight.detach().double()[rows.reshape(-1)]
    src_q = src_q.view(n_kv, groups, attn.nope_dim, src_q.shape[-1]).pow(2).sum(dim=(1, 3)).sqrt().reshape(-1)
    src_q = src_q * float((getattr(attn.config, "mha2mla", None) or {}).get("nope_query_scale", 1.0))
    q, _ = _query_nope(attn)
    _scale_keys(attn, _quotient(q.detach().double().pow(2).sum(dim=(1, 3)).sqrt().reshape(-1), src_q))
    down = attn.kv_down.weight.detach().double().pow(2).sum(dim=1)
    up = torch.zeros_like(down)
    for linear, channels in _latent_readers(attn):
        up[channels] += linear.weight.detach().double().pow(2).sum(dim=0)
    if attn.config.latent_layout == "shared":     # the SVD balanced the up rows once per K/V head, not per copy
        up = up / (attn.num_heads // (source_attn.k_proj.weight.shape[0] // attn.head_dim))
    _scale_latent(attn, _ratio(down, up))        # norms (not mean squares) equal, as the SVD leaves them
