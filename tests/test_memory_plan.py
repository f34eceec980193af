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

from mla import shapes
from mla.errors import UserError
from mla.study.memory_check import memory_errors
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
def test_zero2_and_zero3_states_are_deepspeed_estimators_with_fp32_accumulation(name):
    """DeepSpeed's estimators count a bf16 gradient partition (2P/N); our config accumulates in fp32 instead
    (data_types.grad_accum_dtype): stage 2 holds only the 4P/N fp32 partition (also on the GPU when offloaded),
    stage 3 the fp32 partition and the step's flat fp32 copy (8P/N where the estimator has 4P/N)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    for latent in LATENTS[name]:
        config, P, largest = _model(name, latent)
        for per_node, nodes in GPUS:
            n = per_node * nodes
            for offload in (False, True):
                kw = dict(nproc=per_node, nodes=nodes, offload=offload)
                _, gpu2 = estimate_zero2_model_states_mem_needs(P, per_node, nodes, cpu_offload=offload)
                fp32_accumulation = 4 * P / n if offload else -2 * P / n
                assert abs(_states(config, latent, zero_stage=2, **kw) - (gpu2 + fp32_accumulation)) <= 2, \
                    (latent, per_node, nodes, offload)
                _, gpu3, _ = estimate_zero3_model_states_mem_needs(P, largest, per_node, nodes, cpu_offload=offload,
                                                                   cpu_offload_params=False)
                fp32_accumulation = 0 if offload else 4 * P / n
                assert abs(_states(config, latent, zero_stage=3, **kw) - (gpu3 + fp32_accumulation)) <= 3, \
                    (latent, per_node, nodes, offload)
    # Llama-2-7B, ZeRO-2 on 8 GPUs: 2P + 16P/8 with P = 6.74B (output head included)
    config, P, _ = _model("llama-2-7b", None)
    assert P == 6_738_415_616
    assert _states(config, None, nproc=8, zero_stage=2) == 2 * P + 16 * P // 8


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


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_deepspeed_accumulates_in_fp32_in_the_buffers_the_plan_counts(tmp_path):
    """Two ranks of real DeepSpeed (CPU, gloo) with the workflow's config in bf16, one step of two micro-steps:
    the micro-steps are summed in fp32 at every ZeRO stage, in the buffers the plan's gradient bytes count
    (stage 1 BF16_Optimizer: the whole model; 2 and 3: each rank's half, with no bf16 partition beside it)."""
    from mla.training.config import TrainConfig, resolve
    from mla.training.launch import free_port

    port = str(free_port())   # not one derived from the pid: two pytest-xdist workers may run such tests at once
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port,
                        str(ROOT / "tests/deepspeed_buffers.py"), str(tmp_path), "1,2,3"],
                       capture_output=True, text=True, timeout=380, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-4000:]
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for stage, seen in report.items():
            P, L, n = seen["parameters"], seen["largest_parameter"], seen["world_size"]
            assert seen["grad_accum_dtype"] == "torch.float32" and seen["dtypes"] == ["torch.float32"], (stage, seen)
            assert seen["bf16_partition_elements"] is None, seen   # no bf16 gradient partition is kept
            held = {"1": P, "2": P // n, "3": P // n}[stage]
            assert held <= seen["elements"] <= held + 64, (stage, seen)   # up to alignment padding
            plan = memory.model_states(P, L, gpus_per_node=n, nodes=1, zero_stage=int(stage), offload=False,
                                       precision="bf16")["gradients"]
            fp32 = 4 * seen["elements"]
            counted = {"1": 2 * P + fp32, "2": fp32, "3": 2 * fp32 + 2 * L}[stage]
            assert abs(plan - counted) <= 4 * 64 * 2, (stage, plan, counted)
        assert report["1"]["optimizer"] == "BF16_Optimizer"
    # ZeRO stage 0 has no fp32 accumulation in DeepSpeed 0.19.8: bf16 with accumulation is refused in one line
    with pytest.raises(UserError, match=r"--zero-stage 0 \(train.zero_stage\) with bf16 and 4 accumulation steps"):
        resolve(TrainConfig(model="m", data="d", out="o", zero_stage=0, precision="bf16", micro_batch=1,
                            global_batch=4))
    resolve(TrainConfig(model="m", data="d", out="o", zero_stage=0, precision="bf16", micro_batch=4, global_batch=4))


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
    assert (plan["params_bytes"], plan["gradients_bytes"], plan["optimizer_bytes"]) == (2 * P, 4 * P // 8, 12 * P // 8)
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


def test_distillation_and_attention_only_by_hand():
    """Llama-2-7B, bf16, ZeRO-2 on 8 GPUs, 1 x 2048 tokens, attention only, distilled from itself, by hand:
    P = 6,738,415,616; attention 32 layers x 4 x 4096² = 2,147,483,648 = P_t; teacher 2P bytes; the loss's
    backward gains the teacher's logits, the student's logits kept by the KL and its gradient (3 x 2 x 2048 x 32000
    bytes) and 6 fp32 chunks of 131 tokens x 32000 (131 = 2^22 // 32000)."""
    config = shapes.read_config("llama-2-7b")
    P, Pt = 6_738_415_616, 2_147_483_648
    common = dict(nproc=8, micro_batch=1, seq=2048, zero_stage=2, gradient_checkpointing=False)
    plain = memory.plan_training(config, **common)
    plan = memory.plan_training(config, **common, trainable="attention", teacher_params=memory.teacher_parameters(config))
    assert (plan["model"]["trainable_parameters"], plan["model"]["teacher_parameters"]) == (Pt, P)
    assert (plan["params_bytes"], plan["gradients_bytes"], plan["optimizer_bytes"]) == (2 * P, 4 * Pt // 8, 12 * Pt // 8)   # fp32 accumulation partition
    assert plan["teacher_bytes"] == 2 * P
    bsv = 2048 * 32000
    extra = plan["breakdown"]["activations"]["distillation"]
    assert extra == {"teacher_logits": 2 * bsv, "kl_chunks": 6 * 4 * 131 * 32000,
                     "loss_forward": 2 * bsv + 6 * 4 * 131 * 32000, "loss_backward": 3 * 2 * bsv + 6 * 4 * 131 * 32000}
    before, after = plain["breakdown"]["activations"]["candidates"], plan["breakdown"]["activations"]["candidates"]
    assert after["loss_backward"] - before["loss_backward"] == 393_216_000 + 100_608_000
    assert after["layer_backward"] == before["layer_backward"]   # the KL's tensors are gone by then
    assert plan["total_bytes"] == (plan["params_bytes"] + plan["gradients_bytes"] + plan["optimizer_bytes"]
                                   + plan["teacher_bytes"] + plan["activations_bytes"] + plan["buffers_bytes"])
    # offloaded: the host holds 16 bytes per trainable parameter; ZeRO-3 partitions every parameter, trains P_t
    off = memory.plan_training(config, **dict(common, zero_stage=1), offload=True, trainable="attention")
    assert off["gradients_bytes"] == 2 * Pt + 4 * Pt   # bf16 gradients + the fp32 accumulation buffer
    assert off["breakdown"]["host_bytes_per_node"] == 16 * Pt
    z3 = memory.plan_training(config, **dict(common, zero_stage=3), trainable="attention")
    assert z3["params_bytes"] == 2 * P // 8 + 2 * memory.largest_module_params(shapes.shape_of(config))
    assert z3["optimizer_bytes"] == 12 * Pt // 8


@pytest.mark.parametrize("tie,mla", [(True, False), (False, True)])
def test_trainable_attention_parameters_equal_the_built_model(tie, mla):
    from mla.conversion.convert import convert_model
    from mla.tiny_models import tiny_llama
    from mla.training.trainable import select_trainable

    model = tiny_llama(num_kv_heads=2, tie_word_embeddings=tie)
    latent = None
    if mla:
        model, _ = convert_model(model, d_kv=12, r=2, strategy="high", svd="joint")
        latent = memory.Latent(12, 2)
    s = shapes.shape_of(model.config.to_dict())
    counted = select_trainable(model, "attention")
    assert memory.trainable_params(s, latent, tie, "attention") == counted["trainable_parameters"]
    assert memory.total_params(s, latent, tie) == counted["parameters"]


def test_plan_cli_counts_a_teacher(tmp_path):
    base = ["--base", "smollm-135m", "--train", "--nproc", "1", "--micro-batch", "4", "--seq", "128"]
    plain, own, other = (json.loads(_cli(*base, *extra).stdout) for extra in
                         ([], ["--teacher"], ["--teacher", "llama-3.2-1b", "--trainable", "attention"]))
    assert plain["teacher_bytes"] == 0 and own["teacher_bytes"] == 2 * own["model"]["parameters"]
    assert other["teacher_bytes"] == 2 * memory.teacher_parameters(shapes.read_config("llama-3.2-1b"))
    assert other["model"]["trainable_parameters"] == 30 * (2 * 576 * 576 + 2 * 576 * 192)   # q, o; k, v (3 heads)
    r = _cli("--base", "smollm-135m", "--trainable", "attention")
    assert r.returncode == 2 and "--trainable plans a training job: add --train" in r.stderr


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
    assert memory_errors(cfg) == []


def test_memory_errors_names_the_numbers_and_the_setting(tmp_path, capsys, monkeypatch):
    cfg = _paper()
    cfg["experiments"]["mha2mla"]["train"]["micro_batch_size"] = 16
    errors = memory_errors(cfg)
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
    assert memory_errors(cfg, results=tmp_path) == []
    assert "no config.json at hand for model 'llama2-7b'" in capsys.readouterr().err
    # a downloaded model's config.json is preferred to any named shape: at 4 x 4096 the 7B shape needs 135 GB,
    # a 135M-shaped download fits
    cfg = _paper()
    cfg["experiments"]["mha2mla"]["train"]["micro_batch_size"] = 4
    assert [k for k, _ in memory_errors(cfg, results=tmp_path)] == ["train.gradient_checkpointing"]
    (tmp_path / "models/llama2-7b").mkdir(parents=True)
    (tmp_path / "models/llama2-7b/config.json").write_text(json.dumps(shapes.read_config("smollm-135m")))
    assert memory_errors(cfg, results=tmp_path) == []


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
    """The GPU check's code on tiny shapes on the CPU, started from another folder without PYTHONPATH (its
    subprocesses find this checkout): the GPU test tier collected and skipped, Trainer steps (fp32 load and
    accumulation on the CPU), the plan against the allocator (activations, and DeepSpeed ZeRO-2's own model states
    in bf16 with fp32 accumulation), absorbed-MLA decode beside S(B,T), and the vLLM part skipped with its reason."""
    out = tmp_path / "gpu-check.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, str(ROOT / "scripts/gpu-check"), "--device", "cpu", "--tiny", "--out",
                        str(out), "--workdir", str(tmp_path / "work")],
                       capture_output=True, text=True, timeout=580, env={**env, "OMP_NUM_THREADS": "1"}, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    s = json.loads(out.read_text())
    assert s["status"] == "ok" and s["errors"] == {} and s["parts"] == ["t", "b", "c", "s", "a"]
    # vLLM serving: left out of the CPU rehearsal, saying why (its CPU path is the workflow's serve test)
    assert s["serve"]["status"] == "skipped" and "tests/test_serve_workflow.py" in s["serve"]["reason"]
    assert Path(s["package"]).resolve() == (ROOT / "mla/__init__.py").resolve()
    tests = s["gpu_tests"]   # no CUDA here: every test of the tier collected and skipped, none failed
    assert tests["skipped"] == len(tests["cases"]) >= 8 and tests["failed"] == tests["error"] == 0
    assert all("CUDA" in c["message"] for c in tests["cases"])
    t = s["training"]
    assert len(t["losses"]) == t["steps"]
    # the throughput of real steps: the tokens it implies were trained within the job's wall time
    assert t["steps"] * t["micro_batch"] * t["seq"] / t["tokens_per_second"] <= t["wall_s"]
    # MFU's FLOPs per token of the tiny SmolLM shape at 64 tokens: 6·N + 12·L·n_h·d_h·s, by hand
    n = 512 * 64 + 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 192 + 2 * 64) + 64      # tied: 131,392
    assert t["flops_per_token"]["total_flops"] == 6 * n + 12 * 2 * 4 * 16 * 64 == 886_656
    assert all(0 < loss < 20 for loss in t["losses"])
    assert (t["loaded_dtype"], t["grad_accum_dtype"], t["accumulation"]) == ("float32", "float32", 2)
    for row in s["activations"]["rows"]:
        assert abs(row["measured_over_plan"] - 1) < 0.08, row
    assert s["model_states"]["precision"] == "bf16"
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


# ---------------------------------------------------------------- MFU: model FLOPs and GPU peaks
def test_training_flops_count_attention_by_hand_for_smollm_135m():
    """SmolLM-135M (tied, L 30, hidden 576, 9 heads / 3 KV heads of 64, MLP 1536, vocab 49152) at 2,048 tokens."""
    from mla.training import flops

    embedding = 49152 * 576                                              # 28,311,552 (also the output head)
    per_layer = 576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536 + 2 * 576  # q, o; k, v; gate, up, down; 2 norms
    n = embedding + 30 * per_layer + 576                                 # + final norm = 134,515,008
    assert n == 134_515_008
    attention = 12 * 30 * 9 * 64 * 2048                                  # QKᵀ and PV, forward + backward
    assert attention == 424_673_280
    f = flops.training_flops_per_token(shapes.read_config("smollm-135m"), 2048)
    assert (f["matmul_params"], f["dense_flops"], f["attention_flops"]) == (n, 6 * n, attention)
    assert f["total_flops"] == 1_231_763_328
    assert f["attention_flops"] / f["total_flops"] == pytest.approx(0.3448, abs=1e-4)   # "about a third"
    # 10,000 tokens/s on an H100 (989.4 TFLOP/s): MFU 1.245 %, where 6·N alone said 0.816 %
    assert flops.mfu(1e4, f["total_flops"], 989.4e12) == pytest.approx(1.231763328e13 / 989.4e12)
    assert flops.mfu(1e4, f["total_flops"], None) is None


def test_training_flops_leave_out_an_untied_input_embedding():
    """Llama-2-7B (untied): the 32000 x 4096 input embedding is a lookup, the output head a matmul."""
    from mla.training import flops

    config = shapes.read_config("llama-2-7b")
    per_layer = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096
    n = 32 * per_layer + 4096 + 32000 * 4096                             # layers, final norm, head (no embedding)
    f = flops.training_flops_per_token(config, 4096)
    assert f["matmul_params"] == n == 6_607_343_616
    assert f["attention_flops"] == 12 * 32 * 32 * 128 * 4096
    mla = dict(shapes.read_config("llama-2-7b"), model_type="mla_llama", kv_lora_rank=32 * 16, qk_rope_head_dim=16)
    converted = flops.training_flops_per_token(mla, 4096)
    # k_proj, v_proj (2·4096·4096) become k_rope (4096·32·16), kv_down (4096·512), k_up (512·32·112), v_up (512·4096)
    change = 4096 * 512 + 4096 * 512 + 512 * 32 * 112 + 512 * 4096 - 2 * 4096 * 4096
    assert converted["matmul_params"] - n == 32 * change
    assert converted["attention_flops"] == f["attention_flops"]          # q/k and v heads stay d_h wide


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA L40", 181.05e12), ("NVIDIA L40S", 362.05e12), ("NVIDIA L4", 121e12),
    ("NVIDIA H100 80GB HBM3", 989.4e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA GH200 480GB", 989.4e12), ("NVIDIA H200", 989.4e12), ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA B200", 2250e12), ("NVIDIA GeForce RTX 4090", None), ("cpu", None)])
