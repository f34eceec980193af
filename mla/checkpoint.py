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



def tidy_trained_checkpoint(folder: str | Path) -> dict:
    """Fix what a Trainer save leaves in a checkpoint folder that its model would not write itself: the
    training-time `use_cache: false` (set for gradient checkpointing) back to true, and an `lm_head.weight`
    stored beside the embedding it is tied to (DeepSpeed hands `save_pretrained` a full state dict, which
    keeps both: 734 MB instead of 621 MB for SmolLM2-135M). Returns what changed."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    folder = Path(folder)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    changed = {"use_cache": False, "dropped": []}
    if config.get("use_cache") is False:
        config["use_cache"] = True
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        changed["use_cache"] = True
    if not config.get("tie_word_embeddings", False):
        return changed
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.is_file() else None
    files = sorted({*index["weight_map"].values()}) if index else ["model.safetensors"]
    for name in files:
        path = folder / name
        with safe_open(str(path), "pt") as f:
            if "lm_head.weight" not in f.keys():
                continue
            tensors = {k: f.get_tensor(k) for k in f.keys() if k != "lm_head.weight"}
            metadata = f.metadata() or {"format": "pt"}
        tmp = path.with_name(path.name + ".tmp")
        save_file(tensors, str(tmp), metadata=metadata)
        os.replace(tmp, path)
        changed["dropped"].append("lm_head.weight")
    if index and "lm_head.weight" in index["weight_map"]:
        del index["weight_map"]["lm_head.weight"]
        index_path.write_text(json.dumps(index, indent=2) + "\n")
    return changed
