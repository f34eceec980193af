"""Balanced low-rank factors: each latent channel's down row and up column have equal norms, in every SVD
branch and after a layer fit, and the function the factors compute is the unbalanced one's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mla.conversion import calibrate, lowrank
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


@pytest.mark.parametrize("svd", ["joint", "split"])
def test_balance_attention_on_a_converted_model_keeps_its_logits(svd):
    model = tiny_llama(num_kv_heads=2, seed=3).eval()
    blocks = [torch.as_tensor(b) for b in np.random.default_rng(1).integers(1, 512, (8, 32))]
    covs = {"covariance": calibrate.calibration_pass(model, blocks, scores=False, covariance=True)["covariance"]}
    mla, _ = convert_model(model, d_kv=4, r=2, strategy="high", svd=svd, covariances=covs, whiten=True)
    mla.eval()
    ids = torch.stack(blocks[:2])
    for layer in mla.model.layers:                     # converted balanced
        assert lowrank.attention_imbalance(layer.self_attn) == pytest.approx(1.0, abs=1e-3)
    with torch.no_grad():
        reference = mla(ids).logits
        attn = mla.model.layers[0].self_attn            # unbalance one layer as Adam's steps would
        scale = torch.logspace(-2, 2, attn.kv_down.weight.shape[0])
        attn.kv_down.weight.mul_(scale[:, None])
        for linear, channels in lowrank._latent_readers(attn):
            linear.weight.div_(scale[channels])
    assert lowrank.attention_imbalance(attn) > 100
    assert lowrank.balance_attention(attn) > 100       # returns the imbalance it removed
    assert lowrank.attention_imbalance(attn) == pytest.approx(1.0, abs=1e-3)
    with torch.no_grad():
        torch.testing.assert_close(mla(ids).logits, reference, rtol=1e-4, atol=1e-4)


def test_a_layer_fit_leaves_every_layer_balanced_and_reports_what_it_had():
    from mla.conversion import fit

    source = tiny_llama(num_kv_heads=2, num_hidden_layers=2)
    converted, _ = convert_model(source, d_kv=4, r=1, strategy="high")
    g = np.random.default_rng(1)
    report = fit.fit_model(source, converted, g.integers(1, 512, (16, 32)), g.integers(1, 512, (4, 32)),
                           fit.FitSettings(steps=20, lr=1e-2, batch=4), log=lambda *a: None)
    for entry, layer in zip(report["layers"], converted.model.layers):
        assert entry["factor_imbalance"] > 1.0                     # Adam's steps moved the factors apart
        assert lowrank.attention_imbalance(layer.self_attn) == pytest.approx(1.0, abs=1e-3)
