"""DeepSpeed JSON for the Hugging Face Trainer: "auto" for everything the Trainer owns (batch sizes,
accumulation, lr, weight decay, bf16), explicit values for the rest.

`gradient_clipping` is always written: DeepSpeed 0.19.8 clips at 1.0 when the key is missing.
There is no `"optimizer"` block: the Trainer creates AdamW with two parameter groups
(`mla.training.optimizer`) and DeepSpeed wraps it. With a block, transformers 5.24 passes DeepSpeed one
flat parameter list and weight decay would reach norms and biases.

`data_types.grad_accum_dtype: fp32` under ZeRO: with bf16 the micro-batches of one optimizer step are summed
in fp32 (DeepSpeed's default is the model dtype: the paper's Llama-2-7B recipe would add 32 bf16 gradients,
each addition rounding to 8 bits of mantissa). Stage 1 then runs DeepSpeed's BF16_Optimizer, stages 2 and 3
accumulate into an fp32 gradient partition (mla.training.memory counts both). Stage 0 has no fp32
accumulation in DeepSpeed 0.19.8 (`NotImplementedError` for the mix), so the key is left out there and
mla.training.config refuses bf16 with accumulation at stage 0. With fp32 training the key changes nothing.
"""

from __future__ import annotations

import json
from pathlib import Path


def deepspeed_config(cfg, cuda: bool) -> dict:
    """DeepSpeed config dict for a resolved `TrainConfig`."""
    zero: dict = {"stage": cfg.zero_stage}
    if cfg.zero_stage in (1, 2):
        # contiguous gradients avoid fragmenting GPU memory; on the CPU they are one more copy of every
        # gradient per step (one SmolLM2 step on 2 cores: 5.0 s with, 4.5 s without; docs/training.md)
        zero.update({"contiguous_gradients": cuda, "overlap_comm": cuda,
                     "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8})
    if cfg.zero_stage == 3:
        # without it Trainer.save_model writes no weights under ZeRO-3
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    if cfg.offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": cuda}
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": cfg.clip,
        "zero_optimization": zero,
        "bf16": {"enabled": "auto"},
        **({"data_types": {"grad_accum_dtype": "fp32"}} if cfg.zero_stage > 0 else {}),
        "fp16": {"enabled": False},
        "zero_allow_untested_optimizer": True,
        # offload on a CPU-only machine: torch AdamW (DeepSpeedCPUAdam would need a 2-minute C++ build)
        "zero_force_ds_cpu_optimizer": cuda,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if cfg.deepspeed:
        config = merge(config, json.loads(Path(cfg.deepspeed).read_text()))
    return config


def merge(base: dict, override: dict) -> dict:
    """Recursive dict update: `override` wins, nested mappings are merged key by key."""
    out = dict(base)
    for key, value in override.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out
