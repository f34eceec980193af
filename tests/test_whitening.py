"""Activation-aware (whitened) SVD: the optimum of the output error, exact at full rank, from the files
`mla calibrate --covariance-out` writes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mla.cli import main
from mla.conversion import calibrate, lowrank
from mla.conversion.convert import convert_model
from mla.errors import UserError
from mla.tiny_models import tiny_llama


def correlated_inputs(d=48, n=4000, seed=0):
    """Inputs with a spread spectrum, as attention inputs have (a few directions dominate)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(d, d, generator=g) * torch.logspace(0, -2, d)
    return torch.randn(n, d, generator=g) @ mix.T


@pytest.mark.parametrize("method", ["joint", "split"])
def test_whitened_output_error_is_never_above_plain_and_zero_at_full_rank(method):
    g = torch.Generator().manual_seed(1)
    rows_v = 24 if method == "joint" else 12      # split is exact only when neither half is truncated
    w_k, w_v = torch.randn(12, 48, generator=g), torch.randn(rows_v, 48, generator=g)
    x = correlated_inputs()
    cov = x.T @ x / x.shape[0]
    m = torch.cat([w_k, w_v])
    full = lowrank.max_rank(method, 12, rows_v, 48)
    gains = []
    for rank in range(2, full + 1, 2):
        plain = lowrank.factorize(w_k, w_v, rank, method, covariance=None)
        white = lowrank.factorize(w_k, w_v, rank, method, covariance=cov, damp=1e-6)
        plain_out = lowrank.relative_output_error(m, plain.approximation(), cov)
        assert white.output_error <= plain_out + 1e-6, rank
        # the reported error is the error of what the factors compute, measured on the inputs themselves
        direct = ((x @ (m - white.approximation()).T).norm() / (x @ m.T).norm()).item()
        assert white.output_error == pytest.approx(direct, rel=1e-3)
        gains.append(plain_out - white.output_error)
        assert plain.relative_error <= white.relative_error + 1e-6   # plain SVD is the optimum of the weights
    assert max(gains) > 0.05                                           # and the objectives really differ
    top = lowrank.factorize(w_k, w_v, full, method, covariance=cov)
    assert top.output_error < 1e-4 and top.relative_error < 1e-4


def test_calibration_pass_covariance_is_the_second_moment_of_the_attention_inputs():
    model = tiny_llama(num_kv_heads=2, seed=2)
    blocks = [torch.as_tensor(b) for b in np.random.default_rng(0).integers(1, 512, (5, 24))]
    got = calibrate.calibration_pass(model, blocks, batch_size=2, covariance=True)
    seen = []
    handle = model.model.layers[1].self_attn.register_forward_pre_hook(
        lambda _m, args, kwargs: seen.append(kwargs["hidden_states"].reshape(-1, 64)), with_kwargs=True)
    with torch.no_grad():
        model.model(input_ids=torch.stack(blocks), use_cache=False)
    handle.remove()
    x = seen[0].double()
    torch.testing.assert_close(got["covariance"][1], (x.T @ x / x.shape[0]).float(), rtol=1e-5, atol=1e-6)
    assert got["tokens"] == 5 * 24
    # the same pass still gives the 2-norm scores
    torch.testing.assert_close(got["scores"], calibrate.two_norm_scores(model, blocks, batch_size=5))


def test_whitened_conversion_lowers_the_output_error_of_every_layer():
    model = tiny_llama(num_kv_heads=2, seed=3)
    blocks = [torch.as_tensor(b) for b in np.random.default_rng(1).integers(1, 512, (40, 64))]
    fit = calibrate.calibration_pass(model, blocks[:32], scores=False, covariance=True)["covariance"]
    heldout = calibrate.calibration_pass(model, blocks[32:], scores=False, covariance=True)["covariance"]
    for covs, where in (({"covariance": fit}, "calibration"), ({"covariance": fit, "heldout": heldout}, "heldout")):
        _, plain = convert_model(model, d_kv=4, r=2, strategy="high", covariances=covs)
        _, white = convert_model(model, d_kv=4, r=2, strategy="high", covariances=covs, whiten=True)
        assert plain["output_error_on"] == white["output_error_on"] == where
        assert white["whitened"] and not plain["whitened"]
        for p, w in zip(plain["output_error_per_layer"], white["output_error_per_layer"]):
            assert w < p, where   # on the fitted inputs by construction; held out with 2,048 tokens for 64 dims
    with pytest.raises(UserError, match="covariance"):
        convert_model(model, d_kv=4, r=2, strategy="high", whiten=True)


def test_cli_writes_covariances_and_convert_uses_them(tiny_checkpoint, tmp_path, capsys):
    data = tmp_path / "data"
    assert main(["data", "--tokenizer", str(tiny_checkpoint), "--out", str(data), "--block-length", "32",
                 "--train-tokens", "4096", "--validation-tokens", "1024", "--workers", "1"]) == 0
    scores, cov = tmp_path / "scores.pt", tmp_path / "cov.pt"
    assert main(["calibrate", "--model", str(tiny_checkpoint), "--data", str(data), "--samples", "16",
                 "--device", "cpu", "--out", str(scores), "--covariance-out", str(cov)]) == 0
    saved = torch.load(cov, weights_only=True)
    assert saved["covariance"].shape == (2, 64, 64) and saved["heldout"].shape == (2, 64, 64)
    assert saved["tokens"] == 16 * 32 and saved["heldout_tokens"] == 32 * 32
    reports = {}
    for flag in ("--whiten", "--covariance"):
        out = tmp_path / flag.strip("-")
        assert main(["convert", "--model", str(tiny_checkpoint), "--out", str(out), "--d-kv", "4", "--r", "2",
                     "--scores", str(scores), flag, str(cov)]) == 0
        reports[flag] = json.loads((out / "conversion.json").read_text())
    assert reports["--whiten"]["output_error_mean"] < reports["--covariance"]["output_error_mean"]
    assert "activation-aware" in capsys.readouterr().out


def test_a_covariance_file_of_another_shape_is_refused(tiny_checkpoint, tmp_path, capsys):
    bad = tmp_path / "cov.pt"
    torch.save({"covariance": torch.eye(32).expand(3, 32, 32).clone()}, bad)
    assert main(["convert", "--model", str(tiny_checkpoint), "--out", str(tmp_path / "o"), "--d-kv", "4",
                 "--rope-strategy", "high", "--whiten", str(bad)]) != 0
    err = capsys.readouterr().err
    assert "another model shape" in err and "3 layers of 32 inputs" in err
    assert main(["convert", "--model", str(tiny_checkpoint), "--out", str(tmp_path / "o"), "--d-kv", "4",
                 "--rope-strategy", "high", "--whiten", str(tmp_path / "missing.pt")]) != 0
    assert "does not exist" in capsys.readouterr().err
