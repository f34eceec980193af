"""Reading the YAML/JSON files a user hands to a command (train options, corpus, figure and table specs)."""

from __future__ import annotations

import json
from pathlib import Path

from mla.errors import UserError


def read_mapping(path: str | Path, what: str) -> dict:
    """The mapping in a YAML or JSON file (empty: {}); a missing or malformed file is a UserError naming it."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise UserError(f"{what} {p} does not exist")
    try:
        doc = json.loads(p.read_text()) if p.suffix.lower() == ".json" else yaml.safe_load(p.read_text())
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise UserError(f"{what} {p}: not valid YAML/JSON ({' '.join(str(exc).split())})") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise UserError(f"{what} {p}: expected a mapping")
    return doc
