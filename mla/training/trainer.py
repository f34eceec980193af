"""One fine-tuning run: Hugging Face `Trainer` + DeepSpeed on packed token blocks.

Data order is fixed by us, not by the Trainer: `BlockDataset` maps sample i to a block through a seeded
per-epoch permutation and the Trainer reads it sequentially. Optimizer step t therefore sees samples
[t*G, (t+1)*G) (G = global batch) whatever the number of ranks, which makes runs with 1 or N ranks and a
plain PyTorch loop comparable, and a resumed run skips exactly the samples it has already seen.
"""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import socket
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from mla import atomic, tracking
from mla.checkpoint import copy_tokenizer_files, load_model, tidy_trained_checkpoint
from mla.data import join_consecutive, open_blocks
from mla.errors import UserError
from mla.training import grad_norms
from mla.training.config import resolved_precision, sequence_length, use_cuda
from mla.training.deepspeed_config import deepspeed_config
from mla.training.distill import Distillation, load_teacher, token_kl, whole_parameter_elements
from mla.training.optimizer import optimizer_class_and_kwargs
from mla.training.resume import LayoutCallback, NoResumeCheckpointAtTheEnd, last_checkpoint, resume_plan, saved_layout
from mla.training.schedule import scheduler_arguments
from mla.training.timelimit import STOP_FILE, TimeLimitCallback
from mla.training.trainable import elements, select_trainable

METRICS_HEADER = ["step", "loss", "lr", "grad_norm", "tokens", "tokens_per_second"]
# with distillation `loss` stays the next-token cross-entropy (what the figure and tables compare across runs);
# `kl` is the per-token KL to the teacher and `total_loss` the optimised CE + weight x T^2 x KL
DISTILL_COLUMNS = ["kl", "total_loss"]


class TrainingDiverged(UserError):
    """The loss became NaN or infinite."""


class BlockDataset(torch.utils.data.Dataset):
    """`length` samples drawn from `blocks` [n, L]: epoch e = one seeded permutation of all blocks."""

    def __init__(self, blocks: np.ndarray, length: int, seed: int):
        self.blocks, self.length, self.seed = blocks, length, seed
        self._perms: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.length

    def block_index(self, i: int) -> int:
        epoch, pos = divmod(i, len(self.blocks))
        if epoch not in self._perms:
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(len(self.blocks))
        return int(self._perms[epoch][pos])

    def __getitem__(self, i: int) -> dict:
        ids = torch.from_numpy(np.asarray(self.blocks[self.block_index(i)], dtype=np.int64))
        return {"input_ids": ids, "labels": ids.clone()}


