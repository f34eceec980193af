"""Model families beyond Llama-2: Qwen2/2.5, Llama-3.x RoPE scalings, Mistral — converted exactly — and the
families that are refused, each with its reason."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from mla import shapes
from mla.conversion import calibrate
from mla.conversion.convert import convert_checkpoint, convert_model
from mla.errors import UserError
from mla.kv.accounting import cache_nbytes, kv_elements_per_token
from mla.tiny_models import tiny_decoder, tiny_tokenizer

TOL = 1e-4
HEAD_DIM = 16                      # tiny_decoder: hidden 64 over 4 query heads
SHORT_CONTEXT = 16                 # the tiny models' pre-scaling context, so that 12 + 32 tokens exceed it

# family -> the arguments of its tiny random model (each built by the family's own config class)
FAMILIES = {
    "llama": dict(model_type="llama"),
    "llama-rope-llama3": dict(model_type="llama", rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": SHORT_CONTEXT}),
    "llama-rope-linear": dict(model_type="llama", rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    # dynamic NTK changes the frequencies once the sequence passes max_position_embeddings
    "llama-rope-dynamic": dict(model_type="llama", max_position_embeddings=SHORT_CONTEXT, rope_parameters={
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}),
    "llama-rope-yarn": dict(model_type="llama", max_position_embeddings=8 * SHORT_CONTEXT, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
        "original_max_position_embeddings": SHORT_CONTEXT}),
    # longrope: per-pair factors, switched to the long ones past the original context; attention factor too
    "llama-rope-longrope": dict(model_type="llama", max_position_embeddings=4 * SHORT_CONTEXT, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": SHORT_CONTEXT,
        "short_factor": [1.0 + 0.1 * i for i in range(HEAD_DIM // 2)],
        "long_factor": [1.0 + 0.5 * i for i in range(HEAD_DIM // 2)]}),
    "qwen2": dict(model_type="qwen2"),
    "qwen2-tied": dict(model_type="qwen2", tie_word_embeddings=True),
    "mistral": dict(model_type="mistral", sliding_window=None),
}


def family_model(name: str, seed: int = 0):
    return tiny_decoder(num_kv_heads=2, seed=seed, **FAMILIES[name])


def ids(batch=2, length=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 512, (batch, length), generator=g)


def greedy(model, prompt, steps=32):
    with torch.no_grad():
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=steps,
                              min_new_tokens=steps, do_sample=False)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_full_rank_all_pairs_is_the_original(family):
    model = family_model(family)
    assert model.config.model_type == FAMILIES[family]["model_type"]
    x = ids()
    converted, report = convert_model(model, d_kv=HEAD_DIM, r=HEAD_DIM // 2, strategy="high")
    with torch.no_grad():
        assert (converted(x).logits - model(x).logits).abs().max().item() <= TOL
    # 12 + 32 positions: past the short context, where dynamic/llama3/yarn scaling matters
    prompt = ids(batch=1)
    assert torch.equal(greedy(converted, prompt), greedy(model, prompt))
    assert max(report["reconstruction_error_per_layer"]) < 1e-5


@pytest.mark.parametrize("family", list(FAMILIES))
def test_rotated_rope_with_every_component_kept_is_the_original(family):
    """The rotated layout (one shared RoPE key, mla/conversion/rotation.py) with every component kept, at full
    rank: every RoPE scaling, Qwen2's biases and yarn's folded query scale carry over exactly."""
    model = family_model(family)
    x = ids()
    cal = calibrate.calibration_pass(model, list(ids(batch=4, length=16, seed=3)), batch_size=4)
    converted, _ = convert_model(model, d_kv=None, r=HEAD_DIM // 2, strategy="rotated", scores=cal, svd="none",
                                 latent="shared")
    with torch.no_grad():
        assert (converted(x).logits - model(x).logits).abs().max().item() <= TOL
    prompt = ids(batch=1)                                # past the short context, where the scalings matter
    assert torch.equal(greedy(converted, prompt), greedy(model, prompt))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_reduced_rank_cache_holds_the_formula(family):
    original = family_model(family)
    converted, report = convert_model(original, d_kv=4, r=2, strategy="uniform")
    prompt, new = ids(batch=1, length=6), 10
    with torch.no_grad():
        out = converted.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                                 min_new_tokens=new, do_sample=False, return_dict_in_generate=True)
    tokens = prompt.shape[1] + new - 1                 # the last generated token is never fed back
    per_token = original.config.num_hidden_layers * 2 * (4 + 2 * 2)   # layers · n_kv · (d_kv + 2r)
    assert kv_elements_per_token(converted.config) == report["kv_elements_per_token_after"] == per_token
    assert cache_nbytes(out.cache) == tokens * per_token * 4


def test_qwen2_biases_are_carried_and_o_proj_has_none():
    model = family_model("qwen2")
    converted, report = convert_model(model, d_kv=HEAD_DIM, r=HEAD_DIM // 2, strategy="high")
    attn = converted.model.layers[0].self_attn
    assert converted.config.attention_bias and converted.config.o_proj_bias is False
    assert attn.o_proj.bias is None
    for name in ("q_proj", "k_rope_proj", "k_up", "v_up"):
        assert getattr(attn, name).bias is not None, name
    # the biases matter: zeroing them changes the converted model's output
    x = ids()
    with torch.no_grad():
        before = converted(x).logits
        attn.k_up.bias.zero_()
        attn.v_up.bias.zero_()
        assert (converted(x).logits - before).abs().max().item() > 1e-3
    assert report["params_after_counted"] == report["params_after"]   # the count knows: no o_proj bias


def test_yarn_attention_factor_reaches_the_dims_without_rope():
    """Dropping yarn's slowest pair (nearly no rotation over 6 positions) keeps the original function only
    if that pair's q·k still gets the attention factor squared, as the original gave every dim."""
    model = family_model("llama-rope-yarn")
    x = ids(length=6)
    # full rank for r = 7: per KV head 2 no-RoPE key dims + 16 value dims
    converted, report = convert_model(model, d_kv=HEAD_DIM + 2, r=HEAD_DIM // 2 - 1, strategy="high")
    assert max(report["reconstruction_error_per_layer"]) < 1e-5
    scale = converted.config.mha2mla["nope_query_scale"]
    factor = converted.model.rotary_emb.attention_scaling
    assert factor > 1.1 and scale == pytest.approx(factor ** 2)
    with torch.no_grad():
        ref = model(x).logits
        folded = (converted(x).logits - ref).abs().max().item()
        for layer in converted.model.layers:           # undo the fold: the nope dims lose the factor
            q = layer.self_attn.q_proj.weight.view(4, HEAD_DIM, -1)
            q[:, HEAD_DIM - 2:] /= scale
        unfolded = (converted(x).logits - ref).abs().max().item()
    assert folded <= 1e-3 and unfolded >= 100 * folded


def test_yarn_attention_factor_reaches_the_rotated_layouts_query_without_rope():
    """The same for the rotated layout, whose no-RoPE query is the head's whole query: drop both rotated
    components of yarn's slowest pair (its query norms zeroed, so they score lowest)."""
    model = family_model("llama-rope-yarn")
    x = ids(length=6)
    cal = calibrate.calibration_pass(model, list(ids(batch=4, length=16, seed=3)), batch_size=4)
    cal["query_pair_norms"][:, :, -1] = 0
    m = 2 * (HEAD_DIM // 2 - 1)
    converted, report = convert_model(model, r=HEAD_DIM // 2 - 1, strategy="rotated", scores=cal, svd="none")
    assert all(k != HEAD_DIM // 2 - 1 for layer in report["rotated_components_per_layer"] for k, _ in layer)
    scale = converted.config.mha2mla["nope_query_scale"]
    with torch.no_grad():
        ref = model(x).logits
        folded = (converted(x).logits - ref).abs().max().item()
        for layer in converted.model.layers:           # undo the fold on the [2m RoPE | d_h] query heads
            layer.self_attn.q_proj.weight.view(4, 2 * m + HEAD_DIM, -1)[:, 2 * m:] /= scale
        unfolded = (converted(x).logits - ref).abs().max().item()
    assert folded <= 1e-3 and unfolded >= 100 * folded


def test_plain_llama_gets_no_query_scale():
    converted, _ = convert_model(family_model("llama-rope-llama3"), d_kv=8, r=2, strategy="high")
    assert "nope_query_scale" not in converted.config.mha2mla


@pytest.mark.parametrize("family", ["qwen2", "llama-rope-llama3", "mistral"])
def test_two_norm_calibration_scores_each_family(family):
    """Scores from the calibration pass equal the pair norms of q_proj/k_proj outputs (biases included)."""
    model = family_model(family)
    blocks = [b for b in ids(batch=3, length=20, seed=5)]
    got = calibrate.two_norm_scores(model, blocks, batch_size=3)
    cfg = model.config
    assert got.shape == (cfg.num_hidden_layers, cfg.num_key_value_heads, HEAD_DIM // 2)
    captured = {}

    def hook(module, args, kwargs):
        captured[module] = kwargs.get("hidden_states", args[0] if args else None)

    handles = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for layer in model.model.layers]
    with torch.no_grad():
        model.model(input_ids=torch.stack(blocks), use_cache=False)
    for h in handles:
        h.remove()
    for i, layer in enumerate(model.model.layers):
        h = captured[layer.self_attn]
        q = calibrate.pair_norms(layer.self_attn.q_proj(h).float(), HEAD_DIM).mean(dim=(0, 1))
        k = calibrate.pair_norms(layer.self_attn.k_proj(h).float(), HEAD_DIM).mean(dim=(0, 1))
        expected = calibrate.group_scores(q[None], k[None])[0]
        torch.testing.assert_close(got[i], expected, rtol=1e-4, atol=1e-6)


def test_saved_checkpoints_load_without_the_mla_package(tmp_path):
    """Every family's converted checkpoint loads with trust_remote_code where `mla` cannot be imported,
    and at full rank gives the original's logits."""
    prompt = ids(batch=1).tolist()
    expected, outs = {}, {}
    for family in FAMILIES:
        model = family_model(family)
        src = tmp_path / family
        model.save_pretrained(src)
        tiny_tokenizer(512).save_pretrained(src)
        with torch.no_grad():
            expected[family] = model(torch.tensor(prompt)).logits
        outs[family] = str(tmp_path / f"{family}-mla")
        convert_checkpoint(src, outs[family], d_kv=HEAD_DIM, r=HEAD_DIM // 2, strategy="high")
    code = textwrap.dedent(f"""
        import sys, json, torch
        sys.modules["mla"] = None          # any import of the package raises ImportError
        from transformers import AutoModelForCausalLM
        result = {{}}
        for family, path in {outs!r}.items():
            model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32)
            with torch.no_grad():
                result[family] = [type(model).__name__, model(torch.tensor({prompt})).logits.flatten().tolist()]
        print(json.dumps(result))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for family, (cls, logits) in result.items():
        assert cls == "MLAForCausalLM"
        got = torch.tensor(logits).view_as(expected[family])
        assert (got - expected[family]).abs().max().item() <= TOL, family


# ---------------------------------------------------------------- refused families
REFUSED = {
    "qwen3": ({"model_type": "qwen3"}, "QK-norm"),
    "gemma": ({"model_type": "gemma"}, "GeGLU"),
    "gemma2": ({"model_type": "gemma2"}, "soft-capping"),
    "gemma3_text": ({"model_type": "gemma3_text"}, "QK-norm"),
    "phi3": ({"model_type": "phi3"}, "fused projections"),
    "mistral-sliding": ({"model_type": "mistral", "sliding_window": 4096}, "sliding_window=4096"),
    "qwen2-sliding": ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": True,
                       "max_window_layers": 2, "num_hidden_layers": 4}, "sliding-window"),
    "falcon": ({"model_type": "falcon"}, "unknown or unsupported model family 'falcon'"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_families_say_why(name):
    config, reason = REFUSED[name]
    with pytest.raises(UserError, match=reason.replace("(", r"\(")):
        shapes.check_family(config)


def test_refusal_reaches_the_command_line(tmp_path, capsys):
    from mla.cli import main

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    (tmp_path / "model.safetensors").write_bytes(b"")   # the family is refused before any weight is read
    assert main(["download", "--source", "local", "--path", str(tmp_path), "--out", str(tmp_path / "o")]) != 0
    assert "QK-norm" in capsys.readouterr().err


def test_qwen2_keeps_an_unused_window_and_converts():
    """Qwen2.5's config.json names a sliding_window with use_sliding_window false: not a sliding model."""
    shapes.check_family({"model_type": "qwen2", "sliding_window": 131072, "use_sliding_window": False})
    # all window layers beyond the last layer: the window is never used either
    shapes.check_family({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": True,
                         "max_window_layers": 28, "num_hidden_layers": 28})


# ---------------------------------------------------------------- real shapes for `mla plan`
# published parameter counts, output head included (billions, as the model cards round them)
PUBLISHED_BILLIONS = {"llama-3.1-8b": 8.03, "llama-3.2-1b": 1.24, "qwen2.5-0.5b": 0.49, "qwen2.5-1.5b": 1.54,
                      "qwen2.5-7b": 7.61, "mistral-7b": 7.25}


@pytest.mark.parametrize("name", list(PUBLISHED_BILLIONS))
def test_bundled_shapes_are_the_real_models(name):
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = shapes.read_config(name)
    shapes.check_family(config)                       # each of these converts
    s = shapes.shape_of(config)
    head = 0 if config.get("tie_word_embeddings") else s.vocab * s.hidden
    total = shapes.params_original(s) + head
    assert total / 1e9 == pytest.approx(PUBLISHED_BILLIONS[name], abs=0.006)
    # the counting convention equals the family's own modules (built on the meta device: no memory)
    fields = {k: v for k, v in config.items() if not k.startswith("_") and k != "architectures"}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(CONFIG_MAPPING[config["model_type"]](**fields))
    assert sum(p.numel() for p in model.parameters()) == total


@pytest.mark.parametrize("name,d_kv,reduction", [("qwen2.5-7b", 16, 87.5), ("llama-3.1-8b", 64, 68.75),
                                                  ("llama-3.2-1b", 32, 68.75), ("mistral-7b", 32, 81.25)])
def test_plan_prints_the_kv_reduction_of_real_shapes(name, d_kv, reduction):
    out = subprocess.run([sys.executable, "-m", "mla", "plan", "--base", name, "--d-kv", str(d_kv)],
                         capture_output=True, text=True, check=True)
    row = json.loads(out.stdout)                       # r = d_h / 16 by default
    s = shapes.shape_of(shapes.read_config(name))
    assert row["kv_elements_per_token_before"] == s.layers * 2 * s.kv_heads * s.head_dim
    assert row["kv_reduction_percent"] == reduction
