"""`mla train`: outputs, kill-and-resume, MLflow re-attach, gradient checkpointing, AdamW parameter groups,
guard rails (tiny MLA model, CPU, 1 process)."""

from __future__ import annotations

import json
import statistics

import pytest
from train_helpers import BLOCK, plain_losses, read_rows, run_train, train_inputs  # noqa: F401  (fixture)

from mla.cli import main

STEPS, SAVE, KILL_AT, LR = 8, 3, 5, 3e-3
RECIPE = ["--steps", str(STEPS), "--lr", str(LR), "--warmup-steps", "2", "--decay-steps", "3", "--micro-batch", "2",
          "--grad-accum", "2", "--save-steps", str(SAVE), "--experiment", "t"]


def train(root, out, *extra, kill_at_step=None):
    return run_train(root, out, *RECIPE, *extra, kill_at_step=kill_at_step)


rows = read_rows


@pytest.fixture()
def inputs(train_inputs):
    return train_inputs


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_kill_and_resume_reproduces_the_uninterrupted_run(inputs):
    from mlflow.tracking import MlflowClient

    from mla.checkpoint import load_model

    full = train(inputs, "full", "--run-name", "full")
    assert full.returncode == 0, full.stderr[-3000:]
    # periodic resume checkpoints only: none after the last step (8 is no multiple of 3), the final model follows
    saved = sorted(p.name for p in (inputs / "full.checkpoints").glob("checkpoint-*"))
    assert saved == [f"checkpoint-{SAVE}", f"checkpoint-{2 * SAVE}"], saved

    killed = train(inputs, "resumed", "--run-name", "resumed", kill_at_step=KILL_AT)
    assert killed.returncode == -9, killed.stderr[-3000:]  # really killed (SIGKILL), mid-run
    assert not (inputs / "resumed" / "final").exists()
    assert (inputs / "resumed.checkpoints" / f"checkpoint-{SAVE}").is_dir()
    assert len(rows(inputs / "resumed.checkpoints" / "metrics.csv")) == KILL_AT

    # the same command again, with activation checkpointing switched on: a launch setting that leaves
    # the trajectory as it was (the recompute is the same arithmetic)
    resumed = train(inputs, "resumed", "--run-name", "resumed", "--gradient-checkpointing")
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
    assert info["resumed_from"].endswith(f"checkpoint-{SAVE}") and info["resumed_universal"] is False
    assert (info["loaded_dtype"], info["grad_accum_dtype"]) == ("float32", "float32")   # fp32 on the CPU
    assert info["checkpointed_layers"] == 2  # both decoder layers of the tiny model recompute
    assert json.loads((inputs / "full" / "run.json").read_text())["checkpointed_layers"] == 0
    assert info["tags"] == {"model": "mla", "variant": "d_kv8", "d_kv": 8}
    model = load_model(inputs / "resumed" / "final")
    assert model.config.model_type == "mla_llama"
    assert model.config.use_cache     # training switches the cache off; the saved model has it on again
    norms = [float(r["grad_norm"]) for r in b]
    assert (info["grad_norm_median"], info["grad_norm_max"]) == pytest.approx((statistics.median(norms), max(norms)))

    # MLflow: one run per name, one point per step although steps 4-5 ran twice, params and tags
    client = MlflowClient(tracking_uri=f"sqlite:///{inputs}/mlflow.db")
    exp = client.get_experiment_by_name("t")
    runs = client.search_runs([exp.experiment_id], filter_string="tags.`mlflow.runName` = 'resumed'")
    assert len(runs) == 1 and runs[0].info.run_id == info["mlflow_run_id"]
    run = client.get_run(info["mlflow_run_id"])
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, STEPS + 1))
    assert run.data.metrics["grad_norm_max_over_median"] == pytest.approx(max(norms) / info["grad_norm_median"])
    assert {m.step: m.value for m in history} == pytest.approx(dict(enumerate(losses_b, 1)), abs=1e-9)
    assert run.data.params["steps"] == str(STEPS) and run.data.params["zero_stage"] == "0"
    assert run.data.params["global_batch"] == "4"
    assert run.data.tags["d_kv"] == "8" and run.data.tags["variant"] == "d_kv8"
    assert len(run.data.tags["git_commit"]) == 40
    assert run.info.status == "FINISHED"