def test_peak_is_looked_up_by_whole_words_of_the_gpu_name(name, peak):
    from mla.training.flops import peak_flops

    assert peak_flops(name) == peak
    assert peak_flops(name, override_tflops=100) == 100e12


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpu_check_records_a_failed_part_and_goes_on(tmp_path):
    """A part that raises is recorded (type and message) and the next part runs; the JSON is written after each
    part, so a process killed in a later part leaves the earlier ones on disk."""
    import signal
    import time

    out = tmp_path / "gpu-check.json"
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts/gpu-check"), "--device", "cpu", "--tiny",
                             "--parts", "c,a", "--decode-d-kv", "0", "--out", str(out),
                             "--workdir", str(tmp_path / "work")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None:
            s = json.loads(out.read_text()) if out.is_file() else {}
            if "c" in s.get("timings_s", {}):
                break
            time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()[1][-3000:]   # part a is still running
        assert s["status"] == "failed" and "decode" not in s and "training" not in s
        assert "kv_lora_rank must be positive" in s["errors"]["c"]["error"]
        assert "Traceback" in s["errors"]["c"]["traceback"]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)   # its own group: gpu-check and part a's `mla train`
        proc.communicate()
    assert json.loads(out.read_text())["errors"].keys() == {"c"}   # what was written survives the kill
