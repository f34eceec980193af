"""`mla train`: fine-tune a converted MLA checkpoint or the unconverted baseline (Trainer + DeepSpeed ZeRO)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

HELP = "fine-tune a checkpoint (MLA or baseline) with Trainer + DeepSpeed ZeRO; resumes from --checkpoint-dir"

EPILOG = """\
Options come from defaults < --config FILE (YAML/JSON mapping with the option names below, '_' or '-')
< flags. Schedule: linear warmup from 0 -> constant -> 1-sqrt decay to 0 over the last --decay-steps.
Outputs: OUT/final (HF checkpoint), OUT/metrics.csv (step,loss,lr,grad_norm,tokens,tokens_per_second),
OUT/run.json (MLflow run id, experiment, run name). Checkpoints go to --checkpoint-dir (default
OUT.checkpoints), or with --checkpoint-root ROOT to ROOT/<key>, where the key hashes only what changes the
trajectory (model and data contents, recipe, global batch, seed, precision; see mla.training.resume):
a changed nproc, nodes, micro batch, ZeRO stage or save interval resumes the same folder, which is deleted
after success (other folders under ROOT are listed, never deleted). Running the same command again
resumes from the newest checkpoint. AdamW: no weight decay on norm weights and biases. On CPU: fp32,
gloo, torch AdamW; --nproc N re-launches under torchrun; --nodes N (inside a SLURM job of N nodes)
starts one torchrun per node with srun."""


def add_arguments(parser) -> None:
    from mla.training.config import TrainConfig as D   # the defaults (torch-free)

    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    a = parser.add_argument
    a("--config", help="YAML/JSON file with any of the options below")
    g = parser.add_argument_group("inputs and outputs")
    g.add_argument("--model", help="HF checkpoint folder (MLA from `mla convert`, or the original model)")
    g.add_argument("--data", help="folder from `mla data`")
    g.add_argument("--out", help="run folder for final/, metrics.csv, run.json")
    g.add_argument("--checkpoint-dir", help="Trainer/DeepSpeed checkpoints (default OUT.checkpoints)")
    g.add_argument("--checkpoint-root", metavar="ROOT",
                   help="instead: checkpoints in ROOT/<trajectory key>, deleted after success")
    g = parser.add_argument_group("recipe (defaults: paper-spec §5)")
    g.add_argument("--steps", type=int, help=f"optimizer steps (default {D.steps})")
    g.add_argument("--lr", type=float, help=f"peak learning rate (default {D.lr})")
    g.add_argument("--warmup-steps", type=int, help="linear warmup steps (default 5%% of steps)")
    g.add_argument("--decay-steps", type=int, help="1-sqrt decay steps at the end (default 10%%)")
    g.add_argument("--micro-batch", type=int, help=f"sequences per rank per pass (default {D.micro_batch})")
    g.add_argument("--grad-accum", type=int, help="accumulation steps (default: from global batch, else 1)")
    g.add_argument("--global-batch", type=int, help="sequences per optimizer step over all ranks")
    g.add_argument("--weight-decay", type=float, help=f"AdamW weight decay (default {D.weight_decay})")
    g.add_argument("--clip", type=float, help=f"gradient clipping max norm, 0 = off (default {D.clip})")
    g.add_argument("--seed", type=int, help=f"seed of data order and Trainer (default {D.seed})")
    g.add_argument("--precision", choices=["auto", "bf16", "fp32"], help="auto: bf16 on CUDA with bf16, else fp32")
    g.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                   help="recompute activations in the backward pass (less memory, same losses)")
    g = parser.add_argument_group("DeepSpeed and processes")
    g.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], help=f"ZeRO stage (default {D.zero_stage})")
    g.add_argument("--offload", action=argparse.BooleanOptionalAction, default=None,
                   help="offload the optimizer state to CPU (ZeRO 1-3)")
    g.add_argument("--deepspeed", metavar="JSON", help="DeepSpeed settings merged over the generated config")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"],
                   help="auto (default): CUDA when present; cuda without CUDA is an error")
    g.add_argument("--nproc", type=int, help="processes per node (default 1; >1 re-launches under torchrun)")
    g.add_argument("--nodes", type=int, help="nodes (default 1; >1 only inside a SLURM job with that many nodes)")
    g.add_argument("--master-port", type=int, help="rendezvous port (default: a free one)")
    g.add_argument("--threads", type=int, help="torch threads per process")
    g.add_argument("--save-steps", type=int, help=f"checkpoint every N steps (default {D.save_steps})")
    g.add_argument("--save-total-limit", type=int, help=f"checkpoints kept (default {D.save_total_limit})")
    g.add_argument("--log-steps", type=int, help=f"metrics row every N steps (default {D.log_steps})")
    g.add_argument("--callback", dest="callbacks", action="append", metavar="MODULE:NAME",
                   help="extra transformers TrainerCallback (class or factory, importable on every rank; repeatable)")
    g = parser.add_argument_group("tracking (MLflow)")
    g.add_argument("--mlflow", action=argparse.BooleanOptionalAction, default=None, help="log to MLflow (default on)")
    g.add_argument("--tracking-uri", help="default sqlite:///results/mlflow.db")
    g.add_argument("--experiment", help=f"MLflow experiment (default {D.experiment})")
    g.add_argument("--run-name", help="default <model>-<variant>; a rerun re-attaches to it")
    g.add_argument("--model-name", help="tag 'model' (default: model folder name)")
    g.add_argument("--variant", help="tag 'variant' (default d_kv<N> for MLA, baseline otherwise)")
    g.add_argument("--d-kv", type=int, help="tag 'd_kv' (default: from the MLA config)")
    g.add_argument("--tag", action="append", default=[], metavar="KEY=VALUE", help="extra MLflow tag (repeatable)")


def _flag_values(args) -> dict:
    from mla.errors import UserError
    from mla.training.config import TrainConfig

    values = {name: getattr(args, name) for name in TrainConfig.field_names() if hasattr(args, name)}
    if args.tag:
        tags = {}
        for item in args.tag:
            if "=" not in item:
                raise UserError(f"--tag {item!r}: expected KEY=VALUE")
            key, value = item.split("=", 1)
            tags[key] = value
        values["tags"] = tags
    return values


def run(args) -> int:
    from mla.training import launch
    from mla.training.config import check_inputs, load_config_file, make_config, use_cuda

    file_values = load_config_file(args.config) if args.config else {}
    world = int(os.environ["WORLD_SIZE"]) if launch.under_launcher() else None
    cfg = make_config(file_values, _flag_values(args), world)
    cuda = use_cuda(cfg)  # --device cuda without CUDA: one line, before anything is loaded
    if launch.under_launcher():  # a worker started by torchrun: the launcher has prepared everything
        return _train_here(cfg, check_inputs(cfg), cuda)

    job = launch.slurm_job(cfg.nodes) if cfg.nodes > 1 else None
    manifest = check_inputs(cfg)
    managed = bool(cfg.checkpoint_root)
    if managed:
        _keyed_checkpoint_dir(cfg, manifest, cuda)
    _check_resume(cfg)

    if cfg.nproc * cfg.nodes == 1:
        launch.single_process_environment(cfg.master_port)
        rc = _train_here(cfg, manifest, cuda)
    else:
        config_path = _write_launch_config(cfg)
        rc = (launch.launch_nodes(config_path, job, cfg.nproc, cfg.master_port) if job
              else launch.relaunch(config_path, cfg.nproc, cfg.master_port))
    if rc == 0 and managed:  # the run is complete: its checkpoints (GBs of fp32 + Adam states) go
        from mla.training.resume import remove_after_success

        remove_after_success(cfg.checkpoint_dir)
    return rc


def _keyed_checkpoint_dir(cfg, manifest: dict, cuda: bool) -> None:
    """--checkpoint-root: the resume folder is ROOT/<trajectory key> (mla.training.resume)."""
    from mla.training.config import resolved_precision
    from mla.training.resume import checkpoint_folder, trajectory

    doc = trajectory(cfg, manifest, resolved_precision(cfg, cuda))
    cfg.checkpoint_dir = str(checkpoint_folder(cfg.checkpoint_root, doc, log=lambda m: print(m, file=sys.stderr)))


def _check_resume(cfg) -> None:
    """A checkpoint written by another number of ranks or ZeRO stage: converted or refused, in one line."""
    from mla.training.resume import prepare_resume

    prepare_resume(cfg, log=lambda m: print(m, file=sys.stderr, flush=True))


def _write_launch_config(cfg) -> Path:
    """The resolved config for the workers (checkpoint folder fixed: they do not hash the model again)."""
    ckpt = Path(cfg.checkpoint_dir)
    ckpt.mkdir(parents=True, exist_ok=True)
    config_path = ckpt / "launch-config.json"
    worker = dataclasses.replace(cfg, checkpoint_root="")
    values = {k: v for k, v in json.loads(worker.to_json()).items() if k != "world_size"}
    config_path.write_text(json.dumps(values, indent=2) + "\n")
    return config_path


def _train_here(cfg, manifest: dict, cuda: bool) -> int:
    from mla.training import launch

    launch.prepare_environment(cuda)
    if not cuda:
        launch.skip_shm_build()

    from mla.tracking import is_rank_zero
    from mla.training.trainer import run_training

    info = run_training(cfg, manifest)
    if is_rank_zero():
        print(f"{cfg.out}: {info['steps']} steps, {info['tokens']} tokens, final loss "
              f"{info['train_loss']}, MLflow run {info['mlflow_run_id']} ({info['run_name']})")
    return 0
