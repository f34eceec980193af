"""Pass-key retrieval (needle in a haystack): an offline long-context check that needs no download.

The task of Mohtashami & Jaggi (2023) and RULER's niah_single_1: a haystack of repeated filler sentences
with one needle sentence "The pass key is NNNNN. Remember it. NNNNN is the pass key." at a chosen depth
(0 = first sentence, 1 = last), then the question "What is the pass key? The pass key is". The model
decodes greedily a few tokens; a sample is correct when the first run of digits it writes is the key.

Context length = prompt tokens as the model's tokenizer counts them (special tokens included). The
haystack holds the most whole filler sentences that keep the prompt at or under the target, so every
prompt is at most one sentence (a handful of tokens) short of it; the exact counts are reported.
Keys and depths come from `random.Random(f"{seed}/{length}")`: a run is reproducible, and adding a
length to the list does not change the samples of the others.

Standard errors: binomial sqrt(p(1-p)/n) per length; the overall mean over lengths treats the lengths
as independent estimates, sqrt(Σ SE²)/k.
"""

from __future__ import annotations

import math
import random
import re
import time

from mla.errors import UserError
from mla.evaluation.harness import mean_of_independent

FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
INSTRUCTION = ("There is an important piece of information hidden inside a lot of irrelevant text. "
               "Find it and memorize it. I will quiz you about it.")
QUESTION = "What is the pass key? The pass key is"
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
MAX_NEW_TOKENS = 10   # a 5-digit key is at most ~6 tokens, with a leading space


def needle_sentence(key: int) -> str:
    return NEEDLE.format(key=key)


def build_prompt(n_filler: int, key: int, depth: float) -> str:
    """The prompt with `n_filler` filler sentences and the needle after round(depth · n_filler) of them."""
    if not 0.0 <= depth <= 1.0:
        raise UserError(f"needle depth {depth} is outside [0, 1]")
    sentences = [FILLER[i % len(FILLER)] for i in range(n_filler)]
    sentences.insert(round(depth * n_filler), needle_sentence(key))
    return f"{INSTRUCTION}\n\n{' '.join(sentences)}\n\n{QUESTION}"


def count_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text)["input_ids"])


def fit_prompt(tokenizer, length: int, key: int, depth: float) -> tuple[str, int]:
    """(prompt, its token count): the most filler sentences whose prompt has at most `length` tokens."""
    lo_tokens = count_tokens(tokenizer, build_prompt(0, key, depth))
    if lo_tokens > length:
        raise UserError(f"context length {length} is shorter than the pass-key prompt without filler "
                        f"({lo_tokens} tokens)")
    # binary search for the largest n with tokens(n) <= length; each sentence adds >= 1 token, so n <= length
    lo, hi = 0, length
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count_tokens(tokenizer, build_prompt(mid, key, depth)) <= length:
            lo = mid
        else:
            hi = mid - 1
    prompt = build_prompt(lo, key, depth)
    return prompt, count_tokens(tokenizer, prompt)


def first_number(text: str) -> str | None:
    match = re.search(r"\d+", text)
    return match.group(0) if match else None


def is_correct(generated: str, key: int) -> bool:
    """The first digit run of the generated text is the key ("12345." and " 12345" are; "1234" is not)."""
    return first_number(generated) == str(key)


def binomial_stderr(correct: int, n: int) -> float:
    p = correct / n
    return math.sqrt(p * (1 - p) / n)


def default_depths(samples: int) -> list[float]:
    """`samples` depths evenly spread over [0, 1] (0.5 for a single sample)."""
    if samples == 1:
        return [0.5]
    return [i / (samples - 1) for i in range(samples)]


def draw_samples(tokenizer, length: int, samples: int, seed: int = 0, depths=None) -> list[dict]:
    """The `samples` prompts of one context length: key, depth, prompt text and its token count.

    depths: fractions used in turn (sample i gets depths[i % len]); None = evenly spread over [0, 1],
    in an order shuffled by the seed.
    """
    rng = random.Random(f"{seed}/{length}")
    if depths is None:
        order = default_depths(samples)
        rng.shuffle(order)
    else:
        if not depths:
            raise UserError("depths is empty")
        order = [float(depths[i % len(depths)]) for i in range(samples)]
    out = []
    for depth in order:
        key = rng.randint(10000, 99999)
        prompt, tokens = fit_prompt(tokenizer, length, key, depth)
        out.append({"key": key, "depth": depth, "prompt": prompt, "prompt_tokens": tokens})
    return out


def fitting_lengths(model, lengths: list[int], generate_kwargs: dict | None = None) -> list[int]:
    """The lengths whose prompt and generated tokens fit the model's max_position_embeddings (a workflow
    config lists lengths for several models: SmolLM-135M's window is 2,048 tokens, Llama-2-7B's 4,096)."""
    limit = _max_positions(model)
    new_tokens = (generate_kwargs or {}).get("max_new_tokens", MAX_NEW_TOKENS)
    return [n for n in lengths if limit is None or n + new_tokens <= limit]


