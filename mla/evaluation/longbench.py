"""LongBench (Bai et al. 2024) through lm-eval: the 16 English tasks of the MHA2MLA paper's LongBench table.

lm-eval's own task definitions (prompts, generation lengths, metrics from the LongBench repository)
are used unchanged; every task reports `score` in [0, 1] (QA F1, ROUGE-L, classification/retrieval/count
accuracy or code edit similarity, by task; the paper prints it x100), with lm-eval's closed-form SE.
The mean over tasks is unweighted, as LongBench averages, with SE sqrt(Σ SE²)/16 (independent tasks).

Differences from LongBench's own script: a prompt longer than the context window is cut on the left by
lm-eval (LongBench keeps its head and tail), and no chat template is applied.

The documents (dataset Xnhyacinth/LongBench, split test of each subset) come from local JSON lines when
$MLA_LM_EVAL_DATA=DIR holds them, in the paper tasks' layout (mla/evaluation/harness.py):

    DIR/Xnhyacinth/LongBench/<subset>/test.jsonl      (e.g. .../hotpotqa/test.jsonl)

which `mla prefetch --longbench auto` writes on a host with network access for evaluation jobs that run
offline; otherwise from the Hugging Face Hub; when neither is there the evaluation is skipped with the
reason, before any lm-eval task is loaded. lm-eval reads the columns `context`, `question`, `answers`
(a list) and, for TREC, `all_classes`; `write_local_data` writes stand-in rows in that schema (with
LongBench's other columns) for tests and the offline rehearsal.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
from pathlib import Path

from mla.errors import UserError
from mla.evaluation import harness

DATASET = "Xnhyacinth/LongBench"

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


def task_configs(manager=None) -> dict[str, dict]:
    """lm-eval's full config of each of the 16 tasks (YAML with !function resolved), by task name."""
    from lm_eval.tasks._yaml_loader import load_yaml

    manager = manager or task_manager()
    return {t: load_yaml(manager.task_index[t].yaml_path, resolve_func=True) for t in LONGBENCH_TASKS.values()}


def local_folder(root: str | Path) -> Path:
    return Path(root) / DATASET


def local_root() -> str | None:
    """$MLA_LM_EVAL_DATA when it holds LongBench documents (the folder named in the module docstring)."""
    root = os.environ.get(harness.LOCAL_DATA_ENV)
    return root if root and local_folder(root).is_dir() else None


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
    root = local_root()
    if root is None:
        reason = harness.hub_unreachable_reason()
        if reason:
            return {"status": "skipped", "skipped": f"LongBench needs the Hugging Face Hub (dataset {DATASET}) or "
                                                    f"its documents staged by `mla prefetch --longbench auto` "
                                                    f"(${harness.LOCAL_DATA_ENV}): {reason}", "tasks": tasks}
    missing = missing_metric_modules()
    if missing:
        raise UserError(f"LongBench's metrics need {', '.join(missing)}: pip install 'lm_eval[longbench]'")
    limit_pos = getattr(model.config, "max_position_embeddings", None)
    if max_length is not None and (max_length < 1 or (limit_pos and max_length > limit_pos)):
        raise UserError(f"LongBench max_length {max_length} must be in [1, max_position_embeddings = {limit_pos}]")
    manager = task_manager()
    to_run = harness.local_configs(root, task_configs(manager)) if root else tasks
    res = harness.run_tasks(model, tokenizer, to_run, limit=limit, batch_size=batch_size,
                            task_manager=manager, max_length=max_length)
    out = summarise(res["results"], res.get("n-samples", {}))
    return {**out, "harness": "lm-eval", "metric": "score (fraction, the paper prints x100)", "limit": limit,
            "max_length": max_length or limit_pos, "max_length_unit": "prompt tokens (cut on the left)",
            "documents": f"local files under {root}" if root else "Hugging Face Hub", "tasks": tasks}


# -- stand-in documents --------------------------------------------------------------------------------

TREC_CLASSES = ["Abbreviation", "Entity", "Description", "Human being", "Location", "Numeric value"]


def _row(subset: str, rng: random.Random, i: int) -> dict:
    """One stand-in document of a subset in LongBench's columns (question/context/answers as lm-eval reads)."""
    text = lambda n: harness._text(rng, n)   # noqa: E731
    paragraphs = [f"Paragraph {k + 1}: {text(30)}." for k in range(3)]
    question, answer, classes = text(8) + "?", text(3), None
    if subset == "trec":
        classes = TREC_CLASSES
        answer = rng.choice(classes)
        context = "\n".join(f"Question: {text(6)}?\nType: {rng.choice(classes)}" for _ in range(4))
        question = f"Question: {text(6)}?\nType:"
    elif subset == "passage_count":
        context, question, answer = "\n\n".join(paragraphs + paragraphs[:1]), "", "3"
    elif subset == "passage_retrieval_en":
        pick = rng.randrange(3)
        context, question, answer = "\n\n".join(paragraphs), paragraphs[pick].split(": ", 1)[1], f"Paragraph {pick + 1}"
    elif subset in ("lcc", "repobench-p"):
        lines = [f"{text(1)}_{k} = {text(1)}({k})" for k in range(12)]
        context, answer = "\n".join(lines[:-1]) + "\n", lines[-1]
        question = "" if subset == "lcc" else f"# {text(4)}\n"
    elif subset in ("gov_report", "multi_news"):
        context, question, answer = "\n".join(paragraphs), "", text(25) + "."
    else:   # question answering, qmsum's queries, samsum's dialogue
        context = "\n".join(paragraphs)
    return {"question": question, "context": context, "answers": [answer], "length": len(context.split()),
            "dataset": subset, "language": "en", "all_classes": classes, "_id": f"stand-in-{subset}-{i}"}


def write_local_data(root: str | Path, *, rows_per_task: int, seed: int = 0) -> dict:
    """`rows_per_task` stand-in rows of each of the 16 subsets under `root` (layout: module docstring);
    returns {"MLA_LM_EVAL_DATA": root}."""
    if rows_per_task < 1:
        raise ValueError("rows_per_task must be at least 1")
    for cfg in task_configs().values():
        folder = harness.local_data_folder(root, cfg)
        folder.mkdir(parents=True, exist_ok=True)
        rng = random.Random(f"{seed}/{cfg['dataset_name']}")
        rows = [_row(cfg["dataset_name"], rng, i) for i in range(rows_per_task)]
        (folder / f"{cfg['test_split']}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {harness.LOCAL_DATA_ENV: str(root)}
