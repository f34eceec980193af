"""Activation-aware (whitened) SVD: the optimum of the output error, exact at full rank, from the files
`mla calibrate --covariance-out` writes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mla.cli import main
from mla.conversion import calibrate, lowrank, readers
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


# ---------------------------------------------------------------- attention-aware SVD (mla/conversion/readers.py)
def random_gram(n, seed):
    a = torch.randn(n, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return a @ a.T / n + 0.1 * torch.eye(n, dtype=torch.float64)


def read_error(m, approx, cov, weight):
    """E‖Lᵣᵀ (M − A) x‖² / E‖Lᵣᵀ M x‖² with Lᵣ Lᵣᵀ = R + λI, the objective the attention-aware SVD minimises."""
    left = readers.left_factor(weight)
    e, m = left.T @ (m - approx).double(), left.T @ m.double()
    return float(torch.trace(e @ cov.double() @ e.T) / torch.trace(m @ cov.double() @ m.T))


@pytest.mark.parametrize("method", ["joint", "split"])
def test_attention_aware_svd_is_the_optimum_of_the_read_error_and_exact_at_full_rank(method):
    """Each SVD wins on its own objective: the attention-aware one on the error weighted by the readers, the
    activation-aware one on the plain output error; both objectives differ, and full rank is exact."""
    g = torch.Generator().manual_seed(4)
    rows_v = 24 if method == "joint" else 12
    w_k, w_v = torch.randn(12, 48, generator=g), torch.randn(rows_v, 48, generator=g)
    x = correlated_inputs()
    cov = x.T @ x / x.shape[0]
    weight = torch.block_diag(random_gram(12, 1), random_gram(rows_v, 2) * 30)
    m = torch.cat([w_k, w_v])
    full = lowrank.max_rank(method, 12, rows_v, 48)
    gains = []
    for rank in range(2, full, 2):
        white = lowrank.factorize(w_k, w_v, rank, method, covariance=cov, damp=1e-6)
        aware = lowrank.factorize(w_k, w_v, rank, method, covariance=cov, damp=1e-6, row_weight=weight)
        white_read, aware_read = (read_error(m, f.approximation(), cov, weight) for f in (white, aware))
        assert aware_read <= white_read + 1e-6, rank
        assert white.output_error <= aware.output_error + 1e-6, rank
        gains.append(white_read - aware_read)
    assert max(gains) > 0.01
    top = lowrank.factorize(w_k, w_v, full, method, covariance=cov, row_weight=weight)
    assert top.output_error < 1e-4


def test_readers_weigh_keys_by_their_queries_and_values_by_o_proj_with_equal_energies():
    """Q_g is the second moment of the queries of K/V head g's query heads, O_g the Gram of their o_proj
    columns, and κ makes the weighted error energies of the keys and the values of M x itself equal."""
    g = torch.Generator().manual_seed(5)
    heads, kv_heads, width, d = 4, 2, 6, 16
    x = correlated_inputs(d=d, n=3000, seed=6).double()
    cov = x.T @ x / x.shape[0]
    query = torch.randn(heads, width, d, generator=g, dtype=torch.float64)
    o_proj = torch.randn(d, heads * width, generator=g, dtype=torch.float64)
    k_nope = torch.randn(kv_heads * width, d, generator=g, dtype=torch.float64)
    w_v = torch.randn(kv_heads * width, d, generator=g, dtype=torch.float64)
    keys = readers.key_grams(query, cov, kv_heads)
    q = torch.einsum("hwd,nd->hnw", query, x)                                  # every query head's queries
    torch.testing.assert_close(keys[1], (q[2].T @ q[2] + q[3].T @ q[3]) / x.shape[0])   # heads 2, 3 read head 1
    values = readers.value_grams(o_proj, heads, kv_heads)
    cols = o_proj.reshape(d, heads, width)
    torch.testing.assert_close(values[0], cols[:, 0].T @ cols[:, 0] + cols[:, 1].T @ cols[:, 1])
    weight = readers.row_weight(query, o_proj, k_nope, w_v, cov)
    rows = kv_heads * width
    key_part, value_part = weight[:rows, :rows], weight[rows:, rows:]
    torch.testing.assert_close(value_part, torch.block_diag(*values))
    kappa = key_part[:width, :width] / keys[0]
    energy = [torch.trace(w @ m @ cov @ m.T) for w, m in ((key_part, k_nope), (value_part, w_v))]
    assert kappa.std() < 1e-9 and energy[0] == pytest.approx(float(energy[1]), rel=1e-9)


def test_attention_aware_conversion_needs_the_activation_aware_one(tiny_checkpoint, tmp_path, capsys):
    model = tiny_llama(num_kv_heads=2, seed=3)
    cov = calibrate.calibration_pass(model, [torch.arange(1, 33)], scores=False, covariance=True)
    with pytest.raises(UserError, match="attention-aware SVD .* needs the activation-aware one"):
        convert_model(model, d_kv=4, r=2, strategy="high", covariances=cov, attention_aware=True)
    converted, report = convert_model(model, d_kv=4, r=2, strategy="high", covariances=cov, whiten=True,
                                      attention_aware=True)
    assert report["attention_aware"] and converted.config.mha2mla["attention_aware"] is True
    assert main(["convert", "--model", str(tiny_checkpoint), "--out", str(tmp_path / "o"), "--d-kv", "4",
                 "--rope-strategy", "high", "--attention-aware"]) != 0
    assert "needs the activation-aware one (--whiten FILE)" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
