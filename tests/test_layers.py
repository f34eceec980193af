"""One direction of dependencies: the floors of docs/package.md, as import-linter's contracts in pyproject.toml."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_import_runs_down_the_floors():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert lint, "lint-imports not found: install the test extra (pip install -e '.[test]')"
    # the package of this checkout, whatever an editable install elsewhere points at
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([lint, "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout, done.stdout


def test_parsing_the_workflow_config_loads_no_numerical_library():
    """The Snakefile validates the config on every `snakemake` call (a dry run included): the schema's defaults
    come from mla.evaluation.report's EvalOptions and the package's options, which must stay light."""
    code = ("import sys, yaml; from mla.study.config_schema import validated; "
            "validated(yaml.safe_load(open('config.yaml'))); "
            "print(sorted(m for m in ('torch', 'numpy', 'pandas', 'transformers', 'lm_eval') if m in sys.modules))")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
