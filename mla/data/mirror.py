"""A local stand-in for the paper's Hub mixture, in the real datasets' layout and columns.

`write_smollm_mirror(root, docs_per_source=N)` writes, under `root`, one folder per Hub dataset of
`SMOLLM_MIXTURE`, laid out like its Hub repository (a README.md whose YAML header lists the
`configs:` and their `data_files`, and parquet shards with the dataset's own column names), plus the
gzip blobs that python-edu's `blob_id`s point to under ``root/swh-content/``. With the returned
environment (`MLA_HUB_DATASETS_MIRROR`, `MLA_SWH_CONTENT_URL` as a file:// URL) the `smollm` corpus runs
through the very same `datasets.load_dataset(path, name, split=..., streaming=True)` calls and blob
fetches as online; only the location changes.

The texts are real but local: paragraphs of Python's pydoc topics (prose) and standard-library
modules (code), mixed deterministically by `seed`.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import sysconfig
from pathlib import Path

from mla.data.readers import _read_text, stdlib_files

SMOLLM_CORPUS = "HuggingFaceTB/smollm-corpus"
SMOLLM_CONFIGS = ("cosmopedia-v2", "fineweb-edu-dedup", "python-edu")


def _paragraphs() -> list[str]:
    from pydoc_data.topics import topics

    paragraphs = []
    for key in sorted(topics):
        paragraphs += [p.strip() for p in topics[key].split("\n\n") if len(p.strip()) > 80]
    return paragraphs


def _modules(limit: int = 400) -> list[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in stdlib_files(root):
        text = _read_text(path)  # empty when unreadable
        if len(text) > 200:
            out.append((str(path.relative_to(root)), text[:6000]))
        if len(out) >= limit:
            break
    return out


def _prose(rng: random.Random, paragraphs: list[str], lo: int = 2, hi: int = 6) -> str:
    return "\n\n".join(rng.sample(paragraphs, rng.randint(lo, hi)))


def _write_parquet(folder: Path, prefix: str, rows: list[dict], shards: int = 2, suffix: str = "") -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    shards = max(1, min(shards, len(rows)))
    per = -(-len(rows) // shards)
    for i in range(shards):
        part = rows[i * per:(i + 1) * per]
        pq.write_table(pa.Table.from_pylist(part), folder / f"{prefix}-{i:05d}-of-{shards:05d}{suffix}.parquet")


def _readme(configs: list[tuple[str, str]], title: str) -> str:
    lines = ["---", "configs:"]
    for name, pattern in configs:
        lines += [f"- config_name: {name}", "  data_files:", "  - split: train", f"    path: {pattern}"]
    return "\n".join(lines + ["---", f"# {title}", "", "Local mirror written by mla.data.mirror (synthetic rows, "
                              "real column names).", ""])


def write_smollm_mirror(root: str | Path, *, docs_per_source: int, seed: int = 0) -> dict:
    """Write the five datasets of the smollm mixture (and python-edu's blobs) under `root`; returns the
    environment variables that point `mla data --corpus smollm` at them."""
    root = Path(root)
    paragraphs, modules = _paragraphs(), _modules()
    rng = random.Random(seed)
    n = docs_per_source

    fineweb = []
    for i in range(n):
        text = _prose(rng, paragraphs)
        fineweb.append({"text": text, "id": f"<urn:uuid:{rng.getrandbits(128):032x}>",
                        "metadata": {"dump": "CC-MAIN-2024-10", "url": f"https://example.org/doc/{i}",
                                     "date": "2024-02-21", "file_path": f"s3://commoncrawl/crawl-data/{i}.warc.gz",
                                     "language": "en", "language_score": round(rng.uniform(0.9, 1.0), 4),
                                     "token_count": len(text.split()), "score": round(rng.uniform(3.0, 5.0), 4),
                                     "int_score": 3}})
    cosmopedia = []
    for _ in range(n):
        seed_text = rng.choice(paragraphs)
        text = _prose(rng, paragraphs, 3, 7)
        cosmopedia.append({"prompt": f"Write a textbook section that explains:\n{seed_text}", "text": text,
                           "token_length": len(text.split()), "audience": rng.choice(["students", "experts"]),
                           "format": rng.choice(["textbook", "blogpost", "wikihow"]), "seed_data": "web_samples_v2"})
    blobs = root / "swh-content"
    blobs.mkdir(parents=True, exist_ok=True)
    python_edu = []
    for i in range(n):
        path, text = modules[(i * 7 + seed) % len(modules)]
        text = f"# {path} (variant {i})\n{text}"
        blob_id = hashlib.sha1(text.encode()).hexdigest()
        (blobs / blob_id).write_bytes(gzip.compress(text.encode(), mtime=0))
        python_edu.append({"blob_id": blob_id, "repo_name": f"example/repo-{i}", "path": path,
                           "length_bytes": len(text.encode()), "score": round(rng.uniform(4.0, 5.0), 4),
                           "int_score": 4})
    math = []
    for i in range(n):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        text = (f"Problem {i}. Let $a = {a}$ and $b = {b}$. Then $a + b = {a + b}$ and $a b = {a * b}$, so "
                f"$(a + b)^2 = a^2 + 2ab + b^2 = {(a + b) ** 2}$.\n\n" + _prose(rng, paragraphs, 1, 3))
        math.append({"url": f"https://math.example.org/{i}", "text": text, "date": "2023-06-01",
                     "metadata": json.dumps({"extraction_info": {"found_math": True}, "score": 0.9})})
    stackoverflow = []
    for i in range(n):
        _, code = modules[(i * 13 + 3) % len(modules)]
        snippet = "\n".join(code.splitlines()[:rng.randint(5, 25)])
        stackoverflow.append({"content": f"Q: {rng.choice(paragraphs)[:200]}\n\nA: Try this:\n\n{snippet}\n"})

    corpus = root / SMOLLM_CORPUS
    _write_parquet(corpus / "fineweb-edu-dedup", "train", fineweb)
    _write_parquet(corpus / "cosmopedia-v2", "train", cosmopedia)
    _write_parquet(corpus / "python-edu", "train", python_edu)
    (corpus / "README.md").write_text(_readme([(c, f"{c}/train-*") for c in SMOLLM_CONFIGS], "SmolLM-Corpus"))
    owm = root / "open-web-math/open-web-math"
    _write_parquet(owm / "data", "train", math)
    (owm / "README.md").write_text(_readme([("default", "data/train-*")], "OpenWebMath"))
    so = root / "bigcode/stackoverflow-clean"
    _write_parquet(so / "data", "train", stackoverflow, shards=1, suffix="-" + hashlib.sha1(b"so").hexdigest()[:16])
    (so / "README.md").write_text(_readme([("default", "data/train-*")], "stackoverflow-clean"))
    return {"MLA_HUB_DATASETS_MIRROR": str(root.resolve()), "MLA_SWH_CONTENT_URL": blobs.resolve().as_uri()}
