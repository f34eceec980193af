"""A tiny random Llama converted with the ladder RoPE layout and saved with a tokenizer: what `mla export` takes
(tests/test_export.py checks the export against it; tests/test_serve.py serves the export with vLLM)."""

from __future__ import annotations

from pathlib import Path

import torch

from mla.cli import main as mla_main
from mla.conversion import calibrate
from mla.conversion.convert import convert_model
from mla.tiny_models import tiny_decoder, tiny_tokenizer


def ids(batch=2, length=24, seed=3):
    return torch.randint(1, 512, (batch, length), generator=torch.Generator().manual_seed(seed))


def ladder_checkpoint(folder: Path, *, num_kv_heads=2, head_dim=64, svd="joint", latent="per_head", r=4,
                      strategy="ladder", model_type="llama", **config) -> Path:
    """A tiny random model converted with `strategy` and saved with a tokenizer; its head is scaled up so that
    logits span several units (a 1e-4 tolerance, or a bf16 near-tie, then means something)."""
    model = tiny_decoder(model_type, num_kv_heads=num_kv_heads, head_dim=head_dim, **config)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
    cal = calibrate.calibration_pass(model, list(ids(batch=6, length=16, seed=11)), batch_size=3)
    converted, _ = convert_model(model, d_kv=6, r=r, strategy=strategy, scores=cal, svd=svd, latent=latent)
    converted.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def export(src: Path, out: Path, *extra: str) -> int:
    return mla_main(["export", str(src), "--format", "deepseek_v3", "--out", str(out), *extra])
