"""The converted model computes what the method says: parity, partial RoPE, cache, absorbed decode."""

import math

import pytest
import torch

from mla.conversion.convert import convert_model
from mla.conversion.partial_rope import select_pairs
from mla.kv.accounting import cache_nbytes, kv_elements_per_token
from mla.modeling import MLACache
from mla.tiny_models import tiny_llama

TOL = 1e-4


def ids(batch=2, length=12, vocab=512, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (batch, length), generator=g)


@pytest.mark.parametrize("num_kv_heads", [4, 2], ids=["MHA", "GQA"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_full_rank_all_pairs_is_the_original_model(num_kv_heads, attn):
    model = tiny_llama(num_kv_heads=num_kv_heads, attn_implementation=attn)
    x = ids()
    with torch.no_grad():
        ref = model(x).logits
        d_h = model.config.head_dim
        converted, report = convert_model(model, d_kv=d_h, r=d_h // 2, strategy="high")
        got = converted(x).logits
    assert converted.config._attn_implementation == attn
    assert (got - ref).abs().max().item() <= TOL
    assert max(report["reconstruction_error_per_layer"]) < 1e-5


def reference_partial_rope_logits(model, input_ids, pairs):
    """Independent computation: the original Llama with RoPE applied only to the kept pairs.

    Written from the definitions (RMSNorm, rotate_half RoPE on pairs (k, k + d_h/2), causal softmax
    attention with scale 1/sqrt(d_h), SwiGLU MLP), reusing only the weights.
    """
    cfg = model.config
    d_h, n_h, n_kv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    half = d_h // 2
    theta = cfg.rope_parameters["rope_theta"]
    b, t = input_ids.shape
    pos = torch.arange(t, dtype=torch.float32)
    freqs = theta ** (-torch.arange(half, dtype=torch.float32) * 2 / d_h)
    angle = pos[:, None] * freqs[None, :]                           # [T, half]

    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)

    def rotate(x, kept):                                            # x [B, heads, T, d_h]; kept [heads, r]
        a, bb = x[..., :half], x[..., half:]
        mask = torch.zeros(x.shape[1], half)
        mask.scatter_(1, kept, 1.0)
        cos = torch.where(mask[:, None, :] > 0, angle.cos()[None], torch.ones(1))
        sin = torch.where(mask[:, None, :] > 0, angle.sin()[None], torch.zeros(1))
        return torch.cat([a * cos - bb * sin, bb * cos + a * sin], dim=-1)

    h = model.model.embed_tokens(input_ids)
    causal = torch.full((t, t), float("-inf")).triu(1)
    for i, layer in enumerate(model.model.layers):
        attn, x = layer.self_attn, rms(h, layer.input_layernorm.weight)
        q = attn.q_proj(x).view(b, t, n_h, d_h).transpose(1, 2)
        k = attn.k_proj(x).view(b, t, n_kv, d_h).transpose(1, 2)
        v = attn.v_proj(x).view(b, t, n_kv, d_h).transpose(1, 2)
        kept_kv = pairs[i]
        q = rotate(q, kept_kv.repeat_interleave(n_h // n_kv, dim=0))
        k = rotate(k, kept_kv).repeat_interleave(n_h // n_kv, dim=1)
        v = v.repeat_interleave(n_h // n_kv, dim=1)
        w = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d_h) + causal, dim=-1)
        h = h + attn.o_proj((w @ v).transpose(1, 2).reshape(b, t, n_h * d_h))
        x = rms(h, layer.post_attention_layernorm.weight)
        h = h + layer.mlp.down_proj(torch.nn.functional.silu(layer.mlp.gate_proj(x)) * layer.mlp.up_proj(x))
    return model.lm_head(rms(h, model.model.norm.weight))


@pytest.mark.parametrize("strategy", ["high", "low", "uniform", "2-norm"])
@pytest.mark.parametrize("num_kv_heads", [4, 2], ids=["MHA", "GQA"])
def test_partial_rope_without_svd_equals_reference(strategy, num_kv_heads):
    # MHA needs n_h·d_h < hidden for the SVD to be able to reach full rank: use narrow heads
    model = tiny_llama(num_kv_heads=num_kv_heads, head_dim=8 if num_kv_heads == 4 else 16)
    cfg = model.config
    r = 3
    scores = torch.rand(cfg.num_hidden_layers, num_kv_heads, cfg.head_dim // 2,
                        generator=torch.Generator().manual_seed(7)) if strategy == "2-norm" else None
    pairs = select_pairs(strategy, r, cfg.num_hidden_layers, num_kv_heads, cfg.head_dim, scores)
    # full rank: n_kv·d_kv = rows of [W_k,nope; W_v] (capped by the hidden size)
    full = min(num_kv_heads * (2 * cfg.head_dim - 2 * r), cfg.hidden_size) // num_kv_heads
    x = ids()
    with torch.no_grad():
        assert num_kv_heads * full == num_kv_heads * (2 * cfg.head_dim - 2 * r)
        converted, report = convert_model(model, d_kv=full, r=r, strategy=strategy, scores=scores)
        expected = reference_partial_rope_logits(model, x, pairs)
        got = converted(x).logits
    assert converted.config.rope_pairs == pairs.tolist()
    assert (got - expected).abs().max().item() <= TOL
    # and partial RoPE really changed the function
    assert (got - model(x).logits).abs().max().item() > 10 * TOL


@pytest.mark.parametrize("num_kv_heads", [4, 2], ids=["MHA", "GQA"])
def test_split_svd_at_full_rank_is_exact(num_kv_heads):
    """SVD_split gives K_nope and V half of the latent each; at full rank the model is partial RoPE alone
    (the independent reference). Each half reaches W_v's rank when the hidden size bounds it: hidden = d_h."""
    model = tiny_llama(num_kv_heads=num_kv_heads, hidden_size=16, head_dim=16)
    cfg, r = model.config, 2
    pairs = select_pairs("uniform", r, cfg.num_hidden_layers, num_kv_heads, cfg.head_dim)
    d_kv = 2 * cfg.hidden_size // num_kv_heads        # each half: the hidden size, both matrices' rank
    x = ids()
    with torch.no_grad():
        converted, report = convert_model(model, d_kv=d_kv, r=r, strategy="uniform", svd="split")
        expected = reference_partial_rope_logits(model, x, pairs)
        got = converted(x).logits
    assert converted.config.mha2mla["svd"] == "split"
    assert max(report["reconstruction_error_per_layer"]) < 1e-5
    assert (got - expected).abs().max().item() <= TOL


def gqa_low_rank_model(num_kv_heads=2, d_kv=None, r=2, svd="joint", **kw):
    """A converted tiny GQA model below full rank (d_kv 8 of 2·d_h − 2r = 28 by default)."""
    model = tiny_llama(num_kv_heads=num_kv_heads, **kw)
    d_kv = d_kv or 8
    converted, _ = convert_model(model, d_kv=d_kv, r=r, strategy="uniform", svd=svd)
    return converted


@pytest.mark.parametrize("svd", ["joint", "split"])
def test_cached_greedy_generation_equals_full_recomputation(svd):
    model = gqa_low_rank_model(svd=svd)
    prompt = ids(batch=2, length=5)
    steps = 32
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=steps, min_new_tokens=steps,
                             do_sample=False, output_logits=True, return_dict_in_generate=True)
        seq = prompt
        for step in range(steps):   # no cache: recompute the whole sequence each step
            logits = model(seq, use_cache=False).logits[:, -1]
            assert (logits - out.logits[step]).abs().max().item() <= TOL, f"step {step}"
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(seq, out.sequences)
    assert isinstance(out.cache, MLACache)


def test_absorbed_decode_equals_non_absorbed():
    model = gqa_low_rank_model(d_kv=6, r=2)
    prompt = ids(batch=3, length=7)
    with torch.no_grad():
        prefill = model(prompt, use_cache=True)
        nxt = prefill.logits[:, -1].argmax(-1, keepdim=True)
        results = {}
        for absorb in (True, False):
            model.config.absorb_decode = absorb
            cache = model(prompt, use_cache=True).cache
            results[absorb] = model(nxt, cache=cache, use_cache=True).logits
    assert (results[True] - results[False]).abs().max().item() <= TOL
    # and the absorbed path is really taken: it never calls the up-projections
    calls = []
    model.config.absorb_decode = True
    hook = model.model.layers[0].self_attn.k_up.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        cache = model(prompt, use_cache=True).cache
        n_prefill = len(calls)
        model(nxt, cache=cache, use_cache=True)
    hook.remove()
    assert n_prefill == 1 and len(calls) == 1


def test_batched_left_padding_matches_unpadded_generation():
    model = gqa_low_rank_model(d_kv=6)
    pad = 0
    a, b = ids(1, 9, seed=3)[0], ids(1, 4, seed=4)[0]
    batch = torch.full((2, 9), pad)
    batch[0], batch[1, 5:] = a, b
    mask = (torch.arange(9)[None] >= torch.tensor([[0], [5]])).long()
    for absorb in (True, False):
        model.config.absorb_decode = absorb
        with torch.no_grad():
            both = model.generate(batch, attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False,
                                  pad_token_id=pad)
            alone = model.generate(b[None], attention_mask=torch.ones(1, 4, dtype=torch.long), max_new_tokens=10,
                                   min_new_tokens=10, do_sample=False, pad_token_id=pad)
        assert torch.equal(both[1, 9:], alone[0, 4:])


def test_sampling_generation_runs_with_latent_cache_and_is_seeded():
    model = gqa_low_rank_model()
    prompt = ids(batch=2, length=4)
    outs = []
    for _ in range(2):
        torch.manual_seed(123)
        with torch.no_grad():
            outs.append(model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8,
                                       min_new_tokens=8, do_sample=True, top_k=50, temperature=1.0))
    assert torch.equal(outs[0], outs[1]) and outs[0].shape == (2, 12)


@pytest.mark.parametrize("num_kv_heads,d_kv,r", [(2, 4, 2), (4, 8, 1), (2, 6, 0)])
def test_cache_holds_exactly_the_latent_and_rope_keys(num_kv_heads, d_kv, r):
    original = tiny_llama(num_kv_heads=num_kv_heads)
    converted, report = convert_model(original, d_kv=d_kv, r=r, strategy="high")
    prompt, new = ids(batch=1, length=6), 10
    caches = {}
    for name, model in (("original", original), ("mla", converted)):
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                                 min_new_tokens=new, do_sample=False, return_dict_in_generate=True)
        caches[name] = cache_nbytes(out.cache)
    tokens = prompt.shape[1] + new - 1        # the last generated token is never fed back
    cfg = converted.config
    per_token = num_kv_heads * (d_kv + 2 * r) * cfg.num_hidden_layers
    assert caches["mla"] == tokens * per_token * 4
    assert kv_elements_per_token(cfg) == per_token == report["kv_elements_per_token_after"]
    assert caches["original"] == tokens * kv_elements_per_token(original.config) * 4
    assert caches["mla"] / caches["original"] == pytest.approx(report["kv_ratio"], abs=1e-12)


def test_training_forward_backward_reaches_every_mla_parameter():
    model = gqa_low_rank_model(d_kv=4)
    model.train()
    x = ids()
    loss = model(x, labels=x).loss
    loss.backward()
    attn = model.model.layers[0].self_attn
    for name in ("q_proj", "k_rope_proj", "kv_down", "k_up", "v_up", "o_proj"):
        assert getattr(attn, name).weight.grad.abs().sum() > 0, name


def test_attention_biases_are_supported_exactly():
    """Qwen-style q/k/v biases (here Llama's attention_bias, which also biases o_proj) survive conversion."""
    model = tiny_llama(num_kv_heads=2, attention_bias=True)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(layer.self_attn, proj).bias.normal_(0, 0.5)
        x = ids()
        ref = model(x).logits
        converted, _ = convert_model(model, d_kv=16, r=8, strategy="high")
        assert (converted(x).logits - ref).abs().max().item() <= TOL
        # absorbed decode with biases (k_up bias drops out of softmax, v_up bias passes through)
        low, _ = convert_model(model, d_kv=6, r=2, strategy="uniform")
        step = {}
        for absorb in (True, False):
            low.config.absorb_decode = absorb
            cache = low(x, use_cache=True).cache
            step[absorb] = low(x[:, :1], cache=cache, use_cache=True).logits
    assert (step[True] - step[False]).abs().max().item() <= TOL