def _max_positions(model) -> int | None:
    config = getattr(model, "config", None)
    return getattr(config, "max_position_embeddings", None)


def _generate_kwargs(tokenizer, generate_kwargs: dict | None) -> dict:
    kwargs = {"max_new_tokens": MAX_NEW_TOKENS, **(generate_kwargs or {})}
    if kwargs.get("do_sample") or kwargs.get("num_beams", 1) != 1:
        raise UserError("the pass-key check decodes greedily: do_sample and num_beams cannot be set")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    # temperature/top_p/top_k None: greedy decoding without warnings from a sampling generation_config
    kwargs.update(do_sample=False, num_beams=1, temperature=None, top_p=None, top_k=None)
    kwargs.setdefault("pad_token_id", pad)
    return kwargs


def _left_padded(tokenizer, prompts: list[str], pad_id: int, device):
    """input_ids and attention_mask of prompts padded on the left (the new tokens follow every prompt)."""
    import torch

    ids = [tokenizer(p)["input_ids"] for p in prompts]
    width = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for row, x in enumerate(ids):
        input_ids[row, width - len(x):] = torch.tensor(x)
        mask[row, width - len(x):] = 1
    return input_ids.to(device), mask.to(device)


def generate_answers(model, tokenizer, prompts: list[str], *, generate_kwargs: dict | None = None,
                     batch_size: int = 1, cache_factory=None) -> list[str]:
    """Greedy continuations (new tokens only, special tokens dropped) of each prompt.

    cache_factory: builds the cache of each `generate` call (a quantized one, mla.kv.quantized.cache_factory);
    None = the model's own."""
    import torch

    kwargs = _generate_kwargs(tokenizer, generate_kwargs)
    device = next(model.parameters()).device
    answers = []
    for start in range(0, len(prompts), batch_size):
        input_ids, mask = _left_padded(tokenizer, prompts[start:start + batch_size], kwargs["pad_token_id"], device)
        cache = {"cache": cache_factory()} if cache_factory is not None else {}
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=mask, **kwargs, **cache)
        answers += tokenizer.batch_decode(out[:, input_ids.shape[1]:], skip_special_tokens=True)
    return answers


def needle_accuracy(model, tokenizer, *, lengths: list[int], samples: int, seed: int = 0, depths=None,
                    generate_kwargs: dict | None = None, batch_size: int = 1, cache_factory=None) -> dict:
    """Pass-key accuracy per context length (prompt tokens) with binomial standard errors.

    Returns {"task", "seed", "samples", "max_new_tokens", "lengths": {length: {accuracy, stderr, n,
    correct, prompt_tokens_min, prompt_tokens_max, seconds, samples: [{key, depth, prompt_tokens,
    answer, correct}]}}, "mean", "mean_stderr", "seconds"}.
    UserError when a length plus the generated tokens exceeds the model's max_position_embeddings.
    """
    if samples < 1:
        raise UserError(f"samples must be at least 1, got {samples}")
    if batch_size < 1:
        raise UserError(f"batch_size must be at least 1, got {batch_size}")
    if not lengths:
        raise UserError("no context lengths given")
    new_tokens = _generate_kwargs(tokenizer, generate_kwargs)["max_new_tokens"]
    limit = _max_positions(model)
    for length in lengths:
        if limit is not None and length + new_tokens > limit:
            raise UserError(f"context length {length} + {new_tokens} generated tokens exceeds the model's "
                            f"max_position_embeddings = {limit}")
    t_all = time.perf_counter()
    per_length = {}
    for length in lengths:
        t0 = time.perf_counter()
        drawn = draw_samples(tokenizer, length, samples, seed, depths)
        answers = generate_answers(model, tokenizer, [d["prompt"] for d in drawn],
                                   generate_kwargs=generate_kwargs, batch_size=batch_size,
                                   cache_factory=cache_factory)
        records = [{"key": d["key"], "depth": d["depth"], "prompt_tokens": d["prompt_tokens"], "answer": a,
                    "correct": is_correct(a, d["key"])} for d, a in zip(drawn, answers)]
        correct = sum(r["correct"] for r in records)
        tokens = [r["prompt_tokens"] for r in records]
        per_length[length] = {"accuracy": correct / samples, "stderr": binomial_stderr(correct, samples),
                              "n": samples, "correct": correct,
                              "prompt_tokens_min": min(tokens), "prompt_tokens_max": max(tokens),
                              "seconds": round(time.perf_counter() - t0, 3), "samples": records}
    mean, mean_se = mean_of_independent([r["accuracy"] for r in per_length.values()],
                                        [r["stderr"] for r in per_length.values()])
    return {"task": "passkey", "seed": seed, "samples": samples, "max_new_tokens": new_tokens,
            "lengths": per_length, "mean": mean, "mean_stderr": mean_se,
            "seconds": round(time.perf_counter() - t_all, 3)}


# ---------------------------------------------------------------- teacher-forced score
def answer_ids(tokenizer, key: int) -> list[int]:
    """The tokens of the answer " NNNNN" that follows the question (no special tokens)."""
    return tokenizer(f" {key}", add_special_tokens=False)["input_ids"]


