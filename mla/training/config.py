"""The fine-tuning configuration: one dataclass, filled from defaults < config file < command-line flags,
checked before any work (no model is loaded and no process started for a bad config)."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from mla.checkpoint import require_checkpoint
from mla.devices import resolve_device
from mla.errors import UserError
from mla.specfile import read_mapping
from mla.training.schedule import check_schedule
from mla.training.trainable import TRAINABLE

# The paper's recipe for SmolLM-135M (App. C, Table 4): AdamW(0.9, 0.95, 1e-8), peak lr 1e-4, clip 1.0, warmup
# 5 %, decay 10 % of the steps; weight decay 0.01 as in the authors' released training configs; seed 42.


def option(default, help: str, **argparse_kwargs):
    """A TrainConfig field that is also a `mla train` flag (transformers.HfArgumentParser reads the metadata)
    and a config-file key: each option is declared once, here."""
    shown = "" if default in (None, "") or callable(default) else f" (default {default})"
    kind = "default_factory" if callable(default) else "default"
    return field(**{kind: default}, metadata={"help": help + shown, **argparse_kwargs})


@dataclass
class TrainConfig:
    # inputs and outputs
    model: str = option("", "HF checkpoint folder (MLA from `mla convert`, or the original model)")
    data: str = option("", "folder from `mla data`")
    out: str = option("", "run folder for final/, metrics.csv, run.json")
    checkpoint_dir: str = option("", "Trainer/DeepSpeed checkpoints (default OUT.checkpoints)")
    checkpoint_root: str = option("", "instead: checkpoints in ROOT/<trajectory key>, deleted after success "
                                  "(other folders there are listed, never deleted)", metavar="ROOT")
    # the recipe
    steps: int = option(100, "optimizer steps")
    lr: float = option(1e-4, "peak learning rate")
    warmup_steps: int | None = option(None, "linear warmup steps (default 5 percent of the steps)")
    decay_steps: int | None = option(None, "1-sqrt decay to 0 over the last steps (default 10 percent)")
    micro_batch: int = option(4, "sequences per rank per forward pass")
    grad_accum: int | None = option(None, "accumulation steps (default: from the global batch, else 1)")
    global_batch: int | None = option(None, "sequences per optimizer step over all ranks")
    span: int = option(1, "packed blocks joined end to end into one training sequence: sequences of span x the "
                       "data's block length (packed blocks continue one another, so a sequence is running text)")
    weight_decay: float = option(0.01, "AdamW weight decay (not on norm weights and biases)")
    clip: float = option(1.0, "gradient clipping max global norm, 0 = off")
    adam_beta1: float = option(0.9, "AdamW beta1")
    adam_beta2: float = option(0.95, "AdamW beta2")
    adam_eps: float = option(1e-8, "AdamW epsilon")
    seed: int = option(42, "seed of the data order and the Trainer")
    precision: str = option("auto", "auto | bf16 | fp32; auto: bf16 on CUDA with bf16, else fp32")
    gradient_checkpointing: bool = option(False, "recompute activations in the backward pass (same losses, "
                                          "less memory)")
    # distillation and trainable parameters (docs/distillation.md)
    distill_weight: float = option(0.0, "weight of the KL to the teacher's next-token distribution beside the "
                                   "cross-entropy, 0 = off (the teacher is then not loaded)")
    distill_temperature: float = option(1.0, "softmax temperature T of the distillation: loss = CE + weight x T^2 "
                                        "x KL(teacher_T || student_T)")
    teacher: str = option("", "teacher checkpoint for --distill-weight > 0 (the unconverted source model; same "
                          "tokenizer as the student)", metavar="DIR")
    trainable: str = option("all", "all | attention: train every parameter, or only the attention modules' "
                            "(self_attn.*; the rest stays bit-identical)")
    # DeepSpeed and processes
    zero_stage: int = option(0, "ZeRO stage 0 | 1 | 2 | 3")
    offload: bool = option(False, "offload the optimizer state to CPU (ZeRO 1-3)")
    deepspeed: str | None = option(None, "JSON file merged over the generated DeepSpeed config", metavar="JSON")
    device: str = option("auto", "auto | cpu | cuda; auto: CUDA when present; cuda without CUDA is an error")
    nproc: int = option(1, "processes per node (more than 1 re-launches under torchrun)")
    nodes: int = option(1, "nodes (more than 1 only inside a SLURM job with that many nodes: srun starts "
                        "one torchrun per node)")
    master_port: int | None = option(None, "rendezvous port (default: a free one)")
    threads: int | None = option(None, "torch threads per process")
    save_steps: int = option(50, "checkpoint every N steps")
    save_total_limit: int = option(2, "checkpoints kept")
    log_steps: int = option(1, "metrics row every N steps")
    callbacks: list[str] = option(list, "extra transformers TrainerCallback (class or factory, importable on "
                                  "every rank; repeatable)", aliases=["--callback"], action="extend",
                                  metavar="MODULE:NAME")
    # tracking (MLflow)
    mlflow: bool = option(True, "log to MLflow")
    tracking_uri: str | None = option(None, "MLflow store (default sqlite:///results/mlflow.db)")
    experiment: str = option("mha2mla", "MLflow experiment")
    run_name: str | None = option(None, "MLflow run (default <model>-<variant>); a rerun re-attaches to it")
    model_name: str | None = option(None, "tag 'model' (default: the model folder's name)")
    variant: str | None = option(None, "tag 'variant' (default d_kv<N> for MLA, baseline otherwise)")
    d_kv: int | None = option(None, "tag 'd_kv' (default: from the MLA config)")
    tags: list[str] = option(list, "extra MLflow tag (repeatable)", aliases=["--tag"], action="extend",
                             metavar="KEY=VALUE")

    # resolved, not an option: processes over all nodes (the launcher's WORLD_SIZE)
    world_size: int = field(default=1, init=False)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.init]

    def tag_mapping(self) -> dict[str, str]:
        return dict(tag.split("=", 1) for tag in self.tags)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def option_parser():
    """`mla train`'s flags, generated from TrainConfig by transformers.HfArgumentParser (`--warmup-steps` and
    `--warmup_steps` alike; booleans as `--offload [BOOL]`, `--no-mlflow`)."""
    from transformers import HfArgumentParser

    parser = HfArgumentParser(TrainConfig, add_help=False, prog="mla train", exit_on_error=False)
    parser.add_argument("--config", help="YAML/JSON file with any of these options ('_' or '-'); flags override it")
    return parser


def load_config_file(path: str | os.PathLike) -> dict:
    p = Path(path)
    doc = read_mapping(p, "config file")
    doc = {k.replace("-", "_"): v for k, v in doc.items()}
    unknown = sorted(set(doc) - set(TrainConfig.field_names()))
    if unknown:
        raise UserError(f"config file {p}: unknown option(s) {unknown}")
    return doc


def parse_options(argv: list[str], world_size: int | None = None) -> TrainConfig:
    """defaults < --config FILE < flags, then resolved and checked. The file's values become the parser's
    defaults, so argparse converts them like flags (YAML reads 1e-4 as a string) and flags override them."""
    parser = option_parser()
    config_file = parser.parse_known_args(argv)[0].config
    parser.set_defaults(**(load_config_file(config_file) if config_file else {}))
    try:
        cfg, _ = parser.parse_args_into_dataclasses(argv, look_for_args_file=False)  # TrainConfig, --config
    except argparse.ArgumentError as exc:  # flags were checked by the CLI: a value from the file is wrong
        raise UserError(f"config file {config_file}: {exc}") from None
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
    if cfg.span < 1:
        raise UserError(f"--span (train.span) must be >= 1 block per sequence, got {cfg.span}")
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
    check_accumulation(cfg, cfg.precision)
    if cfg.save_steps <= 0 or cfg.log_steps <= 0:
        raise UserError("save_steps and log_steps must be > 0")
    if cfg.clip < 0 or cfg.weight_decay < 0:
        raise UserError("clip and weight decay must be >= 0")
    _check_distillation(cfg)
    if cfg.deepspeed:
        _check_deepspeed_override(Path(cfg.deepspeed))
    if not isinstance(cfg.tags, list) or not all(isinstance(t, str) and "=" in t for t in cfg.tags):
        raise UserError(f"tags must be a list of KEY=VALUE, got {cfg.tags!r}")
    bad = [s for s in cfg.callbacks if not isinstance(s, str) or not all(s.partition(":")[::2])]
    if not isinstance(cfg.callbacks, list) or bad:
        raise UserError(f"callbacks must be a list of MODULE:NAME, got {cfg.callbacks!r}")
    return cfg


def _check_distillation(cfg: TrainConfig) -> None:
    if not cfg.distill_weight >= 0:
        raise UserError(f"--distill-weight (train.distill.weight) must be >= 0, got {cfg.distill_weight}")
    if not cfg.distill_temperature > 0:
        raise UserError(f"--distill-temperature (train.distill.temperature) must be > 0, got {cfg.distill_temperature}")
    if cfg.distill_weight > 0 and not cfg.teacher:
        raise UserError(f"--distill-weight {cfg.distill_weight} needs --teacher DIR (the unconverted source model)")
    if cfg.trainable not in TRAINABLE:
        raise UserError(f"--trainable (train.trainable) must be one of {', '.join(TRAINABLE)}, got {cfg.trainable!r}")


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
    from mla.data import read_manifest  # lazy: numpy; the workflow's parse reads TrainConfig

    require_checkpoint(cfg.model)
    manifest = read_manifest(cfg.data)
    model_config = json.loads((Path(cfg.model) / "config.json").read_text())
    vocab = model_config.get("vocab_size")
    if vocab is not None and manifest["vocab_size"] > vocab:
        raise UserError(f"data {cfg.data} was tokenized with a {manifest['vocab_size']}-token vocabulary, "
                        f"larger than the model's {vocab}: built with another tokenizer?")
    max_pos = model_config.get("max_position_embeddings")
    if max_pos is not None and sequence_length(cfg, manifest) > max_pos:
        joined = f" x span {cfg.span}" if cfg.span > 1 else ""
        raise UserError(f"training sequences of {sequence_length(cfg, manifest)} tokens (block length "
                        f"{manifest['block_length']}{joined}) exceed the model's max_position_embeddings {max_pos}")
    blocks = manifest["splits"]["train"]["n_blocks"]
    if blocks < cfg.span:
        raise UserError(f"--span {cfg.span} joins {cfg.span} blocks per sequence, but {cfg.data} holds only "
                        f"{blocks} train blocks")
    if cfg.distill_weight > 0:
        _check_teacher(cfg, model_config)
    return manifest


def sequence_length(cfg: TrainConfig, manifest: dict) -> int:
    """Tokens per training sequence: `span` blocks of the data's block length."""
    return cfg.span * manifest["block_length"]


