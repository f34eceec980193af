"""What a real DeepSpeed engine holds per rank after one step, for tests/test_memory_plan.py.

    torchrun --nproc-per-node N tests/zero_states.py STAGE OUT_PREFIX

A tiny Llama trained one fp32 step on the CPU (gloo) with ZeRO stage STAGE through `deepspeed.initialize`;
each rank writes OUT_PREFIX.<rank>.json with P and the bytes of the tensors it holds: the module's
parameters and gradients, and the optimizer's (stage 0: torch's AdamW states over every parameter;
stages 1 and 2: DeepSpeed's fp32 master partition and the AdamW states over it, padding counted apart).
"""

from __future__ import annotations

import json
import os
import sys

import torch


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def main(stage: int, out_prefix: str) -> None:
    from mla.training import launch

    launch.prepare_environment(False)
    launch.skip_shm_build()
    import deepspeed

    from mla.tiny_models import tiny_llama

    world = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    model = tiny_llama(num_kv_heads=2, vocab_size=256)
    P = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": world,
              "zero_optimization": {"stage": stage}, "bf16": {"enabled": False}, "steps_per_print": 10**9}
    engine, opt, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(engine.global_rank))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    grads = nbytes(p.grad for p in engine.module.parameters())   # before the step: what backward left
    engine.step()
    held = {"P": P, "world": world, "stage": stage, "params_bytes": nbytes(engine.module.parameters()),
            "module_grads_bytes": grads}
    if stage == 0:
        states = [t for s in opt.state.values() for k, t in s.items() if k in ("exp_avg", "exp_avg_sq")]
        held.update(master_bytes=0, adam_bytes=nbytes(states), padding_elements=0)
    else:
        master = opt.single_partition_of_fp32_groups
        states = [t for s in opt.optimizer.state.values() for k, t in s.items() if k in ("exp_avg", "exp_avg_sq")]
        # the flat groups are padded to a multiple of the world size; every rank holds 1/world of them
        padding = sum(t.numel() for t in opt.bit16_groups_flat) - P
        held.update(master_bytes=nbytes(master), adam_bytes=nbytes(states), padding_elements=padding,
                    partition_elements=sum(t.numel() for t in master))
    with open(f"{out_prefix}.{engine.global_rank}.json", "w") as f:
        json.dump(held, f)
    engine.destroy()
    launch.leave_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
