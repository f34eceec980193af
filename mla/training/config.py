"""The fine-tuning configuration: one dataclass, filled from defaults < config file < command-line flags,
checked before any work (no model is loaded and no process started for a bad config)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from mla.errors import UserError
from mla.training.schedule import check_schedule

# paper-spec §5.1: AdamW(0.9, 0.95, 1e-8), peak lr 1e-4, clip 1.0, weight decay 0.01, warmup 5 %, decay 10 %
# of the steps (135M), seed 42.


@dataclass
class TrainConfig:
    model: str = ""                      # HF checkpoint folder (converted MLA model or the unconverted baseline)
    data: str = ""                       # folder written by `mla data`
    out: str = ""                        # run folder: final/, metrics.csv, run.json
    checkpoint_dir: str = ""             # Trainer/DeepSpeed checkpoints (default: <out>.checkpoints)
    checkpoint_root: str = ""            # instead: checkpoints in ROOT/<trajectory key> (mla.training.resume),
                                         # deleted after success; other folders there are listed, never deleted
    steps: int = 100
    lr: float = 1e-4
    warmup_steps: int | None = None      # default: 5 % of steps
    decay_steps: int | None = None       # default: 10 % of steps (1-sqrt decay to 0 at the end)
    micro_batch: int = 4                 # sequences per rank per forward pass
    grad_accum: int | None = None        # default: global_batch / (ranks x micro_batch), else 1
    global_batch: int | None = None      # sequences per optimizer step, all ranks together
    zero_stage: int = 0
    offload: bool = False                # ZeRO optimizer state offloaded to CPU (stages 1-3)
    deepspeed: str | None = None         # JSON file merged over the generated DeepSpeed config (expert knobs)
    weight_decay: float = 0.01
    clip: float = 1.0                    # gradient clipping (max global norm); 0 disables
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    seed: int = 42
    save_steps: int = 50
    save_total_limit: int = 2
    log_steps: int = 1
    precision: str = "auto"              # auto (bf16 where CUDA supports it, else fp32) | bf16 | fp32
    gradient_checkpointing: bool = False  # recompute activations in the backward pass (same losses, less memory)
    device: str = "auto"                 # auto (CUDA when present) | cpu | cuda (an error without CUDA)
    nproc: int = 1                       # processes per node (torchrun re-launch when > 1)
    nodes: int = 1                       # > 1: one launcher per node of the SLURM job (srun), torchrun rendezvous
    master_port: int | None = None
    threads: int | None = None           # torch threads per process
    mlflow: bool = True
    tracking_uri: str | None = None      # default sqlite:///results/mlflow.db
    experiment: str = "mha2mla"
    run_name: str | None = None          # default: <model_name>-<variant>
    model_name: str | None = None        # tag; default: the model folder's name
    variant: str | None = None           # tag; default: d_kv<N> for an MLA checkpoint, "baseline" otherwise
    d_kv: int | None = None              # tag; default: from the MLA checkpoint's config
    tags: dict = field(default_factory=dict)
    callbacks: list = field(default_factory=list)  # MODULE:NAME of extra transformers TrainerCallbacks

    # -- resolved values (not set by the user) --
    world_size: int = 1

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name != "world_size"]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def load_config_file(path: str | os.PathLike) -> dict:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise UserError(f"config file {p} does not exist")
    try:
        doc = (json.loads(p.read_text()) if p.suffix == ".json" else yaml.safe_load(p.read_text())) or {}
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise UserError(f"config file {p}: not valid YAML/JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise UserError(f"config file {p}: expected a mapping of option -> value")
    doc = {k.replace("-", "_"): v for k, v in doc.items()}
    unknown = sorted(set(doc) - set(TrainConfig.field_names()) - {"world_size"})
    if unknown:
        raise UserError(f"config file {p}: unknown option(s) {unknown}")
    return {k: _coerce(k, v, p) for k, v in doc.items()}


def _coerce(name: str, value, path):
    """YAML reads 1e-4 as a string (no dot): convert numbers by the field's declared type."""
    kind = {f.name: str(f.type) for f in fields(TrainConfig)}.get(name, "")
    if value is None or not isinstance(value, str):
        return value
    try:
        if kind.startswith("float"):
            return float(value)
        if kind.startswith("int"):
            return int(value)
    except ValueError:
        raise UserError(f"config file {path}: {name} must be a number, got {value!r}") from None
    return value


def make_config(file_values: dict, flag_values: dict, world_size: int | None = None) -> TrainConfig:
    """defaults < file < flags (flags that are None are 'not given'); then resolve and check."""
    values = {**file_values, **{k: v for k, v in flag_values.items() if v is not None}}
    cfg = TrainConfig(**values)
    cfg.world_size = world_size or cfg.nproc * cfg.nodes
    return resolve(cfg)