class MLATrainer(Trainer):
    """Trainer with sequential reading of `BlockDataset`, DeepSpeed engine tuning, a NaN/inf guard, and optionally
    distillation (`mla.training.distill`: the loss CE + weight x T^2 x KL, both parts logged). The paper's schedule
    (`mla.training.schedule`) and AdamW without decay on norms and biases are the Trainer's own
    (warmup_stable_decay; `Trainer.get_decay_parameter_names`, see `mla.training.optimizer`)."""

    def __init__(self, *args, distill=None, **kwargs):
        self.distill = distill
        self._parts = None               # (ce, kl) of the last micro-batch, scaled as the Trainer scales the loss
        self._part_sums = None           # their sums since the last log, as the Trainer's tr_loss
        self._parts_logged_at = None     # global step of the last log
        super().__init__(*args, **kwargs)

    def training_step(self, model, inputs, num_items_in_batch=None):
        if not getattr(self, "_engine_tuned", False):
            _tune_engine(model)
            self._engine_tuned = True
        loss = super().training_step(model, inputs, num_items_in_batch)
        if not torch.isfinite(loss).all():
            raise TrainingDiverged(f"loss is {loss.item()} at step {self.state.global_step + 1} "
                                   f"(rank {self.args.process_index}); lower the lr or check the data")
        if self.distill is not None:
            self._add_parts(num_items_in_batch)
        return loss

    # ------------------------------------------------------------ distillation
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Without distillation the Trainer's own (the model's cross-entropy). With it: the teacher's logits
        first (nothing of the student is held yet), then the student's cross-entropy exactly as without, plus
        weight x T^2 x the per-token KL over the same tokens, normalised and scaled as that cross-entropy."""
        if self.distill is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

        teacher_logits = self.distill.teacher_logits(inputs["input_ids"])
        ce, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        kl = token_kl(outputs.logits, teacher_logits, inputs["labels"], self.distill.temperature, num_items_in_batch)
        kl = kl * self._loss_scale(num_items_in_batch)
        self._parts = (ce.detach(), kl.detach())
        loss = self.distill.combined(ce, kl)
        return (loss, outputs) if return_outputs else loss

    def _loss_scale(self, num_items_in_batch) -> int:
        """The factor Trainer.compute_loss (transformers 5.24) multiplies the model's loss by: the processes,
        when the loss is a sum over the global batch's tokens averaged by DeepSpeed's gradient all-reduce."""
        if (self.args.average_tokens_across_devices and (self.model_accepts_loss_kwargs or self.compute_loss_func)
                and num_items_in_batch is not None):
            return self.accelerator.num_processes // self.get_tp_size()
        return 1

    def _add_parts(self, num_items_in_batch) -> None:
        """Accumulate (ce, kl) as Trainer.training_step accumulates the loss it logs: divided by the accumulation
        steps unless already normalised over the accumulated batch."""
        scaled_for_ga = (self.loss_is_scaled_for_ga if self.loss_is_scaled_for_ga is not None else
                         (self.model_accepts_loss_kwargs and num_items_in_batch is not None)
                         or self.compute_loss_func is not None)
        parts = torch.stack(self._parts).float()
        if not scaled_for_ga:
            parts = parts / self.current_gradient_accumulation_steps
        if self._part_sums is None:
            self._part_sums = torch.zeros_like(parts)
            self._parts_logged_at = self.state.global_step
        self._part_sums += parts

    def log(self, logs: dict, start_time=None) -> None:
        """With distillation: `loss` becomes the cross-entropy, `kl` and `total_loss` (the Trainer's loss) join it,
        averaged over the ranks and the steps since the last log as the Trainer averages its loss."""
        if self.distill is not None and "loss" in logs and self._part_sums is not None:
            from transformers.trainer_pt_utils import nested_gather

            steps = max(self.state.global_step - self._parts_logged_at, 1)
            ce, kl = (nested_gather(self._part_sums[None], self.args.parallel_mode).mean(0) / steps).tolist()
            self._part_sums.zero_()
            self._parts_logged_at = self.state.global_step
            logs.update(total_loss=logs["loss"], loss=ce, kl=kl)
        super().log(logs, start_time)


def _tune_engine(engine) -> None:
    """Two fixes for ZeRO stage 0 (DeepSpeed 0.19.8), applied to the engine before the first step.

    - With a torch optimizer the engine clips through `clip_fp32_gradients`, which drops the norm it
      computes, so the Trainer would get no grad norm: keep it where `get_global_grad_norm` looks.
    - With one rank the backward all-reduce (flatten all grads into buckets, gloo all_reduce, copy back)
      is a no-op that costs two passes over the gradients per step: switch it off.
    """
    is_deepspeed = hasattr(engine, "clip_fp32_gradients") and hasattr(engine, "zero_optimization_stage")
    if not is_deepspeed or engine.zero_optimization_stage() != 0:
        return
    import torch.distributed as dist
    from deepspeed.runtime.utils import clip_grad_norm_

    if dist.is_initialized() and dist.get_world_size() == 1:
        engine.enable_backward_allreduce = False

    def clip_and_record():
        norm = clip_grad_norm_(parameters=engine.module.parameters(), max_norm=engine.gradient_clipping(),
                               mpu=engine.mpu)
        engine._global_grad_norm = float(norm)

    engine.clip_fp32_gradients = clip_and_record


class MetricsCallback(TrainerCallback):
    """Rank 0: per logged step a row step,loss,lr,grad_norm,tokens,tokens_per_second (and kl,total_loss with
    distillation) to a CSV in the checkpoint folder (truncated to the resumed step after a restart), and the same
    rows to MLflow in batches when a checkpoint is saved and at the end (steps already in MLflow are not logged
    twice)."""

    def __init__(self, csv_path: Path, tokens_per_step: int, run_id: str | None, tracking_uri: str | None,
                 distill: bool = False):
        self.csv_path, self.tokens_per_step = csv_path, tokens_per_step
        self.columns = METRICS_HEADER + (DISTILL_COLUMNS if distill else [])
        self.run_id, self.tracking_uri = run_id, tracking_uri
        self.pending: list[dict] = []
        self.in_mlflow: set[int] = set()

    def on_train_begin(self, args, state, control, **kwargs):
        self.last_time, self.last_step = time.perf_counter(), state.global_step
        self.last_cpu, self.cpu_per_step = time.process_time(), []
        if not state.is_world_process_zero:
            return
        rows = []
        if self.csv_path.is_file():
            with open(self.csv_path, newline="") as f:
                rows = [r for r in csv.DictReader(f) if int(r["step"]) <= state.global_step]
        with open(self.csv_path, "w", newline="") as f:
            writer = csv.DictWriter(f, self.columns, lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)
        self.in_mlflow = tracking.logged_steps(self.run_id, "loss", self.tracking_uri)
        self.pending = [{k: float(v) if k != "step" else int(v) for k, v in r.items() if v != ""}
                        for r in rows if int(r["step"]) not in self.in_mlflow]

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        if optimizer is not None:  # the lr this step uses (the Trainer logs the one after the update)
            self.step_lr = optimizer.param_groups[0]["lr"]

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or "loss" not in logs:
            return
        now = time.perf_counter()
        steps = max(state.global_step - self.last_step, 1)
        row = {
            "step": state.global_step,
            "loss": logs["loss"],
            "lr": getattr(self, "step_lr", logs.get("learning_rate")),
            "grad_norm": logs.get("grad_norm"),
            "tokens": state.global_step * self.tokens_per_step,
            "tokens_per_second": steps * self.tokens_per_step / max(now - self.last_time, 1e-9),
            **{k: logs.get(k) for k in self.columns if k in DISTILL_COLUMNS},
        }
        cpu = time.process_time()
        self.cpu_per_step.append((cpu - self.last_cpu) / steps)  # all threads of this process
        self.last_time, self.last_step, self.last_cpu = now, state.global_step, cpu
        with open(self.csv_path, "a", newline="") as f:
            csv.DictWriter(f, self.columns, lineterminator="\n").writerow(row)
        self.pending.append(row)

    def flush(self):
        rows = [r for r in self.pending if r["step"] not in self.in_mlflow]
        tracking.log_step_metrics(self.run_id, rows, self.tracking_uri)
        self.in_mlflow |= {r["step"] for r in rows}
        self.pending = []

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.flush()

    on_train_end = on_save   # the rows since the last checkpoint


def extra_callbacks(specs: list[str]) -> list[TrainerCallback]:
    """The --callback MODULE:NAME classes (or factories), imported and called without arguments."""
    import importlib

    try:
        return [getattr(importlib.import_module(mod), name)() for mod, _, name in (s.partition(":") for s in specs)]
    except (ImportError, AttributeError) as exc:
        raise UserError(f"--callback: {exc}") from None


def default_tags(cfg, model_config) -> dict:
    """model, variant and d_kv tags (flags win; else read from the checkpoint)."""
    info = getattr(model_config, "mha2mla", None) or {}
    d_kv = cfg.d_kv if cfg.d_kv is not None else info.get("d_kv")
    is_mla = model_config.model_type != "llama" and bool(info)
    variant = cfg.variant or (f"d_kv{d_kv}" if is_mla and d_kv is not None else ("mla" if is_mla else "baseline"))
    model_name = cfg.model_name or Path(cfg.model).resolve().name
    return {"model": model_name, "variant": variant, "d_kv": d_kv, **cfg.tag_mapping()}


def mlflow_params(cfg, manifest: dict) -> dict:
    keys = ["steps", "lr", "warmup_steps", "decay_steps", "micro_batch", "grad_accum", "global_batch", "world_size",
            "nodes", "zero_stage", "offload", "gradient_checkpointing", "weight_decay", "clip", "adam_beta1",
            "adam_beta2", "adam_eps", "seed", "precision", "model", "data", "deepspeed"]
    params = {k: getattr(cfg, k) for k in keys}
    if cfg.distill_weight > 0:  # only when on: a run without them keeps the params it always had
        params.update(distill_weight=cfg.distill_weight, distill_temperature=cfg.distill_temperature,
                      teacher=cfg.teacher)
    if cfg.trainable != "all":
        params["trainable"] = cfg.trainable
    if cfg.span > 1:
        params.update(span=cfg.span, sequence_length=sequence_length(cfg, manifest))
    params.update(block_length=manifest["block_length"], data_corpus=manifest["corpus"],
                  data_train_sha256=manifest["splits"]["train"]["sha256"])
    return params


def _save_final(trainer: Trainer, cfg, out: Path) -> None:
    """Final HF checkpoint, written to a temporary folder and renamed by rank 0."""
    tmp = out / ".final.tmp"
    if trainer.is_world_process_zero():
        shutil.rmtree(tmp, ignore_errors=True)
    trainer.accelerator.wait_for_everyone()
    trainer.save_model(str(tmp))  # gathers ZeRO-3 partitions; only rank 0 writes
    if trainer.is_world_process_zero():
        tidy_trained_checkpoint(tmp)
        copy_tokenizer_files(cfg.model, tmp)
        atomic.replace_dir(tmp, out / "final")
    trainer.accelerator.wait_for_everyone()


def training_arguments(cfg, cuda: bool, bf16: bool, universal: bool = False) -> TrainingArguments:
    """The Trainer's arguments, DeepSpeed config included. Create them before loading the model: under
    ZeRO-3 their DeepSpeed config makes `from_pretrained` build the model inside `deepspeed.zero.Init`
    (each rank materialises only its partition), as long as the returned object is alive."""
    ds_config = deepspeed_config(cfg, cuda)
    if universal:  # resume from a checkpoint of another layout (mla.training.resume.resume_plan)
        ds_config.setdefault("checkpoint", {})["load_universal"] = True
    return TrainingArguments(
        output_dir=str(cfg.checkpoint_dir), max_steps=cfg.steps, per_device_train_batch_size=cfg.micro_batch,
        gradient_accumulation_steps=cfg.grad_accum, learning_rate=cfg.lr, weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_epsilon=cfg.adam_eps, max_grad_norm=cfg.clip,
        **scheduler_arguments(cfg.steps, cfg.warmup_steps, cfg.decay_steps),
        logging_steps=cfg.log_steps, logging_nan_inf_filter=False,
        save_strategy="steps", save_steps=cfg.save_steps, save_total_limit=cfg.save_total_limit,
        report_to=[], deepspeed=ds_config, use_cpu=not cuda, bf16=bf16, seed=cfg.seed,
        data_seed=cfg.seed, train_sampling_strategy="sequential", dataloader_drop_last=True,
        dataloader_num_workers=0, disable_tqdm=True, remove_unused_columns=False,
        activation_checkpointing=cfg.gradient_checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": False} if cfg.gradient_checkpointing else None,
    )


def load_dtype(bf16: bool) -> torch.dtype:
    """The dtype every rank loads the start checkpoint in: the training dtype. DeepSpeed casts the module to
    bf16 anyway and builds its fp32 master weights from that bf16 copy, so loading fp32 first only doubles
    each rank's host memory (8 x 27 GB for Llama-2-7B on one node) without changing a number."""
    return torch.bfloat16 if bf16 else torch.float32


def accumulation_dtype(trainer) -> str | None:
    """The dtype DeepSpeed sums the micro-batches' gradients in (None before the engine exists)."""
    engine = getattr(trainer, "model_wrapped", None)
    return str(engine.get_data_types()[1]).removeprefix("torch.") if hasattr(engine, "get_data_types") else None


def time_limit_callbacks(ckpt_dir: Path, rank0: bool) -> list[TrainerCallback]:
    """Inside a SLURM job: stop with a checkpoint before its time limit (mla.training.timelimit)."""
    if rank0:
        (ckpt_dir / STOP_FILE).unlink(missing_ok=True)   # a stop of an earlier submission: resumed now
    if not os.environ.get("SLURM_JOB_ID"):
        return []
    return [TimeLimitCallback(ckpt_dir / STOP_FILE, rank_zero=rank0)]


def build_trainer(cfg, cuda: bool, bf16: bool, dataset, callbacks=(), universal: bool = False) -> MLATrainer:
    """(teacher ->) TrainingArguments (with DeepSpeed) -> model -> MLATrainer, in the order ZeRO-3 needs."""
    # the teacher before the DeepSpeed config exists, so that ZeRO-3 cannot partition it: a whole copy per rank
    teacher = load_teacher(cfg.teacher, bf16) if cfg.distill_weight > 0 else None
    args = training_arguments(cfg, cuda, bf16, universal)
    _ = args.device  # sets up torch.distributed (gloo with use_cpu) before zero.Init needs the world size
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")  # wraps the group made above
    model = load_model(cfg.model, dtype=load_dtype(bf16))
    model.config.use_cache = False
    select_trainable(model, cfg.trainable)  # before the optimizer: frozen parameters get no state
    distill = None
    if teacher is not None:
        distill = Distillation(teacher.to(args.device), cfg.distill_weight, cfg.distill_temperature)
    return MLATrainer(model=model, args=args, train_dataset=dataset, callbacks=list(callbacks),
                      optimizer_cls_and_kwargs=optimizer_class_and_kwargs(cfg, cuda),
                      distill=distill)


def checkpointed_layers(model) -> int:
    """Decoder layers whose activations are recomputed in the backward pass (activation checkpointing)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return sum(1 for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing)


def loaded_share(model) -> dict:
    """What this rank holds of the model's parameters right after loading. Under ZeRO-3 (built inside
    `deepspeed.zero.Init`) every parameter is a partitioned DeepSpeed parameter whose local tensor is
    empty and whose `ds_tensor` holds ~1/world of its elements; otherwise every element is local."""
    total = held = local = 0
    whole = []
    for name, p in model.named_parameters():
        partitioned = hasattr(p, "ds_numel")
        total += p.ds_numel if partitioned else p.numel()
        held += p.ds_tensor.numel() if partitioned else p.numel()
        local += p.numel()
        if not partitioned:
            whole.append(name)
    return {"total": total, "held": held, "local": local, "not_partitioned": whole}


def distill_and_trainable_info(cfg, model) -> dict:
    """run.json's `distill` (null when off) and `trainable` entries."""
    distill = None
    if cfg.distill_weight > 0:
        distill = {"weight": cfg.distill_weight, "temperature": cfg.distill_temperature, "teacher": cfg.teacher}
    params = list(model.parameters())
    return {"distill": distill, "trainable": {"mode": cfg.trainable, "parameters": sum(map(elements, params)),
                                              "trainable_parameters": sum(elements(p) for p in params
                                                                          if p.requires_grad)}}


