"""Training data: text sources -> tokenized, packed token blocks on disk, with a manifest.

A *corpus* is a list of weighted *sources*; each source yields documents ``(key, text)``.
`build_dataset` tokenizes the documents of every source, appends the tokenizer's EOS to each
document (EOS stays in the loss), mixes the sources by weight, concatenates the documents in a
seeded random order and cuts the stream into blocks of ``block_length`` tokens (the tail that does
not fill a block is dropped and counted in the manifest). Documents are assigned to the
``validation`` split by a hash of (source, key), so the two splits are disjoint by document and the
assignment does not depend on caps, seeds or the other documents.

Output folder (written under a temporary name, then renamed, so a failed job leaves nothing that
looks finished)::

    OUT/train.npy, OUT/validation.npy            [n_blocks, block_length] token ids (uint16/uint32)
    OUT/documents-train.tsv, ...-validation.tsv  source, key, offset, tokens (one row per document)
    OUT/manifest.json                            request, tokens/documents per source, sha256 of arrays

Named corpora: ``pydoc-stdlib`` (offline default: Python's documentation topics and the standard
library's sources) and ``smollm`` (the paper's Hub mixture, streamed with ``datasets``). A YAML/JSON
file with a ``sources`` list defines others (see `load_corpus`).
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from mla.cli import UserError
from mla.sources import sha256_of

SPLITS = ("train", "validation")
MANIFEST = "manifest.json"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Source:
    """One weighted text source. ``kind`` selects the reader; ``options`` are the reader's arguments."""

    name: str
    weight: float
    kind: str  # pydoc_topics | python_stdlib | text_files | hub
    options: dict = field(default_factory=dict)


# The paper's fine-tuning mixture (paper-spec §5.1) for SmolLM: smollm-corpus + open-web-math + stackoverflow.
# python-edu rows carry Software Heritage blob ids, not text (paper-spec §9, issue #20); stackoverflow-clean's
# text column is `content` (issue #5).
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

# Offline stand-ins: documentation prose (for fineweb-edu) and library code (for python-edu).
PYDOC_STDLIB = [
    Source("pydoc-topics", 0.7, "pydoc_topics"),
    Source("python-stdlib", 0.3, "python_stdlib"),
]

CORPORA = {"pydoc-stdlib": PYDOC_STDLIB, "smollm": SMOLLM_MIXTURE}
DEFAULT_CORPUS = "pydoc-stdlib"


# --------------------------------------------------------------------------------------------------
# corpus definitions