@pytest.mark.timeout(200)
def test_span_trains_on_sequences_of_consecutive_blocks(inputs):
    """--span 3: each sequence is 3 consecutive packed blocks (96 tokens); the losses are plain PyTorch's on those
    sequences, not on single blocks, and the token counts follow."""
    steps, span = 3, 3
    proc = run_train(inputs, "span", "--steps", str(steps), "--lr", str(LR), "--warmup-steps", "1", "--decay-steps",
                     "1", "--micro-batch", "2", "--span", str(span), "--no-mlflow")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [float(r["loss"]) for r in rows(inputs / "span" / "metrics.csv")]
    joined = plain_losses(inputs, steps, 2, LR, 1, 1, span=span)
    single = plain_losses(inputs, steps, 2, LR, 1, 1)
    assert max(abs(x - y) for x, y in zip(got, joined)) <= 1e-4, (got, joined)
    assert max(abs(x - y) for x, y in zip(got, single)) > 1e-3, (got, single)   # not single blocks
    info = json.loads((inputs / "span" / "run.json").read_text())
    assert info["tokens"] == int(rows(inputs / "span" / "metrics.csv")[-1]["tokens"]) == steps * 2 * span * BLOCK


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
    (["--nodes", "0"], "--nodes must be >= 1"),
    (["--span", "0"], "--span (train.span) must be >= 1"),
    (["--span", "1000"], "training sequences of 32000 tokens (block length 32 x span 1000) exceed the model's "
                         "max_position_embeddings 4096"),
    (["--checkpoint-dir", "a", "--checkpoint-root", "b"], "exclude each other"),
    (["--callback", "fault_injection"], "callbacks must be a list of MODULE:NAME"),
    (["--zero-stage", "0", "--precision", "bf16", "--micro-batch", "2", "--grad-accum", "2"],
     "--zero-stage 0 (train.zero_stage) with bf16 and 2 accumulation steps"),
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


def test_options_come_from_defaults_then_the_config_file_then_the_flags(tmp_path):
    from mla.errors import UserError
    from mla.training.config import TrainConfig, parse_options

    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("model: m\ndata: d\nout: o\nlr: 3e-4\nsteps: 200\nzero-stage: 2\noffload: true\n"
                        "tags: [a=1]\n")
    cfg = parse_options(["--config", str(cfg_file), "--steps", "100", "--tag", "b=2", "--no-mlflow"])
    assert cfg.lr == 3e-4 and isinstance(cfg.lr, float)  # YAML's string '3e-4', converted like a flag
    assert cfg.steps == 100  # a flag wins over the file, even when it repeats the default
    assert (cfg.zero_stage, cfg.offload, cfg.mlflow, cfg.seed) == (2, True, False, TrainConfig.seed)
    assert cfg.tag_mapping() == {"a": "1", "b": "2"}
    assert (cfg.warmup_steps, cfg.decay_steps) == (5, 10)  # resolved: 5 % and 10 % of the steps
    cfg_file.write_text("model: m\ndata: d\nout: o\nsteps: many\n")
    with pytest.raises(UserError, match=r"config file .*c.yaml: argument --steps: invalid int value: 'many'"):
        parse_options(["--config", str(cfg_file)])


