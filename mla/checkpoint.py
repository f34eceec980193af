"""Reading and writing Hugging Face checkpoint folders (original Llama-family or MLA)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from mla.errors import UserError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "chat_template.jinja", "generation_config.json", "vocab.json", "merges.txt")


def require_checkpoint(path: str | Path) -> Path:
    p = Path(path)
    if not (p / "config.json").is_file():
        raise UserError(f"missing checkpoint: {p} has no config.json (run `mla download` or `mla convert` first)")
    if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
        raise UserError(f"missing checkpoint weights: {p} has a config.json but no *.safetensors / *.bin")
    return p


def load_model(path: str | Path, dtype=None, attn_implementation: str | None = None):
    """Load an original or MLA checkpoint as a causal LM (fp32 by default)."""
    import torch
    from transformers import AutoModelForCausalLM

    import mla.modeling  # noqa: F401  registers the MLA classes with the Auto classes; lazy: torch, transformers

    p = require_checkpoint(path)
    kwargs = {"dtype": dtype or torch.float32}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    return AutoModelForCausalLM.from_pretrained(p, **kwargs)


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(path))


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> None:
    for name in TOKENIZER_FILES:
        f = Path(src) / name
        if f.is_file() and not (Path(dst) / name).exists():
            shutil.copy2(f, Path(dst) / name)


def link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link a (large, read-only) file, or copy it when links are impossible."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)

