"""The per-GPU memory plan (mla.training.memory): model states equal DeepSpeed's own estimators, activations
equal what autograd keeps and what the allocator peaks at on CPU, `mla plan --train`, the workflow's check,
and the CPU rehearsal of scripts/gpu-check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mla.conversion import shapes
from mla.errors import UserError
from mla.training import memory

ROOT = Path(__file__).resolve().parents[1]
NAMED = ["llama-2-7b", "smollm-135m"]
# the paper's MLA variants of each (d_kv, r)
LATENTS = {"llama-2-7b": [None, (16, 8), (64, 8)], "smollm-135m": [None, (8, 4), (32, 4)]}
GPUS = [(1, 1), (4, 1), (8, 1), (8, 2), (16, 4)]   # (per node, nodes)


def _model(name, latent):
    config = shapes.read_config(name)
    s = shapes.shape_of(config)
    lat = memory.Latent(*latent) if latent else None
    return config, memory.total_params(s, lat, config["tie_word_embeddings"]), memory.largest_module_params(s, lat)


def _states(config, latent, **kw):
    plan = memory.plan_training(config, micro_batch=1, seq=128, gradient_checkpointing=False,
                                d_kv=latent[0] if latent else None, r=latent[1] if latent else None, **kw)
    return plan["params_bytes"] + plan["gradients_bytes"] + plan["optimizer_bytes"]


@pytest.mark.parametrize("name", NAMED)
def test_zero2_and_zero3_states_equal_deepspeed_estimators(name):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    for latent in LATENTS[name]:
        config, P, largest = _model(name, latent)
        for per_node, nodes in GPUS:
            for offload in (False, True):
                kw = dict(nproc=per_node, nodes=nodes, offload=offload)
                _, gpu2 = estimate_zero2_model_states_mem_needs(P, per_node, nodes, cpu_offload=offload)
                assert _states(config, latent, zero_stage=2, **kw) == gpu2, (latent, per_node, nodes, offload)
                _, gpu3, _ = estimate_zero3_model_states_mem_needs(P, largest, per_node, nodes, cpu_offload=offload,
                                                                   cpu_offload_params=False)
                assert _states(config, latent, zero_stage=3, **kw) == gpu3, (latent, per_node, nodes, offload)
    # Llama-2-7B, ZeRO-2 on 8 GPUs: 2P + 18P/8 with P = 6.74B (output head included)
    config, P, _ = _model("llama-2-7b", None)
    assert P == 6_738_415_616
    assert _states(config, None, nproc=8, zero_stage=2) == 2 * P + 18 * P // 8


@pytest.mark.parametrize("tie,mla", [(True, False), (False, False), (False, True), (True, True)])
def test_estimator_inputs_equal_the_built_model(tie, mla):
    """P and the largest module that the plan derives from a config are DeepSpeed's `model_to_params` of the model."""
    from deepspeed.runtime.zero.stage3 import model_to_params

    from mla.conversion.convert import convert_model
    from mla.tiny_models import tiny_llama

    model = tiny_llama(num_kv_heads=2, tie_word_embeddings=tie, vocab_size=96)   # vocab small: MLP is largest
    latent = None
    if mla:
        model, _ = convert_model(model, d_kv=12, r=2, strategy="high", svd="joint")
        latent = memory.Latent(12, 2)
    s = shapes.shape_of(model.config.to_dict())
    assert (memory.total_params(s, latent, tie), memory.largest_module_params(s, latent)) == model_to_params(model)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [0, 1])
def test_stage0_and_stage1_states_equal_a_deepspeed_engines(stage, tmp_path):
    """Stages 0 and 1 (DeepSpeed has no estimator for them) against what a real engine holds on each of two ranks
    after one fp32 step (tests/zero_states.py): the parameters, and the optimizer's fp32 master partition and
    Adam states (stage 0: torch's AdamW over everything, and the full gradients backward leaves)."""
    from mla.training.launch import free_port

    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                        str(free_port()), str(ROOT / "tests" / "zero_states.py"), str(stage),
                        str(tmp_path / "held")], capture_output=True, text=True, timeout=580,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"})
    assert r.returncode == 0, r.stderr[-4000:]
    for rank in (0, 1):
        held = json.loads((tmp_path / f"held.{rank}.json").read_text())
        P = held["P"]
        plan = memory.model_states(P, 0, gpus_per_node=2, nodes=1, zero_stage=stage, offload=False, precision="fp32")
        assert held["params_bytes"] == plan["params"] == 4 * P
        padding = 12 * held["padding_elements"] // 2     # DeepSpeed pads the flat groups to a multiple of 2
        assert held["master_bytes"] + held["adam_bytes"] - padding == plan["optimizer"]
        if stage == 0:
            assert held["module_grads_bytes"] == plan["gradients"] == 4 * P
        else:   # each rank's partition is half the (padded) model: the fp32 master and Adam's m and v only over it
            assert held["partition_elements"] * 2 == P + held["padding_elements"]


