"""The README is a landing page that stays true: at most 200 lines, every `snakemake` command in its code
blocks plans (a dry run in a copy of the workflow), and every relative link of README.md and docs/*.md
points at a file that exists."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 200
# what a dry run of the workflow reads, copied so that the dry runs write nothing into the checkout
WORKFLOW_FILES = ("Snakefile", "config.yaml", "configs", "workflow")


def fenced_lines(text: str) -> list[str]:
    """Lines inside ``` blocks, comments after ` #` removed."""
    lines, inside = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
        elif inside:
            lines.append(re.split(r"\s+#\s", line, maxsplit=1)[0].strip())
    return lines


def snakemake_commands(text: str) -> list[str]:
    return [line for line in fenced_lines(text) if line.startswith("snakemake ")]


def relative_links(path: Path) -> list[tuple[str, Path]]:
    """Markdown links and images that are neither URLs nor anchors, resolved against the file's folder."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)   # code blocks hold no links
    out = []
    for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        out.append((target, (path.parent / unquote(target.split("#", 1)[0])).resolve()))
    return out


def test_readme_is_at_most_200_lines():
    n = len(README.read_text().splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines, more than {MAX_LINES}: move sections into docs/"


def test_helpers_find_commands_and_links(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```bash\nsnakemake --cores all   # run it\n# snakemake no\nmla plan\n```\n"
                    "See [a](docs/a.md#x), ![f](f.png), [web](https://x.org), [top](#t).\n"
                    "```\n[not a link](nowhere.md)\n```\n")
    assert snakemake_commands(page.read_text()) == ["snakemake --cores all"]
    assert relative_links(page) == [("docs/a.md#x", tmp_path / "docs/a.md"), ("f.png", tmp_path / "f.png")]


def test_readme_has_the_two_commands_and_the_results_markers():
    text = README.read_text()
    assert "snakemake --cores all" in snakemake_commands(text)
    assert any(line.startswith(".venv/bin/pip install") or "pip install" in line for line in fenced_lines(text))
    start, end = text.index("<!-- default-results:start -->"), text.index("<!-- default-results:end -->")
    assert start < end and "results/figures/loss.png" in text[start:end]


@pytest.mark.parametrize("doc", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_relative_links_point_at_files_that_exist(doc):
    missing = [target for target, path in relative_links(doc) if not path.exists()]
    assert not missing, f"{doc.relative_to(ROOT)} links to files that do not exist: {missing}"


@pytest.fixture(scope="module")
def workflow_copy(tmp_path_factory) -> Path:
    copy = tmp_path_factory.mktemp("readme-workflow")
    for name in WORKFLOW_FILES:
        src = ROOT / name
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, copy / name)
    return copy


@pytest.mark.parametrize("command", snakemake_commands(README.read_text()))
def test_readme_snakemake_commands_plan(command, workflow_copy, tmp_path):
    """Each command as written, plus `-n`, run where the README runs it (the repository root, here a copy)."""
    args = shlex.split(command)[1:]
    if "-n" not in args:
        args.insert(0, "-n")
    work = tmp_path / "work"
    shutil.copytree(workflow_copy, work)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1"}
    r = subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=work, capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, f"{command}\n{(r.stdout + r.stderr)[-4000:]}"
    assert "Job stats:" in r.stdout and "This was a dry-run" in r.stdout, r.stdout[-2000:]
