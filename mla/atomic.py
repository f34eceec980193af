"""Writes that a killed job cannot leave half done.

Everything goes to a temporary name beside its target and is renamed into place only once complete
(a rename within one folder is atomic on POSIX file systems), so a reader — or a rerun that checks
whether the output exists — sees the old content or the new one, never a partial file.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def staged(path: str | Path, *, folder: bool = False):
    """Yield a temporary path beside `path` for writers that need a path (torch.save, a copy, a
    DataFrame's to_json); with folder=True, an empty temporary folder. It replaces `path` when the
    block succeeds and is removed when it raises."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if folder:
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    else:  # the pid keeps two processes writing the same target apart
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        if folder:
            replace_dir(tmp, path)
        else:
            os.replace(tmp, path)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise


def write_text(path: str | Path, text: str) -> Path:
    with staged(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def write_json(path: str | Path, obj, *, indent: int | None = 2) -> Path:
    return write_text(path, json.dumps(obj, indent=indent) + "\n")


def replace_dir(tmp: str | Path, out: str | Path) -> None:
    """Move a finished folder into place; an older `out` is removed only once the new one is complete."""
    tmp, out = Path(tmp), Path(out)
    if out.exists():
        old = out.with_name(f".{out.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)
