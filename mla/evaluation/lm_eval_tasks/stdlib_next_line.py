"""Documents of the `mla_stdlib_next_line` lm-eval task (see stdlib_next_line.yaml).

Each document: the `context_lines` lines of a held-out standard-library file that precede a chosen
line, and four candidate next lines — the true one and three other lines of the same file (distinct
texts, not adjacent to the true line). Only files that `mla data` assigns to the validation split
(`mla.data.in_validation("python-stdlib", relative path, fraction)`) are used. Deterministic for a
given (seed, num_docs, context_lines, validation_fraction, Python version).

lm-eval calls `load(**metadata, **dataset_kwargs)`; every keyword is optional.
"""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path

from mla.data import in_validation, stdlib_files
from mla.options import DEFAULT_VALIDATION_FRACTION

SOURCE_NAME = "python-stdlib"   # the name of the source in mla.data.PYDOC_STDLIB (same split hash)
MIN_LINE_CHARS = 12
MAX_CONTEXT_CHARS = 400
N_CHOICES = 4


def heldout_files(root: Path, validation_fraction: float) -> list[tuple[str, list[str]]]:
    out = []
    for path in stdlib_files(root):
        key = str(path.relative_to(root))
        if not in_validation(SOURCE_NAME, key, validation_fraction):
            continue
        try:
            lines = [l.rstrip() for l in path.read_text(encoding="utf-8").splitlines()]
        except (UnicodeDecodeError, OSError):
            continue
        out.append((key, lines))
    return out


def _candidates(lines: list[str]) -> list[int]:
    """Indices of lines that make a fair target: long enough and unique within the file."""
    counts: dict[str, int] = {}
    for l in lines:
        counts[l.strip()] = counts.get(l.strip(), 0) + 1
    return [i for i, l in enumerate(lines)
            if i >= 2 and len(l.strip()) >= MIN_LINE_CHARS and counts[l.strip()] == 1]


def make_docs(files: list[tuple[str, list[str]]], num_docs: int, seed: int, context_lines: int) -> list[dict]:
    rng = random.Random(seed)
    usable = [(k, lines, c) for k, lines in files if len(c := _candidates(lines)) >= N_CHOICES + 3]
    if not usable:
        raise ValueError("no held-out standard-library file has enough distinct lines for the task")
    rng.shuffle(usable)
    docs, i = [], 0
    used: set[tuple[str, int]] = set()
    attempts = 0
    while len(docs) < num_docs and attempts < 20 * num_docs:
        attempts += 1
        key, lines, cand = usable[i % len(usable)]
        i += 1
        target = rng.choice(cand)
        if (key, target) in used:
            continue
        far = [j for j in cand if abs(j - target) > 2]
        if len(far) < N_CHOICES - 1:
            continue
        used.add((key, target))
        distractors = [lines[j] for j in rng.sample(far, N_CHOICES - 1)]
        choices = distractors + [lines[target]]
        rng.shuffle(choices)
        context = "\n".join(lines[max(0, target - context_lines):target]) + "\n"
        docs.append({"file": key, "line": target + 1, "context": context[-MAX_CONTEXT_CHARS:],
                     "choices": choices, "gold": choices.index(lines[target])})
    return docs


def load(num_docs: int = 200, seed: int = 1234, context_lines: int = 6, validation_fraction: float = DEFAULT_VALIDATION_FRACTION,
         stdlib_root: str | None = None, **_ignored):
    import datasets

    root = Path(stdlib_root or sysconfig.get_paths()["stdlib"])
    docs = make_docs(heldout_files(root, float(validation_fraction)), int(num_docs), int(seed), int(context_lines))
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})
