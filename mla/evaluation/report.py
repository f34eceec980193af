"""One evaluation JSON per checkpoint and part, and its metrics in the variant's MLflow run.

Two parts (`EvalOptions.part`, mla/study/evaluation_jobs.py): *quality* (kv_cache, perplexity,
benchmarks, pass keys with the full-precision cache: the workflow's eval.json) and *inference*
(decode, kv_quant, pass keys with quantized caches, LongBench: inference.json); *all* (the default by
hand) runs both into one JSON.

Layout (schema "mla.evaluation/1"); a section not requested is null, a benchmark that could not run
says so in "status"/"reason" and carries no numbers:

    part, checkpoint, variant, model_type, is_mla, d_kv, r, params, device, dtype, threads, created, versions,
    kv_cache     {cache_class, batch, cached_tokens, dtype, cache_bytes, elements_per_token,
                  bytes_per_token_formula, bytes_per_token_measured, matches_formula}
    perplexity   {source, split, blocks, tokens, mean_loss, mean_loss_stderr, perplexity,
                  perplexity_stderr, stderr_method}
    benchmarks   {local: {task, acc, acc_stderr, acc_norm, acc_norm_stderr, n, ...} | null,
                  paper: {status: ok|partial|skipped, reason?, documents, scores{mmlu, arc, piqa,
                          hellaswag, openbookqa, winogrande}, scores_stderr{...}, n{...},
                          average, average_stderr, per_task{task: {score, stderr, n}}} | null,
                  mmlu: {task, acc_norm, acc_norm_stderr, acc, acc_stderr, questions, seed, data,
                         sampling, scorer, seconds} | null}
    decode       {steps, device, dtype, weight_bytes, kv_bytes_per_token, original_*, grid: [
                  {batch, context, status: ok, mla_tps, mla_absorbed_tps, original_tps, speedup,
                   speedup_absorbed, predicted_speedup, fraction_of_predicted, need_bytes, free_bytes,
                   mla_absorbed_q<bits>_tps, speedup_q<bits> (with --kv-bits)}
                  | {batch, context, status: ok, model_tps, ...}
                  | {batch, context, status: skipped, reason, need_bytes, free_bytes, ...}]}
    kv_quant     {group_size, residual, backend: mla|quanto, implementation, loss_unit, dtype, blocks,
                  scored_tokens_per_block, prefix_tokens,
                  bytes: {bits: kv_cache fields + bits, group_size, residual | {status: skipped, reason}},
                  bits: {bits: {status, mean_loss, mean_loss_stderr, perplexity, perplexity_stderr,
                                loss_change, loss_change_stderr (vs 16, paired over blocks)}}} | null
    long_context {needle_skipped?, needle_lengths_skipped? (beyond max_position_embeddings), needle: {bits: {status, task, lengths{L: {accuracy, stderr, n, ...}}, mean, mean_stderr,
                                  samples, seed, ...}} | null,
                  passkey_scored?: {task, samples, seed, lengths{L: {key_logprob, key_logprob_stderr, all_argmax,
                                   all_argmax_stderr, first_argmax, first_argmax_stderr, n, samples: [...]}},
                                   mean_key_logprob, mean_key_logprob_stderr, mean_all_argmax, mean_all_argmax_stderr}
                                   (quality part, full cache; mla/evaluation/needle.py passkey_scores),
                  longbench: {status: ok|partial|skipped, skipped?, scores{column: {task, score, stderr, n}},
                              mean, mean_stderr, ...} | null} | null
    seconds      {stage: wall seconds}
    cpu_seconds  {stage: CPU seconds of the process, all threads (on a busy machine: what the stage costs)}

Every accuracy and perplexity carries its standard error in a sibling `*_stderr` field (None where
it cannot be estimated, e.g. from a single block); see mla/perplexity.py and harness.py for the methods.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from mla import atomic, tracking
from mla.checkpoint import load_model
from mla.evaluation import harness, needle
from mla.evaluation import longbench as longbench_
from mla.kv.accounting import FULL_PRECISION_BITS
from mla.options import DEFAULT_VALIDATION_FRACTION

SCHEMA = "mla.evaluation/1"
PARTS = ("quality", "inference", "all")
TOP_LEVEL_FIELDS = ("schema", "part", "checkpoint", "variant", "model_type", "is_mla", "d_kv", "r", "params", "device", "dtype",
                    "threads", "created", "versions", "kv_cache", "perplexity", "benchmarks", "decode", "kv_quant",
                    "long_context", "seconds", "cpu_seconds")


@dataclass
class EvalOptions:
    part: str = "all"                    # quality | inference | all (both, one JSON)
    blocks: str | None = None            # `mla data` folder or .npy of token blocks; None -> no perplexity
    split: str = "validation"
    max_blocks: int | None = None
    ppl_batch_size: int = 1
    local_task: bool = True
    local_docs: int = 200
    validation_fraction: float = DEFAULT_VALIDATION_FRACTION
    paper_tasks: str = "auto"            # auto (skip offline) | off
    paper_limit: int | None = None
    lm_eval_batch_size: int = 8
    mmlu: int = 0                        # MMLU cloze on N stratified test questions (0 = off, >= 14,042 = all)
    mmlu_seed: int = 1234
    kv_batch: int = 2
    kv_prompt: int = 16
    kv_new_tokens: int = 8
    decode_grid: list = field(default_factory=lambda: [(1, 256), (4, 1024)])
    decode_steps: int = 8
    original: str | None = None          # original checkpoint for the decode comparison (else random twin)
    kv_bits: list = field(default_factory=list)   # cache bit widths (16 = unquantized); empty = no kv_quant
    kv_group_size: int = 64
    kv_residual: int = 128
    kv_scored: int = 32
    kv_blocks: int | None = 16
    needle_lengths: list = field(default_factory=list)   # pass-key prompt lengths; empty = skip
    needle_samples: int = 10
    needle_seed: int = 0
    passkey_scored: int = 0              # teacher-forced pass-key prompts per needle length (0 = off)
    longbench: str = "off"               # auto (skip offline) | off
    longbench_limit: int | None = None
    longbench_max_length: int | None = None


def _versions() -> dict:
    import importlib.metadata as md

    out = {}
    for name in ("torch", "transformers", "lm_eval"):
        try:
            out[name] = md.version(name.replace("_", "-"))
        except md.PackageNotFoundError:
            out[name] = None
    return out


def evaluate_model(model, tokenizer, opts: EvalOptions, *, checkpoint: str = "", variant: str | None = None,
                   log=print) -> dict:
    """Every requested measurement of `opts.part` of one loaded model, as the JSON-ready dict described above."""
    import torch

    from mla.conversion.convert import count_parameters  # lazy: torch; the workflow's parse reads EvalOptions

    cfg = model.config
    is_mla = getattr(cfg, "model_type", "") == "mla_llama"
    prov = (getattr(cfg, "mha2mla", None) or {}) if is_mla else {}
    result = {k: None for k in TOP_LEVEL_FIELDS}
    if opts.part not in PARTS:
        raise ValueError(f"evaluation part {opts.part!r}: one of {', '.join(PARTS)}")
    result.update(schema=SCHEMA, part=opts.part, checkpoint=str(checkpoint), variant=variant, model_type=cfg.model_type,
                  is_mla=is_mla, d_kv=prov.get("d_kv"), r=prov.get("r"), params=count_parameters(model),
                  device=str(next(model.parameters()).device),
                  dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
                  threads=torch.get_num_threads(), created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  versions=_versions(), benchmarks={"local": None, "paper": None, "mmlu": None}, seconds={},
                  cpu_seconds={})

    def stage(name, fn):
        t0, c0 = time.perf_counter(), time.process_time()
        value = fn()
        result["seconds"][name] = round(time.perf_counter() - t0, 3)
        result["cpu_seconds"][name] = round(time.process_time() - c0, 3)
        log(f"evaluate: {name} done in {result['seconds'][name]:.1f}s ({result['cpu_seconds'][name]:.1f} s of CPU)")
        return value

    if opts.part in ("quality", "all"):
        _quality(result, model, tokenizer, opts, log, stage)
    if opts.part in ("inference", "all"):
        _inference(result, model, tokenizer, opts, log, stage)
    return result


def _quality(result: dict, model, tokenizer, opts: EvalOptions, log, stage) -> None:
    """KV-cache bytes, held-out perplexity, the benchmarks, pass keys with the full-precision cache."""
    from mla import perplexity  # lazy: numpy, torch; the workflow's parse reads EvalOptions
    from mla.data import load_blocks
    from mla.kv import measure_bytes

    result["kv_cache"] = stage("kv_cache", lambda: measure_bytes.measure_kv_bytes(
        model, batch=opts.kv_batch, prompt_len=opts.kv_prompt, new_tokens=opts.kv_new_tokens))
    if opts.blocks:
        blocks = load_blocks(opts.blocks, opts.split)
        ppl = stage("perplexity", lambda: perplexity.perplexity(
            model, blocks, batch_size=opts.ppl_batch_size, max_blocks=opts.max_blocks))
        result["perplexity"] = {"source": str(opts.blocks),
                                "split": None if str(opts.blocks).endswith(".npy") else opts.split, **ppl}
    if opts.needle_lengths:
        result["long_context"] = stage("passkey", lambda: measure_long_context(
            model, tokenizer, opts, log, widths=[FULL_PRECISION_BITS], longbench=False))
    if opts.needle_lengths and opts.passkey_scored:
        scored = stage("passkey_scored", lambda: needle.passkey_scores(
            model, tokenizer, lengths=opts.needle_lengths, samples=opts.passkey_scored, seed=opts.needle_seed))
        result["long_context"]["passkey_scored"] = scored
        if scored["lengths"]:
            log(f"evaluate: pass key teacher-forced: answer all argmax {100 * scored['mean_all_argmax']:.1f} ± "
                f"{100 * scored['mean_all_argmax_stderr']:.1f} %, log-probability {scored['mean_key_logprob']:.3f} ± "
                f"{scored['mean_key_logprob_stderr']:.3f} per token ({opts.passkey_scored} prompts per length)")
    if opts.local_task:
        result["benchmarks"]["local"] = stage("local_task", lambda: harness.local_task(
            model, tokenizer, num_docs=opts.local_docs, validation_fraction=opts.validation_fraction,
            batch_size=opts.lm_eval_batch_size))
    if opts.paper_tasks != "off":
        paper = stage("paper_tasks", lambda: harness.paper_tasks(
            model, tokenizer, limit=opts.paper_limit, batch_size=opts.lm_eval_batch_size))
        if paper.get("status") == "skipped":
            log(f"evaluate: skipped: {paper['reason']}")
        result["benchmarks"]["paper"] = paper
    if opts.mmlu:
        result["benchmarks"]["mmlu"] = stage("mmlu", lambda: harness.mmlu_cloze(
            model, tokenizer, num_questions=opts.mmlu, seed=opts.mmlu_seed, batch_size=opts.lm_eval_batch_size))


def _inference(result: dict, model, tokenizer, opts: EvalOptions, log, stage) -> None:
    """Quantized caches (bytes, decoded losses, pass keys), LongBench, decode speed."""
    from mla.data import load_blocks  # lazy: numpy, torch; the workflow's parse reads EvalOptions
    from mla.evaluation import decode

    if opts.part == "inference":
        result["benchmarks"] = None
    if opts.kv_bits:
        result["kv_quant"] = stage("kv_quant", lambda: measure_kv_quant(
            model, load_blocks(opts.blocks, opts.split) if opts.blocks else None, opts, log))
    quantized = sorted(set(opts.kv_bits) - {FULL_PRECISION_BITS}, reverse=True) if opts.needle_lengths else []
    if quantized or opts.longbench != "off":
        measured = stage("long_context", lambda: measure_long_context(
            model, tokenizer, opts, log, widths=quantized, longbench=opts.longbench != "off"))
        full = (result["long_context"] or {}).get("needle") or {}     # part all: the quality part's full cache
        result["long_context"] = {**measured, "needle": {**full, **(measured["needle"] or {})} or None}
    if opts.decode_grid:
        original = None
        if opts.original:
            first = next(model.parameters())
            original = load_model(opts.original, dtype=first.dtype).to(first.device).eval()
        result["decode"] = stage("decode", lambda: decode.decode_grid(
            model, opts.decode_grid, steps=opts.decode_steps, original=original, log=log,
            quant=_decode_quant(model, opts)))


def measure_kv_quant(model, blocks, opts: EvalOptions, log) -> dict:
    """Bytes held after generate at each quantized width, and (with held-out blocks) the decoded losses."""
    from mla.kv import measure_bytes, quantized  # lazy: numpy, torch; the workflow's parse reads EvalOptions

    out = {"group_size": opts.kv_group_size, "residual": opts.kv_residual, "bytes": {}}
    for b in sorted(set(opts.kv_bits) - {FULL_PRECISION_BITS}, reverse=True):
        reason = quantized.unsupported(model, b)
        if reason:
            out["bytes"][str(b)] = {"status": "skipped", "reason": reason}
            continue
        out["bytes"][str(b)] = measure_bytes.measure_kv_bytes(
            model, batch=opts.kv_batch, prompt_len=opts.kv_prompt, new_tokens=opts.kv_new_tokens,
            quant=quantized.KVQuant(b, opts.kv_group_size, opts.kv_residual))
    if blocks is not None:
        out.update(quantized.quantized_cache_losses(
            model, blocks, opts.kv_bits, group_size=opts.kv_group_size, residual=opts.kv_residual,
            scored=opts.kv_scored, max_blocks=opts.kv_blocks, batch_size=max(opts.ppl_batch_size, 8), log=log))
    return out


def measure_long_context(model, tokenizer, opts: EvalOptions, log, widths: list[int], longbench: bool) -> dict:
    """Pass-key retrieval with the cache at each of `widths` (16 = full precision); LongBench when asked
    (and online)."""
    from mla.kv import quantized  # lazy: numpy, torch; the workflow's parse reads EvalOptions

    out = {"needle": None, "longbench": None}
    lengths = needle.fitting_lengths(model, opts.needle_lengths) if widths else []
    if widths and not lengths:
        out["needle_skipped"] = (f"no length of {opts.needle_lengths} fits the model's "
                                 f"{model.config.max_position_embeddings} positions")
        log(f"evaluate: pass key skipped: {out['needle_skipped']}")
    elif lengths:
        if lengths != opts.needle_lengths:
            out["needle_lengths_skipped"] = sorted(set(opts.needle_lengths) - set(lengths))
            log(f"evaluate: pass key: {out['needle_lengths_skipped']} exceed the model's "
                f"{model.config.max_position_embeddings} positions, skipped")
        out["needle"] = {}
        for b in widths:
            reason = quantized.unsupported(model, b)
            if reason:
                out["needle"][str(b)] = {"status": "skipped", "reason": reason}
                continue
            quant = quantized.KVQuant(b, opts.kv_group_size, opts.kv_residual)
            res = needle.needle_accuracy(model, tokenizer, lengths=lengths, samples=opts.needle_samples,
                                         seed=opts.needle_seed, cache_factory=quantized.cache_factory(model, quant))
            out["needle"][str(b)] = {"status": "ok", **res}
            log(f"evaluate: pass key, {b}-bit cache: {100 * res['mean']:.1f} ± {100 * res['mean_stderr']:.1f} %")
    if longbench:
        out["longbench"] = longbench_.longbench(model, tokenizer, limit=opts.longbench_limit,
                                                max_length=opts.longbench_max_length, batch_size=1)
        lb = out["longbench"]
        if lb.get("status") == "skipped":
            log(f"evaluate: skipped: {lb['skipped']}")
        elif lb.get("mean") is not None:
            log(f"evaluate: LongBench {100 * lb['mean']:.2f} ± {100 * (lb['mean_stderr'] or 0):.2f} (mean score x100 "
                f"over 16 tasks, {lb['limit'] or 'all'} documents each, prompts cut to {lb['max_length']} tokens, "
                f"{lb['documents']})")
    return out


def _decode_quant(model, opts: EvalOptions):
    """The cache an MLA model is also timed with: 4 bits when measured, else the smallest width."""
    from mla.kv import quantized  # lazy: numpy, torch; the workflow's parse reads EvalOptions

    widths = [b for b in opts.kv_bits if b != FULL_PRECISION_BITS]
    if not widths or not quantized.is_mla(model):
        return None
    return quantized.KVQuant(4 if 4 in widths else min(widths), opts.kv_group_size, opts.kv_residual)


def write_json(result: dict, out: str | Path) -> Path:
    atomic.write_json(out, result)
    return Path(out)


def flat_metrics(result: dict) -> dict:
    """Scalar metrics for MLflow (prefix eval/)."""
    m = {}
    kv = result.get("kv_cache") or {}
    if kv:
        m["eval/kv_bytes_per_token"] = kv["bytes_per_token_measured"]
        m["eval/kv_elements_per_token"] = kv["elements_per_token"]
    ppl = result.get("perplexity") or {}
    for k in ("perplexity", "perplexity_stderr", "mean_loss", "mean_loss_stderr"):
        if ppl.get(k) is not None:
            m[f"eval/{k}"] = ppl[k]
    local = (result.get("benchmarks") or {}).get("local") or {}
    for k in ("acc", "acc_stderr", "acc_norm", "acc_norm_stderr"):
        if local.get(k) is not None:
            m[f"eval/{local['task']}_{k}"] = local[k]
    mmlu = (result.get("benchmarks") or {}).get("mmlu") or {}
    for k in ("acc_norm", "acc_norm_stderr", "acc", "acc_stderr"):
        if mmlu.get(k) is not None:
            m[f"eval/mmlu_{k}"] = mmlu[k]
    paper = (result.get("benchmarks") or {}).get("paper") or {}
    stderrs = paper.get("scores_stderr") or {}
    for k, v in (paper.get("scores") or {}).items():
        # eval/mmlu_* is the paper-prompt cloze above; the Hub set's MMLU column is lm-eval's
        # mmlu_continuation (another prompt), logged under that name so the two never overwrite
        name = "mmlu_continuation" if k == "mmlu" else k
        if v is not None:
            m[f"eval/{name}_acc_norm"] = v
        if stderrs.get(k) is not None:
            m[f"eval/{name}_acc_norm_stderr"] = stderrs[k]
    if paper.get("average") is not None:
        m["eval/paper_avg"] = paper["average"]
    if paper.get("average_stderr") is not None:
        m["eval/paper_avg_stderr"] = paper["average_stderr"]
    for p in (result.get("decode") or {}).get("grid", []):
        tag = f"B{p['batch']}_T{p['context']}"
        for k in ("speedup", "speedup_absorbed", "predicted_speedup", "mla_absorbed_tps", "original_tps",
                  "model_tps", *(k for k in p if k.startswith(("speedup_q", "mla_absorbed_q")))):
            if p.get(k) is not None:
                m[f"decode/{k}_{tag}"] = p[k]
    kvq = result.get("kv_quant") or {}
    for b, entry in (kvq.get("bits") or {}).items():
        for k in ("mean_loss", "mean_loss_stderr", "loss_change", "loss_change_stderr"):
            if entry.get(k) is not None:
                m[f"eval/kv{b}bit_{k}"] = entry[k]
    long_context = result.get("long_context") or {}
    for b, entry in (long_context.get("needle") or {}).items():
        if entry.get("status") == "ok":
            m[f"eval/passkey_{b}bit_acc"] = entry["mean"]
            m[f"eval/passkey_{b}bit_acc_stderr"] = entry["mean_stderr"]
    lb = long_context.get("longbench") or {}
    if lb.get("mean") is not None:
        m["eval/longbench_avg"] = lb["mean"]
        m["eval/longbench_avg_stderr"] = lb["mean_stderr"]
    for b, entry in (kvq.get("bytes") or {}).items():
        if entry.get("bytes_per_token_measured") is not None:
            m[f"eval/kv{b}bit_bytes_per_token"] = entry["bytes_per_token_measured"]
    return m


def log_to_mlflow(result: dict, json_path: Path, *, tracking_uri: str | None, run_id: str | None = None,
                  experiment: str | None = None, run_name: str | None = None) -> str | None:
    """Log the scalar metrics and the JSON to the variant's run (found by id, or by experiment + name)."""
    opened = run_id is None
    if opened:
        run_id = tracking.get_or_create_run(tracking_uri, experiment, run_name,
                                            tags={"variant": result.get("variant"), "d_kv": result.get("d_kv")})
    tracking.log_metrics(run_id, flat_metrics(result), tracking_uri=tracking_uri)
    tracking.log_artifacts(run_id, [json_path], artifact_path="evaluation", tracking_uri=tracking_uri)
    if opened:
        tracking.set_terminated(run_id, tracking_uri=tracking_uri)
    return run_id