def load_corpus(spec: str) -> tuple[str, list[Source]]:
    """A named corpus (``pydoc-stdlib``, ``smollm``) or a YAML/JSON file ``{sources: [{name, weight,
    kind, ...options}]}``. Returns (corpus name, sources)."""
    if spec in CORPORA:
        return spec, list(CORPORA[spec])
    path = Path(spec)
    if not path.is_file():
        raise UserError(f"unknown corpus {spec!r}: not one of {sorted(CORPORA)} and not a file")
    import yaml

    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise UserError(f"corpus file {path}: not valid YAML/JSON ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("sources"), list) or not doc["sources"]:
        raise UserError(f"corpus file {path}: expected a mapping with a non-empty 'sources' list")
    sources = []
    for i, entry in enumerate(doc["sources"]):
        if not isinstance(entry, dict) or not {"name", "weight", "kind"} <= set(entry):
            raise UserError(f"corpus file {path}: source #{i} needs 'name', 'weight' and 'kind'")
        options = {k: v for k, v in entry.items() if k not in ("name", "weight", "kind")}
        sources.append(Source(str(entry["name"]), float(entry["weight"]), str(entry["kind"]), options))
    return str(doc.get("name", path.stem)), sources


def check_sources(sources: list[Source]) -> None:
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        raise UserError(f"source names must be unique, got {names}")
    for s in sources:
        if s.kind not in READERS:
            raise UserError(f"source {s.name!r}: unknown kind {s.kind!r} (one of {sorted(READERS)})")
        if not s.weight > 0:
            raise UserError(f"source {s.name!r}: weight must be > 0, got {s.weight}")


# --------------------------------------------------------------------------------------------------
# readers: each yields (key, text) for every document of a source


def _read_pydoc_topics(options: dict) -> Iterator[tuple[str, str]]:
    from pydoc_data.topics import topics

    for key in sorted(topics):
        yield key, topics[key]


def _stdlib_files(root: Path) -> list[Path]:
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def _read_python_stdlib(options: dict) -> Iterator[tuple[str, str]]:
    root = Path(options.get("root") or sysconfig.get_paths()["stdlib"])
    for path in _stdlib_files(root):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            yield str(path.relative_to(root)), text


def _read_text_files(options: dict) -> Iterator[tuple[str, str]]:
    root = Path(options.get("root", "."))
    pattern = options.get("glob", "**/*.txt")
    for path in sorted(root.glob(pattern)):
        if path.is_file():
            yield str(path.relative_to(root)), path.read_text(encoding="utf-8", errors="replace")


def _fetch_softwareheritage(blob_id: str) -> str:
    """python-edu rows hold a Software Heritage blob id; the file is a gzip object in the public bucket."""
    import urllib.request

    url = f"https://softwareheritage.s3.amazonaws.com/content/{blob_id}"
    with urllib.request.urlopen(url, timeout=60) as response:  # noqa: S310 (fixed https host)
        return gzip.decompress(response.read()).decode("utf-8", errors="replace")


def _read_hub(options: dict) -> Iterator[tuple[str, str]]:
    path, name = options["path"], options.get("name")
    label = f"{path}" + (f" ({name})" if name else "")
    column = options.get("column", "text")
    try:
        import datasets

        stream = datasets.load_dataset(path, name, split=options.get("split", "train"), streaming=True)
        rows = iter(stream)
        first = next(rows)
    except Exception as exc:  # offline, unknown dataset, gated, ...
        raise UserError(
            f"cannot stream {label} from the Hugging Face Hub ({type(exc).__name__}: {exc}). The "
            f"'smollm' corpus needs Hub access; offline, use --corpus {DEFAULT_CORPUS} or a corpus file "
            f"with local sources"
        ) from None
    if column not in first:
        raise UserError(f"{label}: rows have no column {column!r} (columns: {sorted(first)})")
    fetch = options.get("fetch")
    row: dict | None = first
    while row is not None:
        value = row[column]
        if fetch == "softwareheritage":
            try:
                text = _fetch_softwareheritage(value)
            except Exception as exc:
                raise UserError(
                    f"{label}: rows hold Software Heritage blob ids, and fetching blob {value} failed "
                    f"({exc}); use a pre-tokenized release of this corpus instead"
                ) from None
        else:
            text = value
        if text:
            yield hashlib.sha1(text.encode("utf-8")).hexdigest(), text
        row = next(rows, None)


READERS = {
    "pydoc_topics": _read_pydoc_topics,
    "python_stdlib": _read_python_stdlib,
    "text_files": _read_text_files,
    "hub": _read_hub,
}


# --------------------------------------------------------------------------------------------------
# splitting, tokenizing, mixing, packing


def in_validation(source: str, key: str, fraction: float) -> bool:
    """Deterministic document-level split: a hash of (source, key) below `fraction` -> validation."""
    digest = hashlib.sha256(f"{source}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def _documents(source: Source, split: str, fraction: float, seed: int) -> Iterator[tuple[str, str]]:
    """Documents of one split of a source; local sources in a seeded random order, Hub in stream order."""
    docs = ((k, t) for k, t in READERS[source.kind](source.options)
            if in_validation(source.name, k, fraction) == (split == "validation"))
    if source.kind == "hub":
        yield from docs
        return
    docs = list(docs)
    order = np.random.default_rng([seed, _stable_int(source.name)]).permutation(len(docs))
    for i in order:
        yield docs[i]


def _stable_int(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big")


def _tokenized(docs: Iterator[tuple[str, str]], tokenizer, eos: int, batch: int = 32):
    """(key, token ids + [eos]) for each document, encoding `batch` documents per tokenizer call."""
    pending: list[tuple[str, str]] = []

    def flush():
        ids = tokenizer([t for _, t in pending], add_special_tokens=False)["input_ids"]
        out = [(k, list(x) + [eos]) for (k, _), x in zip(pending, ids)]
        pending.clear()
        return out

    for doc in docs:
        pending.append(doc)
        if len(pending) == batch:
            yield from flush()
    if pending:
        yield from flush()


def _take(stream, budget: int | None) -> list[tuple[str, list[int]]]:
    """Documents from `stream` until `budget` tokens; the last one is cut to fit (its EOS kept)."""
    taken, total = [], 0
    for key, ids in stream:
        if budget is not None and total + len(ids) > budget:
            rest = budget - total
            if rest > 1:
                taken.append((key, ids[: rest - 1] + [ids[-1]]))
            break
        taken.append((key, ids))
        total += len(ids)
        if budget is not None and total >= budget:
            break
    return taken


def _mix(sources: list[Source], split: str, tokenizer, eos: int, max_tokens: int | None,
         fraction: float, seed: int) -> dict[str, list[tuple[str, list[int]]]]:
    """Per source, the documents of `split` such that token counts follow the weights.

    With a cap, source i gets weight_i/sum(w) * max_tokens tokens. Without one, the largest total that
    no source runs out of (min_i available_i / weight_i), so the mixture keeps its proportions."""
    total_weight = sum(s.weight for s in sources)
    shares = {s.name: s.weight / total_weight for s in sources}
    if max_tokens is not None:
        return {s.name: _take(_tokenized(_documents(s, split, fraction, seed), tokenizer, eos),
                              int(round(shares[s.name] * max_tokens)))
                for s in sources}
    if any(s.kind == "hub" for s in sources):
        raise UserError("a corpus with Hub sources needs a token cap (--max-tokens): the streams are unbounded")
    everything = {s.name: list(_tokenized(_documents(s, split, fraction, seed), tokenizer, eos)) for s in sources}
    available = {n: sum(len(ids) for _, ids in docs) for n, docs in everything.items()}
    total = min(available[n] / shares[n] for n in everything)
    return {n: _take(iter(docs), int(shares[n] * total)) for n, docs in everything.items()}


def _pack(per_source: dict[str, list[tuple[str, list[int]]]], block_length: int, seed: int, dtype):
    """Shuffle documents across sources, concatenate, cut into blocks. Returns blocks, rows, stats."""
    docs = [(name, key, ids) for name, items in per_source.items() for key, ids in items]
    order = np.random.default_rng(seed).permutation(len(docs))
    stream = np.fromiter((t for i in order for t in docs[i][2]), dtype=np.int64,
                         count=sum(len(d[2]) for d in docs))
    n_blocks = len(stream) // block_length
    kept = n_blocks * block_length
    rows, stats, offset = [], {name: {"documents": 0, "tokens": 0} for name in per_source}, 0
    for i in order:
        name, key, ids = docs[i]
        in_blocks = max(0, min(len(ids), kept - offset))
        if in_blocks:
            stats[name]["documents"] += 1
            stats[name]["tokens"] += in_blocks
        rows.append((name, key, offset, len(ids)))
        offset += len(ids)
    blocks = stream[:kept].astype(dtype).reshape(n_blocks, block_length)
    return blocks, rows, stats, len(stream) - kept


# --------------------------------------------------------------------------------------------------
# tokenizer fingerprint, hashes, manifest


def _tokenizer_fingerprint(path: Path) -> str:
    names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
             "merges.txt", "tokenizer.model")
    h = hashlib.sha256()
    for name in names:
        f = path / name
        if f.is_file():
            h.update(name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def read_manifest(data_dir: str | os.PathLike) -> dict:
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise UserError(f"{data_dir} is not a data folder made by `mla data` (no {MANIFEST})")
    return json.loads(path.read_text())


def open_blocks(data_dir: str | os.PathLike, split: str = "train") -> np.ndarray:
    """The packed token blocks of a split, memory-mapped: array [n_blocks, block_length]."""
    if split not in SPLITS:
        raise UserError(f"unknown split {split!r} (one of {SPLITS})")
    manifest = read_manifest(data_dir)
    blocks = np.load(Path(data_dir) / manifest["splits"][split]["file"], mmap_mode="r")
    if blocks.ndim != 2 or blocks.shape[1] != manifest["block_length"]:
        raise UserError(f"{data_dir}: {split} array has shape {blocks.shape}, manifest says block length "
                        f"{manifest['block_length']}")
    return blocks


# --------------------------------------------------------------------------------------------------
# the build


@dataclass
class DataRequest:
    """Everything that determines the output; equal requests -> the existing folder is reused."""

    corpus: str
    sources: list[dict]
    tokenizer_sha256: str
    block_length: int
    max_train_tokens: int | None
    max_validation_tokens: int | None
    validation_fraction: float
    seed: int
    format_version: int = FORMAT_VERSION


def build_dataset(corpus: str, tokenizer_path: str | os.PathLike, out_dir: str | os.PathLike, *,
                  block_length: int = 2048, max_train_tokens: int | None = None,
                  max_validation_tokens: int | None = None, validation_fraction: float = 0.05,
                  seed: int = 0, weights: dict[str, float] | None = None, force: bool = False,
                  log=print) -> dict:
    """Build (or reuse) the packed data folder `out_dir`; returns its manifest. `weights` overrides
    the mixture weights of named sources."""
    if block_length < 2:
        raise UserError(f"block length must be >= 2, got {block_length}")
    if not 0 < validation_fraction < 1:
        raise UserError(f"validation fraction must be in (0, 1), got {validation_fraction}")
    for label, cap in (("--max-tokens", max_train_tokens), ("--max-validation-tokens", max_validation_tokens)):
        if cap is not None and cap < block_length:
            raise UserError(f"{label} {cap} is smaller than one block ({block_length} tokens)")
    corpus_name, sources = load_corpus(corpus)
    if weights:
        unknown = sorted(set(weights) - {s.name for s in sources})
        if unknown:
            raise UserError(f"--weight for unknown source(s) {unknown}; corpus {corpus_name!r} has "
                            f"{[s.name for s in sources]}")
        sources = [Source(s.name, float(weights.get(s.name, s.weight)), s.kind, s.options) for s in sources]
    check_sources(sources)
    tokenizer_path = Path(tokenizer_path)
    if not tokenizer_path.is_dir():
        raise UserError(f"tokenizer folder {tokenizer_path} does not exist")
    request = DataRequest(corpus_name, [asdict(s) for s in sources], _tokenizer_fingerprint(tokenizer_path),
                          block_length, max_train_tokens, max_validation_tokens, validation_fraction, seed)
    out_dir = Path(out_dir)
    if (out_dir / MANIFEST).is_file():
        old = read_manifest(out_dir)
        if old.get("request") == asdict(request):
            log(f"{out_dir} is up to date (same corpus, tokenizer, block length and caps)")
            return old
        if not force:
            raise UserError(f"{out_dir} holds data built from a different request; pass --force to rebuild")
    elif out_dir.exists() and any(out_dir.iterdir()) and not force:
        raise UserError(f"{out_dir} exists, is not empty and has no {MANIFEST}; pass --force to replace it")

    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
    except Exception as exc:
        raise UserError(f"cannot load a tokenizer from {tokenizer_path}: {exc}") from None
    eos = tokenizer.eos_token_id
    if eos is None:
        raise UserError(f"tokenizer {tokenizer_path} has no EOS token; documents are separated by EOS")
    vocab = len(tokenizer)
    dtype = np.uint16 if vocab <= np.iinfo(np.uint16).max + 1 else np.uint32

    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        splits = {}
        caps = {"train": max_train_tokens, "validation": max_validation_tokens}
        for split in SPLITS:
            t0 = time.time()
            per_source = _mix(sources, split, tokenizer, eos, caps[split], validation_fraction, seed)
            blocks, rows, stats, dropped = _pack(per_source, block_length, seed, dtype)
            if len(blocks) == 0:
                raise UserError(f"the {split} split has fewer than {block_length} tokens; lower the block "
                                f"length or raise the caps / validation fraction")
            np.save(tmp / f"{split}.npy", blocks)
            with open(tmp / f"documents-{split}.tsv", "w", newline="") as f:
                writer = csv.writer(f, delimiter="\t", lineterminator="\n")
                writer.writerow(["source", "key", "offset", "tokens"])
                writer.writerows(rows)
            splits[split] = {
                "file": f"{split}.npy",
                "documents_file": f"documents-{split}.tsv",
                "n_blocks": int(blocks.shape[0]),
                "tokens": int(blocks.size),
                "tokens_dropped": int(dropped),
                "sources": stats,
                "sha256": sha256_of(tmp / f"{split}.npy"),
            }
            log(f"{split}: {blocks.shape[0]} blocks x {block_length} tokens from "
                + ", ".join(f"{n} {s['documents']} docs/{s['tokens']} tokens" for n, s in stats.items())
                + f" ({time.time() - t0:.1f} s)")
        manifest = {
            "request": asdict(request),
            "corpus": corpus_name,
            "tokenizer": str(tokenizer_path.resolve()),
            "block_length": block_length,
            "eos_token_id": int(eos),
            "vocab_size": int(vocab),
            "dtype": np.dtype(dtype).name,
            "splits": splits,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "python": sys.version.split()[0],
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest
