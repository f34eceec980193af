"""Tiny real models for tests and smoke runs: a random Llama, a random dense DeepSeek-V3 (what stock serving
engines load) and a small trained BPE tokenizer."""

from __future__ import annotations

import functools
from pathlib import Path

EOS = "<|endoftext|>"


@functools.lru_cache(maxsize=1)
def _tokenizer_json(vocab_size: int) -> str:
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    texts = [topics[k] for k in sorted(topics)]
    tok.train_from_iterator(texts, trainer)
    return tok.to_str()


def tiny_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer trained on Python's own documentation (deterministic, ~1 s)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(_tokenizer_json(vocab_size))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, bos_token=None)


def tiny_decoder(model_type: str = "llama", num_kv_heads: int = 2, num_attention_heads: int = 4,
                 hidden_size: int = 64, num_hidden_layers: int = 2, intermediate_size: int = 128,
                 vocab_size: int = 512, seed: int = 0, max_position_embeddings: int = 4096, **config_kwargs):
    """A random decoder of a transformers family (llama, mistral, qwen2, ...) in fp32 (eval mode),
    built from that family's own config class."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type](
        hidden_size=hidden_size, num_attention_heads=num_attention_heads, num_key_value_heads=num_kv_heads,
        num_hidden_layers=num_hidden_layers, intermediate_size=intermediate_size, vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings, eos_token_id=0, bos_token_id=None, pad_token_id=0,
        **config_kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger than the 0.02 default, so attention is far from uniform
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                proj.weight.normal_(0, 0.3)
                if proj.bias is not None:   # Qwen2-style biases, non-zero so that they matter
                    proj.bias.normal_(0, 0.3)
            if layer.self_attn.v_proj.bias is not None:
                layer.self_attn.v_proj.bias.normal_(0, 0.3)
    return model.eval()


def tiny_llama(num_kv_heads: int = 2, **kwargs):
    """A random LlamaForCausalLM in fp32 (eval mode)."""
    return tiny_decoder("llama", num_kv_heads=num_kv_heads, **kwargs)


def save_tiny_checkpoint(path: str | Path, **kwargs) -> Path:
    """Write a tiny random Llama checkpoint with its tokenizer to `path`."""
    path = Path(path)
    vocab = kwargs.setdefault("vocab_size", 512)
    model = tiny_llama(**kwargs)
    model.save_pretrained(path)
    tiny_tokenizer(vocab).save_pretrained(path)
    return path
