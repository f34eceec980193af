"""Balanced weights: each latent channel's down row and up column have equal norms in every SVD branch; a
converted attention is balanced in all three of its rescalings (latent, value, key channels: mla/conversion/
balance.py) after conversion and after a layer fit; the function is the unbalanced one's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mla.conversion import balance, calibrate, lowrank
from mla.conversion.convert import convert_model
from mla.tiny_models import tiny_llama


def _weights(rows_k=12, rows_v=24, d=48, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows_k, d, generator=g) * 3, torch.randn(rows_v, d, generator=g) * 0.05


def _spread_covariance(d=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(d, d, generator=g) * torch.logspace(0, -2, d)
    x = torch.randn(4000, d, generator=g) @ mix.T
    return x.T @ x / x.shape[0]


def _pairs(f: lowrank.LowRankKV) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(up, down) of each factorisation inside f: one for joint/none, one per half for split."""
    if f.up_k.shape[1] == f.down.shape[0]:
        return [(torch.cat([f.up_k, f.up_v]), f.down)]
    half = f.up_k.shape[1]
    return [(f.up_k, f.down[:half]), (f.up_v, f.down[half:])]


@pytest.mark.parametrize("whitened", [False, True])
@pytest.mark.parametrize("method,rank", [("joint", 10), ("split", 10), ("none", 36)])
def test_every_branch_gives_balanced_factors_of_the_same_approximation(method, rank, whitened):
    w_k, w_v = _weights()
    cov = _spread_covariance() if whitened else None
    f = lowrank.factorize(w_k, w_v, rank, method, covariance=cov)
    for up, down in _pairs(f):
        torch.testing.assert_close(up.norm(dim=0), down.norm(dim=1), rtol=1e-4, atol=1e-7)
        assert lowrank.imbalance(up, down) == pytest.approx(1.0, abs=1e-4)
    # the product is the truncated SVD's (plain) or the whitened optimum's, whichever way Σ is split
    m = torch.cat([w_k, w_v])
    if not whitened and method != "split":
        u, s, vh = torch.linalg.svd(m, full_matrices=False)
        torch.testing.assert_close(f.approximation(), (u[:, :rank] * s[:rank]) @ vh[:rank], rtol=1e-4, atol=1e-5)
    if method == "none":
        torch.testing.assert_close(f.approximation(), m, rtol=1e-4, atol=1e-4)
    # plain SVD: Σ^½ on each side, so every down row's norm is the square root of its singular value
    if not whitened and method == "joint":
        s = torch.linalg.svdvals(m)[:rank]
        torch.testing.assert_close(f.down.norm(dim=1), s.sqrt(), rtol=1e-4, atol=1e-6)


def test_balance_factors_keeps_the_product_and_handles_a_zero_channel():
    g = torch.Generator().manual_seed(0)
    up, down = torch.randn(8, 4, generator=g) * torch.tensor([100.0, 1.0, 0.01, 1.0]), torch.randn(4, 6, generator=g)
    up[:, 3] = 0.0                                    # a channel nothing reads stays as it is
    assert lowrank.imbalance(up[:, :3], down[:3]) > 100
    b_up, b_down = lowrank.balance_factors(up, down)
    torch.testing.assert_close(b_up @ b_down, up @ down, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b_up[:, :3].norm(dim=0), b_down[:3].norm(dim=1), rtol=1e-5, atol=0)
    torch.testing.assert_close(b_down[3], down[3])


def _converted(svd="joint", strategy="high", latent="per_head", bias=False, num_kv_heads=2):
    model = tiny_llama(num_kv_heads=num_kv_heads, seed=3, attention_bias=bias).eval()
    if bias:
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                    getattr(layer.self_attn, proj).bias.normal_(0, 0.5)
    blocks = [torch.as_tensor(b) for b in np.random.default_rng(1).integers(1, 512, (8, 32))]
    cal = calibrate.calibration_pass(model, blocks, covariance=True, batch_size=4)
    covs = {"covariance": cal["covariance"]}
    mla, _ = convert_model(model, d_kv=4, r=2, strategy=strategy, svd=svd, covariances=covs, whiten=True,
                           scores=cal if strategy in ("rotated", "2-norm") else None, latent=latent)
    return model, mla.eval(), torch.stack(blocks[:2])


