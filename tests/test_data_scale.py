"""`mla data` at scale, on CPU-sized corpora: memory flat in the corpus size, SIGKILL then rerun
(resume from a checkpoint, or a clean restart), never a half-written folder that looks finished."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mla.data import build_dataset, read_manifest
from mla.errors import UserError

BLOCK = 64


def write_corpus(root: Path, copies: int) -> Path:
    """A text_files corpus: `copies` variants of every pydoc topic (~190k tiny-tokenizer tokens per copy)."""
    from pydoc_data.topics import topics

    for c in range(copies):
        folder = root / f"copy{c:03d}"
        folder.mkdir(parents=True)
        for key in sorted(topics):
            (folder / f"{key}.txt").write_text(f"Copy {c} of the topic {key}.\n\n{topics[key]}")
    corpus = root / "corpus.yaml"
    corpus.write_text(f"name: topics\nsources:\n  - name: topics\n    weight: 1\n    kind: text_files\n"
                      f"    root: {root}\n    glob: '*/*.txt'\n")
    return corpus


CHILD = """
import json, os, resource, signal, sys
from mla.data import build_dataset
args = json.loads(sys.argv[1])
kill_at = args.pop("kill_at_checkpoint", None)   # fault injection: SIGKILL once that checkpoint is written
def on_checkpoint(n):
    if n == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
m = build_dataset(**args, log=lambda *_: None, on_checkpoint=on_checkpoint)
print(json.dumps({"self_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "children_kb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
                  "tokens": m["splits"]["train"]["tokens"]}))
