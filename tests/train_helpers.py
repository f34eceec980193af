"""Shared by test_train.py and test_train_zero.py: a tiny MLA checkpoint + packed data (built once per
session), `mla train` in a subprocess, and the plain single-process PyTorch reference loop."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mla.training.config import TrainConfig

BLOCK = 32


@pytest.fixture(scope="session")
def train_inputs(tmp_path_factory) -> Path:
    """root/llama (tiny GQA Llama), root/mla (converted, d_kv 8), root/data (pydoc-stdlib, 32-token blocks)."""
    from mla.conversion.convert import convert_checkpoint
    from mla.data import build_dataset
    from mla.tiny_models import save_tiny_checkpoint

    root = tmp_path_factory.mktemp("train")
    save_tiny_checkpoint(root / "llama")
    convert_checkpoint(root / "llama", root / "mla", d_kv=8, strategy="high")
    build_dataset("pydoc-stdlib", root / "llama", root / "data", block_length=BLOCK, train_tokens=4096,
                  validation_tokens=256, log=lambda *_: None)
    return root


def run_train(root: Path, out: str, *flags: str, kill_at_step: int | None = None) -> subprocess.CompletedProcess:
    """`python -m mla train` on the tiny MLA model and data; OUT = root/out, MLflow in root/mlflow.db.
    kill_at_step=N: every rank SIGKILLs itself once step N is logged (tests/fault_injection.py)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    if kill_at_step is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
        env["MLA_TEST_KILL_AT_STEP"] = str(kill_at_step)
        flags = (*flags, "--callback", "fault_injection:KillAtStep")
    cmd = [sys.executable, "-m", "mla", "train", "--model", str(root / "mla"), "--data", str(root / "data"),
           "--out", str(root / out), "--tracking-uri", f"sqlite:///{root}/mlflow.db", *flags]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def read_rows(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def paper_lr_multiplier(step: int, total_steps: int, warmup_steps: int, decay_steps: int) -> float:
    """The paper's schedule written out (mla/training/schedule.py): the factor on the peak lr at 0-based
    scheduler step `step`: linear warmup from 0, constant, 1-sqrt decay to 0 over the last steps."""
    if step >= total_steps:
        return 0.0
    if step < warmup_steps:
        return step / warmup_steps
    decay_start = total_steps - decay_steps
    if step < decay_start:
        return 1.0
    return 1.0 - math.sqrt((step - decay_start) / decay_steps)


def parameter_groups(model, weight_decay: float) -> list[dict]:
    """AdamW's groups as the Trainer builds them: decay on what `Trainer.get_decay_parameter_names` names."""
    from transformers import Trainer

    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]


def plain_losses(root: Path, steps: int, global_batch: int, lr: float, warmup: int, decay: int,
                 clip: float = 1.0, weight_decay: float = TrainConfig.weight_decay, seed: int = TrainConfig.seed,
                 model_dir: str = "mla",
                 groups: bool = True, return_model: bool = False, distill: tuple | None = None,
                 trainable: str = "all", span: int = 1):
    """The reference: one process, the whole global batch per step, same data order, AdamW (with the
    recipe's parameter groups unless groups=False: then decay on everything) and schedule.
    distill=(teacher folder, weight, T): the loss CE + weight·T²·KL, the KL written directly (torch's kl_div
    over every predicted token); the losses are then (ce, kl) pairs. trainable: as `mla train --trainable`;
    span: sequences of that many consecutive blocks, joined here by concatenation."""
    from functools import partial

    from mla.checkpoint import load_model
    from mla.data import open_blocks
    from mla.training.trainable import select_trainable
    from mla.training.trainer import BlockDataset

    model = load_model(root / model_dir).train()
    select_trainable(model, trainable)
    teacher = load_model(distill[0]).eval() if distill else None
    blocks = open_blocks(root / "data")
    usable = len(blocks) // span * span
    joined = np.stack([np.concatenate(blocks[i:i + span]) for i in range(0, usable, span)])
    data = BlockDataset(joined, steps * global_batch, seed=seed)
    params = parameter_groups(model, weight_decay) if groups else model.parameters()
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, partial(paper_lr_multiplier, total_steps=steps,
                                                           warmup_steps=warmup, decay_steps=decay))
    losses = []
    for step in range(steps):
        ids = torch.stack([data[i]["input_ids"] for i in range(step * global_batch, (step + 1) * global_batch)])
        out = model(input_ids=ids, labels=ids)
        loss = out.loss
        if teacher is not None:
            _, weight, t = distill
            with torch.no_grad():
                target = torch.log_softmax(teacher(input_ids=ids).logits[:, :-1] / t, -1)
            student = torch.log_softmax(out.logits[:, :-1] / t, -1)
            kl = torch.nn.functional.kl_div(student, target, log_target=True, reduction="sum") / target[..., 0].numel()
            (loss + weight * t * t * kl).backward()
            loss = (loss, kl)
        else:
            loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(tuple(x.item() for x in loss) if teacher is not None else loss.item())
    return (losses, model) if return_model else losses


def loaded_shares(log: str) -> dict[int, tuple[int, int, int, int, str]]:
    """rank -> (held, total, local, not partitioned, node) from `mla train`'s "holds ... after loading" lines."""
    import re

    found = {}
    for m in re.finditer(r"rank (\d+) on (\S+) holds ([\d,]+) of ([\d,]+) parameter elements after loading "
                         r"\(([\d,]+) in local tensors, (\d+) parameters not partitioned\)", log):
        counts = tuple(int(g.replace(",", "")) for g in m.groups()[2:])
        found[int(m.group(1))] = (*counts, m.group(2))
    return found
