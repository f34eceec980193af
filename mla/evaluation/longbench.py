"""LongBench (Bai et al. 2024) through lm-eval: the 16 English tasks of the MHA2MLA paper's LongBench table.

lm-eval's own task definitions (prompts, generation lengths, metrics from the LongBench repository)
are used unchanged; every task reports `score` in [0, 1] (QA F1, ROUGE-L, classification/retrieval/count
accuracy or code edit similarity, by task; the paper prints it x100), with lm-eval's closed-form SE.
The mean over tasks is unweighted, as LongBench averages, with SE sqrt(Σ SE²)/16 (independent tasks).

Differences from LongBench's own script: a prompt longer than the context window is cut on the left by
lm-eval (LongBench keeps its head and tail), and no chat template is applied.

The documents come from the Hugging Face Hub (dataset Xnhyacinth/LongBench); when it is unreachable the
evaluation is skipped with the reason, before any lm-eval task is loaded.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from mla.errors import UserError
from mla.evaluation import harness

# the paper's column -> lm-eval task
LONGBENCH_TASKS = {
    "NarrativeQA": "longbench_narrativeqa",
    "Qasper": "longbench_qasper",
    "MultiFieldQA-en": "longbench_multifieldqa_en",
    "HotpotQA": "longbench_hotpotqa",
    "2WikiMQA": "longbench_2wikimqa",
    "MuSiQue": "longbench_musique",
    "GovReport": "longbench_gov_report",
    "QMSum": "longbench_qmsum",
    "MultiNews": "longbench_multi_news",
    "TREC": "longbench_trec",
    "TriviaQA": "longbench_triviaqa",
    "SAMSum": "longbench_samsum",
    "PassageCount": "longbench_passage_count",
    "PassageRetrieval-en": "longbench_passage_retrieval_en",
    "LCC": "longbench_lcc",
    "RepoBench-P": "longbench_repobench-p",
}
# lm-eval's LongBench metrics import these at task load (extra `lm_eval[longbench]`)
METRIC_MODULES = ("jieba", "fuzzywuzzy", "rouge")


def task_manager():
    """A TaskManager over lm-eval's longbench folder only (milliseconds instead of indexing every task)."""
    import lm_eval.tasks
    from lm_eval.tasks import TaskManager

    root = Path(lm_eval.tasks.__file__).resolve().parent
    return TaskManager(include_defaults=False, include_path=[str(root / "longbench")])


def missing_metric_modules() -> list[str]:
    return [m for m in METRIC_MODULES if importlib.util.find_spec(m) is None]


def summarise(results: dict, n_samples: dict) -> dict:
    """Per-task score, stderr and n from lm-eval's results, and their unweighted mean ± SE."""
    per_task, missing = {}, []
    for column, task in LONGBENCH_TASKS.items():
        r = results.get(task, {})
        score = r.get("score,none")
        if not isinstance(score, (int, float)):
            missing.append(column)
            continue
        se = r.get("score_stderr,none")
        per_task[column] = {"task": task, "score": float(score),
                            "stderr": float(se) if isinstance(se, (int, float)) else None,
                            "n": int(n_samples.get(task, {}).get("effective", 0))}
    mean, mean_se = (None, None)
    if not missing:
        mean, mean_se = harness.mean_of_independent([t["score"] for t in per_task.values()],
                                                    [t["stderr"] for t in per_task.values()])
    return {"status": "ok" if not missing else "partial", "scores": per_task, "mean": mean,
            "mean_stderr": mean_se, "missing": missing}


def longbench(model, tokenizer, *, limit=None, max_length=None, batch_size=1) -> dict:
    """The paper's 16 English LongBench tasks: per-task score ± SE and their mean ± SE.

    limit: documents per task (lm-eval's --limit); max_length: prompt window in tokens (default: the
    model's max_position_embeddings). Hub unreachable -> {"status": "skipped", "skipped": reason, ...}.
    """
    tasks = list(LONGBENCH_TASKS.values())
    reason = harness.hub_unreachable_reason()
    if reason:
        return {"status": "skipped", "skipped": f"LongBench needs the Hugging Face Hub (dataset "
                                                f"Xnhyacinth/LongBench): {reason}", "tasks": tasks}
    missing = missing_metric_modules()
    if missing:
        raise UserError(f"LongBench's metrics need {', '.join(missing)}: pip install 'lm_eval[longbench]'")
    limit_pos = getattr(model.config, "max_position_embeddings", None)
    if max_length is not None and (max_length < 1 or (limit_pos and max_length > limit_pos)):
        raise UserError(f"LongBench max_length {max_length} must be in [1, max_position_embeddings = {limit_pos}]")
    res = harness.run_tasks(model, tokenizer, tasks, limit=limit, batch_size=batch_size,
                            task_manager=task_manager(), max_length=max_length)
    out = summarise(res["results"], res.get("n-samples", {}))
    return {**out, "harness": "lm-eval", "metric": "score", "limit": limit,
            "max_length": max_length or limit_pos, "tasks": tasks}
