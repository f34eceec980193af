"""docs/configuration.md is the schema rendered (mla.study.config_reference): it cannot drift."""

from pathlib import Path

from mla.study import config_reference
from mla.study.config_schema import load_schema

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_the_reference_is_the_schema_rendered():
    assert DOC.read_text() == config_reference.render(), (
        "docs/configuration.md is stale: run `python -m mla.study.config_reference > docs/configuration.md`")


def test_every_key_of_every_section_is_listed_with_its_default():
    schema = load_schema()
    text = config_reference.render(schema)
    for section, node in schema["properties"].items():
        for key, child in (node.get("properties") or {}).items():
            row = next((line for line in text.splitlines() if line.startswith(f"| `{section}.{key}` |")), None)
            assert row is not None, f"{section}.{key} missing from the reference"
            if "default" in child and child["default"] is not None:
                assert "`" in row.split("|")[3], f"{section}.{key}: its default is not shown"