def resolve(cfg: TrainConfig) -> TrainConfig:
    for name in ("model", "data", "out"):
        if not getattr(cfg, name):
            raise UserError(f"--{name} is required (flag or config file)")
    if cfg.checkpoint_dir and cfg.checkpoint_root:
        raise UserError("--checkpoint-dir and --checkpoint-root exclude each other: give one")
    if not cfg.checkpoint_dir and not cfg.checkpoint_root:
        cfg.checkpoint_dir = str(Path(cfg.out).with_name(Path(cfg.out).name + ".checkpoints"))
    if cfg.warmup_steps is None:
        cfg.warmup_steps = round(0.05 * cfg.steps)
    if cfg.decay_steps is None:
        cfg.decay_steps = round(0.10 * cfg.steps)
    check_schedule(cfg.steps, cfg.warmup_steps, cfg.decay_steps)
    if cfg.lr <= 0:
        raise UserError(f"lr must be > 0, got {cfg.lr}")
    if cfg.micro_batch <= 0:
        raise UserError(f"micro batch must be > 0, got {cfg.micro_batch}")
    if cfg.nodes <= 0:
        raise UserError(f"--nodes must be >= 1, got {cfg.nodes}")
    if cfg.nproc <= 0 or cfg.world_size <= 0:
        raise UserError(f"nproc must be > 0, got {cfg.nproc}")
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise UserError(f"--device must be auto, cpu or cuda, got {cfg.device!r}")
    per_pass = cfg.world_size * cfg.micro_batch
    if cfg.global_batch is not None:
        if cfg.global_batch <= 0 or cfg.global_batch % per_pass:
            raise UserError(f"global batch {cfg.global_batch} is not divisible by ranks x micro batch = "
                            f"{cfg.world_size} x {cfg.micro_batch}")
        accum = cfg.global_batch // per_pass
        if cfg.grad_accum is not None and cfg.grad_accum != accum:
            raise UserError(f"global batch {cfg.global_batch} = {cfg.world_size} ranks x {cfg.micro_batch} x "
                            f"{accum} accumulation steps, but grad_accum is {cfg.grad_accum}")
        cfg.grad_accum = accum
    else:
        cfg.grad_accum = cfg.grad_accum or 1
        if cfg.grad_accum <= 0:
            raise UserError(f"grad_accum must be > 0, got {cfg.grad_accum}")
        cfg.global_batch = per_pass * cfg.grad_accum
    if cfg.zero_stage not in (0, 1, 2, 3):
        raise UserError(f"zero stage must be 0, 1, 2 or 3, got {cfg.zero_stage}")
    if cfg.offload and cfg.zero_stage == 0:
        raise UserError("optimizer offload needs ZeRO stage 1, 2 or 3")
    if cfg.precision not in ("auto", "bf16", "fp32"):
        raise UserError(f"precision must be auto, bf16 or fp32, got {cfg.precision!r}")
    if cfg.save_steps <= 0 or cfg.log_steps <= 0:
        raise UserError("save_steps and log_steps must be > 0")
    if cfg.clip < 0 or cfg.weight_decay < 0:
        raise UserError("clip and weight decay must be >= 0")
    if cfg.deepspeed:
        _check_deepspeed_override(Path(cfg.deepspeed))
    if not isinstance(cfg.tags, dict):
        raise UserError("tags must be a mapping name -> value")
    bad = [s for s in cfg.callbacks if not isinstance(s, str) or not all(s.partition(":")[::2])]
    if not isinstance(cfg.callbacks, list) or bad:
        raise UserError(f"callbacks must be a list of MODULE:NAME, got {cfg.callbacks!r}")
    return cfg


def _check_deepspeed_override(path: Path) -> None:
    if not path.is_file():
        raise UserError(f"DeepSpeed override file {path} does not exist")
    try:
        override = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"--deepspeed {path}: not valid JSON ({exc})") from None
    # the Trainer owns optimizer and schedule: a DeepSpeed block would replace the AdamW parameter
    # groups (no decay on norms and biases) by one flat list, and the paper's schedule by DeepSpeed's
    owned = sorted({"optimizer", "scheduler"} & set(override if isinstance(override, dict) else {}))
    if owned:
        raise UserError(f"--deepspeed {path}: remove {owned}; the optimizer (AdamW with parameter groups) and the "
                        "schedule come from mla train's options")


def check_inputs(cfg: TrainConfig) -> dict:
    """Model and data exist and fit together; returns the data manifest."""
    from mla.checkpoint import require_checkpoint
    from mla.data import read_manifest

    require_checkpoint(cfg.model)
    manifest = read_manifest(cfg.data)
    model_config = json.loads((Path(cfg.model) / "config.json").read_text())
    vocab = model_config.get("vocab_size")
    if vocab is not None and manifest["vocab_size"] > vocab:
        raise UserError(f"data {cfg.data} was tokenized with a {manifest['vocab_size']}-token vocabulary, "
                        f"larger than the model's {vocab}: built with another tokenizer?")
    max_pos = model_config.get("max_position_embeddings")
    if max_pos is not None and manifest["block_length"] > max_pos:
        raise UserError(f"block length {manifest['block_length']} exceeds the model's "
                        f"max_position_embeddings {max_pos}")
    return manifest


def use_cuda(cfg: TrainConfig) -> bool:
    """The device decision, made before anything is loaded: --device cuda without CUDA is an error."""
    from mla.devices import resolve_device

    return resolve_device(cfg.device, flag="--device", config_key="train.device").type == "cuda"


def resolved_precision(cfg: TrainConfig, cuda: bool) -> str:
    """bf16 or fp32: `auto` means bf16 on CUDA devices that support it, else fp32."""
    if cfg.precision != "auto":
        return cfg.precision
    import torch

    return "bf16" if cuda and torch.cuda.is_bf16_supported() else "fp32"
