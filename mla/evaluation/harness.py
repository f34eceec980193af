"""Benchmark accuracy through EleutherAI's lm-eval harness, with the model object as an `HFLM`.

Two task sets:
  - the offline default `mla_stdlib_next_line` (mla/lm_eval_tasks): runs everywhere, no Hub;
  - the paper's six commonsense tasks (zero-shot, length-normalised accuracy): HellaSwag,
    ARC-Easy + ARC-Challenge (one column: their mean), PIQA, WinoGrande, OpenBookQA, MMLU in cloze
    form (lm-eval's `mmlu_continuation`: "Question: ...\nAnswer:" with the answer texts as choices).
    They download datasets from the Hugging Face Hub; offline they are skipped with the reason, never
    filled in. Average = unweighted mean of the six columns, as the paper computes it.

Differences from the paper's harness (lighteval, `loglikelihood_acc_norm_nospace`): lm-eval's
acc_norm divides by the byte length of the continuation; WinoGrande in lm-eval scores the partial
sentence and reports `acc` only, which is used for that column.
"""

from __future__ import annotations

import logging
import os
import socket

from mla.lm_eval_tasks import LOCAL_TASK, TASKS_DIR

# paper column -> lm-eval task(s) whose acc_norm (acc where absent) make the column
PAPER_TASKS = {
    "mmlu": ("mmlu_continuation",),
    "arc": ("arc_easy", "arc_challenge"),
    "piqa": ("piqa",),
    "hellaswag": ("hellaswag",),
    "openbookqa": ("openbookqa",),
    "winogrande": ("winogrande",),
}


def hub_unreachable_reason(timeout: float = 3.0) -> str | None:
    """Why the Hub's datasets cannot be fetched now (offline flag or no connection), or None."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{var} is set"
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
    except OSError as exc:
        return f"huggingface.co is unreachable ({exc.__class__.__name__}: {exc})"
    return None


def run_tasks(model, tokenizer, tasks: list[str], *, include_path=None, include_defaults: bool = True,
              metadata: dict | None = None, limit: int | float | None = None, batch_size: int = 8) -> dict:
    """`lm_eval.simple_evaluate` on an in-memory model; returns lm-eval's results dict."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=batch_size)
    manager = TaskManager(include_path=str(include_path) if include_path else None,
                          include_defaults=include_defaults, metadata=metadata)
    return simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, num_fewshot=0, limit=limit,
                           bootstrap_iters=0, log_samples=False)


def _metric(result: dict, name: str):
    for key in (f"{name},none", name):
        if key in result and isinstance(result[key], (int, float)):
            return float(result[key])
    return None


def local_task(model, tokenizer, *, num_docs: int = 200, seed: int = 1234, context_lines: int = 6,
               validation_fraction: float = 0.05, batch_size: int = 8) -> dict:
    """Accuracy on `mla_stdlib_next_line` (4 choices: chance is 0.25)."""
    meta = {"num_docs": num_docs, "seed": seed, "context_lines": context_lines,
            "validation_fraction": validation_fraction}
    res = run_tasks(model, tokenizer, [LOCAL_TASK], include_path=TASKS_DIR, include_defaults=False,
                    metadata=meta, batch_size=batch_size)
    r = res["results"][LOCAL_TASK]
    n = res.get("n-samples", {}).get(LOCAL_TASK, {}).get("effective", num_docs)
    return {"task": LOCAL_TASK, "harness": "lm-eval", "num_fewshot": 0, "n": int(n), **meta,
            "acc": _metric(r, "acc"), "acc_norm": _metric(r, "acc_norm")}


def _column_score(results: dict, n_samples: dict, names: tuple[str, ...]) -> float | None:
    """acc_norm (acc where lm-eval has none) of a paper column; MMLU = size-weighted over its subjects."""
    if names == ("mmlu_continuation",):
        parts = [(k, v) for k, v in results.items() if k.startswith("mmlu_") and k.endswith("_continuation")
                 and _metric(v, "acc_norm") is not None and k in n_samples]
        if not parts:
            return None
        total = sum(n_samples[k]["effective"] for k, _ in parts)
        return sum(_metric(v, "acc_norm") * n_samples[k]["effective"] for k, v in parts) / total
    values = []
    for name in names:
        r = results.get(name, {})
        v = _metric(r, "acc_norm")
        values.append(v if v is not None else _metric(r, "acc"))
    return None if any(v is None for v in values) else sum(values) / len(values)


def paper_tasks(model, tokenizer, *, limit: int | float | None = None, batch_size: int = 8) -> dict:
    """The paper's six columns and their average, or {"status": "skipped", "reason": ...} offline."""
    reason = hub_unreachable_reason()
    if reason:
        return {"status": "skipped", "reason": f"the paper's six benchmark tasks need the Hugging Face Hub: {reason}",
                "tasks": {k: list(v) for k, v in PAPER_TASKS.items()}}
    names = [n for group in PAPER_TASKS.values() for n in group]
    res = run_tasks(model, tokenizer, names, limit=limit, batch_size=batch_size)
    scores = {col: _column_score(res["results"], res.get("n-samples", {}), group)
              for col, group in PAPER_TASKS.items()}
    missing = [c for c, v in scores.items() if v is None]
    avg = None if missing else sum(scores.values()) / len(scores)
    return {"status": "ok" if not missing else "partial", "harness": "lm-eval", "num_fewshot": 0,
            "metric": "acc_norm", "limit": limit, "scores": scores, "average": avg, "missing": missing,
            "tasks": {k: list(v) for k, v in PAPER_TASKS.items()}}