def test_zero0_refuses_offload():
    config, _, _ = _model("llama-2-7b", None)
    with pytest.raises(UserError, match="offload needs ZeRO stage 1, 2 or 3"):
        _states(config, None, nproc=8, zero_stage=0, offload=True)


def test_buffers_are_the_workflow_deepspeed_buckets():
    """The bucket sizes the plan counts are the ones our DeepSpeed config writes (and DeepSpeed's defaults)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from mla.training.config import TrainConfig
    from mla.training.deepspeed_config import deepspeed_config

    zero = deepspeed_config(TrainConfig(model="m", data="d", out="o", zero_stage=2), True)["zero_optimization"]
    assert zero["reduce_bucket_size"] == memory.REDUCE_BUCKET_ELEMENTS and zero["overlap_comm"] is True
    assert zero.get("contiguous_gradients", True) is True
    defaults = DeepSpeedZeroConfig()
    assert defaults.reduce_bucket_size == memory.REDUCE_BUCKET_ELEMENTS
    assert defaults.prefetch_bucket_size == memory.PREFETCH_BUCKET_ELEMENTS
    assert memory.buffer_bytes(zero_stage=2, precision="bf16") == 2 * 2 * 500_000_000
    assert memory.buffer_bytes(zero_stage=0, precision="bf16") == 0


# ---------------------------------------------------------------- activations against measurements
SMALL = dict(model_type="llama", hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096, tie_word_embeddings=False)
# (precision, attention, latent, micro-batch, seq): activations dominate the 0.5M parameters by ~30x
CASES = {
    "llama-gqa-fp32": ("fp32", "sdpa", None, 2, 1024),
    "mla-fp32": ("fp32", "sdpa", (8, 2), 2, 1024),
    "llama-gqa-bf16": ("bf16", "sdpa", None, 1, 512),
    "llama-eager-fp32": ("fp32", "eager", None, 2, 256),
}


def _small_model(precision, attention, latent):
    import torch
    from gpucheck import fresh_model

    config = dict(SMALL, attn_implementation=attention)
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    return config, fresh_model(config, "cpu", dtype, latent=dict(d_kv=latent[0], r=latent[1]) if latent else None)


def _plan(config, precision, attention, latent, b, seq, ckpt):
    return memory.plan_training(config, nproc=1, micro_batch=b, seq=seq, zero_stage=2, gradient_checkpointing=ckpt,
                                precision=precision, attention=attention, d_kv=latent[0] if latent else None,
                                r=latent[1] if latent else None)


@pytest.mark.parametrize("case", list(CASES))
def test_activation_plan_matches_the_allocator_peak(case):
    """Peak allocator bytes of one forward + backward on CPU (the profiler's memory events, gradients allocated
    before) are the plan's activations, with and without gradient checkpointing (the must-show asks 25 %)."""
    from gpucheck import measure_activations

    precision, attention, latent, b, seq = CASES[case]
    config, model = _small_model(precision, attention, latent)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    for ckpt in (False, True):
        plan = _plan(config, precision, attention, latent, b, seq, ckpt)
        measured = measure_activations(model, micro_batch=b, seq=seq, gradient_checkpointing=ckpt, device="cpu")
        ratio = measured / plan["activations_bytes"]
        print(f"{case} checkpointing={ckpt}: measured {measured} plan {plan['activations_bytes']} ratio {ratio:.3f}")
        assert abs(ratio - 1) < 0.08, (case, ckpt, measured, plan["breakdown"]["activations"])
        assert plan["activations_bytes"] > 4 * params
    # checkpointing keeps only the layer inputs: the plan and the measurement agree that it saves memory
    assert (_plan(config, precision, attention, latent, b, seq, True)["activations_bytes"]
            < 0.7 * _plan(config, precision, attention, latent, b, seq, False)["activations_bytes"])