"""


def build_in_subprocess(**kwargs) -> subprocess.CompletedProcess:
    """build_dataset(**kwargs) in a child process; kill_at_checkpoint=N: it SIGKILLs itself there."""
    kwargs = {k: str(v) if isinstance(v, Path) else v for k, v in kwargs.items()}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", CHILD, json.dumps(kwargs)], env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_peak_memory_does_not_grow_with_the_corpus(tokenizer_dir, tmp_path):
    """Main process + its largest worker, for corpora of ~1.5M and ~15M tokens (the whole corpus each time):
    keeping the tokens in Python lists, as before, would add ~0.5 GB to the second."""
    peaks = []
    for copies in (8, 80):
        corpus = write_corpus(tmp_path / f"c{copies}", copies)
        run = build_in_subprocess(corpus=corpus, tokenizer_path=tokenizer_dir, out_dir=tmp_path / f"out{copies}",
                                  block_length=BLOCK, train_tokens=None, validation_tokens=None, workers=2)
        assert run.returncode == 0, run.stderr[-3000:]
        result = json.loads(run.stdout.strip().splitlines()[-1])
        peaks.append((result["self_kb"] + result["children_kb"], result["tokens"]))
        print(f"{copies} copies: {result['tokens']:,} train tokens, peak RSS main {result['self_kb'] / 1024:.0f} MiB"
              f" + largest worker {result['children_kb'] / 1024:.0f} MiB")
    (small, small_tokens), (large, large_tokens) = peaks
    assert large_tokens > 9 * small_tokens
    assert large < 1.3 * small, f"peak RSS {large / 1024:.0f} MiB vs {small / 1024:.0f} MiB"


# -- SIGKILL and rerun -----------------------------------------------------------------------------------

def _request(corpus, tokenizer_dir, out):
    return dict(corpus=corpus, tokenizer_path=tokenizer_dir, out_dir=out, block_length=BLOCK, train_tokens=60_000,
                validation_tokens=6_000, workers=2, checkpoint_tokens=5_000)


def _hashes(manifest):
    return {s: manifest["splits"][s]["sha256"] for s in ("train", "validation")}


@pytest.fixture(scope="module")
def kill_corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("killcorpus"), 2)


@pytest.fixture(scope="module")
def clean_build(kill_corpus, tokenizer_dir, tmp_path_factory):
    """The reference: the same request built in one go; (manifest, folder)."""
    out = tmp_path_factory.mktemp("clean") / "data"
    return build_dataset(**_request(kill_corpus, tokenizer_dir, out), log=lambda *_: None), out


def test_killed_at_a_checkpoint_then_rerun_resumes_to_the_same_bytes(kill_corpus, tokenizer_dir, clean_build,
                                                                      tmp_path):
    out = tmp_path / "data"
    run = build_in_subprocess(**_request(kill_corpus, tokenizer_dir, out), kill_at_checkpoint=5)
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    assert not out.exists()                                   # nothing that looks finished
    partial = tmp_path / ".data.partial"
    state = json.loads((partial / "state.json").read_text())
    assert state["checkpoints"] == 5 and 0 < state["plans"]["train"]["tokens"][0] < 60_000
    assert not (partial / "manifest.json").exists()
    logged = []
    manifest = build_dataset(**_request(kill_corpus, tokenizer_dir, out), log=logged.append)
    assert any(line.startswith("resuming from checkpoint 5") for line in logged), logged
    assert _hashes(manifest) == _hashes(clean_build[0])
    for name in ("documents-train.tsv", "documents-validation.tsv"):
        assert (out / name).read_bytes() == (clean_build[1] / name).read_bytes()
    assert not partial.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["data"]
    assert "up to date" in _rerun_log(kill_corpus, tokenizer_dir, out)


def _rerun_log(corpus, tokenizer_dir, out) -> str:
    logged = []
    build_dataset(**_request(corpus, tokenizer_dir, out), log=logged.append)
    return "\n".join(logged)


def test_sigkill_at_any_moment_then_rerun_gives_the_same_bytes(kill_corpus, tokenizer_dir, clean_build, tmp_path):
    """A real SIGKILL from outside (the whole process group, as a scheduler does) while the build runs."""
    out = tmp_path / "data"
    kwargs = {k: str(v) if isinstance(v, Path) else v for k, v in _request(kill_corpus, tokenizer_dir, out).items()}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(kwargs)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    state = tmp_path / ".data.partial" / "state.json"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if state.is_file() and json.loads(state.read_text() or "{}").get("checkpoints", 0) >= 3:
            break
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the build ended before it could be killed"
    assert not out.exists()
    manifest = build_dataset(**_request(kill_corpus, tokenizer_dir, out), log=lambda *_: None)
    assert _hashes(manifest) == _hashes(clean_build[0])
    assert read_manifest(out)["splits"]["train"]["n_blocks"] == 60_000 // BLOCK


def test_a_partial_build_of_another_request_is_removed(kill_corpus, tokenizer_dir, clean_build, tmp_path):
    out = tmp_path / "data"
    run = build_in_subprocess(**dict(_request(kill_corpus, tokenizer_dir, out), train_tokens=50_000),
                              kill_at_checkpoint=2)
    assert run.returncode == -signal.SIGKILL
    logged = []
    manifest = build_dataset(**_request(kill_corpus, tokenizer_dir, out), log=logged.append)
    assert any(line.startswith(f"removing {tmp_path / '.data.partial'}") for line in logged), logged
    assert not any(line.startswith("resuming") for line in logged)
    assert _hashes(manifest) == _hashes(clean_build[0])


def test_a_second_build_of_the_same_folder_at_once_is_refused(kill_corpus, tokenizer_dir, tmp_path):
    from mla.data.build import _exclusive

    out = tmp_path / "data"
    with _exclusive(out):
        with pytest.raises(UserError, match="another `mla data` is building .*data right now"):
            build_dataset(**_request(kill_corpus, tokenizer_dir, out), log=lambda *_: None)
    assert not out.exists()


def test_a_partial_folder_without_a_checkpoint_is_removed(kill_corpus, tokenizer_dir, clean_build, tmp_path):
    partial = tmp_path / ".data.partial"
    partial.mkdir()
    (partial / "train.bin").write_bytes(b"\0" * 1000)  # killed before its first checkpoint
    manifest = build_dataset(**_request(kill_corpus, tokenizer_dir, tmp_path / "data"), log=lambda *_: None)
    assert _hashes(manifest) == _hashes(clean_build[0]) and not partial.exists()


def test_a_finished_build_killed_before_its_rename_is_moved_into_place(kill_corpus, tokenizer_dir, clean_build,
                                                                        tmp_path):
    import shutil

    shutil.copytree(clean_build[1], tmp_path / ".data.partial")  # complete, manifest written, not yet renamed
    logged = []
    manifest = build_dataset(**_request(kill_corpus, tokenizer_dir, tmp_path / "data"), log=logged.append)
    assert any("moving the finished build" in line for line in logged)
    assert _hashes(manifest) == _hashes(clean_build[0]) and sorted(p.name for p in tmp_path.iterdir()) == ["data"]
