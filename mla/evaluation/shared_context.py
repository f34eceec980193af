"""Multiple-choice log-likelihoods with each question's context run once (an lm-eval HFLM).

lm-eval's HFLM scores every (context, choice) pair with its own forward over context + choice. In
MMLU's cloze form the context (topic line and question: tens to thousands of tokens) is much longer
than an answer (a few tokens), so four forwards per question process the context four times.
`SharedContextLM` groups the requests by context and, for a batch of contexts:

  1. runs the contexts once with the KV cache on (for an MLA model this is its latent cache, MLACache:
     only c_kv and the RoPE keys are kept, and copied);
  2. reads the log-probability of every choice's first token from its context's last logits;
  3. runs the rest of every longer choice on top of a copy of its context's cache rows
     (`batch_select_indices` on a shallow copy of the cache: the batch's cache itself stays intact).

Tokens through the model per question: |context| + Σ(|choice| − 1) plus padding, instead of
Σ(|context| + |choice| − 1). Padding is what is left to waste, so it is kept small: contexts are taken
longest first and a batch ends early where a context is shorter than CONTEXT_KEEP of the batch's
longest; the choice rows of a batch, sorted by length, are split into at most MAX_CHOICE_BATCHES
forwards at the cuts that pad least. Within a forward, contexts are right-padded (pads after the real
tokens are invisible to them under the causal mask); choice rows carry an attention mask that hides
their context's pad slots and position ids that continue their own context. A request too long for
the model (which lm-eval would truncate from the left) goes through HFLM's own path. Results
(log-likelihood, is-greedy) and their order are exactly HFLM's.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from lm_eval.models.huggingface import HFLM

DEFAULT_CONTEXTS_PER_BATCH = 8      # when lm-eval's batch size is "auto"
CONTEXT_KEEP = 0.8                  # a context batch ends before a context shorter than this × its longest
MAX_CHOICE_BATCHES = 3              # forwards over the choice rows of one context batch, at most


@contextmanager
def count_tokens(model):
    """Count the token positions of every forward of `model` (pads included: they are computed too)."""
    counter = {"tokens": 0, "forwards": 0}

    def hook(_module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        counter["tokens"] += int(ids.numel())
        counter["forwards"] += 1

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield counter
    finally:
        handle.remove()


class SharedContextLM(HFLM):
    """HFLM whose log-likelihood requests share one forward (and one KV cache) per distinct context."""

    def _contexts_per_batch(self, override_bs) -> int:
        if override_bs:
            return int(override_bs)
        return self.batch_size if isinstance(self.batch_size, int) else DEFAULT_CONTEXTS_PER_BATCH

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        if self.backend != "causal":
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        results: list = [None] * len(requests)
        groups: dict[tuple[int, ...], list[int]] = {}
        too_long = []
        for i, (_, ctx, cont) in enumerate(requests):
            if len(ctx) + len(cont) - 1 > self.max_length:
                too_long.append(i)
            else:
                groups.setdefault(tuple(ctx), []).append(i)
        if too_long:
            plain = super()._loglikelihood_tokens([requests[i] for i in too_long], disable_tqdm=True)
            for i, answer in zip(too_long, plain, strict=True):
                results[i] = answer
        contexts = sorted(groups, key=lambda c: (-len(c), c))   # longest first, as HFLM: memory errors show early
        for chunk in context_batches(contexts, self._contexts_per_batch(override_bs)):
            for i, answer in self._score_contexts(chunk, [[requests[i] for i in groups[c]] for c in chunk],
                                                  [groups[c] for c in chunk]):
                results[i] = answer
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
        return results

    def _forward(self, **kwargs):
        with torch.no_grad(), torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                                             enabled=self.mixed_precision_dtype is not None):
            return self.model(use_cache=True, **kwargs)

    def _score_contexts(self, contexts, reqs, indices):
        """(request index, (log-likelihood, is_greedy)) for every request of these contexts."""
        device = self.device
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eot_token_id
        lens = torch.tensor([len(c) for c in contexts], device=device)
        ids = torch.full((len(contexts), int(lens.max())), pad, dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for b, ctx in enumerate(contexts):
            ids[b, :len(ctx)] = torch.tensor(ctx, dtype=torch.long, device=device)
            mask[b, :len(ctx)] = 1
        # logits only where the contexts end (the LM head over every position would be wasted work)
        ends, where = torch.unique(lens - 1, return_inverse=True)
        out = self._forward(input_ids=ids, attention_mask=mask, logits_to_keep=ends)
        first = F.log_softmax(out.logits[torch.arange(len(contexts), device=device), where], dim=-1,
                              dtype=self.softmax_dtype)                                  # [B, V]

        # every choice: (its context's row b, request index, tokens); log P(token 1) from `first`
        choices = [(b, i, cont) for b, (group, idx) in enumerate(zip(reqs, indices))
                   for (_, _, cont), i in zip(group, idx)]
        scored = {r: (first[b, cont[0]], first[b].argmax() == cont[0]) for r, (b, _, cont) in enumerate(choices)}
        # the rest of each longer choice on its context's cache rows, longest first, in few forwards
        longer = sorted((r for r, (_, _, cont) in enumerate(choices) if len(cont) > 1),
                        key=lambda r: -len(choices[r][2]))
        for part in split_rows([len(choices[r][2]) - 1 for r in longer]):
            rows = [longer[k] for k in part]
            which = torch.tensor([choices[r][0] for r in rows], device=device)
            steps = len(choices[rows[0]][2]) - 1
            inputs = torch.full((len(rows), steps), pad, dtype=torch.long, device=device)
            targets = torch.zeros_like(inputs)
            for k, r in enumerate(rows):
                cont = torch.tensor(choices[r][2], dtype=torch.long, device=device)
                inputs[k, :len(cont) - 1], targets[k, :len(cont) - 1] = cont[:-1], cont[1:]
            attn = torch.cat([mask[which], torch.ones_like(inputs)], dim=1)
            positions = lens[which, None] + torch.arange(steps, device=device)
            logits = self._forward(input_ids=inputs, attention_mask=attn, position_ids=positions,
                                   cache=cache_rows(out.cache, which)).logits
            logp = F.log_softmax(logits, dim=-1, dtype=self.softmax_dtype)              # [rows, steps, V]
            token_logp = logp.gather(-1, targets[..., None])[..., 0]
            hits = logp.argmax(-1) == targets
            for k, r in enumerate(rows):
                n = len(choices[r][2]) - 1
                head, head_hit = scored[r]
                scored[r] = (head + token_logp[k, :n].sum(), head_hit & hits[k, :n].all())
        for r, (_, i, _) in enumerate(choices):
            logp, greedy = scored[r]
            yield i, (float(logp), bool(greedy))


def context_batches(contexts: list, per_batch: int, keep: float = CONTEXT_KEEP) -> list[list]:
    """Consecutive batches of contexts sorted longest first: at most `per_batch`, and a batch ends
    before a context shorter than `keep` × its first (so no batch is mostly padding)."""
    batches: list[list] = []
    for ctx in contexts:
        if not batches or len(batches[-1]) == per_batch or len(ctx) < keep * len(batches[-1][0]):
            batches.append([])
        batches[-1].append(ctx)
    return batches


def split_rows(lengths: list[int], max_parts: int = MAX_CHOICE_BATCHES) -> list[range]:
    """Cut rows sorted by length (longest first) into at most `max_parts` consecutive parts with the
    fewest padded tokens Σ rows × longest (dynamic programming over the cut points)."""
    n = len(lengths)
    if n == 0:
        return []
    parts = min(max_parts, n)
    inf = float("inf")
    cost = [[inf] * (n + 1) for _ in range(parts + 1)]     # cost[g][j]: rows [0, j) in g parts
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    cost[0][0] = 0
    for g in range(1, parts + 1):
        for j in range(1, n + 1):
            for i in range(g - 1, j):
                c = cost[g - 1][i] + (j - i) * lengths[i]
                if c < cost[g][j]:
                    cost[g][j], cut[g][j] = c, i
    g = min(range(1, parts + 1), key=lambda k: (cost[k][n], k))
    bounds, j = [], n
    while g:
        i = cut[g][j]
        bounds.append(range(i, j))
        j, g = i, g - 1
    return bounds[::-1]


def cache_rows(cache, index: torch.Tensor):
    """A cache holding rows `index` of `cache` (repeats allowed), which itself is left untouched:
    a shallow copy with copied layers, whose `batch_select_indices` rebinds new indexed tensors."""
    rows = copy.copy(cache)
    rows.layers = [copy.copy(layer) for layer in cache.layers]
    for layer in rows.layers:
        layer.batch_select_indices(index)
    return rows
