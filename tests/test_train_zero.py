"""DeepSpeed ZeRO with 2 ranks on CPU (gloo), through `mla train`, against one reference run:

- ZeRO-2 on 2 ranks (torchrun) == a plain single-process PyTorch loop (1e-4), half the optimizer state each;
- ZeRO-3 partitions at load (every parameter, the MLA modules' included, is a DeepSpeed partition right
  after `from_pretrained`, each rank holding about half) and trains to the ZeRO-2 losses (1e-4);
- two launchers forming a 2-node job (torchrun --nnodes 2, c10d rendezvous on 127.0.0.1, 1 process
  each) == one launcher with 2 processes (1e-5);
- a 2-rank run killed mid-way resumes with 1 process through a universal checkpoint, after an attempt
  with another ZeRO stage stopped in one line; the keyed resume folder goes once the run succeeded.

Tiny MLA model (converted from the tiny Llama), 10 steps, global batch 8, the paper's schedule and AdamW.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from train_helpers import loaded_shares, plain_losses, read_rows, run_train, train_inputs  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow   # several DeepSpeed processes per test (minutes)

STEPS, MICRO, RANKS, LR, WARMUP, DECAY = 10, 4, 2, 3e-3, 2, 3
RECIPE = ["--zero-stage", "2", "--micro-batch", str(MICRO), "--steps", str(STEPS), "--lr", str(LR), "--warmup-steps",
          str(WARMUP), "--decay-steps", str(DECAY), "--clip", "1.0", "--weight-decay", "0.01", "--no-mlflow"]


def losses(folder) -> list[float]:
    return [float(r["loss"]) for r in read_rows(folder / "metrics.csv")]


def max_diff(a, b) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def zero2(train_inputs):
    """The reference DeepSpeed run: ZeRO-2 on 2 ranks; returns its losses."""
    proc = run_train(train_inputs, "zero2", "--nproc", str(RANKS), *RECIPE, "--save-steps", str(STEPS))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return losses(train_inputs / "zero2")


@pytest.mark.timeout(400)
def test_zero2_two_ranks_matches_plain_pytorch_and_partitions(train_inputs, zero2):
    from mla.checkpoint import load_model

    root = train_inputs
    ref = plain_losses(root, STEPS, RANKS * MICRO, LR, WARMUP, DECAY)
    assert len(zero2) == STEPS
    assert ref[-1] < ref[0] - 0.05  # the run really learns, so the comparison is not trivially flat
    assert max_diff(zero2, ref) <= 1e-4, list(zip(zero2, ref))

    # each rank's ZeRO-2 optimizer shard holds half of the fp32 master parameters
    ckpt = root / "zero2.checkpoints" / f"checkpoint-{STEPS}" / f"global_step{STEPS}"
    shards = sorted(ckpt.glob("*optim_states.pt"))
    assert [p.name for p in shards] == [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(RANKS)]
    n_params = sum(p.numel() for p in load_model(root / "mla").parameters())
    held = []
    for shard in shards:
        state = torch.load(shard, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        held.append(sum(t.numel() for t in state["single_partition_of_fp32_groups"]))
        # two parameter groups reached DeepSpeed: with decay, and norms without
        assert [g["weight_decay"] for g in state["base_optimizer_state"]["param_groups"]] == [0.01, 0.0]
    assert sum(held) >= n_params
    for h in held:
        assert abs(h - n_params / RANKS) <= 64, (held, n_params)  # half, up to alignment padding


@pytest.mark.timeout(400)
def test_zero3_partitions_at_load_and_trains_like_zero2(train_inputs, zero2):
    from mla.checkpoint import load_model

    root = train_inputs
    proc = run_train(root, "zero3", "--nproc", str(RANKS), *RECIPE, "--zero-stage", "3", "--save-steps", str(STEPS))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    shares = loaded_shares(proc.stderr)
    model = load_model(root / "mla")
    total = sum(p.numel() for p in model.parameters())
    assert sorted(shares) == [0, 1], proc.stderr[-3000:]
    for held, seen_total, local, whole, _node in shares.values():
        assert seen_total == total
        assert whole == 0 and local == 0  # every parameter (kv_down, k_up, v_up, ... included) partitioned
        assert abs(held - total / RANKS) <= 2 * len(list(model.parameters()))  # half, up to padding
    assert max_diff(losses(root / "zero3"), zero2) <= 1e-4
    # and the gathered final weights are a real model (the save of ZeRO-3 partitions works)
    final = load_model(root / "zero3" / "final")
    assert sum(p.numel() for p in final.parameters()) == total


@pytest.mark.timeout(400)
def test_two_launchers_as_two_nodes_match_one_launcher(train_inputs, zero2, tmp_path):
    """The multi-node path minus SLURM: the torchrun command `mla train --nodes 2` gives srun, run twice."""
    from mla.training.launch import free_port, launcher_environment, torchrun_command

    root = train_inputs
    config = tmp_path / "two-nodes.json"
    config.write_text(json.dumps({
        "model": str(root / "mla"), "data": str(root / "data"), "out": str(root / "nodes2"), "nproc": 1, "nodes": 2,
        "zero_stage": 2, "micro_batch": MICRO, "steps": STEPS, "lr": LR, "warmup_steps": WARMUP,
        "decay_steps": DECAY, "clip": 1.0, "weight_decay": 0.01, "mlflow": False, "save_steps": STEPS}))
    cmd = torchrun_command(config, 1, nnodes=2, endpoint=f"127.0.0.1:{free_port()}", rdzv_id="two-nodes")
    env = {**launcher_environment(), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    launchers = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for _ in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in launchers]
    assert [p.returncode for p in launchers] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    assert "--nnodes" in cmd and "c10d" in cmd
    info = json.loads((root / "nodes2" / "run.json").read_text())
    assert info["world_size"] == 2 and info["config"]["nodes"] == 2
    assert max_diff(losses(root / "nodes2"), zero2) <= 1e-5


@pytest.mark.timeout(600)
def test_resume_with_fewer_processes_through_a_universal_checkpoint(train_inputs, zero2):
    root = train_inputs
    ckpt_root = root / "keyed"
    keyed = ["--checkpoint-root", str(ckpt_root), "--save-steps", "4"]
    killed = run_train(root, "elastic", "--nproc", str(RANKS), *RECIPE, *keyed,
                       kill_at_step=5)
    assert killed.returncode != 0
    [folder] = [p for p in ckpt_root.iterdir()]
    assert (folder / "checkpoint-4" / "mla-layout.json").is_file()
    assert json.loads((folder / "checkpoint-4" / "mla-layout.json").read_text())["world_size"] == RANKS

    # another ZeRO stage: one line saying what to restore, nothing started or converted
    refused = run_train(root, "elastic", "--nproc", "1", *RECIPE, *keyed, "--micro-batch", "8", "--zero-stage", "3")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1].startswith("mla train: error: --zero-stage 3 (train.zero_stage)")
    assert "resume with --zero-stage 2" in refused.stderr
    assert not (folder / "checkpoint-4" / "latest_universal").exists()

    # one process instead of two (and another micro batch): the same folder, converted, the same losses
    resumed = run_train(root, "elastic", "--nproc", "1", *RECIPE, *keyed, "--micro-batch", "8")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "converting" in resumed.stderr and "universal checkpoint" in resumed.stderr
    info = json.loads((root / "elastic" / "run.json").read_text())
    assert info["resumed_from"] == str(folder / "checkpoint-4") and info["resumed_universal"] is True
    rows = read_rows(root / "elastic" / "metrics.csv")
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    assert max_diff([float(r["loss"]) for r in rows], zero2) <= 1e-5
    assert not folder.exists() and ckpt_root.is_dir()  # the run's own folder went after success, only it
    assert os.listdir(ckpt_root) == []
