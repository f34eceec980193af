"""`mla train`: fine-tune a converted MLA checkpoint or the unconverted baseline (Trainer + DeepSpeed ZeRO)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from mla.tracking import is_rank_zero
from mla.training import launch
from mla.training.config import (
    check_accumulation,
    check_inputs,
    option_parser,
    parse_options,
    resolved_precision,
    use_cuda,
)

HELP = "fine-tune a checkpoint (MLA or baseline) with Trainer + DeepSpeed ZeRO; resumes from --checkpoint-dir"

EPILOG = """\
Schedule: linear warmup from 0 -> constant -> 1-sqrt decay to 0 over the last --decay-steps.
Outputs: OUT/final (HF checkpoint), OUT/metrics.csv (step,loss,lr,grad_norm,tokens,tokens_per_second),
OUT/run.json (MLflow run id, experiment, run name). Checkpoints go to --checkpoint-dir (default
OUT.checkpoints), or with --checkpoint-root ROOT to ROOT/<key>, where the key hashes only what changes the
trajectory (model and data contents, recipe, global batch, seed, precision; see mla.training.resume):
a changed nproc, nodes, micro batch, ZeRO stage or save interval resumes the same folder, which is deleted
after success (other folders under ROOT are listed, never deleted). Running the same command again
resumes from the newest checkpoint. On CPU: fp32, gloo, torch AdamW; --nproc N re-launches under torchrun;
--nodes N (inside a SLURM job of N nodes) starts one torchrun per node with srun."""


def parents() -> list:
    """The options, one per field of mla.training.config.TrainConfig."""
    return [option_parser()]


def add_arguments(parser) -> None:
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter


def run(args) -> int:
    world = int(os.environ["WORLD_SIZE"]) if launch.under_launcher() else None
    cfg = parse_options(args.verb_args, world)
    cuda = use_cuda(cfg)  # --device cuda without CUDA: one line, before anything is loaded
    check_accumulation(cfg, resolved_precision(cfg, cuda))  # --precision auto: bf16 is known only now
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
        rc = (launch.launch_nodes(config_path, job, cfg.nproc, cfg.master_port, cuda) if job
              else launch.relaunch(config_path, cfg.nproc, cfg.master_port))
    if rc == 0:
        rc = _stopped_for_time_limit(cfg)
    if rc == 0 and managed:  # the run is complete: its checkpoints (GBs of fp32 + Adam states) go
        from mla.training.resume import remove_after_success  # lazy: torch; keeps `mla --help` fast

        remove_after_success(cfg.checkpoint_dir)
    return rc


def _stopped_for_time_limit(cfg) -> int:
    """EXIT_STOPPED when the run stopped with a checkpoint before its SLURM job's time limit, else 0."""
    from mla.training.timelimit import EXIT_STOPPED, stopped_step  # lazy: torch; keeps `mla --help` fast

    step = stopped_step(cfg.checkpoint_dir)
    if step is None:
        return 0
    print(f"mla train: stopped after step {step} of {cfg.steps} before the SLURM job's time limit; the checkpoint "
          f"is in {cfg.checkpoint_dir} and the same command resumes from it", file=sys.stderr, flush=True)
    return EXIT_STOPPED


def _keyed_checkpoint_dir(cfg, manifest: dict, cuda: bool) -> None:
    """--checkpoint-root: the resume folder is ROOT/<trajectory key> (mla.training.resume)."""
    from mla.training.resume import checkpoint_folder, trajectory  # lazy: torch; keeps `mla --help` fast

    doc = trajectory(cfg, manifest, resolved_precision(cfg, cuda))
    cfg.checkpoint_dir = str(checkpoint_folder(cfg.checkpoint_root, doc, log=lambda m: print(m, file=sys.stderr)))


def _check_resume(cfg) -> None:
    """A checkpoint written by another number of ranks or ZeRO stage: converted or refused, in one line."""
    from mla.training.resume import prepare_resume  # lazy: torch; keeps `mla --help` fast

    prepare_resume(cfg, log=lambda m: print(m, file=sys.stderr, flush=True))


def _write_launch_config(cfg) -> Path:
    """The resolved config for the workers (checkpoint folder fixed: they do not hash the model again)."""
    ckpt = Path(cfg.checkpoint_dir)
    ckpt.mkdir(parents=True, exist_ok=True)
    config_path = ckpt / "launch-config.json"
    values = {k: v for k, v in json.loads(cfg.to_json()).items() if k != "world_size"}
    values["checkpoint_root"] = ""
    config_path.write_text(json.dumps(values, indent=2) + "\n")
    return config_path


def _train_here(cfg, manifest: dict, cuda: bool) -> int:
    launch.prepare_environment(cuda)
    if not cuda:
        launch.skip_shm_build()

    from mla.training.trainer import run_training  # lazy: torch; keeps `mla --help` fast

    info = run_training(cfg, manifest)
    launch.leave_process_group()
    if is_rank_zero() and "stopped_at_step" not in info:
        print(f"{cfg.out}: {info['steps']} steps, {info['tokens']} tokens, final loss "
              f"{info['train_loss']}, MLflow run {info['mlflow_run_id']} ({info['run_name']})")
    return 0
