"""The config.json of each model a workflow config names, from what is at hand before any job runs: the
downloaded copy, a bundled shape (mla/model_shapes/) for known Hub repositories and the wheel, a local folder,
the Hub's cached file, or the tiny model itself. The parse-time checks (`layout_check`, `memory_check`,
`kv_check`) read shapes from here."""

from __future__ import annotations

import json
from pathlib import Path

from mla import shapes, tiny_models

# Hub repositories whose architecture is one of the named shapes in mla/model_shapes/
HUB_SHAPES = {"meta-llama/Llama-2-7b-hf": "llama-2-7b", "HuggingFaceTB/SmolLM-135M": "smollm-135m",
              "meta-llama/Llama-3.1-8B": "llama-3.1-8b", "meta-llama/Llama-3.2-1B": "llama-3.2-1b",
              "Qwen/Qwen2.5-0.5B": "qwen2.5-0.5b", "Qwen/Qwen2.5-1.5B": "qwen2.5-1.5b", "Qwen/Qwen2.5-7B": "qwen2.5-7b",
              "mistralai/Mistral-7B-v0.3": "mistral-7b"}
# the PyPI wheel's SmolLM2-135M has SmolLM-135M's architecture (576/1536/30 layers/9+3 heads/49152 tokens, tied)
SOURCE_SHAPES = {"smollm2-wheel": "smollm-135m"}


def model_config(config: dict, name: str, results: str | Path = "results") -> dict | None:
    """config.json of model `name` of a workflow config, from what is at hand; None when nothing is."""
    model = config["models"][name]
    source = model["source"]
    if source == "mha-from-gqa":
        parent = model_config(config, model["from"], results)
        if parent is None:
            return None
        return dict(parent, num_key_value_heads=parent["num_attention_heads"])
    downloaded = Path(results) / "models" / name / "config.json"
    if downloaded.is_file():
        return json.loads(downloaded.read_text())
    if source == "hub" and model.get("repo_id") in HUB_SHAPES:
        return shapes.read_config(HUB_SHAPES[model["repo_id"]])
    if source in SOURCE_SHAPES:
        return shapes.read_config(SOURCE_SHAPES[source])
    if source == "local":
        p = Path(model["path"]) / "config.json"
        return shapes.read_config(p) if p.is_file() else None
    if source == "hub":
        try:
            from huggingface_hub import hf_hub_download

            path = hf_hub_download(model["repo_id"], "config.json", revision=model.get("revision", "main"))
            return shapes.read_config(path)
        except Exception:   # offline without a cached copy, gated, unknown repo: the check is skipped
            return None
    if source == "tiny-random":
        kwargs = {k: model[k] for k in ("num_kv_heads", "head_dim") if k in model}
        return tiny_models.tiny_llama(**kwargs).config.to_dict()
    return None