def _report_teacher_and_trainable(trainer: MLATrainer, cfg, node: str) -> None:
    """One stderr line each: the teacher is whole on this rank (never a DeepSpeed partition); what trains."""
    rank = os.environ.get("RANK", "0")
    if trainer.distill is not None:
        teacher = trainer.distill.teacher
        local, partitioned = whole_parameter_elements(teacher)
        print(f"mla train: rank {rank} on {node} holds the teacher {cfg.teacher} whole: {local:,} parameter "
              f"elements in local tensors, {partitioned} parameters partitioned, {next(teacher.parameters()).dtype}, "
              f"{next(teacher.parameters()).device}, weight {cfg.distill_weight}, temperature "
              f"{cfg.distill_temperature}", file=sys.stderr, flush=True)
    if cfg.trainable != "all":
        info = distill_and_trainable_info(cfg, trainer.model)["trainable"]
        print(f"mla train: rank {rank} trains {info['trainable_parameters']:,} of {info['parameters']:,} parameter "
              f"elements ({cfg.trainable} only)", file=sys.stderr, flush=True)


def run_training(cfg, manifest: dict) -> dict:
    """Train per `cfg` (already resolved and checked) inside a launched process; returns run.json's content."""
    cuda = use_cuda(cfg)
    bf16 = resolved_precision(cfg, cuda) == "bf16"
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out, ckpt_dir = Path(cfg.out), Path(cfg.checkpoint_dir)
    rank0 = tracking.is_rank_zero()
    if rank0:
        out.mkdir(parents=True, exist_ok=True)
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    resume = last_checkpoint(ckpt_dir) if ckpt_dir.is_dir() else None
    universal = resume is not None and resume_plan(saved_layout(resume), cfg.world_size, cfg.zero_stage) == "universal"

    sequences = join_consecutive(open_blocks(cfg.data, "train"), cfg.span)
    dataset = BlockDataset(sequences, cfg.steps * cfg.global_batch, cfg.seed)
    metrics = MetricsCallback(ckpt_dir / "metrics.csv", cfg.global_batch * sequence_length(cfg, manifest), None,
                              cfg.tracking_uri, distill=cfg.distill_weight > 0)
    callbacks = [metrics, LayoutCallback(cfg), NoResumeCheckpointAtTheEnd(), *time_limit_callbacks(ckpt_dir, rank0),
                 *extra_callbacks(cfg.callbacks)]
    trainer = build_trainer(cfg, cuda, bf16, dataset, callbacks, universal)
    loaded = str(next(trainer.model.parameters()).dtype).removeprefix("torch.")
    share = loaded_share(trainer.model)
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    print(f"mla train: rank {os.environ.get('RANK', '0')} on {node} holds {share['held']:,} of {share['total']:,} "
          f"parameter elements after loading ({share['local']:,} in local tensors, {len(share['not_partitioned'])} "
          f"parameters not partitioned)", file=sys.stderr, flush=True)
    _report_teacher_and_trainable(trainer, cfg, node)

    run_id = None
    tags = default_tags(cfg, trainer.model.config)
    run_name = cfg.run_name or f"{tags['model']}-{tags['variant']}"
    if cfg.mlflow and rank0:
        run_id = tracking.get_or_create_run(cfg.tracking_uri, cfg.experiment, run_name, tags=tags,
                                            params=mlflow_params(cfg, manifest))
    metrics.run_id = run_id
    status = "FAILED"
    t0 = time.time()
    try:
        result = trainer.train(resume_from_checkpoint=str(resume) if resume else None)
        if trainer.state.global_step < cfg.steps:   # stopped before the SLURM time limit (mla.training.timelimit)
            status = "KILLED"
            return {"stopped_at_step": trainer.state.global_step, "mlflow_run_id": run_id}
        _save_final(trainer, cfg, out)
        status = "FINISHED"
    finally:
        if run_id is not None:
            tracking.set_terminated(run_id, status, cfg.tracking_uri)
    info = {
        "mlflow_run_id": run_id, "experiment": cfg.experiment, "run_name": run_name,
        "tracking_uri": cfg.tracking_uri or tracking.DEFAULT_TRACKING_URI, "tags": tags,
        "steps": cfg.steps, "world_size": cfg.world_size, "global_batch": cfg.global_batch,
        "tokens": cfg.steps * cfg.global_batch * sequence_length(cfg, manifest), "precision": "bf16" if bf16 else "fp32",
        "loaded_dtype": loaded, "grad_accum_dtype": accumulation_dtype(trainer),
        "resumed_from": str(resume) if resume else None, "resumed_universal": universal,
        "checkpointed_layers": checkpointed_layers(trainer.model),
        "train_runtime_s": round(time.time() - t0, 3),
        "train_loss": result.training_loss if math.isfinite(result.training_loss) else None,
        "cpu_seconds_per_step": metrics.cpu_per_step,  # rank 0's process CPU time per logged step
        **distill_and_trainable_info(cfg, trainer.model),
        "config": json.loads(cfg.to_json()),
    }
    if rank0:
        with atomic.staged(out / "metrics.csv") as tmp:
            shutil.copyfile(ckpt_dir / "metrics.csv", tmp)
        median, largest = grad_norms.spread(out / "metrics.csv")
        info.update(grad_norm_median=median, grad_norm_max=largest)
        atomic.write_json(out / "run.json", info)
        if run_id is not None and median:     # the spread of the run's gradient norms (mla/training/grad_norms.py)
            tracking.log_metrics(run_id, {"grad_norm_median": median, "grad_norm_max": largest,
                                          "grad_norm_max_over_median": largest / median}, tracking_uri=cfg.tracking_uri)
        if run_id is not None:
            tracking.log_artifacts(run_id, [out / "metrics.csv", out / "run.json"], tracking_uri=cfg.tracking_uri)
    return info
