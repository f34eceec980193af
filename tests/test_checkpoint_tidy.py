"""What a Trainer save leaves that the model would not write itself: `use_cache: false` and an lm_head stored
beside the embedding it is tied to (mla.checkpoint.tidy_trained_checkpoint)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mla.checkpoint import load_model, tidy_trained_checkpoint
from mla.tiny_models import tiny_llama


def _saved_like_deepspeed(model, folder):
    """save_pretrained, then the weights rewritten with every state-dict key (lm_head included) and the cache off."""
    model.save_pretrained(folder)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "use_cache": False}))


@pytest.mark.parametrize("tied", [True, False])
def test_tidy_drops_a_tied_lm_head_and_turns_the_cache_back_on(tmp_path, tied):
    model = tiny_llama(tie_word_embeddings=tied, seed=4)
    _saved_like_deepspeed(model, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" in f.keys()
    size = (tmp_path / "model.safetensors").stat().st_size

    changed = tidy_trained_checkpoint(tmp_path)

    assert changed == {"use_cache": True, "dropped": ["lm_head.weight"] if tied else []}
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert ("lm_head.weight" in f.keys()) is not tied
    assert ((tmp_path / "model.safetensors").stat().st_size < size) is tied
    loaded = load_model(tmp_path).eval()
    assert loaded.config.use_cache is True
    ids = torch.arange(1, 20)[None]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    assert tidy_trained_checkpoint(tmp_path) == {"use_cache": False, "dropped": []}   # nothing left to do
