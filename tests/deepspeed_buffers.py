"""Run under torchrun by tests/test_memory_plan.py: DeepSpeed with the workflow's config (mla.training.deepspeed_config)
in bf16 on a tiny Llama, per ZeRO stage one optimizer step of two micro-steps. After the first micro-step each
rank records the buffer the micro-steps accumulate into (dtype and elements, as DeepSpeed 0.19.8 names it),
the bf16 gradient partition stage 2 would otherwise keep, and the engine's accumulation dtype; rank r writes
OUT/rank<r>.json.

    torchrun --nproc_per_node 2 tests/deepspeed_buffers.py OUT 1,2,3
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def buffers(engine, stage: int) -> dict:
    opt = engine.optimizer
    if stage == 1:   # BF16_Optimizer: one fp32 gradient buffer per parameter group, the whole group each
        tensors, bf16_partition = list(opt.fp32_groups_gradients_flat), None
    elif stage == 2:   # the fp32 partition groups the reduced micro-steps are added to
        tensors = [g.flat_partition for g in opt.averaged_gradients.values() if hasattr(g, "flat_partition")]
        bf16_partition = opt.grads_in_partition
    else:
        tensors, bf16_partition = [opt.grad_partitions_flat_buffer], None
    return {"optimizer": type(opt).__name__, "dtypes": sorted({str(t.dtype) for t in tensors}),
            "elements": sum(t.numel() for t in tensors),
            "bf16_partition_elements": None if bf16_partition is None else bf16_partition.numel()}


def main(out: Path, stages: list[int]) -> None:
    import torch

    from mla.tiny_models import tiny_llama
    from mla.training import launch
    from mla.training.config import TrainConfig, resolve
    from mla.training.deepspeed_config import deepspeed_config

    launch.prepare_environment(cuda=False)
    launch.skip_shm_build()
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    report = {}
    for stage in stages:
        cfg = TrainConfig(model="-", data="-", out="-", zero_stage=stage, micro_batch=1, grad_accum=2, precision="bf16")
        cfg.world_size = world
        cfg = resolve(cfg)
        ds = deepspeed_config(cfg, cuda=False)
        # the plan counts a GPU's memory: its gradient layout (contiguous, which the CPU config leaves off)
        ds["zero_optimization"]["contiguous_gradients"] = deepspeed_config(cfg, cuda=True)["zero_optimization"].get(
            "contiguous_gradients", True)
        ds.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=2, train_batch_size=cfg.global_batch,
                  bf16={"enabled": True})
        model = tiny_llama(num_kv_heads=2, tie_word_embeddings=False).to(torch.bfloat16).train()
        params = sum(p.numel() for p in model.parameters())
        largest = max(p.numel() for p in model.parameters())
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                          config=ds)
        g = torch.Generator().manual_seed(rank)
        seen = None
        for micro in range(2):
            ids = torch.randint(0, 512, (1, 16), generator=g)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            if micro == 0:
                seen = buffers(engine, stage)
            engine.step()
        report[str(stage)] = {**seen, "parameters": params, "largest_parameter": largest,
                              "grad_accum_dtype": str(engine.get_data_types()[1]), "world_size": world}
        engine.destroy()
    (out / f"rank{rank}.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main(Path(sys.argv[1]), [int(s) for s in sys.argv[2].split(",")])
