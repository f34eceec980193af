"""Corpus definitions: weighted sources, the named corpora, corpus files, and the document split.

A *corpus* is a list of weighted *sources*; a source's `kind` selects its reader (`mla.data.readers`)
and its `options` are the reader's arguments. Documents go to the validation split by a hash of
(source name, document key), so the splits are disjoint by document and the assignment depends on
nothing else (not on budgets, seeds, worker counts or the other documents).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from mla.errors import UserError
from mla.specfile import read_mapping

SPLITS = ("train", "validation")


@dataclass(frozen=True)
class Source:
    """One weighted text source. ``kind`` selects the reader; ``options`` are the reader's arguments."""

    name: str
    weight: float
    kind: str  # pydoc_topics | python_docstrings | python_docs | python_stdlib | text_files | hub
    options: dict = field(default_factory=dict)

    @property
    def split_name(self) -> str:
        """The name whose hash assigns this source's documents to a split: its own, or ``split_as``."""
        return self.options.get("split_as", self.name)


# The paper's fine-tuning mixture (App. C) for SmolLM: smollm-corpus + open-web-math + stackoverflow.
# python-edu rows carry Software Heritage blob ids, not text (fetched by mla/data/readers.py); stackoverflow-clean's
# text column is `content`.
SMOLLM_MIXTURE = [
    Source("fineweb-edu-dedup", 0.70, "hub",
           {"path": "HuggingFaceTB/smollm-corpus", "name": "fineweb-edu-dedup", "column": "text"}),
    Source("cosmopedia-v2", 0.15, "hub",
           {"path": "HuggingFaceTB/smollm-corpus", "name": "cosmopedia-v2", "column": "text"}),
    Source("python-edu", 0.08, "hub",
           {"path": "HuggingFaceTB/smollm-corpus", "name": "python-edu", "column": "blob_id",
            "fetch": "softwareheritage"}),
    Source("open-web-math", 0.06, "hub", {"path": "open-web-math/open-web-math", "column": "text"}),
    Source("stackoverflow-clean", 0.01, "hub", {"path": "bigcode/stackoverflow-clean", "column": "content"}),
]

# Offline stand-ins, from what every Python installs: prose for fineweb-edu (0.7: the docstrings of the
# standard library and pydoc's topics, the language reference's sections) and code for python-edu (0.3: the
# standard library's sources). A module's docstrings split with its source file (`split_as`): a held-out
# module is held out whole, as prose and as code, which the local lm-eval task (mla/evaluation/lm_eval_tasks) relies on.
# The prose weights follow the sources' sizes (SmolLM2's tokenizer: ~560k docstring and ~113k topic tokens).
PYDOC_STDLIB = [
    Source("python-docstrings", 0.6, "python_docstrings", {"split_as": "python-stdlib"}),
    Source("pydoc-topics", 0.1, "pydoc_topics"),
    Source("python-stdlib", 0.3, "python_stdlib"),
]
# The same with the whole documentation as prose: the reStructuredText of Debian's python3.11-doc (or the
# folder MLA_PYTHON_DOCS names). The pydoc topics are excerpts of it, hence not a source of their own here.
DEBIAN_DOCS_STDLIB = [
    Source("python-docs", 0.7, "python_docs"),
    Source("python-stdlib", 0.3, "python_stdlib"),
]

CORPORA = {"pydoc-stdlib": PYDOC_STDLIB, "debian-docs-stdlib": DEBIAN_DOCS_STDLIB, "smollm": SMOLLM_MIXTURE}
DEFAULT_CORPUS = "pydoc-stdlib"


def load_corpus(spec: str) -> tuple[str, list[Source]]:
    """A named corpus (``pydoc-stdlib``, ``debian-docs-stdlib``, ``smollm``) or a YAML/JSON file ``{name,
    sources: [{name, weight, kind, ...options}]}``. Returns (corpus name, sources). The option ``split_as``
    makes a source's documents follow another source's split (same keys, same hash)."""
    if spec in CORPORA:
        return spec, list(CORPORA[spec])
    path = Path(spec)
    if not path.is_file():
        raise UserError(f"unknown corpus {spec!r}: not one of {sorted(CORPORA)} and not a file")
    doc = read_mapping(path, "corpus file")
    if not isinstance(doc.get("sources"), list) or not doc["sources"]:
        raise UserError(f"corpus file {path}: expected a mapping with a non-empty 'sources' list")
    sources = []
    for i, entry in enumerate(doc["sources"]):
        if not isinstance(entry, dict) or not {"name", "weight", "kind"} <= set(entry):
            raise UserError(f"corpus file {path}: source #{i} needs 'name', 'weight' and 'kind'")
        options = {k: v for k, v in entry.items() if k not in ("name", "weight", "kind")}
        try:
            weight = float(entry["weight"])
        except (TypeError, ValueError):
            raise UserError(f"corpus file {path}: source {entry['name']!r} has a non-numeric weight") from None
        sources.append(Source(str(entry["name"]), weight, str(entry["kind"]), options))
    return str(doc.get("name", path.stem)), sources


def with_weights(sources: list[Source], weights: dict[str, float] | None, corpus_name: str) -> list[Source]:
    """`sources` with the weights of the named ones replaced (``--weight SRC=W``)."""
    if not weights:
        return sources
    unknown = sorted(set(weights) - {s.name for s in sources})
    if unknown:
        raise UserError(f"--weight for unknown source(s) {unknown}; corpus {corpus_name!r} has "
                        f"{[s.name for s in sources]}")
    return [Source(s.name, float(weights.get(s.name, s.weight)), s.kind, s.options) for s in sources]


def check_sources(sources: list[Source], kinds) -> None:
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        raise UserError(f"source names must be unique, got {names}")
    for s in sources:
        if s.kind not in kinds:
            raise UserError(f"source {s.name!r}: unknown kind {s.kind!r} (one of {sorted(kinds)})")
        if not s.weight > 0:
            raise UserError(f"source {s.name!r}: weight must be > 0, got {s.weight}")


def in_validation(source: str, key: str, fraction: float) -> bool:
    """Deterministic document-level split: a hash of (source, key) below `fraction` -> validation."""
    digest = hashlib.sha256(f"{source}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def split_of(source: str, key: str, fraction: float) -> str:
    return "validation" if in_validation(source, key, fraction) else "train"
