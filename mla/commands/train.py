"""`mla train`: fine-tune a converted MLA checkpoint or the unconverted baseline (Trainer + DeepSpeed ZeRO)."""

from __future__ import annotations

import argparse
import os

HELP = "fine-tune a checkpoint (MLA or baseline) with Trainer + DeepSpeed ZeRO; resumes from --checkpoint-dir"

EPILOG = """\
Options come from defaults < --config FILE (YAML/JSON mapping with the option names below, '_' or '-')
< flags. Schedule: linear warmup from 0 -> constant -> 1-sqrt decay to 0 over the last --decay-steps.
Outputs: OUT/final (HF checkpoint), OUT/metrics.csv (step,loss,lr,grad_norm,tokens,tokens_per_second),
OUT/run.json (MLflow run id, experiment, run name). Checkpoints go to --checkpoint-dir (default
OUT.checkpoints); running the same command again resumes from the newest one. On CPU: fp32, gloo,
torch AdamW; --nproc N re-launches under torchrun."""


def add_arguments(parser) -> None:
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    a = parser.add_argument
    a("--config", help="YAML/JSON file with any of the options below")
    g = parser.add_argument_group("inputs and outputs")
    g.add_argument("--model", help="HF checkpoint folder (MLA from `mla convert`, or the original model)")
    g.add_argument("--data", help="folder from `mla data`")
    g.add_argument("--out", help="run folder for final/, metrics.csv, run.json")
    g.add_argument("--checkpoint-dir", dest="checkpoint_dir", help="Trainer/DeepSpeed checkpoints (default OUT.checkpoints)")
    g = parser.add_argument_group("recipe (defaults: paper-spec §5)")
    g.add_argument("--steps", type=int, help="optimizer steps (default 100)")
    g.add_argument("--lr", type=float, help="peak learning rate (default 1e-4)")
    g.add_argument("--warmup-steps", dest="warmup_steps", type=int, help="linear warmup steps (default 5%% of steps)")
    g.add_argument("--decay-steps", dest="decay_steps", type=int, help="1-sqrt decay steps at the end (default 10%%)")
    g.add_argument("--micro-batch", dest="micro_batch", type=int, help="sequences per rank per pass (default 4)")
    g.add_argument("--grad-accum", dest="grad_accum", type=int, help="accumulation steps (default: from global batch, else 1)")
    g.add_argument("--global-batch", dest="global_batch", type=int, help="sequences per optimizer step over all ranks")
    g.add_argument("--weight-decay", dest="weight_decay", type=float, help="AdamW weight decay (default 0.01)")
    g.add_argument("--clip", type=float, help="gradient clipping max norm, 0 = off (default 1.0)")
    g.add_argument("--seed", type=int, help="seed of data order and Trainer (default 42)")
    g.add_argument("--precision", choices=["auto", "bf16", "fp32"], help="auto: bf16 on CUDA with bf16, else fp32")
    g = parser.add_argument_group("DeepSpeed and processes")
    g.add_argument("--zero-stage", dest="zero_stage", type=int, choices=[0, 1, 2, 3], help="ZeRO stage (default 0)")
    g.add_argument("--offload", action=argparse.BooleanOptionalAction, default=None,
                   help="offload the optimizer state to CPU (ZeRO 1-3)")
    g.add_argument("--deepspeed", metavar="JSON", help="DeepSpeed settings merged over the generated config")
    g.add_argument("--nproc", type=int, help="processes on this node (default 1; >1 re-launches under torchrun)")
    g.add_argument("--master-port", dest="master_port", type=int, help="rendezvous port (default: a free one)")
    g.add_argument("--threads", type=int, help="torch threads per process")
    g.add_argument("--save-steps", dest="save_steps", type=int, help="checkpoint every N steps (default 50)")
    g.add_argument("--save-total-limit", dest="save_total_limit", type=int, help="checkpoints kept (default 2)")
    g.add_argument("--log-steps", dest="log_steps", type=int, help="metrics row every N steps (default 1)")
    g = parser.add_argument_group("tracking (MLflow)")
    g.add_argument("--mlflow", action=argparse.BooleanOptionalAction, default=None, help="log to MLflow (default on)")
    g.add_argument("--tracking-uri", dest="tracking_uri", help="default sqlite:///results/mlflow.db")
    g.add_argument("--experiment", help="MLflow experiment (default mha2mla)")
    g.add_argument("--run-name", dest="run_name", help="default <model>-<variant>; a rerun re-attaches to it")
    g.add_argument("--model-name", dest="model_name", help="tag 'model' (default: model folder name)")
    g.add_argument("--variant", help="tag 'variant' (default d_kv<N> for MLA, baseline otherwise)")
    g.add_argument("--d-kv", dest="d_kv", type=int, help="tag 'd_kv' (default: from the MLA config)")
    g.add_argument("--tag", action="append", default=[], metavar="KEY=VALUE", help="extra MLflow tag (repeatable)")


def _flag_values(args) -> dict:
    from mla.cli import UserError
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
    from pathlib import Path

    from mla.training import launch
    from mla.training.config import check_inputs, load_config_file, make_config

    file_values = load_config_file(args.config) if args.config else {}
    world = int(os.environ["WORLD_SIZE"]) if launch.under_launcher() else None
    cfg = make_config(file_values, _flag_values(args), world)
    manifest = check_inputs(cfg)

    if cfg.nproc > 1 and not launch.under_launcher():
        ckpt = Path(cfg.checkpoint_dir)
        ckpt.mkdir(parents=True, exist_ok=True)
        config_path = ckpt / "launch-config.json"
        config_path.write_text(cfg.to_json())
        return launch.relaunch(config_path, cfg.nproc, cfg.master_port)

    import torch

    cuda = torch.cuda.is_available()
    launch.prepare_environment(cuda)
    if not launch.under_launcher():
        launch.single_process_environment(cfg.master_port)
    if not cuda:
        launch.skip_shm_build()

    from mla.training.trainer import run_training

    info = run_training(cfg, manifest)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{cfg.out}: {info['steps']} steps, {info['tokens']} tokens, final loss "
              f"{info['train_loss']}, MLflow run {info['mlflow_run_id']} ({info['run_name']})")
    return 0
