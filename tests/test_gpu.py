"""The GPU tier: what only a CUDA device can show. Skipped without CUDA; `scripts/gpu-check` runs it as its first
part (`python -m pytest tests/test_gpu.py`). DeepSpeed must find CUDA here: tests/conftest.py pins the session to
DeepSpeed's CPU accelerator (DS_ACCELERATOR=cpu, for the CPU suite), so every DeepSpeed run of this tier is a
fresh process started without it.

- absorbed vs expanded MLA attention in bf16 on a converted tiny model, both against fp32;
- a bf16 quantize/dequantize round trip of the latent cache within half a quantization step;
- one bf16 ZeRO-2 step (fp32 accumulation of two micro-batches) against an fp32 reference;
- `mla train` on CUDA: the start model loaded in bf16, gradients accumulated in fp32;
- the quantized-cache evaluation of an original (unconverted) model: numbers, or a skip with its reason;
- `generate` with the latent cache (full precision and quantized) on CUDA;
- vLLM's GPU MLA backend on the DeepSeek-V3 export of a tiny ladder conversion beside the original (skipped when
  vLLM is not installed in this venv: `pip install vllm`, docs/evaluation-on-gpus.md).
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA device (torch.cuda.is_available())")]

# The CPU suite pins DeepSpeed to its CPU accelerator (tests/conftest.py); a subprocess of this tier must not
# inherit that, or DeepSpeed would train on the CPU beside an idle GPU.
GPU_ENV = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
GPU_ENV["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])


def rms(t: torch.Tensor) -> float:
    return t.float().pow(2).mean().sqrt().item()


def converted_tiny(**kwargs):
    """A tiny GQA Llama converted to MLA (fp32), with attention logits of a realistic size: tiny_llama draws its
    q/k weights at std 0.3 for sharp attention, which gives scores of |s| ~ 80; at std 0.1 they stay below ~10."""
    from mla.conversion.convert import convert_model
    from mla.tiny_models import tiny_llama

    torch.manual_seed(0)
    base = tiny_llama(num_kv_heads=2, hidden_size=256, num_attention_heads=8, num_hidden_layers=2,
                      intermediate_size=512, **kwargs)
    with torch.no_grad():
        for layer in base.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                proj.weight.normal_(0, 0.1)
    model, _ = convert_model(base, d_kv=16, r=2, strategy="uniform", svd="joint")
    return model.eval()


def decode_step_output(attn, rotary, config, x, dtype, absorb: bool, implementation: str = "sdpa"):
    """One attention layer: prefill all tokens of `x` but the last into a latent cache, then the last one as a
    single-token decode step (the absorbed path when `absorb`); its output in fp32."""
    from mla.modeling import MLACache

    attn = copy.deepcopy(attn).to(dtype)
    attn.config = copy.copy(attn.config)
    attn.config.absorb_decode = absorb
    attn.config._attn_implementation = implementation
    x = x.to(dtype)
    positions = torch.arange(x.shape[1], device=x.device)[None].expand(x.shape[0], -1)
    cos, sin = rotary(x, positions)
    cache = MLACache(config=config)
    with torch.no_grad():
        attn(x[:, :-1], position_embeddings=(cos[:, :-1], sin[:, :-1]), attention_mask=None, cache=cache)
        out, _ = attn(x[:, -1:], position_embeddings=(cos[:, -1:], sin[:, -1:]), attention_mask=None, cache=cache)
    return out.float()


def test_absorbed_attention_matches_expanded_in_bf16():
    """Tolerance: the absorbed bf16 output is within 2x the expanded (SDPA) bf16 output's own distance from fp32,
    and within 2^-5 (3.1 %) RMS of it. Why: bf16 keeps 8 significant bits (each stored value rounds by up to
    2^-9); cuBLAS accumulates bf16 matmuls in fp32 and rounds their outputs, and the absorbed path rounds more
    intermediates than the fused kernel (the latent query, the nope and RoPE scores and their sum; the kernel keeps
    scores in fp32), so it may be somewhat further from fp32, never by more than its extra roundings: measured on
    the CPU (whose bf16 matmuls also accumulate in fp32) 1.0 % against the kernel's 0.8 % and eager's 1.2 %. An
    absorbed path that drops a term is off by tens of per cent (the RoPE scores: 56 %)."""
    model = converted_tiny().to("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    attn, rotary, config = model.model.layers[0].self_attn, model.model.rotary_emb, model.config
    x = torch.randn(4, 65, 256, generator=torch.Generator().manual_seed(1)).to("cuda")
    reference = decode_step_output(attn, rotary, config, x, torch.float32, absorb=False)
    assert rms(decode_step_output(attn, rotary, config, x, torch.float32, absorb=True) - reference) \
        <= 1e-5 * rms(reference)                                  # the algebra is exact in fp32 on CUDA too
    absorbed = rms(decode_step_output(attn, rotary, config, x, torch.bfloat16, absorb=True) - reference)
    expanded = rms(decode_step_output(attn, rotary, config, x, torch.bfloat16, absorb=False) - reference)
    assert absorbed <= 2 * expanded and absorbed <= 2 ** -5 * rms(reference), (absorbed, expanded, rms(reference))


@pytest.mark.parametrize("nbits", [8, 4, 2])
def test_bf16_quantize_dequantize_round_trip_is_within_half_a_step(nbits):
    """|x̂ - x| <= step/2 + one bf16 rounding of x̂ (|x̂|·2^-8, half a unit in the last of 8 significant bits):
    dequantization computed in fp32 and cast to bf16 once."""
    from mla.modeling.cache_mla import QuantizedRows

    g = torch.Generator().manual_seed(nbits)
    x = (torch.randn(4, 64, 256, generator=g) * torch.logspace(-2, 1, 256)).to("cuda", torch.bfloat16)
    q = QuantizedRows.quantize(x, nbits, 64)
    back = q.dequantize(torch.bfloat16)
    assert back.dtype == torch.bfloat16 and back.device.type == "cuda" and q.packed.device.type == "cuda"
    step = q.scale.float().repeat_interleave(64, dim=-1)
    err = (back.float() - x.float()).abs()
    assert (err <= step / 2 + back.float().abs() * 2 ** -8).all(), float((err / step).max())
    assert err.max() > 0.1 * step.min()   # it really quantized


def test_zero2_bf16_step_matches_an_fp32_reference(tmp_path):
    """DeepSpeed's fp32-accumulated gradient of two bf16 micro-batches against the fp32 gradient: cosine >= 0.999
    and norm within 1 % (bf16 forward and backward round each value by <= 2^-9; a lost or bf16-summed micro-step
    is far off: the first micro-batch alone has cosine ~0.7). The fp32 master weights after one AdamW step: Adam's
    first update is lr·g/(|g|+eps), so a weight can differ by at most 2 lr (a gradient sign flipped by rounding),
    and on average by a few thousandths of lr."""
    out = tmp_path / "zero-step.json"
    r = subprocess.run([sys.executable, str(ROOT / "tests/zero_step.py"), str(out), "cuda"], capture_output=True,
                       text=True, timeout=600, env=GPU_ENV, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    s = json.loads(out.read_text())
    assert s["accelerator"] == "CUDA_Accelerator", s
    assert (s["model_dtype"], s["grad_accum_dtype"], s["master_dtype"]) == \
        ("torch.bfloat16", "torch.float32", "torch.float32"), s
    assert s["grad_cosine"] >= 0.999 and abs(s["grad_norm_ratio"] - 1) <= 0.01, s
    assert s["first_micro_batch_cosine"] < 0.99, s   # the check can tell a lost micro-batch
    assert s["max_master_diff_in_lr"] <= 2.01 and s["mean_master_diff_in_lr"] <= 0.02, s


def test_mla_train_on_cuda_loads_bf16_and_accumulates_in_fp32(tmp_path):
    """`mla train --device cuda` (Trainer + DeepSpeed ZeRO-2, bf16, 2 accumulation steps) on a tiny converted model."""
    from mla.conversion.convert import convert_checkpoint
    from mla.data import build_dataset
    from mla.tiny_models import save_tiny_checkpoint

    save_tiny_checkpoint(tmp_path / "llama")
    convert_checkpoint(tmp_path / "llama", tmp_path / "mla", d_kv=8, strategy="high")
    corpus = tmp_path / "corpus.yaml"
    corpus.write_text("name: stdlib\nsources:\n  - {name: python-stdlib, weight: 1, kind: python_stdlib}\n")
    build_dataset(str(corpus), tmp_path / "llama", tmp_path / "data", block_length=32, train_tokens=4096,
                  validation_tokens=256, log=lambda *_: None)
    cmd = [sys.executable, "-m", "mla", "train", "--model", str(tmp_path / "mla"), "--data", str(tmp_path / "data"),
           "--out", str(tmp_path / "run"), "--steps", "3", "--warmup-steps", "1", "--decay-steps", "1",
           "--micro-batch", "2", "--global-batch", "4", "--zero-stage", "2", "--precision", "bf16",
           "--device", "cuda", "--no-mlflow", "--save-steps", "100"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=GPU_ENV, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    info = json.loads((tmp_path / "run/run.json").read_text())
    assert (info["precision"], info["loaded_dtype"], info["grad_accum_dtype"]) == ("bf16", "bfloat16", "float32")
    assert info["global_batch"] == 4 and info["config"]["grad_accum"] == 2
    assert info["train_loss"] is not None and math.isfinite(info["train_loss"])


def test_quantized_cache_evaluation_of_an_original_model():
    """The original model's 4-bit cache (transformers' quanto backend) on CUDA in bf16, as `mla evaluate` runs it:
    a loss near the 16-bit one, or the row skipped with its reason -- never an exception."""
    from mla.kv.quantized import quantized_cache_losses
    from mla.tiny_models import tiny_llama

    model = tiny_llama(num_kv_heads=2).to("cuda", torch.bfloat16)
    blocks = np.random.RandomState(0).randint(1, 512, (4, 48))
    res = quantized_cache_losses(model, blocks, [4], group_size=8, residual=8, scored=8, log=lambda *_: None)
    assert res["backend"] == "quanto" and res["bits"]["16"]["status"] == "ok"
    row = res["bits"]["4"]
    assert row["status"] in ("ok", "skipped"), row
    if row["status"] == "skipped":
        assert row["reason"].strip(), row
    else:
        assert math.isfinite(row["mean_loss"]) and abs(row["loss_change"]) < 1.0, row


def test_generate_with_the_latent_cache_on_cuda():
    """fp32: each cached decoding step's logits equal recomputing the whole sequence so far (1e-3, TF32 off; the
    recomputation is fed generate's own tokens, since a random tiny model's top two logits can be closer than
    that); bf16 and the 8-bit quantized latent cache: the caches live on the GPU in the model's dtype, logits
    are finite."""
    from mla.modeling import MLACache, MLAQuantizedCache

    torch.backends.cuda.matmul.allow_tf32 = False
    model = converted_tiny().to("cuda")
    prompt = torch.randint(1, 512, (2, 12), generator=torch.Generator().manual_seed(2)).to("cuda")
    steps = 8
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=steps,
                             min_new_tokens=steps, do_sample=False, output_logits=True, output_scores=True,
                             return_dict_in_generate=True)
        for step in range(steps):
            seen = out.sequences[:, :prompt.shape[1] + step]
            logits = model(seen, use_cache=False).logits[:, -1]
            assert (logits - out.logits[step]).abs().max().item() <= 1e-3, step
            # greedy on the processed scores (min_new_tokens masks the end-of-sequence token)
            assert torch.equal(out.scores[step].argmax(-1), out.sequences[:, prompt.shape[1] + step])
    assert isinstance(out.cache, MLACache) and out.cache.get_seq_length() == prompt.shape[1] + steps - 1
    assert out.cache.layers[0].latent.device.type == "cuda"

    model = model.to(torch.bfloat16)
    with torch.no_grad():
        for kwargs in ({}, {"cache_implementation": "quantized",
                            "cache_config": {"nbits": 8, "q_group_size": 8, "residual_length": 4}}):
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=steps,
                                 min_new_tokens=steps, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, **kwargs)
            assert out.sequences.shape == (2, 12 + steps)
            assert all(torch.isfinite(l.float()).all() for l in out.logits)
            layer = out.cache.layers[0]
            assert layer.latent.dtype == torch.bfloat16 and layer.latent.device.type == "cuda"
            if kwargs:
                assert isinstance(out.cache, MLAQuantizedCache)
                assert layer.quantized[0].packed.device.type == "cuda" and layer.quantized[0].tokens > 0


@pytest.mark.parametrize("latent", ["512", "native"])
def test_vllm_serves_the_export_with_its_gpu_mla_backend(tmp_path, latent):
    """The workflow's serve job on the GPU (mla.evaluation.serving): KV bytes per token as vLLM allocated them
    (the export's latent + RoPE key, the original's K and V, bf16), decode tokens/s of both, and vLLM's greedy
    tokens on the export against transformers' on the MLA checkpoint, every difference a bf16 near-tie. The
    native latent (16 here) is TRITON_MLA's; 512 FlashMLA's on Hopper and Blackwell."""
    pytest.importorskip("vllm", reason="vLLM is not installed in this venv (pip install vllm)")
    from export_helpers import export, ladder_checkpoint

    from mla.evaluation import serving
    from mla.tiny_models import save_tiny_checkpoint

    original = save_tiny_checkpoint(tmp_path / "original", num_kv_heads=2, head_dim=64)
    mla_dir = ladder_checkpoint(tmp_path / "mla", num_kv_heads=2, head_dim=64)
    assert export(mla_dir, tmp_path / "deepseek_v3", "--latent", latent) == 0
    width = json.loads((tmp_path / "deepseek_v3" / "config.json").read_text())["kv_lora_rank"]
    prompts = [list(range(1 + i, 33 + i)) for i in range(8)]
    result = serving.measure(tmp_path / "deepseek_v3", original, mla_dir, prompts, [(1, 64), (4, 64)], steps=8,
                             max_tokens=16, device="gpu")
    print(serving.summary_line(result))
    assert result["export"]["attention_backend"] in (("FLASHMLA", "TRITON_MLA") if latent == "512" else ("TRITON_MLA",))
    assert result["export"]["kv_bytes_per_token"] == (width + 64) * 2 * 2 and (width == 512) == (latent == "512")
    assert result["original"]["kv_bytes_per_token"] == 2 * 2 * 64 * 2 * 2
    assert all(d["export_tokens_per_s"] > 0 and d["original_tokens_per_s"] > 0 for d in result["decode"])
    agreement = result["greedy_agreement"]
    assert agreement["all_near_ties"], agreement["differing"]
    assert agreement["token_agreement"] >= 0.5
