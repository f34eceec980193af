"""A tiny random Llama converted with the ladder RoPE layout and saved with a tokenizer: what `mla export` takes
(tests/test_export.py checks the export against it; tests/test_serve.py serves the export with vLLM)."""

from __future__ import annotations

from pathlib import Path

import torch

from mla.cli import main as mla_main
from mla.export.tiny import save_ladder_conversion, tiny_source


def ids(batch=2, length=24, seed=3):
    return torch.randint(1, 512, (batch, length), generator=torch.Generator().manual_seed(seed))


def ladder_checkpoint(folder: Path, *, num_kv_heads=2, head_dim=64, svd="joint", latent="per_head", r=4,
                      strategy="ladder", model_type="llama", conversion: dict | None = None, **config) -> Path:
    """A tiny random model (head scaled up: mla.export.tiny) converted with `strategy` at d_kv 6 (and the
    `conversion` options), with a tokenizer."""
    model = tiny_source(model_type, num_kv_heads=num_kv_heads, head_dim=head_dim, **config)
    return save_ladder_conversion(model, folder, d_kv=6, r=r, strategy=strategy, svd=svd, latent=latent,
                                  **(conversion or {}))


def export(src: Path, out: Path, *extra: str) -> int:
    return mla_main(["export", str(src), "--format", "deepseek_v3", "--out", str(out), *extra])


def assert_refused(argv: list[str], out: Path, message: str, capsys) -> None:
    """`mla ARGV` exits 2 with one line on stderr holding `message`, and leaves nothing at `out`, not even a
    temporary sibling."""
    capsys.readouterr()                     # what building the checkpoint printed
    assert mla_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not out.exists() and not any(p.name.startswith(f".{out.name}") for p in out.parent.iterdir())
