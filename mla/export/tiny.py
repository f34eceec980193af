"""Tiny random checkpoints in the layout `mla export` takes: a random Llama-family model converted with the
ladder RoPE layout and saved with a tokenizer. The tests of the export and of vLLM serving and the GPU check's
serving part build them here, so that all of them serve the same kind of model."""

from __future__ import annotations

from pathlib import Path

import torch

from mla.conversion import calibrate
from mla.conversion.convert import convert_model
from mla.tiny_models import tiny_decoder, tiny_tokenizer


def tiny_source(model_type: str = "llama", **shape):
    """A random decoder (mla.tiny_models.tiny_decoder) whose LM head is scaled up tenfold: its logits span
    several units, so that a 1e-4 tolerance or a bf16 near-tie between two greedy candidates means something."""
    model = tiny_decoder(model_type, **shape)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
    return model


def save_ladder_conversion(model, out: str | Path, *, d_kv: int, r: int = 4, strategy: str = "ladder",
                           svd: str = "joint", latent: str = "per_head", calibration_length: int = 16,
                           **options) -> Path:
    """Calibrate `model` on 6 random sequences of `calibration_length` tokens (seeded), convert it (`strategy`
    ladder by default: what the export takes; `options`: more of convert_model's, which then gets the
    calibration's covariances) and save the MLA checkpoint with the tiny tokenizer to `out`."""
    out = Path(out)
    ids = torch.randint(1, 512, (6, calibration_length), generator=torch.Generator().manual_seed(11))
    scores = calibrate.calibration_pass(model, list(ids), batch_size=3, covariance=bool(options))
    if options:
        options["covariances"] = scores
    converted, _ = convert_model(model, d_kv=d_kv, r=r, strategy=strategy, scores=scores, svd=svd, latent=latent,
                                 **options)
    converted.save_pretrained(out)
    tiny_tokenizer().save_pretrained(out)     # 512 tokens: ids past it are never produced, which is fine for these
    return out


__all__ = ["save_ladder_conversion", "tiny_source"]
