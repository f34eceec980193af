"""`mla train`: outputs, kill-and-resume, MLflow re-attach, guard rails (tiny MLA model, CPU, 1 process)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mla.cli import main

STEPS, SAVE, KILL_AT = 8, 3, 5


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from mla.convert import convert_checkpoint
    from mla.data import build_dataset
    from mla.testing import save_tiny_checkpoint

    root = tmp_path_factory.mktemp("train")
    save_tiny_checkpoint(root / "llama")
    convert_checkpoint(root / "llama", root / "mla", d_kv=8, strategy="high")
    build_dataset("pydoc-stdlib", root / "llama", root / "data", block_length=32, max_train_tokens=4096,
                  max_validation_tokens=256, log=lambda *_: None)
    return root


def train(root: Path, out: str, *extra: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env_extra or {})}
    env.pop("MLA_FAULT_KILL_AT_STEP", None)
    env.update(env_extra or {})
    cmd = [sys.executable, "-m", "mla", "train", "--model", str(root / "mla"), "--data", str(root / "data"),
           "--out", str(root / out), "--steps", str(STEPS), "--lr", "3e-3", "--warmup-steps", "2",
           "--decay-steps", "3", "--micro-batch", "2", "--grad-accum", "2", "--zero-stage", "2",
           "--save-steps", str(SAVE), "--tracking-uri", f"sqlite:///{root}/mlflow.db", "--experiment", "t",
           *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)


def rows(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.timeout(400)
def test_kill_and_resume_reproduces_the_uninterrupted_run(inputs):
    from mlflow.tracking import MlflowClient

    from mla.checkpoint import load_model

    full = train(inputs, "full", "--run-name", "full")
    assert full.returncode == 0, full.stderr[-3000:]

    killed = train(inputs, "resumed", "--run-name", "resumed", env_extra={"MLA_FAULT_KILL_AT_STEP": str(KILL_AT)})
    assert killed.returncode == -9, killed.stderr[-3000:]  # really killed (SIGKILL), mid-run
    assert not (inputs / "resumed" / "final").exists()
    assert (inputs / "resumed.checkpoints" / f"checkpoint-{SAVE}").is_dir()
    assert len(rows(inputs / "resumed.checkpoints" / "metrics.csv")) == KILL_AT

    resumed = train(inputs, "resumed", "--run-name", "resumed")  # the same command again
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    a, b = rows(inputs / "full" / "metrics.csv"), rows(inputs / "resumed" / "metrics.csv")
    assert [int(r["step"]) for r in b] == list(range(1, STEPS + 1))
    losses_a, losses_b = [float(r["loss"]) for r in a], [float(r["loss"]) for r in b]
    assert losses_a[-1] < losses_a[0] - 0.05
    assert max(abs(x - y) for x, y in zip(losses_a, losses_b)) <= 1e-6, (losses_a, losses_b)
    assert [float(r["lr"]) for r in a] == [float(r["lr"]) for r in b]
    assert int(b[-1]["tokens"]) == STEPS * 4 * 32

    info = json.loads((inputs / "resumed" / "run.json").read_text())
    assert info["resumed_from"].endswith(f"checkpoint-{SAVE}")
    assert info["tags"] == {"model": "mla", "variant": "d_kv8", "d_kv": 8}
    model = load_model(inputs / "resumed" / "final")
    assert model.config.model_type == "mla_llama"

    # MLflow: one run per name, one point per step although steps 4-5 ran twice, params and tags
    client = MlflowClient(tracking_uri=f"sqlite:///{inputs}/mlflow.db")
    exp = client.get_experiment_by_name("t")
    runs = client.search_runs([exp.experiment_id], filter_string="tags.`mlflow.runName` = 'resumed'")
    assert len(runs) == 1 and runs[0].info.run_id == info["mlflow_run_id"]
    run = client.get_run(info["mlflow_run_id"])
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, STEPS + 1))
    assert {m.step: m.value for m in history} == pytest.approx(dict(enumerate(losses_b, 1)), abs=1e-9)
    assert run.data.params["steps"] == str(STEPS) and run.data.params["zero_stage"] == "2"
    assert run.data.params["global_batch"] == "4"
    assert run.data.tags["d_kv"] == "8" and run.data.tags["variant"] == "d_kv8"
    assert len(run.data.tags["git_commit"]) == 40
    assert run.info.status == "FINISHED"


@pytest.mark.timeout(200)
def test_nan_loss_stops_with_the_step(inputs):
    proc = train(inputs, "nan", "--lr", "1e9", "--clip", "0", "--warmup-steps", "0", "--decay-steps", "0",
                 "--no-mlflow")
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()[-1]
    assert "loss is" in err and "at step" in err, proc.stderr[-2000:]
    step = int(err.split("at step ")[1].split()[0])
    assert 2 <= step <= STEPS
    assert not (inputs / "nan" / "final").exists()


@pytest.mark.parametrize("flags,message", [
    (["--steps", "0"], "steps must be > 0"),
    (["--steps", "10", "--warmup-steps", "6", "--decay-steps", "5"], "exceed the 10 training steps"),
    (["--nproc", "2", "--micro-batch", "2", "--global-batch", "6"], "not divisible by ranks x micro batch"),
    (["--global-batch", "8", "--micro-batch", "2", "--grad-accum", "3"], "grad_accum is 3"),
    (["--zero-stage", "0", "--offload"], "offload needs ZeRO"),
])
def test_bad_configs_fail_before_any_work(inputs, tmp_path, capsys, flags, message):
    out = tmp_path / "run"
    rc = main(["train", "--model", str(inputs / "mla"), "--data", str(inputs / "data"), "--out", str(out), *flags])
    assert rc == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_missing_inputs_and_config_file(inputs, tmp_path, capsys):
    assert main(["train", "--model", str(tmp_path / "none"), "--data", str(inputs / "data"),
                 "--out", str(tmp_path / "o")]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert main(["train", "--model", str(inputs / "mla"), "--data", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "not a data folder" in capsys.readouterr().err
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {inputs / 'mla'}\ndata: {inputs / 'data'}\nout: {tmp_path / 'o'}\nlr: 1e-4\n"
                   "steps: 5\nwarmup_steps: 5\ndecay_steps: 1\n")
    assert main(["train", "--config", str(cfg)]) == 2
    assert "exceed the 5 training steps" in capsys.readouterr().err
    cfg.write_text("stepz: 3\n")
    assert main(["train", "--config", str(cfg)]) == 2
    assert "unknown option(s) ['stepz']" in capsys.readouterr().err