def _key_scores(model, tokenizer, drawn: list[dict], batch_size: int) -> list[dict]:
    """Per prompt: mean log-probability of the answer's tokens given the prompt and the answer's earlier
    tokens (teacher-forced), and whether each of them is the argmax. Batches are right-padded: a causal model
    sees no padding before a scored position."""
    import torch

    device = next(model.parameters()).device
    head = model.get_output_embeddings()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    out = []
    with torch.no_grad():
        for start in range(0, len(drawn), batch_size):
            chunk = drawn[start:start + batch_size]
            prompts = [tokenizer(d["prompt"])["input_ids"] for d in chunk]
            answers = [answer_ids(tokenizer, d["key"]) for d in chunk]
            width = max(len(p) + len(a) for p, a in zip(prompts, answers))
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, (p, a) in enumerate(zip(prompts, answers)):
                ids[row, :len(p) + len(a)] = torch.tensor(p + a)
                mask[row, :len(p) + len(a)] = 1
            # the body once, the LM head only where an answer token is predicted
            hidden = model.get_decoder()(input_ids=ids.to(device), attention_mask=mask.to(device),
                                         use_cache=False).last_hidden_state
            for row, (d, p, a) in enumerate(zip(chunk, prompts, answers)):
                # the answer's token j is predicted at position len(p) − 1 + j
                scored = head(hidden[row, len(p) - 1:len(p) - 1 + len(a)]).float().log_softmax(-1)
                target = torch.tensor(a, device=scored.device)
                logprob = scored.gather(1, target[:, None]).squeeze(1)
                out.append({"key": d["key"], "depth": d["depth"], "prompt_tokens": len(p), "answer_tokens": len(a),
                            "key_logprob": float(logprob.mean()),
                            "all_argmax": bool((scored.argmax(-1) == target).all()),
                            "first_argmax": bool(scored[0].argmax() == target[0])})
    return out


SCORED_TOKENS_PER_BATCH = 4096   # teacher-forced prompts per forward pass: 16 of 256 tokens, 1 of 4,000


def passkey_scores(model, tokenizer, *, lengths: list[int], samples: int, seed: int = 0,
                   batch_size: int | None = None) -> dict:
    """The pass-key task teacher-forced: per length, `samples` prompts (draw_samples) with the true answer
    " NNNNN" appended, scored in one forward pass each. A model can retrieve a key it does not yet write first
    (a thin margin): these scores see that, greedy decoding of a few prompts does not.

    Per length: `key_logprob` (mean over prompts of the mean log-probability of the answer's tokens) ± its SE
    over prompts, `all_argmax` (share of prompts whose answer tokens are all the argmax: greedy decoding would
    write the key right after the question) ± binomial SE, `first_argmax` (the answer's first token). `mean_*`:
    over lengths, as independent estimates. Lengths beyond the model's positions are left out
    (`lengths_skipped`). `batch_size` None: as many prompts per forward pass as fit SCORED_TOKENS_PER_BATCH
    tokens, so that the paper's 4,000-token prompts do not batch like 256-token ones.
    """
    from mla.stats import mean_and_stderr  # lazy: numpy; the workflow's parse reads EvalOptions beside this

    if samples < 1:
        raise UserError(f"samples must be at least 1, got {samples}")
    if not lengths:
        raise UserError("no context lengths given")
    t_all = time.perf_counter()
    fitting = fitting_lengths(model, lengths, {"max_new_tokens": 8})     # " NNNNN": at most 6 answer tokens
    per_length = {}
    for length in fitting:
        t0 = time.perf_counter()
        batch = batch_size or max(1, SCORED_TOKENS_PER_BATCH // length)
        records = _key_scores(model, tokenizer, draw_samples(tokenizer, length, samples, seed), batch)
        logprob, logprob_se = mean_and_stderr([r["key_logprob"] for r in records])
        hits = sum(r["all_argmax"] for r in records)
        first = sum(r["first_argmax"] for r in records)
        per_length[length] = {"key_logprob": logprob, "key_logprob_stderr": logprob_se,
                              "all_argmax": hits / samples, "all_argmax_stderr": binomial_stderr(hits, samples),
                              "first_argmax": first / samples,
                              "first_argmax_stderr": binomial_stderr(first, samples),
                              "n": samples, "seconds": round(time.perf_counter() - t0, 3), "samples": records}
    out = {"task": "passkey_scored", "seed": seed, "samples": samples, "lengths": per_length,
           "lengths_skipped": sorted(set(lengths) - set(fitting))}
    for name in ("key_logprob", "all_argmax"):
        values = [r[name] for r in per_length.values()]
        stderrs = [r[f"{name}_stderr"] for r in per_length.values()]
        out[f"mean_{name}"], out[f"mean_{name}_stderr"] = mean_of_independent(values, stderrs) if values else (None, None)
    out["seconds"] = round(time.perf_counter() - t_all, 3)
    return out
