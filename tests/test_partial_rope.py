"""Partial-RoPE selection: the four strategies and 2-norm calibration on a case with a known answer."""

import pytest
import torch

from mla.conversion import calibrate
from mla.conversion.partial_rope import fixed_pairs, head_permutation, nope_dims, rope_dims, select_pairs
from mla.tiny_models import tiny_llama


def test_fixed_strategies_match_the_paper_definitions():
    # d_h = 64, r = 4 (SmolLM): S_high = {0..3}, S_low = {28..31}, S_uniform = {0, 8, 16, 24}
    assert fixed_pairs("high", 4, 64) == [0, 1, 2, 3]
    assert fixed_pairs("low", 4, 64) == [28, 29, 30, 31]
    assert fixed_pairs("uniform", 4, 64) == [0, 8, 16, 24]
    assert fixed_pairs("uniform", 8, 128) == [0, 8, 16, 24, 32, 40, 48, 56]
    with pytest.raises(ValueError, match="out of range"):
        fixed_pairs("high", 33, 64)


def test_rotate_half_pairing_and_permutation():
    pairs = torch.tensor([[1, 5]])
    assert rope_dims(pairs, 16).tolist() == [[1, 5, 9, 13]]             # pair k = dims (k, k + d_h/2)
    assert nope_dims(pairs, 16).tolist() == [[0, 2, 3, 4, 6, 7, 8, 10, 11, 12, 14, 15]]
    perm = head_permutation(pairs, 16)
    assert sorted(perm[0].tolist()) == list(range(16))


def test_group_scores_multiply_q_and_k_and_sum_over_the_group():
    q = torch.tensor([[[1.0, 2.0], [3.0, 1.0], [0.5, 0.5], [1.0, 1.0]]])    # L=1, n_h=4, d_h/2=2
    k = torch.tensor([[[2.0, 1.0], [1.0, 4.0]]])                            # n_kv=2
    scores = calibrate.group_scores(q, k)
    assert scores.tolist() == [[[1 * 2 + 3 * 2, 2 * 1 + 1 * 1], [0.5 * 1 + 1 * 1, 0.5 * 4 + 1 * 4]]]


def test_two_norm_calibration_finds_the_planted_pairs():
    """Scale the q/k rows of chosen pairs up: the calibrated top-r must be exactly those pairs."""
    model = tiny_llama(num_kv_heads=2, num_hidden_layers=2)
    cfg = model.config
    d_h, half = cfg.head_dim, cfg.head_dim // 2
    planted = {(0, 0): [2, 5], (0, 1): [0, 7], (1, 0): [3, 4], (1, 1): [1, 6]}
    with torch.no_grad():
        for layer_idx, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            for proj, heads in ((attn.q_proj, cfg.num_attention_heads), (attn.k_proj, cfg.num_key_value_heads)):
                w = proj.weight.view(heads, d_h, -1)
                w.mul_(0.05)
                for head in range(heads):
                    kv = head // (heads // cfg.num_key_value_heads)
                    for k in planted[(layer_idx, kv)]:
                        w[head, k] *= 40.0
                        w[head, k + half] *= 40.0
    blocks = [torch.randint(1, cfg.vocab_size, (16,), generator=torch.Generator().manual_seed(i)) for i in range(5)]
    scores = calibrate.two_norm_scores(model, blocks, batch_size=2)
    assert scores.shape == (2, 2, half)
    chosen = select_pairs("2-norm", 2, 2, 2, d_h, scores)
    for (layer_idx, kv), pairs in planted.items():
        assert chosen[layer_idx, kv].tolist() == pairs


def test_two_norm_needs_scores_of_the_right_shape():
    with pytest.raises(ValueError, match="needs a scores file"):
        select_pairs("2-norm", 4, 30, 3, 64, None)
    with pytest.raises(ValueError, match="belongs to another model"):
        select_pairs("2-norm", 4, 30, 3, 64, torch.rand(32, 32, 64))