def _unbalance(attn, seed=0):
    """Rescale each of the three groups' channels by factors up to 100 either way, as Adam's steps drift them
    apart: the same function."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for norms, scale in balance.GROUPS.values():
            grow, _ = norms(attn)
            scale(attn, torch.exp(torch.empty(grow.shape[0], dtype=torch.float64).uniform_(-4.6, 4.6, generator=g)))


# (svd, strategy, latent, bias, num_kv_heads): the layouts both balancing tests run on
LAYOUTS = pytest.mark.parametrize("svd,strategy,latent,bias,num_kv_heads", [
    ("joint", "high", "per_head", False, 2),
    ("split", "high", "per_head", False, 2),
    ("split", "2-norm", "per_head", True, 2),
    ("joint", "high", "per_head", False, 4),
    ("joint", "high", "per_head", True, 4),
    ("joint", "rotated", "per_head", True, 2),
    ("joint", "rotated", "shared", False, 2),
], ids=["joint-GQA", "split-GQA", "split-2norm-biases", "MHA", "biases-MHA", "rotated-biases-GQA",
        "rotated-shared-latent"])


@LAYOUTS
def test_balance_attention_balances_every_group_and_keeps_the_logits(svd, strategy, latent, bias, num_kv_heads):
    source, mla, ids = _converted(svd, strategy, latent, bias, num_kv_heads)
    for layer in mla.model.layers:                     # the conversion hands over balanced weights
        assert balance.attention_imbalance(layer.self_attn) == pytest.approx(1.0, abs=1e-3)
    with torch.no_grad():
        reference = mla(ids).logits
        torch.testing.assert_close(reference, source(ids).logits, rtol=1, atol=10)   # sanity: a converted model
    attn = mla.model.layers[0].self_attn
    _unbalance(attn)
    with torch.no_grad():
        torch.testing.assert_close(mla(ids).logits, reference, rtol=1e-4, atol=1e-4)   # the same function ...
    before = balance.imbalances(attn)
    assert all(v > 10 for v in before.values()), before                             # ... every group far apart
    assert balance.balance_attention(attn) == pytest.approx(max(before.values()))   # returns what it removed
    after = balance.imbalances(attn)
    assert all(v == pytest.approx(1.0, abs=1e-3) for v in after.values()), after
    with torch.no_grad():
        torch.testing.assert_close(mla(ids).logits, reference, rtol=1e-4, atol=1e-4)


def test_balanced_means_equal_mean_squares_on_both_sides_of_each_channel():
    """The definition, computed from the weights themselves: per value channel of K/V head h, v_up's row
    against the o_proj columns of h's query heads; per key channel, k_up's row against the query's no-RoPE
    rows; per latent channel, kv_down's row against the up-projections' columns; each side's squared norm
    divided by its matrix's size."""
    _, mla, _ = _converted(num_kv_heads=2)
    attn = mla.model.layers[1].self_attn
    _unbalance(attn, seed=1)
    balance.balance_attention(attn)
    n_kv, groups, d_h = attn.num_kv_heads, attn.num_heads // attn.num_kv_heads, attn.head_dim
    v, o = attn.v_up.weight.detach().double(), attn.o_proj.weight.detach().double()
    k = attn.k_up.weight.detach().double()
    q = attn.q_proj.weight.detach().double().view(attn.num_heads, -1, o.shape[0])
    down = attn.kv_down.weight.detach().double()
    for h in range(n_kv):
        heads = range(h * groups, (h + 1) * groups)
        for i in range(d_h):
            columns = o[:, [j * d_h + i for j in heads]]
            assert v[h * d_h + i].pow(2).sum() / v.numel() == pytest.approx(columns.pow(2).sum() / o.numel(), rel=1e-3)
        for i in range(attn.nope_dim):
            rows = q[list(heads), attn.rope_dim + i]
            assert k[h * attn.nope_dim + i].pow(2).sum() / k.numel() == pytest.approx(
                rows.pow(2).sum() / q.numel(), rel=1e-3)
    up = k.pow(2).sum(0) / k.numel() + v.pow(2).sum(0) / v.numel()
    torch.testing.assert_close(down.pow(2).sum(1) / down.numel(), up, rtol=1e-3, atol=0)


def test_balance_leaves_the_source_model_alone():
    """The conversion reuses no source tensor that balancing scales (o_proj, v_proj's bias)."""
    model = tiny_llama(num_kv_heads=2, seed=3, attention_bias=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    convert_model(model, d_kv=4, r=2, strategy="high")
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


@LAYOUTS
def test_at_source_scale_gives_back_the_weights_the_svd_gave(monkeypatch, svd, strategy, latent, bias, num_kv_heads):
    """The layer fit's starting point: a balanced conversion rescaled to o_proj and the query as the source has
    them and the latent balanced by norms is exactly the conversion without `balance_attention`."""
    from mla.conversion import convert as convert_module

    source, balanced, ids = _converted(svd, strategy, latent, bias, num_kv_heads)
    monkeypatch.setattr(convert_module.balance, "balance_attention", lambda attn: 1.0)
    _, plain, _ = _converted(svd, strategy, latent, bias, num_kv_heads)
    for b_layer, p_layer, s_layer in zip(balanced.model.layers, plain.model.layers, source.model.layers):
        assert balance.attention_imbalance(p_layer.self_attn) > 1.5          # the SVD's weights are not balanced
        balance.at_source_scale(b_layer.self_attn, s_layer.self_attn)
        for name, p in p_layer.self_attn.state_dict().items():
            torch.testing.assert_close(b_layer.self_attn.state_dict()[name], p, rtol=1e-4, atol=1e-6, msg=name)
    torch.testing.assert_close(balanced.model.layers[0].self_attn.o_proj.weight, source.model.layers[0].self_attn.o_proj.weight)


def test_a_layer_fit_leaves_every_layer_balanced_and_reports_what_it_had():
    from mla.conversion import fit

    source = tiny_llama(num_kv_heads=2, num_hidden_layers=2)
    converted, _ = convert_model(source, d_kv=4, r=1, strategy="high")
    g = np.random.default_rng(1)
    report = fit.fit_model(source, converted, g.integers(1, 512, (16, 32)), g.integers(1, 512, (4, 32)),
                           fit.FitSettings(steps=20, lr=1e-2, batch=4), log=lambda *a: None)
    for entry, layer in zip(report["layers"], converted.model.layers):
        assert entry["factor_imbalance"] > 1.0                     # Adam's steps moved the weights apart
        assert balance.attention_imbalance(layer.self_attn) == pytest.approx(1.0, abs=1e-3)
