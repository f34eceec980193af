"""Resume folders that survive launch changes: keyed by what changes the training trajectory only.

`mla train --checkpoint-root ROOT` keeps the Trainer/DeepSpeed checkpoints of a run in ROOT/<key>, where
<key> hashes (`trajectory()`):

- the start model: sha256 of its config.json and weight files (content, not time stamps: a re-made but
  identical conversion resumes; another one starts afresh),
- the data: the train split's sha256 from the data manifest (block length and tokenizer included),
- the recipe: steps, lr, warmup and decay steps, weight decay, clipping, AdamW betas and eps, global
  batch, seed, the resolved precision (bf16 | fp32), and the content of a --deepspeed override file,
- distillation (weight, temperature, the teacher's sha256 as for the start model), `--trainable` and `--span`
  (blocks per sequence), only when they are on (a run without them keeps its key),
- KEY_VERSION, bumped when the code changes what a trajectory is (e.g. the parameter groups).

Not in the key (launch settings, changeable between a crash and its resume): nproc, nodes, micro batch
and accumulation (they split the same global batch; fp32 sums differ in the last bits only), ZeRO stage
and offload (same AdamW update), gradient checkpointing (recomputes the same activations), save/log
intervals, threads, device placement, ports, MLflow names and tags. A launch setting that the saved
DeepSpeed state cannot follow (the number of ranks or the ZeRO stage, see `resume_plan`) is handled at
resume: converted to a universal checkpoint, or refused with one line saying what to restore.

Other folders under ROOT are never deleted automatically: they are listed with their size. The run's
own folder is deleted only after the run succeeded (by `mla train`, once the final model is written).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from transformers import TrainerCallback

from mla.errors import UserError
from mla.sources import sha256_of

KEY_VERSION = 1
TRAJECTORY_FIELDS = ("steps", "lr", "warmup_steps", "decay_steps", "weight_decay", "clip", "adam_beta1",
                     "adam_beta2", "adam_eps", "global_batch", "seed")
WEIGHT_PATTERNS = ("*.safetensors", "*.bin")
KEY_FILE = "trajectory.json"    # in ROOT/<key>: what the key was computed from (for people)
LAYOUT_FILE = "mla-layout.json"  # in each checkpoint-N: ranks and ZeRO stage that wrote it


# ---------------------------------------------------------------- the key
def model_identity(path: str | Path) -> str:
    """sha256 over the model's config.json and weight files (names and contents)."""
    folder = Path(path)
    files = [folder / "config.json"] + sorted(f for pattern in WEIGHT_PATTERNS for f in folder.glob(pattern))
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}\0{sha256_of(f)}\n".encode())
    return h.hexdigest()


def data_identity(manifest: dict) -> str:
    """The train split's content hash from the data manifest (the whole manifest if it has none)."""
    train = manifest.get("splits", {}).get("train", {})
    if train.get("sha256"):
        return train["sha256"]
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


def trajectory(cfg, manifest: dict, precision: str) -> dict:
    """Everything the key hashes (see the module docstring)."""
    doc = {"key_version": KEY_VERSION, "model": model_identity(cfg.model), "data": data_identity(manifest),
           "precision": precision, **{name: getattr(cfg, name) for name in TRAJECTORY_FIELDS}}
    if cfg.deepspeed:
        doc["deepspeed_override"] = hashlib.sha256(Path(cfg.deepspeed).read_bytes()).hexdigest()
    # distillation and attention-only training only when on, so the keys of runs without them stay as they were
    if cfg.distill_weight > 0:
        doc["distill"] = {"weight": cfg.distill_weight, "temperature": cfg.distill_temperature,
                          "teacher": model_identity(cfg.teacher)}
    if cfg.trainable != "all":
        doc["trainable"] = cfg.trainable
    if cfg.span > 1:   # longer sequences of the same blocks: another trajectory (span 1 keeps the keys it had)
        doc["span"] = cfg.span
    return doc


