"""Greedy tokens of transformers against another engine's (vLLM) on the same checkpoint and prompts.

Two bf16 engines sum in different orders, so their greedy paths may part where two logits are a near-tie;
anywhere else a difference is a bug. `compare` finds each prompt's first differing step and measures
transformers' own margin there: its logit for its token minus its logit for the other engine's token.
Runs in the project's venv (transformers' DeepseekV3ForCausalLM, an MLA checkpoint or any causal LM it loads).
"""

from __future__ import annotations

# bf16 keeps 8 significant bits: one rounding of a logit L moves it by up to |L|·2^-8. Both engines round
# every activation through a few layers, so a margin within a few of those steps is a near-tie.
BF16_RELATIVE_TOLERANCE = 2.0 ** -5


def hf_greedy(model_dir, prompts: list[list[int]], max_tokens: int, dtype: str = "bfloat16"):
    """transformers' greedy continuation of each prompt (one at a time: no padding to differ by) and its
    logits at every generated step: (tokens per prompt, list of [steps, vocab] float32 tensors).
    A plain argmax loop rather than `generate`, whose EOS handling (min_new_tokens suppresses EOS) would
    differ from the other engine's `ignore_eos`, which lets EOS be chosen and carries on."""
    import torch   # lazy: torch and transformers live in the project's venv, not in vLLM's
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    return greedy_with_logits(model, prompts, max_tokens)


def greedy_with_logits(model, prompts: list[list[int]], max_tokens: int):
    """hf_greedy on a loaded model (on its device)."""
    import torch

    device = next(model.parameters()).device
    tokens, logits = [], []
    with torch.no_grad():
        for prompt in prompts:
            out = model(torch.tensor([prompt], device=device), use_cache=True)
            steps, chosen = [], []
            for _ in range(max_tokens):
                row = out.logits[0, -1].float()
                steps.append(row.cpu())
                chosen.append(int(row.argmax()))
                out = model(torch.tensor([[chosen[-1]]], device=device), cache=out.cache, use_cache=True)
            tokens.append(chosen)
            logits.append(torch.stack(steps))
    return tokens, logits


def compare(hf_tokens, hf_logits, other_tokens, tolerance: float = BF16_RELATIVE_TOLERANCE) -> dict:
    """Agreement of two engines' greedy tokens; for each prompt that differs, transformers' margin at the
    first differing step and whether it is a near-tie (margin <= tolerance x |its top logit|)."""
    differing = []
    agreeing_tokens = 0
    for i, (ours, theirs) in enumerate(zip(hf_tokens, other_tokens, strict=True)):
        step = next((s for s, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if step is None:
            agreeing_tokens += len(ours)
            continue
        agreeing_tokens += step
        row = hf_logits[i][step]
        top = float(row[ours[step]])
        margin = top - float(row[theirs[step]])
        differing.append({"prompt": i, "step": step, "hf_token": ours[step], "other_token": theirs[step],
                          "margin": margin, "allowed": tolerance * abs(top),
                          "near_tie": 0 <= margin <= tolerance * abs(top)})
    total = sum(len(t) for t in hf_tokens)
    return {"prompts": len(hf_tokens), "prompts_agreeing": len(hf_tokens) - len(differing),
            "prompt_agreement": 1 - len(differing) / len(hf_tokens),
            "token_agreement": agreeing_tokens / total,   # tokens before each prompt's first difference
            "differing": differing, "all_near_ties": all(d["near_tie"] for d in differing)}
