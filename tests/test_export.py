"""`mla export --format deepseek_v3`: a ladder conversion loads in transformers' own DeepseekV3ForCausalLM (no
remote code) and computes the same logits and greedy tokens; what the format cannot express is refused before
anything is written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from export_helpers import assert_refused, export, ids, ladder_checkpoint
from safetensors import safe_open
from transformers import DeepseekV3ForCausalLM

from mla.checkpoint import load_model, load_tokenizer
from mla.conversion import calibrate
from mla.conversion.convert import convert_model
from mla.export import engines, latent_norm

TOL = 1e-4


# ---------------------------------------------------------------- exactness
CASES = {
    "GQA d_h 64, eps 1e-5": (dict(num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5), "512"),
    "MHA d_h 64, tied embeddings, native latent": (dict(num_kv_heads=4, head_dim=64, tie_word_embeddings=True),
                                                   "native"),
    "GQA d_h 128, split SVD": (dict(num_kv_heads=2, head_dim=128, svd="split"), "512"),
    "GQA d_h 32, shared latent, native latent": (dict(num_kv_heads=2, head_dim=32, latent="shared", r=3), "native"),
    "GQA d_h 64, folded RoPE, attention-aware SVD": (
        dict(num_kv_heads=2, head_dim=64, conversion=dict(rope_fold=4, whiten=True, attention_aware=True)), "512"),
}


@pytest.mark.parametrize("case", CASES)
def test_export_loads_in_transformers_deepseek_v3_and_computes_the_same(case, tmp_path, capsys):
    options, latent = CASES[case]
    src = ladder_checkpoint(tmp_path / "mla", **options)
    out = tmp_path / "ds"
    assert export(src, out, "--latent", latent) == 0
    assert "deepseek_v3 (float32)" in capsys.readouterr().out

    config = json.loads((out / "config.json").read_text())
    mla = load_model(src)
    n_h, layers = mla.config.num_attention_heads, mla.config.num_hidden_layers
    assert config["model_type"] == "deepseek_v3" and config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["first_k_dense_replace"] == layers and isinstance(config["n_routed_experts"], int)
    assert config["q_lora_rank"] is None and config["num_key_value_heads"] == n_h
    width = mla.config.kv_lora_rank if latent == "native" else 512
    assert config["kv_lora_rank"] == width and config["qk_rope_head_dim"] == 64
    # the head padded to the smallest shape vLLM's GPU prefill takes: d_h 32 and 64 -> (64, 64, 128)
    prefill = (config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"])
    assert prefill in engines.PREFILL_SHAPES and prefill[0] >= mla.config.head_dim <= prefill[2]
    assert prefill == ((128, 64, 128) if mla.config.head_dim == 128 else (64, 64, 128))
    backends = json.loads((out / "mha2mla_export.json").read_text())["engines"]["vllm_gpu"]["backends"]
    assert "TRITON_MLA" in backends and ("FLASHMLA" in backends) == (latent == "512")
    assert config["rope_interleave"] is True and config["attention_bias"] is False
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] and config["num_nextn_predict_layers"] == 0
    assert config["tie_word_embeddings"] is False and "auto_map" not in config
    with safe_open(out / "model.safetensors", "pt") as f:
        assert "lm_head.weight" in f.keys()
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()

    exported = DeepseekV3ForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert all(type(layer.mlp).__name__ == "DeepseekV3MLP" for layer in exported.model.layers)
    x = ids()
    with torch.no_grad():
        expected, got = mla(x).logits, exported(x).logits
    assert expected.abs().max() > 1.0
    assert (got - expected).abs().max().item() <= TOL
    prompt = x[:1, :8]
    greedy = dict(max_new_tokens=16, do_sample=False, attention_mask=torch.ones_like(prompt))
    assert torch.equal(exported.generate(prompt, **greedy), mla.generate(prompt, **greedy))


def test_export_report_states_the_latent_norm_and_the_eps(tmp_path):
    src = ladder_checkpoint(tmp_path / "mla", rms_norm_eps=1e-5)
    export(src, tmp_path / "ds")
    report = json.loads((tmp_path / "ds" / "mha2mla_export.json").read_text())
    assert report["rms_norm_eps_source"] == 1e-5 and report["rms_norm_eps"] == 1e-6
    assert json.loads((tmp_path / "ds" / "config.json").read_text())["rms_norm_eps"] == 1e-6
    # an RMSNorm with eps 1e-6 on the residual stream scaled by sqrt(0.1) is one with eps 1e-5 on the original;
    # without that scale the tiny model's logits (its hidden states are small) would move a lot
    assert report["residual_scale"] == pytest.approx(0.1 ** 0.5) and report["eps_logit_change_unscaled"] > 1e-2
    assert report["latent_error_measured"] <= report["latent_error_bound"] <= latent_norm.TARGET_ERROR
    assert all(a == 2.0 ** round(torch.tensor(a).log2().item()) for a in report["latent_norm_alpha_per_layer"])
    assert report["kv_elements_per_token"] == 2 * 576


def test_identity_norm_bound_holds_for_any_input():
    torch.manual_seed(0)
    down, gamma = torch.randn(12, 64), torch.rand(64) * 3
    norm = latent_norm.identity_norm(down, gamma, 512, 1e-6, torch.float32)
    x = torch.randn(1000, 64) * torch.logspace(-3, 3, 1000)[:, None]          # any scale: RMSNorm removes it
    u = x / x.pow(2).mean(-1, keepdim=True).sqrt()
    latent = (u * gamma) @ down.T
    assert latent.norm(dim=-1).max() <= norm.latent_norm_bound
    assert latent_norm.relative_error(latent, norm.alpha, 512, 1e-6) <= norm.error_bound <= latent_norm.TARGET_ERROR
    # what transformers' DeepseekV3RMSNorm computes, in fp32
    y = (norm.alpha * latent).float()
    normed = norm.weight * y * torch.rsqrt(torch.cat([y, y.new_zeros(1000, 500)], -1).pow(2).mean(-1, keepdim=True)
                                           + 1e-6)
    assert ((normed - latent) / latent.norm(dim=-1, keepdim=True)).abs().max() < 1e-6


def test_bfloat16_export_keeps_the_greedy_tokens(tmp_path):
    src = ladder_checkpoint(tmp_path / "mla")
    assert export(src, tmp_path / "ds", "--dtype", "bfloat16") == 0
    report = json.loads((tmp_path / "ds" / "mha2mla_export.json").read_text())
    assert report["dtype"] == "bfloat16" and all(k != 1.0 for k in report["latent_norm_kappa_per_layer"])
    exported = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "ds", dtype=torch.float32)
    mla = load_model(src)
    with torch.no_grad():
        expected, got = mla(ids()).logits, exported(ids()).logits
    assert (got - expected).abs().max().item() <= 0.05 * expected.abs().max().item()   # bf16 weights


# ---------------------------------------------------------------- refusals
def edited(src: Path, folder: Path, **changes) -> Path:
    """A copy of a checkpoint whose config.json says something else (the checks read config.json alone)."""
    shutil.copytree(src, folder)
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def ladder_src(tmp_path_factory):
    return ladder_checkpoint(tmp_path_factory.mktemp("export") / "mla")


REFUSALS = {
    "rotated": (dict(strategy="rotated", r=16), "repeat frequency pairs"),
    "per_head": (dict(strategy="uniform"), "rope_layout 'per_head'"),
    "biases": (dict(model_type="qwen2"), "attention_bias"),
    "rope scaling": (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
                     "rope_type 'linear'"),
}
EDITS = {
    "wide latent": (dict(kv_lora_rank=640), "kv_lora_rank 640"),
    "gelu MLP": (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    # pairs on d_h 256's ladder (every 4th): only vLLM's prefill list refuses the head
    "head_dim 256": (dict(head_dim=256, rope_pairs=[[[0, 4, 8, 12]]] * 2), "head_dim 256"),
    "fp16": (dict(dtype="float16"), "--dtype float16"),
    "not MLA": (dict(model_type="llama"), "not an MLA checkpoint"),
}


def refused(src: Path, out: Path, message: str, capsys) -> None:
    assert_refused(["export", str(src), "--format", "deepseek_v3", "--out", str(out)], out, message, capsys)


@pytest.mark.parametrize("case", REFUSALS)
def test_conversions_the_format_cannot_express_are_refused(case, tmp_path, capsys):
    options, message = REFUSALS[case]
    src = ladder_checkpoint(tmp_path / "mla", **options)
    refused(src, tmp_path / "ds", message, capsys)


@pytest.mark.parametrize("case", EDITS)
def test_configs_the_engines_refuse_are_refused(case, ladder_src, tmp_path, capsys):
    changes, message = EDITS[case]
    refused(edited(ladder_src, tmp_path / "mla", **changes), tmp_path / "ds", message, capsys)


def test_refusals_name_the_ladder_flag(tmp_path, capsys):
    src = ladder_checkpoint(tmp_path / "mla", strategy="rotated", r=16)
    capsys.readouterr()
    export(src, tmp_path / "ds")
    assert "--rope-strategy ladder" in capsys.readouterr().err


# ---------------------------------------------------------------- real weights
@pytest.mark.slow
def test_smollm2_ladder_export_matches_the_mla_model(smollm2_dir, tmp_path):
    """SmolLM2-135M converted as the default workflow does (d_kv 16, r 4, activation-aware joint SVD), with the
    ladder layout instead of rotated, exported and loaded in transformers' DeepseekV3ForCausalLM."""
    from pydoc_data.topics import topics

    model, tok = load_model(smollm2_dir), load_tokenizer(smollm2_dir)
    blocks = [torch.tensor(tok(topics[k]).input_ids[:128]) for k in sorted(topics)[:16]]
    cal = calibrate.calibration_pass(model, [b for b in blocks if len(b) == 128][:8], batch_size=4, covariance=True)
    converted, _ = convert_model(model, d_kv=16, r=4, strategy="ladder", scores=cal,
                                 covariances={"covariance": cal["covariance"]}, whiten=True)
    converted.save_pretrained(tmp_path / "mla")
    tok.save_pretrained(tmp_path / "mla")
    del model, converted
    assert export(tmp_path / "mla", tmp_path / "ds") == 0
    mla = load_model(tmp_path / "mla")
    exported = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "ds", dtype=torch.float32)
    report = json.loads((tmp_path / "ds" / "mha2mla_export.json").read_text())

    prompts = ["The for statement in Python", "def fibonacci(n):", "A list comprehension"]
    worst = 0.0
    for text in prompts + [topics["while"][:400]]:
        x = torch.tensor([tok(text).input_ids])
        with torch.no_grad():
            worst = max(worst, (exported(x).logits - mla(x).logits).abs().max().item())
    print(f"SmolLM2-135M ladder export: largest |logit difference| {worst:.2e}, latent norm error "
          f"{report['latent_error_measured']:.1e} (eps 1e-5 -> 1e-6 without the residual scale would move logits "
          f"by {report['eps_logit_change_unscaled']:.2e})")
    assert worst <= 1e-3
    for text in prompts:
        x = torch.tensor([tok(text).input_ids])
        greedy = dict(max_new_tokens=24, do_sample=False, attention_mask=torch.ones_like(x))
        assert torch.equal(exported.generate(x, **greedy), mla.generate(x, **greedy)), text
