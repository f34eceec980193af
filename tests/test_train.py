"""`mla train`: outputs, kill-and-resume, MLflow re-attach, guard rails (tiny MLA model, CPU, 1 process)."""

from __future__ import annotations

import json

import pytest
from train_helpers import BLOCK, plain_losses, read_rows, run_train, train_inputs  # noqa: F401  (fixture)

from mla.cli import main

STEPS, SAVE, KILL_AT, LR = 8, 3, 5, 3e-3
RECIPE = ["--steps", str(STEPS), "--lr", str(LR), "--warmup-steps", "2", "--decay-steps", "3", "--micro-batch", "2",
          "--grad-accum", "2", "--save-steps", str(SAVE), "--experiment", "t"]


def train(root, out, *extra, env_extra=None):
    return run_train(root, out, *RECIPE, *extra, env_extra=env_extra)


rows = read_rows


@pytest.fixture()
def inputs(train_inputs):
    return train_inputs


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
    assert int(b[-1]["tokens"]) == STEPS * 4 * BLOCK
    assert all(float(r["grad_norm"]) > 0 for r in a)
    # default ZeRO stage 0, one process, 2 micro-batches accumulated == plain PyTorch on the whole batch
    ref = plain_losses(inputs, STEPS, 4, LR, 2, 3)
    assert max(abs(x - y) for x, y in zip(losses_a, ref)) <= 1e-4, (losses_a, ref)

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
    assert run.data.params["steps"] == str(STEPS) and run.data.params["zero_stage"] == "0"
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


def test_deepspeed_config_is_explicit_where_it_matters(tmp_path):
    from mla.training.config import TrainConfig, resolve
    from mla.training.deepspeed_config import deepspeed_config

    cfg = resolve(TrainConfig(model="m", data="d", out=str(tmp_path / "o"), zero_stage=3, clip=0.5, offload=True))
    cpu = deepspeed_config(cfg, cuda=False)
    assert cpu["gradient_clipping"] == 0.5  # DeepSpeed 0.19.8 would clip at 1.0 without the key
    assert cpu["optimizer"]["params"]["torch_adam"] is True
    assert cpu["optimizer"]["params"]["betas"] == [0.9, 0.95] and cpu["optimizer"]["params"]["eps"] == 1e-8
    assert cpu["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    assert cpu["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert {cpu[k] for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")} \
        == {"auto"}
    assert "torch_adam" not in deepspeed_config(cfg, cuda=True)["optimizer"]["params"]
    override = tmp_path / "ds.json"
    override.write_text(json.dumps({"wall_clock_breakdown": True, "zero_optimization": {"reduce_bucket_size": 7}}))
    cfg.deepspeed = str(override)
    merged = deepspeed_config(cfg, cuda=False)
    assert merged["wall_clock_breakdown"] is True
    assert merged["zero_optimization"]["reduce_bucket_size"] == 7 and merged["zero_optimization"]["stage"] == 3
