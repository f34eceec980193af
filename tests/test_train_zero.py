"""ZeRO-2 on 2 ranks (torchrun, gloo) through `mla train` == a plain single-process PyTorch loop.

Tiny MLA model (converted from the tiny Llama), 10 steps, global batch 8 = 2 ranks x micro-batch 4,
the paper's schedule and AdamW; the losses must agree to 1e-4 and each rank's ZeRO checkpoint must
hold half of the fp32 optimizer state.
"""

from __future__ import annotations

import pytest
import torch
from train_helpers import plain_losses, read_rows, run_train, train_inputs  # noqa: F401  (fixture)

STEPS, MICRO, RANKS, LR, WARMUP, DECAY = 10, 4, 2, 3e-3, 2, 3


@pytest.mark.timeout(400)
def test_zero2_two_ranks_matches_plain_pytorch_and_partitions(train_inputs):
    from mla.checkpoint import load_model

    root = train_inputs
    proc = run_train(root, "zero2", "--nproc", str(RANKS), "--zero-stage", "2", "--micro-batch", str(MICRO),
                     "--steps", str(STEPS), "--lr", str(LR), "--warmup-steps", str(WARMUP), "--decay-steps",
                     str(DECAY), "--clip", "1.0", "--weight-decay", "0.01", "--save-steps", str(STEPS),
                     "--run-name", "zero2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    ds_losses = [float(r["loss"]) for r in read_rows(root / "zero2" / "metrics.csv")]
    ref = plain_losses(root, STEPS, RANKS * MICRO, LR, WARMUP, DECAY)
    assert len(ds_losses) == STEPS
    assert ref[-1] < ref[0] - 0.05  # the run really learns, so the comparison is not trivially flat
    assert max(abs(a - b) for a, b in zip(ds_losses, ref)) <= 1e-4, list(zip(ds_losses, ref))

    # each rank's ZeRO-2 optimizer shard holds half of the fp32 master parameters
    ckpt = root / "zero2.checkpoints" / f"checkpoint-{STEPS}" / f"global_step{STEPS}"
    shards = sorted(ckpt.glob("*optim_states.pt"))
    assert [p.name for p in shards] == [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(RANKS)]
    n_params = sum(p.numel() for p in load_model(root / "mla").parameters())
    held = []
    for shard in shards:
        state = torch.load(shard, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        held.append(sum(t.numel() for t in state["single_partition_of_fp32_groups"]))
    assert sum(held) >= n_params
    for h in held:
        assert abs(h - n_params / RANKS) <= 64, (held, n_params)  # half, up to alignment padding
