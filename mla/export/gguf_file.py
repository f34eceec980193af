"""Writing a GGUF file (llama.cpp's format) with the `gguf` package: the tokenizer's metadata from a checkpoint's
tokenizer.json, and tensors in the weight type asked for.

The tokenizer. llama.cpp's byte-level BPE (`tokenizer.ggml.model: gpt2`) takes the vocabulary and merges of a
Hugging Face BPE tokenizer as they are, so token ids are the checkpoint's; `tokenizer.ggml.pre` names the
pre-tokenizer's split rule, which llama.cpp knows by name (`_pre_tokenizer_name`: the structures of
tokenizer.json this writer recognises). Anything else (SentencePiece, an unknown split) is refused, naming what was found.

Weight types: 1-D tensors (norms) are always f32, as llama.cpp's own converter writes them; q8_0 needs rows of
a multiple of its block (32) and falls back to f16 for the others; `keep_f32` names tensors whose values f16
cannot hold (the export's α-scaled latent rows).
"""

from __future__ import annotations

import json
from pathlib import Path

from mla.errors import UserError

WEIGHT_TYPES = ("f32", "f16", "bf16", "q8_0")
LLAMA3_REGEX = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
                "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")


def _pre_tokenizer_name(pre: dict | None) -> str | None:
    """llama.cpp's name for a tokenizer.json pre_tokenizer (None: not one it has)."""
    if pre is None:
        return None
    steps = pre["pretokenizers"] if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    byte_level = steps[-1] if kinds[-1] == "ByteLevel" else None
    if byte_level is None:
        return None
    if kinds == ["ByteLevel"] and byte_level.get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and byte_level.get("use_regex", True):
        return "smollm"                     # SmolLM's: single digits, then GPT-2's split
    if (kinds == ["Split", "ByteLevel"] and not byte_level.get("use_regex", True)
            and steps[0].get("pattern", {}).get("Regex") == LLAMA3_REGEX):
        return "llama-bpe"                  # Llama 3's
    return None


def tokenizer_metadata(folder: Path, vocab_size: int) -> dict:
    """The tokenizer keys of a GGUF file, from a checkpoint's tokenizer.json (+ tokenizer_config.json,
    chat_template.jinja, config.json): tokens by id (padded with unused entries to the model's vocab_size),
    their types, merges, special token ids, whether a BOS is added, the chat template."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"{folder} has no tokenizer.json: the GGUF export writes the tokenizer from it")
    tok = json.loads(path.read_text())
    model = tok.get("model", {})
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise UserError(f"tokenizer.json model {model.get('type')!r} (byte_fallback {model.get('byte_fallback')}): "
                        "the GGUF export writes byte-level BPE tokenizers (GPT-2, SmolLM, Llama 3 style) only")
    pre = _pre_tokenizer_name(tok.get("pre_tokenizer"))
    if pre is None:
        raise UserError(f"tokenizer.json pre_tokenizer {json.dumps(tok.get('pre_tokenizer'))[:120]}: not a split "
                        "rule llama.cpp names (gpt-2, smollm, llama-bpe), so its tokenization could differ")
    ids = dict(model["vocab"])
    added = {t["content"]: t for t in tok.get("added_tokens", [])}
    ids.update({content: t["id"] for content, t in added.items()})
    size = max(vocab_size, max(ids.values()) + 1)
    tokens, types = [f"[PAD{i}]" for i in range(size)], [5] * size           # 5: UNUSED
    for content, i in ids.items():
        tokens[i] = content
        types[i] = (3 if added[content].get("special") else 4) if content in added else 1   # CONTROL, USER_DEFINED, NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]

    config = json.loads((folder / "tokenizer_config.json").read_text()) if (folder / "tokenizer_config.json").is_file() else {}
    model_config = json.loads((folder / "config.json").read_text())
    special = {}
    for role in ("bos", "eos", "unk", "pad"):
        value = config.get(f"{role}_token")
        value = value.get("content") if isinstance(value, dict) else value
        token_id = ids.get(value) if value is not None else model_config.get(f"{role}_token_id")
        if isinstance(token_id, list):
            token_id = token_id[0]
        if token_id is not None:
            special[role] = int(token_id)
    template = folder / "chat_template.jinja"
    chat_template = template.read_text() if template.is_file() else config.get("chat_template")
    return {"pre": pre, "tokens": tokens, "types": types, "merges": merges, "special": special,
            "add_bos": bool(config.get("add_bos_token", False)), "chat_template": chat_template}


def add_tokenizer(writer, meta: dict) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(meta["pre"])
    writer.add_token_list(meta["tokens"])
    writer.add_token_types(meta["types"])
    writer.add_token_merges(meta["merges"])
    for role, token_id in meta["special"].items():
        getattr(writer, f"add_{role}_token_id")(token_id)
    writer.add_add_bos_token(meta["add_bos"])
    if meta["chat_template"]:
        writer.add_chat_template(meta["chat_template"])


def check_weight_type(weight_type: str) -> None:
    if weight_type not in WEIGHT_TYPES:
        raise UserError(f"--type {weight_type!r}: choose one of {', '.join(WEIGHT_TYPES)}")


def encoded(array, weight_type: str, keep_f32: bool = False):
    """(data, raw GGML type or None) of one float array in `weight_type` (module docstring for the exceptions)."""
    import gguf
    import numpy as np

    array = np.ascontiguousarray(array, dtype=np.float32)
    if array.ndim == 1 or keep_f32 or weight_type == "f32":
        return array, None
    if weight_type == "f16" or (weight_type == "q8_0" and array.shape[-1] % 32):
        return array.astype(np.float16), None
    qtype = gguf.GGMLQuantizationType.BF16 if weight_type == "bf16" else gguf.GGMLQuantizationType.Q8_0
    return gguf.quants.quantize(array, qtype), qtype


def file_type(weight_type: str):
    import gguf

    return {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
            "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[weight_type]
