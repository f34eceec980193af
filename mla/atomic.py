"""Writes that a killed job cannot leave half done: everything goes to a temporary name beside its target
and is renamed into place once complete (atomic within one file system), so a reader, or a rerun that
checks whether the output exists, sees the old content or the new one, never a partial file."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def staged(path: str | Path, *, folder: bool = False):
    """Yield a temporary path beside `path` for writers that need one (torch.save, a copy, to_json), or with
    folder=True an empty temporary folder; it replaces `path` if the block succeeds and is removed if not."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = (Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent)) if folder
           else path.with_name(f".{path.name}.{os.getpid()}.tmp"))   # the pid keeps two writers apart
    try:
        yield tmp
        replace_dir(tmp, path) if folder else os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
        raise


def write_json(path: str | Path, obj, *, indent: int | None = 2) -> None:
    with staged(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=indent) + "\n")


def replace_dir(tmp: str | Path, out: str | Path) -> None:
    """Move a finished folder into place; an older `out` is removed only once the new one is complete."""
    tmp, out = Path(tmp), Path(out)
    old = out.with_name(f".{out.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)