def _check_teacher(cfg: TrainConfig, model_config: dict) -> None:
    """The teacher exists and predicts over the student's vocabulary: same size and, where both folders carry a
    tokenizer.json, the same tokens (the KL compares the two next-token distributions entry by entry)."""
    try:
        require_checkpoint(cfg.teacher)
    except UserError as exc:
        raise UserError(f"--teacher {cfg.teacher}: {exc}") from None
    teacher_vocab = json.loads((Path(cfg.teacher) / "config.json").read_text()).get("vocab_size")
    if teacher_vocab != model_config.get("vocab_size"):
        raise UserError(f"--teacher {cfg.teacher}: its vocabulary has {teacher_vocab} tokens, the student's "
                        f"{model_config.get('vocab_size')}; distillation needs the student's tokenizer (its source "
                        "model)")
    files = [Path(cfg.teacher) / "tokenizer.json", Path(cfg.model) / "tokenizer.json"]
    if all(f.is_file() for f in files):
        teacher_tokens, student_tokens = (_tokenizer_tokens(f) for f in files)
        if teacher_tokens != student_tokens:
            raise UserError(f"--teacher {cfg.teacher}: its tokenizer.json maps other tokens than the student's "
                            f"({cfg.model}); distillation needs the student's tokenizer (its source model)")


