"""The validated workflow config as a file that the verbs read (`mla evaluate|table|plot --config FILE`).

Snakemake merges config.yaml (or the --configfile files) and --config overrides; the Snakefile
validates the result and writes it here, so a verb reads exactly what the workflow planned with.
The file is named after a hash of its content and written only when absent: it never changes once
written, and a rule names it in its shell command (not as an input or a param), so neither a new
config nor a rewritten file reruns a job. What each job depends on is listed in its `params:`
(mla.study.evaluation_jobs, mla.study.reports), which is what reruns it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from mla import atomic
from mla.errors import UserError
from mla.specfile import read_mapping

FOLDER = "results/config"


def normalised(cfg: dict) -> dict:
    """`cfg` with the forms YAML allows made canonical in place (d_kv 8.0 -> 8: wildcards and paths need ints)."""
    for exp in cfg.get("experiments", {}).values():
        exp["d_kv"] = [int(d) for d in exp.get("d_kv", [])]
    return cfg


def write(cfg: dict, folder: str | Path = FOLDER) -> str:
    """Path of `cfg` (validated, defaults filled) as FOLDER/<hash>.yaml, written once per content."""
    import yaml


    # key order is content: experiments are the figure's panels, top to bottom
    blob = json.dumps(cfg, default=str)
    path = Path(folder) / f"{hashlib.sha256(blob.encode()).hexdigest()[:12]}.yaml"
    if not path.is_file():
        with atomic.staged(path) as tmp:
            tmp.write_text("# the validated config of a workflow run (mla/study/config_file.py); do not edit\n"
                           + yaml.safe_dump(json.loads(blob), sort_keys=False))
    return str(path)


def load(path: str | Path) -> dict:
    """The config in `path`, validated and with its defaults filled, as the Snakefile sees it; a bad
    file is a UserError naming every bad key."""
    from mla.study.config_schema import config_problems  # jsonschema: keeps `mla --help` fast

    cfg = read_mapping(path, "--config file")
    problems = config_problems(cfg)
    if problems:
        raise UserError(f"--config {path}: " + "; ".join(f"config key '{k}': {m}" for k, m in problems))
    return normalised(cfg)