@pytest.mark.parametrize("case", ["llama-gqa-fp32", "mla-fp32", "llama-eager-fp32"])
def test_saved_tensors_are_the_per_layer_formula(case):
    """The tensors autograd keeps for the backward (each storage once, parameters excluded) are exactly the
    plan's: layers x per-layer terms + final norm + log-softmax + RoPE tables (+ token ids)."""
    import torch

    precision, attention, latent, b, seq = CASES[case]
    config, model = _small_model(precision, attention, latent)
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            kept[ptr] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, SMALL["vocab_size"], (b, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    acts = _plan(config, precision, attention, latent, b, seq, False)["breakdown"]["activations"]
    expected = acts["layers_kept"] + acts["final_norm"] + acts["log_softmax"] + acts["rope_tables"]
    ids_bytes = 2 * 8 * b * seq + 4   # token ids and shifted labels (int64), the loss's normaliser
    assert sum(kept.values()) == pytest.approx(expected + ids_bytes, rel=2e-3)


# ---------------------------------------------------------------- mla plan --train
def _cli(*args):
    return subprocess.run([sys.executable, "-m", "mla", "plan", *args], capture_output=True, text=True)


def test_plan_cli_training_mode_paper_jobs():
    r = _cli("--base", "llama-2-7b", "--train", "--nproc", "8", "--micro-batch", "1", "--seq", "4096",
             "--zero-stage", "2", "--gpu-memory", "80GB")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    P = 6_738_415_616
    assert (plan["params_bytes"], plan["gradients_bytes"], plan["optimizer_bytes"]) == (2 * P, 6 * P // 8, 12 * P // 8)
    assert plan["total_bytes"] == (plan["params_bytes"] + plan["gradients_bytes"] + plan["optimizer_bytes"]
                                   + plan["activations_bytes"] + plan["buffers_bytes"])
    assert plan["fits"] is True and plan["usable_bytes"] == 72 * 10**9
    # micro-batch 4 without checkpointing (the old paper config) cannot fit; with checkpointing it does
    big = json.loads(_cli("--base", "llama-2-7b", "--train", "--nproc", "8", "--micro-batch", "4", "--seq", "4096",
                          "--gpu-memory", "80GB").stdout)
    ckpt = json.loads(_cli("--base", "llama-2-7b", "--train", "--nproc", "8", "--micro-batch", "4", "--seq", "4096",
                           "--gpu-memory", "80GB", "--gradient-checkpointing").stdout)
    assert big["fits"] is False and big["activations_bytes"] > 4 * plan["activations_bytes"] * 0.99
    assert ckpt["fits"] is True and ckpt["activations_bytes"] < big["activations_bytes"] / 8
    # the converted model: fewer parameters, a few more activations (latent, head-major output copy)
    mla = json.loads(_cli("--base", "llama-2-7b", "--train", "--nproc", "8", "--micro-batch", "1", "--seq", "4096",
                          "--d-kv", "16").stdout)
    assert mla["model"]["parameters"] == shapes.params_mla(shapes.shape_of(shapes.read_config("llama-2-7b")), 16, 8) \
        + 32000 * 4096
    assert mla["params_bytes"] < plan["params_bytes"] and mla["activations_bytes"] > plan["activations_bytes"]
    assert mla["fits"] is None   # no --gpu-memory


@pytest.mark.parametrize("args,message", [
    (["--train", "--nproc", "8", "--seq", "4096"], "--train needs --micro-batch"),
    (["--nproc", "8"], "--nproc plans a training job: add --train"),
    (["--train", "--nproc", "8", "--micro-batch", "1", "--seq", "4096", "--gpu-memory", "lots"], "--gpu-memory"),
    (["--train", "--nproc", "8", "--micro-batch", "1", "--seq", "4096", "--d-kv", "16", "--d-kv", "32"],
     "give --d-kv once"),
    (["--train", "--nproc", "8", "--micro-batch", "1", "--seq", "4096", "--r", "4"], "--r needs --d-kv"),
])
def test_plan_cli_bad_input(args, message):
    r = _cli("--base", "llama-2-7b", *args)
    assert r.returncode == 2 and message in r.stderr and r.stderr.startswith("mla plan: error:")


def test_parse_memory():
    assert memory.parse_memory("80GB") == 80 * 10**9 == memory.parse_memory(80)
    assert memory.parse_memory("80 GiB") == 80 * 2**30
    assert memory.parse_memory("141e9B") == 141 * 10**9


# ---------------------------------------------------------------- the workflow's check
def _paper():
    return yaml.safe_load((ROOT / "configs/paper.yaml").read_text())


def test_paper_config_jobs_fit_80gb():
    cfg = _paper()
    assert cfg["train"]["gpu_memory_gb"] == 80
    assert memory.memory_errors(cfg) == []


def test_memory_errors_names_the_numbers_and_the_setting(tmp_path, capsys, monkeypatch):
    cfg = _paper()
    cfg["experiments"]["mha2mla"]["train"]["micro_batch_size"] = 16
    errors = memory.memory_errors(cfg)
    assert len(errors) == 1
    key, message = errors[0]
    assert key == "experiments.mha2mla.train.micro_batch_size"
    for word in ("params", "gradients", "optimizer", "activations", "buffers", "72.0 GB usable",
                 "micro_batch_size: 1", "gradient_checkpointing: true"):
        assert word in message, message
    # unknown shapes are skipped with a warning naming the model
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)   # no Hub here: fail fast
    cfg["models"]["llama2-7b"]["repo_id"] = "someone/unknown-model"
    assert memory.memory_errors(cfg, results=tmp_path) == []
    assert "no config.json at hand for model 'llama2-7b'" in capsys.readouterr().err
    # a downloaded model's config.json is preferred to any named shape: at 4 x 4096 the 7B shape needs 135 GB,
    # a 135M-shaped download fits
    cfg = _paper()
    cfg["experiments"]["mha2mla"]["train"]["micro_batch_size"] = 4
    assert [k for k, _ in memory.memory_errors(cfg, results=tmp_path)] == ["train.gradient_checkpointing"]
    (tmp_path / "models/llama2-7b").mkdir(parents=True)
    (tmp_path / "models/llama2-7b/config.json").write_text(json.dumps(shapes.read_config("smollm-135m")))
    assert memory.memory_errors(cfg, results=tmp_path) == []


def test_snakemake_stops_an_oversized_paper_job(tmp_path):
    """configs/paper.yaml plans; the same with Llama-2-7B at micro-batch 16 stops before any job with the numbers."""
    cfg = _paper()
    cfg["experiments"]["mha2mla"]["train"]["micro_batch_size"] = 16
    big = tmp_path / "big.yaml"
    big.write_text(yaml.safe_dump(cfg))
    base = [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "-n", "--cores", "1"]
    for config, ok in ((ROOT / "configs/paper.yaml", True), (big, False)):
        work = tmp_path / ("ok" if ok else "big")
        work.mkdir()
        r = subprocess.run([*base, "-d", str(work), "--configfile", str(config)], capture_output=True, text=True,
                           timeout=300)
        out = r.stdout + r.stderr
        if ok:
            assert r.returncode == 0 and "finetune" in out, out[-3000:]
        else:
            assert r.returncode != 0 and "Job stats" not in out
            assert "config key 'experiments.mha2mla.train.micro_batch_size'" in out
            assert "cannot fit one GPU" in out and "activations" in out and "train.gpu_memory_gb = 80" in out


# ---------------------------------------------------------------- scripts/gpu-check
def test_gpu_check_skips_without_cuda(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: scripts/gpu-check would run for minutes")
    r = subprocess.run([sys.executable, str(ROOT / "scripts/gpu-check"), "--out", str(tmp_path / "s.json")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["status"] == "skipped" and "no CUDA device" in summary["reason"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_gpu_check_tiny_cpu_rehearsal(tmp_path):
    """The GPU check's code on tiny shapes on the CPU: Trainer steps, the plan against the allocator (activations
    and DeepSpeed ZeRO-2's own model states), and absorbed-MLA decode beside S(B,T)."""
    out = tmp_path / "gpu-check.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts/gpu-check"), "--device", "cpu", "--tiny", "--out",
                        str(out), "--workdir", str(tmp_path / "work")],
                       capture_output=True, text=True, timeout=580, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-4000:]
    s = json.loads(out.read_text())
    t = s["training"]
    assert len(t["losses"]) == t["steps"]
    # the throughput of real steps: the tokens it implies were trained within the job's wall time
    assert t["steps"] * t["micro_batch"] * t["seq"] / t["tokens_per_second"] <= t["wall_s"]
    assert all(0 < loss < 20 for loss in t["losses"])
    for row in s["activations"]["rows"]:
        assert abs(row["measured_over_plan"] - 1) < 0.08, row
    ratios = s["model_states"]["measured_over_plan"]
    for key in ("params_bytes", "initialize_bytes", "first_step_kept_bytes", "steady_state_bytes"):
        assert abs(ratios[key] - 1) < 0.01, (key, s["model_states"])
    assert 0.9 < ratios["peak_bytes"] <= 1.0   # the plan is an upper bound: fp32 grads and activations at once
    points = s["decode"]["grid"]
    assert [(p["batch"], p["context"]) for p in points] == [(2, 64), (4, 64)]
    for p in points:
        assert p["status"] == "ok" and p["predicted_speedup"] > 1
        assert p["speedup_absorbed"] == pytest.approx(p["mla_absorbed_tps"] / p["original_tps"])
        assert p["speedup_q4"] == pytest.approx(p["mla_absorbed_q4_tps"] / p["original_tps"])
