"""`train.distill` and `train.trainable` in the workflow: recipe keys that do not move for runs without them,
the baseline never distilled from itself, the teacher passed to `mla train` and declared as the job's input, and
bad teachers named by their key before any job."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mla.study import experiments
from mla.study.config_schema import config_problems, validated

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"


def smoke() -> dict:
    return yaml.safe_load(SMOKE.read_text())


def runs(cfg: dict) -> dict[str, str]:
    """variant (experiment/name) -> its run folder."""
    return {f"{v.experiment}/{v.name}": v.run_dir for v in experiments.Study(validated(cfg)).variants}


def test_runs_without_distillation_keep_their_recipe_keys():
    before = runs(smoke())
    off = smoke()
    off["train"].update(distill={"weight": 0, "temperature": 3}, trainable="all")
    off["experiments"]["gqa2mla"]["train"] = {"distill": {"weight": 0.0}}
    assert runs(off) == before


def test_distillation_is_a_recipe_setting_and_the_baseline_stays_plain():
    before = runs(smoke())
    on = smoke()
    on["train"]["distill"] = {"weight": 1}
    after = runs(on)
    for name, folder in before.items():
        if name.endswith("/baseline"):
            assert after[name] == folder, name             # distilling from itself is skipped: the same run
        else:
            assert after[name] != folder, name
    study = experiments.Study(validated(on))
    by = {f"{v.experiment}/{v.name}": v for v in study.variants}
    assert by["mha2mla/dkv8"].train["distill"] == {"weight": 1.0, "temperature": 1.0, "teacher": "tiny-mha"}
    assert "distill" not in by["mha2mla/baseline"].train
    # the teacher written out, 1 for 1.0: the same recipe
    explicit = smoke()
    explicit["train"]["distill"] = {"weight": 1.0, "temperature": 1, "teacher": "tiny-mha"}
    explicit["experiments"]["gqa2mla"]["train"] = {"distill": {"weight": 1.0, "teacher": "tiny-gqa"}}
    assert runs(explicit) == after
    # attention-only training changes every run, the baselines' too (the same recipe for all curves)
    attention = smoke()
    attention["train"]["trainable"] = "attention"
    assert not set(runs(attention).values()) & set(before.values())


def test_a_variant_can_distil_alone():
    cfg = smoke()
    cfg["experiments"]["gqa2mla"]["overrides"] = {"dkv4": {"distill": {"weight": 2, "temperature": 2},
                                                           "trainable": "attention"}}
    study = experiments.Study(validated(cfg))
    by = {f"{v.experiment}/{v.name}": v for v in study.experiment("gqa2mla")}
    assert by["gqa2mla/dkv4"].train["distill"] == {"weight": 2.0, "temperature": 2.0, "teacher": "tiny-gqa"}
    assert by["gqa2mla/dkv4"].train["trainable"] == "attention"
    assert "distill" not in by["gqa2mla/dkv8"].train and "trainable" not in by["gqa2mla/dkv8"].train
    assert runs(cfg)["gqa2mla/dkv8"] == runs(smoke())["gqa2mla/dkv8"]


def test_the_recipe_becomes_mla_train_flags():
    from mla.study.train_options import workflow_options
    from mla.training.config import parse_options

    cfg = smoke()
    cfg["train"].update(distill={"weight": 0.5, "temperature": 2}, trainable="attention")
    v = next(v for v in experiments.Study(validated(cfg)).variants if v.name == "dkv8")
    options = workflow_options(v.train)
    assert (options["distill_weight"], options["distill_temperature"], options["teacher"], options["trainable"]) \
        == (0.5, 2.0, "results/models/tiny-mha", "attention")
    argv = [f"--{k.replace('_', '-')}={val}" for k, val in options.items()]
    parsed = parse_options(["--model", "m", "--data", "d", "--out", "o", *argv])
    assert (parsed.distill_weight, parsed.distill_temperature, parsed.teacher, parsed.trainable) == \
        (0.5, 2.0, "results/models/tiny-mha", "attention")
    plain = workflow_options(next(v for v in experiments.Study(validated(smoke())).variants if v.name == "dkv8").train)
    assert not {"distill_weight", "distill_temperature", "teacher", "trainable"} & set(plain)


@pytest.mark.parametrize("change,key,message", [
    (lambda c: c["train"].update(distill={"weight": 1, "teacher": "other-tok"}), "train.distill.teacher",
     "teacher 'other-tok' reads the tokenizer of 'other-tok', the student 'tiny-"),
    (lambda c: c["experiments"]["gqa2mla"].update(overrides={"dkv4": {"distill": {"weight": 1, "teacher": "nope"}}}),
     "experiments.gqa2mla.overrides.dkv4.distill.teacher", "'nope' is not a key of models"),
    (lambda c: c["experiments"]["gqa2mla"].update(train={"distill": {"weight": 1, "teacher": "other-tok"}}),
     "experiments.gqa2mla.train.distill.teacher", "reads the tokenizer of 'other-tok'"),
    (lambda c: c["experiments"]["gqa2mla"].update(overrides={"baseline": {"distill": {"weight": 1}}}),
     "experiments.gqa2mla.overrides.baseline.distill", "the baseline would distil from itself"),
    (lambda c: c["train"].update(distill={"weight": -1}), "train.distill.weight", "less than the minimum of 0"),
    (lambda c: c["train"].update(distill={"weight": 1, "temperature": 0}), "train.distill.temperature",
     "less than or equal to the minimum of 0"),
    (lambda c: c["train"].update(distill={"temperature": 2}), "train.distill", "'weight' is a required property"),
    (lambda c: c["train"].update(trainable="mlp"), "train.trainable", "'mlp' is not one of ['all', 'attention']"),
])
def test_bad_distillation_settings_are_named_before_any_job(change, key, message):
    cfg = smoke()
    cfg["models"]["other-tok"] = {"source": "tiny-random", "num_kv_heads": 2}   # its own root: its own tokenizer
    # a derived model shares its root's tokenizer: a valid teacher for the MHA student
    cfg["models"]["tiny-mha-copy"] = {"source": "mha-from-gqa", "from": "tiny-gqa"}
    assert config_problems(copy.deepcopy(cfg)) == []
    ok = copy.deepcopy(cfg)
    ok["train"]["distill"] = {"weight": 1, "teacher": "tiny-mha-copy"}
    assert config_problems(ok) == []
    change(cfg)
    problems = dict(config_problems(cfg))
    assert key in problems, problems
    assert message in problems[key], problems[key]


def test_snakemake_gives_the_teacher_to_the_distilled_run(tmp_path):
    """A dry run: the distilled job's command carries the flags, and the teacher's folder is its input."""
    cfg = smoke()
    cfg["experiments"]["gqa2mla"]["overrides"] = {"dkv4": {"distill": {"weight": 1, "temperature": 2}}}
    config = tmp_path / "distill.yaml"
    config.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "-d", str(tmp_path / "work"),
           "--configfile", str(config), "--profile", str(ROOT / "workflow/profiles/local"), "-n", "-p"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    text = out.stdout + out.stderr
    distilled = next(v for v in experiments.Study(validated(cfg)).variants if v.name == "dkv4")
    jobs = [block for block in text.split("\n\n") if "rule finetune:" in block]
    [job] = [b for b in jobs if f"{distilled.start}/{distilled.recipe}" in b]
    assert "--distill-weight 1.0 --distill-temperature 2.0 --teacher results/models/tiny-gqa" in job, job
    assert "results/models/tiny-gqa" in job.split("input:")[1].split("output:")[0], job
    others = [b for b in jobs if b is not job]
    assert len(others) == 4 and not any("--teacher" in b or "--distill" in b for b in others)