def trajectory_key(doc: dict) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def checkpoint_folder(root: str | Path, doc: dict, log=print) -> Path:
    """ROOT/<key> for the trajectory `doc` (created, with its trajectory.json); lists the other folders."""
    root = Path(root)
    folder = root / trajectory_key(doc)
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / KEY_FILE).is_file():
        (folder / KEY_FILE).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    stale = [p for p in sorted(root.iterdir()) if p.is_dir() and p != folder]
    if stale:
        sizes = ", ".join(f"{p.name} ({folder_bytes(p) / 2**30:.2f} GiB, {_last_step_text(p)})" for p in stale)
        log(f"mla train: resume folder {folder}; other folders under {root}, kept (delete them yourself when "
            f"no longer needed): {sizes}")
    return folder


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def _last_step_text(folder: Path) -> str:
    ckpt = last_checkpoint(folder)
    return f"last step {ckpt.name.split('-')[-1]}" if ckpt else "no checkpoint"


def last_checkpoint(checkpoint_dir: Path) -> Path | None:
    """The newest complete `checkpoint-N` folder (one with trainer_state.json)."""
    done = [p for p in Path(checkpoint_dir).glob("checkpoint-*")
            if p.name.split("-")[-1].isdigit() and (p / "trainer_state.json").is_file()]
    return max(done, key=lambda p: int(p.name.split("-")[-1]), default=None)


def remove_after_success(folder: str | Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


# ---------------------------------------------------------------- which steps save
class NoResumeCheckpointAtTheEnd(TrainerCallback):
    """Cancel the resume checkpoint that the Trainer adds after the last step (transformers 5.24 saves one
    there whatever `save_steps` says). `mla train` writes the final model next and deletes the run's resume
    folder once it has: that checkpoint would only be written to be deleted (SmolLM2: 2.7 GB and 7 s per run;
    Llama-2-7B: the fp32 Adam states, over 100 GB). A job killed while the final model is written resumes from
    the last periodic checkpoint. A last step that is a multiple of `save_steps` still saves, as asked."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps and state.global_step % state.save_steps:
            control.should_save = False
        return control


# ---------------------------------------------------------------- the saved layout
class LayoutCallback(TrainerCallback):
    """Rank 0 writes checkpoint-N/mla-layout.json: the ranks and ZeRO stage that wrote the checkpoint."""

    def __init__(self, cfg):
        self.layout = {"world_size": cfg.world_size, "zero_stage": cfg.zero_stage, "nodes": cfg.nodes,
                       "nproc": cfg.nproc}

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if folder.is_dir():
                (folder / LAYOUT_FILE).write_text(json.dumps(self.layout) + "\n")


def saved_layout(checkpoint: Path) -> dict:
    """{"world_size", "zero_stage"} of a checkpoint: from mla-layout.json, else from DeepSpeed's files."""
    f = checkpoint / LAYOUT_FILE
    if f.is_file():
        return json.loads(f.read_text())
    tag = (checkpoint / "latest").read_text().strip() if (checkpoint / "latest").is_file() else None
    step_dir = checkpoint / tag if tag else next(iter(sorted(checkpoint.glob("global_step*"))), checkpoint)
    # bf16 runs name their optimizer shards bf16_zero_pp_rank_* (DeepSpeed's bf16 mode, every ZeRO stage)
    optim = list(step_dir.glob("*zero_pp_rank_*_mp_rank_00_optim_states.pt"))
    model = list(step_dir.glob("*zero_pp_rank_*_mp_rank_00_model_states.pt"))
    if model:
        return {"world_size": len(model), "zero_stage": 3}
    if optim:
        return {"world_size": len(optim), "zero_stage": None}  # 1 or 2: same file layout
    return {"world_size": None, "zero_stage": 0}



# ---------------------------------------------------------------- resuming with another layout
def _family(stage) -> str:
    """DeepSpeed checkpoint formats: stage 0 (plain optimizer state), 1/2 (partitioned fp32 groups),
    3 (partitioned parameters too). `None` is a 1/2 checkpoint whose exact stage is unknown."""
    return "0" if stage == 0 else "3" if stage == 3 else "12"


def resume_plan(saved: dict, world_size: int, zero_stage: int) -> str:
    """How a checkpoint written with `saved` layout resumes under (world_size, zero_stage):

    - "plain": as saved (same layout; or stage 0, whose state every rank holds whole, at any world size);
    - "universal": through DeepSpeed's universal checkpoint (other number of ranks within stages 1/2, or
      within stage 3, or 1 <-> 2; checked: losses equal to the uninterrupted run, tests/test_train_resume.py);
    - "incompatible": another format family (0 <-> 1/2/3, 1/2 <-> 3: DeepSpeed 0.19.8 cannot load it).
    """
    before, now = _family(saved.get("zero_stage")), _family(zero_stage)
    if before != now:
        return "incompatible"
    if before == "0":
        return "plain"
    same_world = saved.get("world_size") == world_size
    same_stage = saved.get("zero_stage") == zero_stage or saved.get("zero_stage") is None
    return "plain" if same_world and same_stage else "universal"


def universal_ready(checkpoint: Path) -> bool:
    return (checkpoint / "latest_universal").is_file()


def convert_to_universal(checkpoint: Path, log=print) -> None:
    """`python -m deepspeed.checkpoint.ds_to_universal` on the checkpoint's DeepSpeed folder, in place
    (writes global_stepN_universal/ and latest_universal next to it)."""
    import os
    import subprocess
    import sys

    tag = (checkpoint / "latest").read_text().strip()
    source, target = checkpoint / tag, checkpoint / f"{tag}_universal"
    shutil.rmtree(target, ignore_errors=True)  # an interrupted conversion (latest_universal comes last)
    workers = str(max(1, min(4, os.cpu_count() or 1)))
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(source),
           "--output_folder", str(target), "--inject_missing_state", "--num_extract_workers", workers,
           "--num_merge_workers", "1"]
    log(f"mla train: converting {checkpoint} to a universal checkpoint: {' '.join(cmd)}")
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    if done.returncode != 0 or not universal_ready(checkpoint):
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"checkpoint {checkpoint}: conversion to a universal checkpoint failed ({last}); "
                        "resume with the ranks and ZeRO stage in its mla-layout.json")


