"""The configuration reference (docs/configuration.md), generated from the workflow's schema.

The schema (workflow/schemas/config.schema.yaml, with the package's defaults filled in by
`config_schema.load_schema`) is the one truth about every config key: its type, default and description.
This module renders it as Markdown, one table per top-level section, so that the reference cannot drift
from what the Snakefile checks (tests/test_config_reference.py compares the file with a fresh render).

    python -m mla.study.config_reference > docs/configuration.md
"""

from __future__ import annotations

import json

from mla.study.config_schema import load_schema

HEADER = """# Configuration reference

Generated from `workflow/schemas/config.schema.yaml` by `python -m mla.study.config_reference >
docs/configuration.md` (a test fails when the two differ). Every key is checked when Snakemake starts;
an unknown key or a bad value stops the workflow before any job runs, naming the key. `config.yaml` is the
CPU default; `configs/paper.yaml` is the paper's configuration; several `--configfile` files merge in
order, dictionaries key by key.
"""


def _resolve(schema: dict, node: dict) -> dict:
    """Follow a local `$ref` ("#/$defs/a/b") to the node it names, keeping the referring node's own keys."""
    ref = node.get("$ref")
    if not ref:
        return node
    target = schema
    for part in ref.removeprefix("#/").split("/"):
        target = target[part]
    return {**_resolve(schema, target), **{k: v for k, v in node.items() if k != "$ref"}}


def _type(node: dict) -> str:
    if "enum" in node:
        return " | ".join(f"`{v}`" for v in node["enum"])
    kind = node.get("type")
    if kind is None and "oneOf" in node:
        return " or ".join(_type(n) for n in node["oneOf"])
    if isinstance(kind, list):
        return " or ".join(kind)
    if kind == "array" and isinstance(node.get("items"), dict):
        return f"list of {_type(node['items'])}"
    return kind or "any"


def _default(node: dict) -> str:
    if "default" not in node:
        return ""
    value = node["default"]
    return f"`{json.dumps(value) if not isinstance(value, str) else value}`"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _rows(schema: dict, node: dict, prefix: str) -> list[tuple[str, str, str, str]]:
    """(key, type, default, description) for a node's properties, recursing into objects; a mapping of
    user-chosen names (additionalProperties: {object}) is shown as `<name>`."""
    node = _resolve(schema, node)
    rows = []
    for key, child in (node.get("properties") or {}).items():
        child = _resolve(schema, child)
        path = f"{prefix}.{key}" if prefix else key
        rows.append((path, _type(child), _default(child), child.get("description", "")))
        rows += _nested(schema, child, path)
    return rows


def _nested(schema: dict, node: dict, path: str) -> list[tuple[str, str, str, str]]:
    rows = []
    if node.get("properties"):
        rows += _rows(schema, node, path)
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        extra = _resolve(schema, extra)
        if extra.get("properties"):
            rows += _rows(schema, extra, f"{path}.<name>")
    return rows


def render(schema: dict | None = None) -> str:
    """The whole reference as Markdown."""
    if schema is None:
        schema = load_schema()
    out = [HEADER]
    for section, node in schema["properties"].items():
        node = _resolve(schema, node)
        out.append(f"## `{section}`\n")
        if node.get("description"):
            out.append(_cell(node["description"]) + "\n")
        rows = _nested(schema, node, section)
        if not rows:
            out.append(f"Type: {_type(node)}. Default: {_default(node) or 'none'}.\n")
            continue
        out.append("| key | type | default | description |\n|---|---|---|---|")
        out += [f"| `{k}` | {_cell(t)} | {d} | {_cell(desc)} |" for k, t, d, desc in rows]
        out.append("")
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    print(render(), end="")
