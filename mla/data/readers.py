"""Readers: one per source kind, each a deterministic stream of documents ``(key, text)``.

A reader is built from a `Source` and the corpus seed. `check()` fails fast with one line (missing
folder, no documents, dataset unreachable) before any long work; `documents(start)` yields every
document from position `start` on, in a fixed order, so a resumed build skips exactly what it has
consumed. A document that cannot be read yields empty text: it keeps its position and is skipped later.

Local kinds list their keys up front (paths, not contents: memory O(number of files)) and visit them
in a seeded random order. The `hub` kind streams with `datasets.load_dataset(..., streaming=True)` in
the dataset's own order; `MLA_HUB_DATASETS_MIRROR` swaps the Hub for a local folder laid out like it,
and `MLA_SWH_CONTENT_URL` swaps the Software Heritage bucket that python-edu's blob ids point to.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import os
import sysconfig
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from mla.data.corpus import Source
from mla.errors import UserError

PYTHON_DOCS_ROOT = "/usr/share/doc/python3.11/html/_sources"  # Debian 12's python3.11-doc
PYTHON_DOCS_ENV = "MLA_PYTHON_DOCS"  # another folder of the documentation's .rst.txt sources (python.org's HTML archive)
SWH_CONTENT_URL = "https://softwareheritage.s3.amazonaws.com/content"
FETCH_THREADS = 32    # blob requests in flight: one request per file is latency-bound, not bandwidth-bound
FETCH_WINDOW = 256    # blobs fetched ahead of the consumer (bounded memory, order preserved)


def _stable_int(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big")


def stdlib_files(root: Path) -> list[Path]:
    """The standard library's modules under `root`, sorted: tests, installed packages and `pydoc_data`
    (the generated module that holds the pydoc topics, a prose source of their own) left out."""
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "pydoc_data"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def docstrings(source: str, module: str) -> str:
    """Every docstring of a module's source, in source order, each under its qualified name
    (``json.dumps``): the module's, then its classes', functions' and methods'. Empty when the source
    does not parse or has none."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    parts = []

    def visit(node, name):
        doc = ast.get_docstring(node)  # indentation cleaned as pydoc shows it
        if doc and doc.strip():
            parts.append(f"{name}\n\n{doc.strip()}")
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, f"{name}.{child.name}")

    visit(tree, module)
    return "\n\n".join(parts)


def _read_text(path: Path, errors: str = "strict") -> str:
    """The file's UTF-8 text; empty when it cannot be read or (errors="strict") decoded."""
    try:
        return path.read_text(encoding="utf-8", errors=errors)
    except (UnicodeDecodeError, OSError):
        return ""


def _one_line(exc: Exception) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]


class LocalReader:
    """Documents known up front by key; visited in a seeded permutation of the sorted keys."""

    def __init__(self, source: Source, seed: int):
        self.source, self.seed = source, seed
        self._order: list[str] | None = None

    def keys(self) -> list[str]:
        raise NotImplementedError

    def text(self, key: str) -> str:
        raise NotImplementedError

    def ordered_keys(self) -> list[str]:
        if self._order is None:
            keys = sorted(self.keys())
            if not keys:
                raise UserError(f"source {self.source.name!r} ({self.source.kind}): no documents{self._where()}")
            rng = np.random.default_rng([self.seed, _stable_int(self.source.name)])
            self._order = [keys[i] for i in rng.permutation(len(keys))]
        return self._order

    def _where(self) -> str:
        return ""

    def check(self) -> None:
        self.ordered_keys()

    def documents(self, start: int = 0) -> Iterator[tuple[str, str]]:
        for key in self.ordered_keys()[start:]:
            yield key, self.text(key)


class PydocTopics(LocalReader):
    """pydoc's help topics (excerpts of the language reference, shipped with every Python)."""

    def keys(self):
        from pydoc_data.topics import topics

        return list(topics)

    def text(self, key):
        from pydoc_data.topics import topics

        return topics[key]


class FileTree(LocalReader):
    """Text files under a root folder matching a glob; the key is the path relative to the root."""

    default_root: str = "."
    default_glob: str = "**/*.txt"
    decode_errors: str = "replace"

    @property
    def root(self) -> Path:
        return Path(self.source.options.get("root") or self.default_root)

    @property
    def glob(self) -> str:
        return self.source.options.get("glob", self.default_glob)

    def _where(self) -> str:
        return f" under {self.root} matching {self.glob!r}"

    def missing_root(self) -> str:
        return f"source {self.source.name!r} ({self.source.kind}): folder {self.root} does not exist"

    def files(self) -> list[Path]:
        return [p for p in self.root.glob(self.glob) if p.is_file()]

    def keys(self):
        if not self.root.is_dir():
            raise UserError(self.missing_root())
        return [str(p.relative_to(self.root)) for p in self.files()]

    def text(self, key):
        return _read_text(self.root / key, self.decode_errors)


class PythonDocs(FileTree):
    """The Python documentation's reStructuredText sources (Debian package python3.11-doc, or the folder
    that MLA_PYTHON_DOCS names): prose. Optional: only the `debian-docs-stdlib` corpus reads them."""

    default_glob = "**/*.rst.txt"

    @property
    def default_root(self) -> str:
        return os.environ.get(PYTHON_DOCS_ENV) or PYTHON_DOCS_ROOT

    def missing_root(self):
        return (f"source {self.source.name!r}: the Python documentation sources are not at {self.root}; "
                f"install Debian's python3.11-doc (apt-get install python3.11-doc), point {PYTHON_DOCS_ENV} at "
                f"them, or use the corpus pydoc-stdlib (docstrings, no system package)")