def _tokenizer_tokens(path: Path):
    doc = json.loads(path.read_text())
    return doc.get("model", {}).get("vocab"), [t.get("content") for t in doc.get("added_tokens", [])]


def use_cuda(cfg: TrainConfig) -> bool:
    """The device decision, made before anything is loaded: --device cuda without CUDA is an error."""
    return resolve_device(cfg.device, flag="--device", config_key="train.device").type == "cuda"


def check_accumulation(cfg: TrainConfig, precision: str) -> None:
    """bf16 with gradient accumulation needs ZeRO: only there does DeepSpeed 0.19.8 sum the micro-batches in
    fp32 (mla.training.deepspeed_config); at stage 0 they would be summed in bf16."""
    if precision == "bf16" and cfg.zero_stage == 0 and cfg.grad_accum > 1:
        raise UserError(f"--zero-stage 0 (train.zero_stage) with bf16 and {cfg.grad_accum} accumulation steps: "
                        "DeepSpeed sums the micro-batches in fp32 only under ZeRO (stage 0 would add them in "
                        "bf16); use --zero-stage 1, 2 or 3, or --precision fp32")


def resolved_precision(cfg: TrainConfig, cuda: bool) -> str:
    """bf16 or fp32: `auto` means bf16 on CUDA devices that support it, else fp32."""
    if cfg.precision != "auto":
        return cfg.precision
    import torch

    return "bf16" if cuda and torch.cuda.is_bf16_supported() else "fp32"
