"""Resume folders keyed by the trajectory only (mla.training.resume): what changes the key, what does
not, stale folders listed and kept, and which saved layouts resume how."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mla.training.config import TrainConfig, resolve
from mla.training.resume import (
    KEY_FILE,
    checkpoint_folder,
    prepare_resume,
    resume_plan,
    saved_layout,
    trajectory,
    trajectory_key,
)

MANIFEST = {"block_length": 32, "splits": {"train": {"sha256": "a" * 64, "file": "train.npy"}}}

# settings of a launch: changing any of them after a crash must find the same resume folder
LAUNCH_CHANGES = {"nproc": 8, "nodes": 2, "micro_batch": 1, "grad_accum": None, "zero_stage": 3,
                  "gradient_checkpointing": True, "save_steps": 7, "save_total_limit": 5, "log_steps": 3,
                  "threads": 4, "device": "cpu", "master_port": 1234, "run_name": "other", "experiment": "x",
                  "tags": ["a=b"], "mlflow": False, "out": "elsewhere"}
# settings of the recipe: each one makes another trajectory
RECIPE_CHANGES = {"steps": 120, "lr": 2e-4, "warmup_steps": 3, "decay_steps": 9, "weight_decay": 0.05, "clip": 0.5,
                  "adam_beta1": 0.8, "adam_beta2": 0.99, "adam_eps": 1e-6, "global_batch": 32, "seed": 7}


@pytest.fixture()
def model(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(b"weights" * 100)
    return folder


def config(model, tmp_path, **changes) -> TrainConfig:
    base = dict(model=str(model), data="d", out=str(tmp_path / "o"), steps=100, global_batch=16, micro_batch=2,
                nproc=2)
    cfg = TrainConfig(**{**base, **changes})
    cfg.world_size = cfg.nproc * cfg.nodes
    return resolve(cfg)


def key(cfg, manifest=MANIFEST, precision="fp32") -> str:
    return trajectory_key(trajectory(cfg, manifest, precision))


def test_key_ignores_launch_settings_and_follows_the_recipe(model, tmp_path):
    base = key(config(model, tmp_path))
    for name, value in LAUNCH_CHANGES.items():
        changed = {name: value}
        if name in ("nproc", "nodes", "micro_batch"):  # keep the global batch divisible
            changed = {"nproc": 2, "nodes": 1, "micro_batch": 2, name: value}
        assert key(config(model, tmp_path, **changed)) == base, name
    assert key(config(model, tmp_path, zero_stage=2, offload=True)) == base
    for name, value in RECIPE_CHANGES.items():
        assert key(config(model, tmp_path, **{name: value})) != base, name
    assert key(config(model, tmp_path), precision="bf16") != base
    other_data = {"block_length": 32, "splits": {"train": {"sha256": "b" * 64}}}
    assert key(config(model, tmp_path), manifest=other_data) != base


def test_key_follows_the_model_contents_not_its_time_stamps(model, tmp_path):
    import os

    base = key(config(model, tmp_path))
    os.utime(model / "model.safetensors", (1, 1))  # re-made with the same bytes: the same trajectory
    (model / "config.json").write_text((model / "config.json").read_text())
    assert key(config(model, tmp_path)) == base
    (model / "model.safetensors").write_bytes(b"weights" * 99 + b"changed")
    assert key(config(model, tmp_path)) != base


def test_other_folders_are_listed_with_their_size_and_kept(model, tmp_path):
    root = tmp_path / "ckpt"
    stale = root / "0123456789abcdef" / "checkpoint-40"
    stale.mkdir(parents=True)
    (stale / "trainer_state.json").write_text("{}")
    (stale / "optim.pt").write_bytes(b"x" * 3 * 2**20)
    lines = []
    doc = trajectory(config(model, tmp_path), MANIFEST, "fp32")
    folder = checkpoint_folder(root, doc, log=lines.append)
    assert folder == root / trajectory_key(doc) and folder.is_dir()
    assert json.loads((folder / KEY_FILE).read_text()) == json.loads(json.dumps(doc))
    assert stale.is_dir()  # never deleted automatically
    assert len(lines) == 1 and "0123456789abcdef (0.00 GiB, last step 40)" in lines[0], lines
    assert checkpoint_folder(root, doc, log=lines.append) == folder  # the same trajectory, the same folder


@pytest.mark.parametrize("saved,now,plan", [
    ({"world_size": 2, "zero_stage": 2}, (2, 2), "plain"),
    ({"world_size": 2, "zero_stage": 2}, (1, 2), "universal"),
    ({"world_size": 2, "zero_stage": 2}, (4, 1), "universal"),
    ({"world_size": 2, "zero_stage": 3}, (1, 3), "universal"),
    ({"world_size": 2, "zero_stage": 0}, (1, 0), "plain"),      # stage 0: every rank holds the whole state
    ({"world_size": 2, "zero_stage": 2}, (2, 3), "incompatible"),
    ({"world_size": 2, "zero_stage": 3}, (2, 2), "incompatible"),
    ({"world_size": 1, "zero_stage": 0}, (1, 2), "incompatible"),
    ({"world_size": 2, "zero_stage": None}, (2, 1), "plain"),    # 1 or 2 inferred from the files
])
def test_resume_plan(saved, now, plan):
    assert resume_plan(saved, *now) == plan


def deepspeed_shards(ckpt: Path, step: int, ranks: int, kind: str, prefix: str = "") -> Path:
    """Empty files named as DeepSpeed names a checkpoint's per-rank shards (`kind`: optim or model)."""
    tag = ckpt / f"global_step{step}"
    tag.mkdir(parents=True, exist_ok=True)
    (ckpt / "latest").write_text(tag.name)
    for r in range(ranks):
        (tag / f"{prefix}zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt").write_bytes(b"")
    return ckpt


def test_layout_is_inferred_from_deepspeed_files_without_the_record(tmp_path):
    ckpt = deepspeed_shards(tmp_path / "checkpoint-5", 5, 4, "optim")
    assert saved_layout(ckpt) == {"world_size": 4, "zero_stage": None}
    deepspeed_shards(ckpt, 5, 4, "model")
    assert saved_layout(ckpt) == {"world_size": 4, "zero_stage": 3}
    # a bf16 run's optimizer shards carry DeepSpeed's bf16_ prefix
    bf16 = deepspeed_shards(tmp_path / "checkpoint-7", 7, 2, "optim", prefix="bf16_")
    assert saved_layout(bf16) == {"world_size": 2, "zero_stage": None}


def test_incompatible_resume_stops_in_one_line_before_any_work(model, tmp_path):
    from mla.errors import UserError

    cfg = config(model, tmp_path, checkpoint_dir=str(tmp_path / "c"), zero_stage=3)
    ckpt = tmp_path / "c" / "checkpoint-4"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text("{}")
    (ckpt / "mla-layout.json").write_text(json.dumps({"world_size": 2, "zero_stage": 2}))
    with pytest.raises(UserError) as err:
        prepare_resume(cfg, log=lambda *_: None)
    message = str(err.value)
    assert "\n" not in message and "--zero-stage 3 (train.zero_stage)" in message
    assert "resume with --zero-stage 2" in message
    same_layout = config(model, tmp_path, checkpoint_dir=str(tmp_path / "c"), zero_stage=2)  # 2 ranks, ZeRO-2
    assert prepare_resume(same_layout, log=lambda *_: None) == "plain"
