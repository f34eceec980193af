"""environment.yml (conda, for clusters) must list exactly the requirements of pyproject.toml."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]


def pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def conda_env():
    return yaml.safe_load((ROOT / "environment.yml").read_text())


def as_map(lines):
    reqs = {}
    for line in lines:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        assert name not in reqs, f"{req.name} listed twice"
        reqs[name] = (req.specifier, req.extras, req.marker)
    return reqs


def pip_section(env):
    sections = [d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d]
    assert len(sections) == 1, "environment.yml needs exactly one pip: section"
    return [line for line in sections[0] if not line.lstrip().startswith(("-", "."))]


def test_pip_section_equals_pyproject_requirements():
    project = pyproject()
    wanted = as_map(project["dependencies"] + project["optional-dependencies"]["workflow"]
                    + project["optional-dependencies"]["test"])
    listed = as_map(pip_section(conda_env()))
    missing = sorted(set(wanted) - set(listed))
    extra = sorted(set(listed) - set(wanted))
    assert not missing, f"in pyproject.toml but not in environment.yml: {missing}"
    assert not extra, f"in environment.yml but not in pyproject.toml: {extra}"
    differ = {n: (str(listed[n][0]), str(wanted[n][0])) for n in wanted if listed[n] != wanted[n]}
    assert not differ, f"versions differ (environment.yml, pyproject.toml): {differ}"


def test_python_version_agrees():
    env = conda_env()
    pythons = [d for d in env["dependencies"] if isinstance(d, str) and re.match(r"python\b", d)]
    assert len(pythons) == 1
    version = pythons[0].split("=", 1)[1].strip("=")
    from packaging.specifiers import SpecifierSet

    assert version + ".0" in SpecifierSet(pyproject()["requires-python"]), (version, pyproject()["requires-python"])
    assert "pip" in env["dependencies"]


def test_the_package_itself_is_installed_from_the_checkout():
    env = conda_env()
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert any(line.split()[-1] == "." and "-e" in line.split() for line in pip)