class PythonStdlib(FileTree):
    """The standard library's .py files (tests, site-packages and pydoc_data excluded): code."""

    default_root = sysconfig.get_paths()["stdlib"]
    decode_errors = "strict"  # a module that is not valid UTF-8 is skipped, not read with replacement characters

    def files(self):
        return stdlib_files(self.root)


class PythonDocstrings(PythonStdlib):
    """The docstrings of the standard library's modules, classes and functions (`docstrings`), one
    document per module file keyed by its path like `PythonStdlib`'s: prose that every Python ships."""

    def text(self, key):
        source = super().text(key)
        module = ".".join(Path(key).with_suffix("").parts).removesuffix(".__init__")
        return docstrings(source, module) if source else ""


# ---------------------------------------------------------------------------------------------- Hub


def hub_location(path: str) -> str:
    """Where `datasets` loads Hub dataset `path` from: the Hub, or the local mirror's copy."""
    mirror = os.environ.get("MLA_HUB_DATASETS_MIRROR")
    return str(Path(mirror) / path) if mirror else path


def swh_content_url() -> str:
    """Where python-edu's blobs are: the Software Heritage bucket, or MLA_SWH_CONTENT_URL's stand-in."""
    return os.environ.get("MLA_SWH_CONTENT_URL") or SWH_CONTENT_URL


def fetch_blob(blob_id: str, attempts: int = 3) -> str | None:
    """Text of a Software Heritage blob (a gzip object under `swh_content_url()`); None if it does not exist."""
    import urllib.error
    import urllib.request

    url = f"{swh_content_url().rstrip('/')}/{blob_id}"
    for attempt in range(attempts):
        try:
            with urllib.request.urlopen(url, timeout=60) as response:  # noqa: S310 (configured content host)
                return gzip.decompress(response.read()).decode("utf-8", errors="replace")
        except urllib.error.HTTPError as exc:
            if exc.code in (403, 404):  # the public bucket answers 403 for unknown keys
                return None
            error = exc
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, FileNotFoundError):
                return None
            error = exc
        except (OSError, EOFError) as exc:  # reset connection, truncated gzip
            error = exc
        time.sleep(0.5 * 2**attempt)
    raise UserError(f"fetching Software Heritage blob {url} failed {attempts} times ({error})")


class HubReader:
    """A Hub dataset streamed with `datasets` (rows in the dataset's order, one text column)."""

    def __init__(self, source: Source, seed: int):
        o = source.options
        if "path" not in o:
            raise UserError(f"source {source.name!r} (hub): needs a 'path' option (the dataset repo id)")
        self.source = source
        self.path, self.name, self.split = o["path"], o.get("name"), o.get("split", "train")
        self.column, self.fetch = o.get("column", "text"), o.get("fetch")
        self.label = self.path + (f" ({self.name})" if self.name else "")
        self.blobs_missing = 0

    def _open(self):
        mirror = os.environ.get("MLA_HUB_DATASETS_MIRROR")
        location = hub_location(self.path)
        if mirror and not Path(location).is_dir():
            raise UserError(f"dataset {self.label}: MLA_HUB_DATASETS_MIRROR={mirror} has no folder {location}")
        try:
            import datasets

            return datasets.load_dataset(location, self.name, split=self.split, streaming=True)
        except Exception as exc:  # offline, unknown dataset or config, gated, ...
            where = f"the mirror {location}" if mirror else "the Hugging Face Hub"
            raise UserError(f"cannot stream dataset {self.label} from {where} ({_one_line(exc)}); offline, use a local "
                            f"corpus (pydoc-stdlib or a corpus file) or set MLA_HUB_DATASETS_MIRROR") from None

    def check(self) -> None:
        try:
            first = next(iter(self._open()))
        except StopIteration:
            raise UserError(f"dataset {self.label}: the {self.split!r} split has no rows") from None
        except UserError:
            raise
        except Exception as exc:
            raise UserError(f"cannot read dataset {self.label} ({_one_line(exc)})") from None
        if self.column not in first:
            raise UserError(f"dataset {self.label}: rows have no column {self.column!r} (columns: {sorted(first)})")
        if self.fetch == "softwareheritage" and fetch_blob(first[self.column]) is None:
            raise UserError(f"dataset {self.label}: blob {first[self.column]} of its first row is not at "
                            f"{swh_content_url()} (MLA_SWH_CONTENT_URL)")

    def documents(self, start: int = 0) -> Iterator[tuple[str, str]]:
        stream = self._open()
        if start:
            stream = stream.skip(start)
        values = (row[self.column] for row in stream)
        texts = self._fetched(values) if self.fetch == "softwareheritage" else values
        for text in texts:
            text = text or ""
            yield (hashlib.sha1(text.encode("utf-8")).hexdigest() if text else ""), text

    def _fetched(self, blob_ids: Iterator[str]) -> Iterator[str]:
        """Blob texts in row order, FETCH_THREADS requests in flight; a missing blob gives empty text."""
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="swh-fetch")
        window: deque = deque()
        try:
            for blob_id in blob_ids:
                window.append(pool.submit(fetch_blob, blob_id))
                if len(window) >= FETCH_WINDOW:
                    yield self._text_of(window.popleft())
            while window:
                yield self._text_of(window.popleft())
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _text_of(self, future) -> str:
        text = future.result()
        if text is None:
            self.blobs_missing += 1
            return ""
        return text


READERS = {
    "pydoc_topics": PydocTopics,
    "python_docs": PythonDocs,
    "python_stdlib": PythonStdlib,
    "python_docstrings": PythonDocstrings,
    "text_files": FileTree,
    "hub": HubReader,
}


def reader_for(source: Source, seed: int):
    return READERS[source.kind](source, seed)