def test_deepspeed_config_is_explicit_where_it_matters(tmp_path):
    from mla.training.config import TrainConfig, resolve
    from mla.training.deepspeed_config import deepspeed_config

    cfg = resolve(TrainConfig(model="m", data="d", out=str(tmp_path / "o"), zero_stage=3, clip=0.5, offload=True))
    cpu = deepspeed_config(cfg, cuda=False)
    assert cpu["gradient_clipping"] == 0.5  # DeepSpeed 0.19.8 would clip at 1.0 without the key
    # no "optimizer" block: the Trainer builds AdamW with parameter groups (see test_parameter_groups_*)
    assert "optimizer" not in cpu and "scheduler" not in cpu
    assert cpu["zero_force_ds_cpu_optimizer"] is False  # torch AdamW with offload on a CPU-only machine
    assert cpu["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    assert cpu["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert {cpu[k] for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")} \
        == {"auto"}
    assert deepspeed_config(cfg, cuda=True)["zero_force_ds_cpu_optimizer"] is True
    stage2 = resolve(TrainConfig(model="m", data="d", out=str(tmp_path / "o"), zero_stage=2))
    # contiguous gradient buffers against GPU memory fragmentation; on the CPU only an extra copy per step
    assert deepspeed_config(stage2, cuda=True)["zero_optimization"]["contiguous_gradients"] is True
    assert deepspeed_config(stage2, cuda=False)["zero_optimization"]["contiguous_gradients"] is False
    import torch

    from mla.training.optimizer import optimizer_class_and_kwargs

    cls, kwargs = optimizer_class_and_kwargs(cfg, cuda=False)
    assert cls is torch.optim.AdamW and kwargs == {"lr": cfg.lr, "betas": (0.9, 0.95), "eps": 1e-8, "fused": True}
    assert optimizer_class_and_kwargs(cfg, cuda=True)[0].__name__ == "DeepSpeedCPUAdam"  # offload on GPU machines
    cfg.offload = False
    assert optimizer_class_and_kwargs(cfg, cuda=True) == (torch.optim.AdamW, kwargs)
    cfg.offload = True
    override = tmp_path / "ds.json"
    override.write_text(json.dumps({"wall_clock_breakdown": True, "zero_optimization": {"reduce_bucket_size": 7}}))
    cfg.deepspeed = str(override)
    merged = deepspeed_config(cfg, cuda=False)
    assert merged["wall_clock_breakdown"] is True
    # under ZeRO the micro-batches are summed in fp32; stage 0 has no such mode (bf16 accumulation is refused)
    assert cpu["data_types"] == {"grad_accum_dtype": "fp32"}
    assert "data_types" not in deepspeed_config(resolve(TrainConfig(model="m", data="d", out="o", zero_stage=0)), True)
    assert merged["zero_optimization"]["reduce_bucket_size"] == 7 and merged["zero_optimization"]["stage"] == 3


def test_device_cuda_and_nodes_fail_in_one_line_before_loading(inputs, tmp_path, capsys, monkeypatch):
    import torch

    base = ["train", "--model", str(inputs / "mla"), "--data", str(inputs / "data"), "--out", str(tmp_path / "o")]
    if not torch.cuda.is_available():
        assert main([*base, "--device", "cuda"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--device cuda" in err[0] and "train.device" in err[0], err
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert main([*base, "--nodes", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--nodes 2 (train.nodes)" in err[0] and "SLURM" in err[0], err
    override = tmp_path / "ds.json"
    override.write_text(json.dumps({"optimizer": {"type": "AdamW"}}))
    assert main([*base, "--deepspeed", str(override)]) == 2
    assert "remove ['optimizer']" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.json"]  # nothing was created


@pytest.mark.parametrize("model_dir", ["mla", "llama"])
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(inputs, model_dir):
    import torch

    from mla.checkpoint import load_model
    from mla.data import open_blocks

    ids = torch.from_numpy(open_blocks(inputs / "data")[:4].astype("int64"))
    results = []
    for checkpointing in (False, True):
        model = load_model(inputs / model_dir).train()
        model.config.use_cache = False
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        calls = []
        model.model.layers[0].self_attn.register_forward_hook(lambda *_: calls.append(1))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.item(), len(calls), {n: p.grad for n, p in model.named_parameters()}))
    (loss_a, calls_a, grads_a), (loss_b, calls_b, grads_b) = results
    assert (calls_a, calls_b) == (1, 2)  # checkpointing really recomputed the layer in the backward pass
    assert abs(loss_a - loss_b) <= 1e-5
    assert grads_a.keys() == grads_b.keys()
    assert max((grads_a[n] - grads_b[n]).abs().max().item() for n in grads_a) <= 1e-5


def test_the_trainers_own_groups_leave_norms_and_biases_without_decay(tmp_path):
    """transformers 5.24's `Trainer.get_decay_parameter_names` (what mla train uses, mla/training/optimizer.py)
    on Llama and MLA checkpoints: every matrix and embedding decays, MLA's own included; norms and biases do not."""
    from transformers import Trainer

    from mla.checkpoint import load_model
    from mla.conversion.convert import convert_checkpoint
    from mla.tiny_models import save_tiny_checkpoint

    save_tiny_checkpoint(tmp_path / "llama", attention_bias=True, num_hidden_layers=1)
    convert_checkpoint(tmp_path / "llama", tmp_path / "mla", d_kv=8, strategy="high")
    mla = load_model(tmp_path / "mla")
    norms = {"model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
             "model.norm.weight"}
    biases = {f"model.layers.0.self_attn.{p}.bias" for p in ("q_proj", "k_rope_proj", "k_up", "v_up", "o_proj")}
    everything = {n for n, _ in mla.named_parameters()}
    decayed = set(Trainer.get_decay_parameter_names(None, mla))
    assert decayed == everything - norms - biases
    for name in ("kv_down", "k_up", "v_up", "k_rope_proj", "q_proj", "o_proj"):  # MLA's own matrices decay
        assert f"model.layers.0.self_attn.{name}.weight" in decayed
    llama = load_model(tmp_path / "llama")
    llama_biases = {f"model.layers.0.self_attn.{p}_proj.bias" for p in "qkvo"}
    assert set(Trainer.get_decay_parameter_names(None, llama)) == (
        {n for n, _ in llama.named_parameters()} - norms - llama_biases)
    # and the real SmolLM2's names (the same Llama layout, 30 layers, tied head)
    from mla.tiny_models import tiny_llama

    deep = tiny_llama(num_hidden_layers=30, tie_word_embeddings=True)
    no_decay = {n for n, _ in deep.named_parameters()} - set(Trainer.get_decay_parameter_names(None, deep))
    assert len(no_decay) == 2 * 30 + 1 and all(n.endswith(("layernorm.weight", "model.norm.weight")) for n in no_decay)


@pytest.mark.timeout(200)
def test_deepspeed_applies_no_decay_to_norms(inputs):
    """One ZeRO-2 step through mla train: norm weights moved exactly as AdamW without decay moves them,
    matrices as AdamW with decay (the groups reached DeepSpeed's optimizer)."""
    import torch

    from mla.checkpoint import load_model

    lr, wd = 1e-2, 0.5  # large, so that decay would move a weight of 1 by lr * wd = 5e-3
    proc = run_train(inputs, "groups", "--steps", "1", "--lr", str(lr), "--warmup-steps", "0", "--decay-steps", "0",
                     "--micro-batch", "4", "--weight-decay", str(wd), "--zero-stage", "2", "--no-mlflow")
    assert proc.returncode == 0, proc.stderr[-3000:]
    trained = dict(load_model(inputs / "groups" / "final").named_parameters())
    _, grouped = plain_losses(inputs, 1, 4, lr, 0, 0, weight_decay=wd, return_model=True)
    _, flat = plain_losses(inputs, 1, 4, lr, 0, 0, weight_decay=wd, groups=False, return_model=True)
    grouped, flat = dict(grouped.named_parameters()), dict(flat.named_parameters())
    for name in ("model.norm.weight", "model.layers.0.input_layernorm.weight",
                 "model.layers.1.self_attn.kv_down.weight", "model.layers.0.self_attn.k_up.weight"):
        assert torch.allclose(trained[name], grouped[name], atol=1e-6), name
    norm = "model.layers.1.post_attention_layernorm.weight"
    assert (trained[norm] - flat[norm]).abs().max().item() > 1e-3  # decay would have shown


@pytest.mark.timeout(400)
def test_bf16_training_loads_bf16_and_sums_micro_batches_in_fp32(inputs, tmp_path):
    """bf16 on the CPU (slow there, tiny here): every rank loads the start model in bf16, and DeepSpeed's ZeRO-2
    accumulates the 2 micro-batches of each step in fp32; DeepSpeed's accumulated gradient of two bf16
    micro-batches has cosine >= 0.999 and norm within 1 % of the fp32 one (a lost micro-batch: ~0.7), its fp32
    masters after one AdamW step within 2 lr per weight (tests/zero_step.py; tests/test_gpu.py runs it on CUDA)."""
    import subprocess
    import sys
    from pathlib import Path

    proc = train(inputs, "bf16", "--precision", "bf16", "--zero-stage", "2", "--steps", "2", "--warmup-steps", "0",
                 "--decay-steps", "0", "--no-mlflow")
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads((inputs / "bf16" / "run.json").read_text())
    assert (info["precision"], info["loaded_dtype"], info["grad_accum_dtype"]) == ("bf16", "bfloat16", "float32")
    assert info["config"]["grad_accum"] == 2

    out = tmp_path / "zero-step.json"
    r = subprocess.run([sys.executable, str(Path(__file__).parent / "zero_step.py"), str(out), "cpu"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(out.read_text())
    assert (s["model_dtype"], s["grad_accum_dtype"], s["master_dtype"]) == \
        ("torch.bfloat16", "torch.float32", "torch.float32"), s
    assert s["grad_cosine"] >= 0.999 and abs(s["grad_norm_ratio"] - 1) <= 0.01, s
    assert s["first_micro_batch_cosine"] < 0.99, s
    assert s["max_master_diff_in_lr"] <= 2.01 and s["mean_master_diff_in_lr"] <= 0.02, s