def prepare_resume(cfg, log=print) -> str | None:
    """Before launching: how the newest checkpoint resumes under this launch (None: nothing to resume).
    Converts it to a universal checkpoint when needed; one line and no work when it cannot resume."""
    ckpt = last_checkpoint(Path(cfg.checkpoint_dir)) if Path(cfg.checkpoint_dir).is_dir() else None
    if ckpt is None:
        return None
    saved = saved_layout(ckpt)
    plan = resume_plan(saved, cfg.world_size, cfg.zero_stage)
    if plan == "incompatible":
        stage = saved.get("zero_stage")
        stage_text = "1 or 2" if stage is None else str(stage)
        raise UserError(f"--zero-stage {cfg.zero_stage} (train.zero_stage): checkpoint {ckpt} was written with ZeRO "
                        f"stage {stage_text} by {saved.get('world_size') or '?'} ranks, which DeepSpeed cannot load "
                        f"with stage {cfg.zero_stage}; resume with --zero-stage {stage_text.split()[0]} (any number "
                        f"of processes), or move {ckpt.parent} away to start afresh")
    if plan == "universal" and not universal_ready(ckpt):
        log(f"mla train: {ckpt.name} was written by {saved.get('world_size')} ranks with ZeRO stage "
            f"{saved.get('zero_stage')}; this launch has {cfg.world_size} ranks with stage {cfg.zero_stage}")
        convert_to_universal(ckpt, log)
    return plan
