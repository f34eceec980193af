"""Results tables: one per experiment (source model), as CSV and Markdown, beside the paper's numbers.

An experiment is a list of variants; each variant may bring
  - `eval`: the JSON written by `mla evaluate` (perplexity, benchmark scores, KV bytes, pass keys; by hand
    it may hold the inference measurements too);
  - `inference`: optional, the inference measurements' JSON (`mla evaluate --part inference`: decode speed,
    quantized caches, pass keys with them, LongBench), whose sections complete `eval`'s;
  - `serve`: optional, a stock engine's measurements of the variant's export and of its original model
    (`mla serve-bench`, evaluate.serve: vLLM or llama.cpp): decode tokens/s of both, KV bytes per token of both,
    greedy agreement;
  - `conversion`: the conversion.json written by `mla convert` (params_before/after,
    kv_elements_per_token_before/after, kv_ratio);
  - `metrics`: the training metrics.csv (step-1 train loss = the first logged loss, before any update: the
    loss right after conversion (and fit) on the first batch; final training loss = mean loss of the last
    FINAL_LOSS_STEPS steps).
Variant names "original" and "baseline" (the unconverted model, fine-tuned) are special; any other
variant is a converted model and needs a d_kv (given, or read from conversion.json / the eval JSON).

For a model of the paper's Table 1 the paper's KV-memory change and benchmark scores are placed in
the column right after ours, followed by the difference (ours − paper, in points).

When any eval JSON has `benchmarks.mmlu` (`mla evaluate --mmlu N`: the paper's MMLU cloze prompt on a
stratified sample of the test split), an "MMLU (cloze)" column with its SE follows the MMLU columns,
with its own difference to the paper's MMLU number when the paper's columns are shown.

Measured perplexities and accuracies carry their standard error (from the eval JSON's `*_stderr`
fields): in the CSV as a separate column named after the value's column with the suffix `_se`
(empty where unknown), in Markdown as `value ± se`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from mla.study import paper_numbers
from mla.training import grad_norms

FINAL_LOSS_STEPS = 10
SPECIAL_VARIANTS = ("original", "baseline")
SE_SUFFIX = "_se"


class TableInputError(ValueError):
    """An input file or variant spec that cannot be tabulated; the message names the cause."""


AUTO = "auto"


@dataclass
class Variant:
    name: str
    d_kv: int | None = None
    eval: Path | None = None
    inference: Path | None = None
    serve: Path | None = None
    conversion: Path | None = None
    metrics: Path | None = None
    label: str | None = None                 # shown in a `label` column when any variant has one
    paper_row: str | int | None = AUTO       # the paper's row beside it: AUTO = by name/d_kv, None = none


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise TableInputError(f"file not found: {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise TableInputError(f"{path}: not valid JSON ({exc})") from None


def read_metrics(path: Path) -> pd.DataFrame:
    """A training metrics.csv, read once per variant (losses and gradient norms)."""
    if not path.is_file():
        raise TableInputError(f"metrics file not found: {path}")
    try:
        return pd.read_csv(path)
    except pd.errors.EmptyDataError:
        raise TableInputError(f"{path}: empty, no 'loss' column") from None


def finite_losses(path: Path, metrics: pd.DataFrame | None = None) -> pd.Series:
    """The finite logged training losses of a metrics.csv (or of its `metrics`, already read), in step order."""
    if metrics is None:
        metrics = read_metrics(path)
    if "loss" not in metrics:
        raise TableInputError(f"{path}: no 'loss' column (header is {list(metrics.columns)})")
    losses = metrics["loss"][np.isfinite(metrics["loss"])]
    if losses.empty:
        raise TableInputError(f"{path}: no finite loss values")
    return losses


def mean_of_last(losses: pd.Series, last: int = FINAL_LOSS_STEPS) -> float:
    """The tables' final loss: the mean of the last `last` logged losses."""
    return float(losses.tail(last).mean())


def final_loss(path: Path, last: int = FINAL_LOSS_STEPS) -> float:
    """Mean training loss over the last `last` logged steps of a metrics.csv."""
    return mean_of_last(finite_losses(path), last)


def _variant_key(v: Variant) -> str | int | None:
    if v.paper_row != AUTO:
        return v.paper_row
    return v.name if v.name in SPECIAL_VARIANTS else v.d_kv


def _decode_summary(decode: dict | None) -> tuple[float | None, float | None, str | None]:
    """(measured speedup, predicted S(B,T), 'BxT') at the largest B·T of the grid, absorbed path preferred."""
    measured_points = [g for g in (decode or {}).get("grid") or [] if g.get("status", "ok") == "ok"]
    if not measured_points:
        return None, None, None
    best = max(measured_points, key=lambda g: g["batch"] * g["context"])
    measured = best.get("speedup_absorbed", best.get("speedup"))
    return measured, best.get("predicted_speedup"), f"{best['batch']}x{best['context']}"


INFERENCE_SECTIONS = ("decode", "kv_quant")
SERVED_COLUMNS = ["served by", "served decode tok/s", "served decode tok/s (original)", "served at BxT",
                  "served KV bytes/token", "served KV bytes/token (original)", "served greedy agreement %"]


def _served_cells(served: dict) -> list | None:
    """The SERVED_COLUMNS of a serve.json: the engine (and, for llama.cpp, its first K cache type), speed at the
    largest B·T of its grid, KV bytes per token of both, token agreement with transformers."""
    if not served:
        return None
    engine = "vLLM"
    if served.get("engine") == "llama.cpp":       # one entry per K cache type: the first, the unquantized one
        served = served["cache_types"][0]
        engine = f"llama.cpp, {served['cache_type']} cache"
    points = served.get("decode") or []
    best = max(points, key=lambda d: d["batch"] * d["context"]) if points else {}
    export = best.get("export_tokens_per_s", best.get("export_decode_tokens_per_s"))
    original = best.get("original_tokens_per_s", best.get("original_decode_tokens_per_s"))
    return [engine, export, original, f"{best['batch']}x{best['context']}" if best else None,
            served["export"]["kv_bytes_per_token"], served["original"]["kv_bytes_per_token"],
            100 * served["greedy_agreement"]["token_agreement"]]


def merged_evaluation(quality: dict, inference: dict) -> dict:
    """One checkpoint's evaluation as a table reads it: the quality JSON completed by the inference JSON's
    sections (decode, kv_quant, LongBench, and pass keys with the quantized caches beside the full cache's)."""
    if not inference:
        return quality
    out = dict(quality)
    for key in INFERENCE_SECTIONS:
        if inference.get(key) is not None:
            out[key] = inference[key]
    q, i = quality.get("long_context") or {}, inference.get("long_context") or {}
    needle = {**(q.get("needle") or {}), **(i.get("needle") or {})}
    out["long_context"] = {"needle": needle or None, "longbench": i.get("longbench") or q.get("longbench")}
    return out


def collect(variants: list[Variant]) -> list[dict]:
    """One dict of raw values per variant (None where an input was not given)."""
    rows = []
    for v in variants:
        ev = merged_evaluation(_read_json(v.eval) if v.eval else {}, _read_json(v.inference) if v.inference else {})
        conv = _read_json(v.conversion) if v.conversion else {}
        d_kv = v.d_kv
        if d_kv is None:
            d_kv = conv.get("d_kv") if conv.get("d_kv") is not None else ev.get("d_kv")
        if v.name not in SPECIAL_VARIANTS and d_kv is None:
            raise TableInputError(f"variant {v.name!r}: d_kv unknown (give --d-kv, a conversion.json or "
                                  f"an eval JSON with d_kv)")
        kv_ratio = conv.get("kv_ratio")
        kv_elems = (ev.get("kv_cache") or {}).get("elements_per_token")
        ppl = (ev.get("perplexity") or {})
        bench = ((ev.get("benchmarks") or {}).get("paper") or {})
        local = ((ev.get("benchmarks") or {}).get("local") or {})
        mmlu = ((ev.get("benchmarks") or {}).get("mmlu") or {})
        speed, pred, at = _decode_summary(ev.get("decode"))
        metrics = read_metrics(v.metrics) if v.metrics else None
        losses = finite_losses(v.metrics, metrics) if v.metrics else None
        grad_median, grad_max = grad_norms.median_and_max(metrics.get("grad_norm", ())) if v.metrics else (None, None)
        scored = (ev.get("long_context") or {}).get("passkey_scored") or {}
        local_metric = "acc_norm" if local.get("acc_norm") is not None else "acc"
        rows.append({
            "variant": v.name, "d_kv": d_kv, "kv_ratio": kv_ratio, "kv_elements": kv_elems,
            "params": conv.get("params_after", ev.get("params")),
            # step 1's loss is computed before the first update: the loss right after conversion (and fit)
            "first_loss": float(losses.iloc[0]) if losses is not None else None,
            "final_loss": mean_of_last(losses) if losses is not None else None,
            "grad_norm_median": grad_median, "grad_norm_max": grad_max,
            "perplexity": ppl.get("perplexity"), "perplexity_se": ppl.get("perplexity_stderr"),
            "local_acc": local.get(local_metric), "local_acc_se": local.get(f"{local_metric}_stderr"),
            "scores": bench.get("scores") or {}, "scores_se": bench.get("scores_stderr") or {},
            "average": bench.get("average"), "average_se": bench.get("average_stderr"),
            "mmlu_cloze": mmlu.get("acc_norm"), "mmlu_cloze_se": mmlu.get("acc_norm_stderr"),
            "decode_speedup": speed, "decode_predicted": pred, "decode_at": at,
            "label": v.label, "kv_quant": ev.get("kv_quant"), "decode": ev.get("decode"),
            "served": _served_cells(_read_json(v.serve) if v.serve else {}),
            "needle": ((ev.get("long_context") or {}).get("needle") or {}),
            "key_argmax": scored.get("mean_all_argmax"), "key_argmax_se": scored.get("mean_all_argmax_stderr"),
            "key_logprob": scored.get("mean_key_logprob"), "key_logprob_se": scored.get("mean_key_logprob_stderr"),
            "longbench": ((ev.get("long_context") or {}).get("longbench") or {}).get("mean"),
            "longbench_se": ((ev.get("long_context") or {}).get("longbench") or {}).get("mean_stderr"),
            "_key": _variant_key(Variant(v.name, d_kv, paper_row=v.paper_row)),
        })
    # KV ratio without a conversion.json: relative to the "original" row's measured elements
    orig = next((r for r in rows if r["variant"] == "original" and r["kv_elements"]), None)
    for r in rows:
        if r["kv_ratio"] is None:
            if r["variant"] in SPECIAL_VARIANTS:
                r["kv_ratio"] = 1.0
            elif orig and r["kv_elements"]:
                r["kv_ratio"] = r["kv_elements"] / orig["kv_elements"]
    return rows


def _pct_change(ratio: float | None) -> float | None:
    return None if ratio is None else (ratio - 1.0) * 100.0


def build_table(variants: list[Variant], paper_model: str | None = None) -> tuple[list[str], list[list]]:
    """(header, rows) of the experiment table; numbers stay numbers (formatting happens on output)."""
    raw = collect(variants)
    if paper_model is not None and paper_model not in paper_numbers.TABLE1:
        raise TableInputError(f"paper model {paper_model!r} is not in the paper's Table 1 "
                              f"(known: {', '.join(paper_numbers.TABLE1)})")
    tasks = [t for t in paper_numbers.TASKS if any(t in r["scores"] for r in raw)]
    have = {k: any(r[k] is not None for r in raw)
            for k in ("params", "first_loss", "final_loss", "perplexity", "local_acc", "average", "mmlu_cloze",
                      "decode_speedup", "grad_norm_max", "key_argmax")}

    labels = any(r["label"] for r in raw)
    header = ["variant", *(["label"] if labels else []), "d_kv", "KV mem. change %"]
    if paper_model:
        header += ["KV mem. change % (paper)", "Δ KV mem. change"]
    for key, title in (("params", "params"), ("first_loss", "step-1 train loss"), ("final_loss", "final train loss"),
                       ("perplexity", "held-out perplexity"), ("local_acc", "local task acc_norm")):
        if have[key]:
            header.append(title)
            if key in ("perplexity", "local_acc"):
                header.append(title + SE_SUFFIX)
    if have["grad_norm_max"]:
        header += [GRAD_MEDIAN, GRAD_MAX_RATIO]
    if paper_model:   # the paper's average always; its task columns where we measured tasks (MMLU: cloze too)
        score_cols = ["avg", *(paper_numbers.TASKS if tasks else ["mmlu"] if have["mmlu_cloze"] else [])]
    elif have["average"] or tasks:
        score_cols = ["avg", *tasks]
    else:
        score_cols = []
    for t in score_cols:
        title = "Avg" if t == "avg" else paper_numbers.TASK_TITLES[t]
        header += [title, title + SE_SUFFIX]
        if paper_model:
            header += [f"{title} (paper)", f"Δ {title}"]
        if t == "mmlu" and have["mmlu_cloze"]:
            header += _mmlu_cloze_header(paper_model)
    if have["mmlu_cloze"] and "mmlu" not in score_cols:
        header += _mmlu_cloze_header(paper_model)
    if have["decode_speedup"]:
        header += ["decode speedup", "predicted S(B,T)", "at BxT"]
    cache_rows = any((r["kv_quant"] or {}).get("bits") for r in raw)
    served = any(r["served"] for r in raw)
    if served:
        header += SERVED_COLUMNS
    if cache_rows:
        header += CACHE_COLUMNS
    passkey = any(r["needle"] for r in raw)
    if passkey:
        header += [PASSKEY, PASSKEY + SE_SUFFIX]
    if have["key_argmax"]:
        header += [KEY_ARGMAX, KEY_ARGMAX + SE_SUFFIX, KEY_LOGPROB, KEY_LOGPROB + SE_SUFFIX]
    if any(r["longbench"] is not None for r in raw):
        header += [LONGBENCH, LONGBENCH + SE_SUFFIX]

    rows = []
    for r in raw:
        paper = paper_numbers.paper_row(paper_model, r["_key"]) if paper_model and r["_key"] is not None else None
        ours_kv = _pct_change(r["kv_ratio"])
        row = [r["variant"], *([r["label"] or r["variant"]] if labels else []), r["d_kv"], ours_kv]
        if paper_model:
            p_kv = None if paper is None else paper["kv_change"]
            if p_kv is None and paper is not None and r["variant"] == "original":
                p_kv = 0.0
            row += [p_kv, _diff(ours_kv, p_kv)]
        for key in ("params", "first_loss", "final_loss", "perplexity", "local_acc"):
            if have[key]:
                row.append(r[key])
                if key in ("perplexity", "local_acc"):
                    row.append(r[f"{key}_se"])
        if have["grad_norm_max"]:
            median, largest = r["grad_norm_median"], r["grad_norm_max"]
            row += [median, None if median is None or not median > 0 else largest / median]
        for t in score_cols:
            ours = r["average"] if t == "avg" else r["scores"].get(t)
            se = r["average_se"] if t == "avg" else r["scores_se"].get(t)
            ours = None if ours is None else ours * 100.0    # fractions -> percentage points
            se = None if ours is None or se is None else se * 100.0
            row += [ours, se]
            if paper_model:
                p = None if paper is None else paper[t]
                row += [p, _diff(ours, p)]
            if t == "mmlu" and have["mmlu_cloze"]:
                row += _mmlu_cloze_cells(r, paper, paper_model)
        if have["mmlu_cloze"] and "mmlu" not in score_cols:
            row += _mmlu_cloze_cells(r, paper, paper_model)
        if have["decode_speedup"]:
            row += [r["decode_speedup"], r["decode_predicted"], r["decode_at"]]
        if served:
            row += r["served"] or [None] * len(SERVED_COLUMNS)
        if cache_rows:
            full = ((r["kv_quant"] or {}).get("bits") or {}).get("16") or {}
            row += [16 if full else None, full.get("mean_loss"), full.get("mean_loss_stderr"), None, None,
                    _bytes_per_token(r, 16)]
        if passkey:
            row += _passkey(r, "16")
        if have["key_argmax"]:
            argmax, argmax_se = r["key_argmax"], r["key_argmax_se"]
            row += [None if argmax is None else 100 * argmax, None if argmax_se is None else 100 * argmax_se,
                    r["key_logprob"], r["key_logprob_se"]]
        if LONGBENCH in header:
            row += [None if r["longbench"] is None else 100 * r["longbench"],
                    None if r["longbench_se"] is None else 100 * r["longbench_se"]]
        rows.append(row)
        if cache_rows:
            rows += _quantized_rows(r, header, labels)
    return header, rows


PASSKEY, LONGBENCH = "pass-key acc", "LongBench avg"
KEY_ARGMAX, KEY_LOGPROB = "pass key all-argmax %", "pass-key log-prob"   # teacher-forced (needle.passkey_scores)
GRAD_MEDIAN, GRAD_MAX_RATIO = "grad norm median", "grad norm max/median"


def _passkey(r: dict, bits: str) -> list:
    """Pass-key accuracy in points over all lengths, and its SE, with the cache at `bits`."""
    entry = r["needle"].get(bits) or {}
    if entry.get("status") != "ok":
        return [None, None]
    return [100 * entry["mean"], 100 * entry["mean_stderr"]]


CACHE_COLUMNS = ["cache bits", "cache-decoded loss", "cache-decoded loss" + SE_SUFFIX, "Δ loss vs 16-bit",
                 "Δ loss vs 16-bit" + SE_SUFFIX, "KV bytes/token"]


def _bytes_per_token(r: dict, bits: int) -> float | None:
    """Bytes per cached token at `bits` (quantized: every token quantized, scales included)."""
    kvq = r["kv_quant"] or {}
    if bits == 16:
        measured = [e for e in (kvq.get("bytes") or {}).values() if e.get("bytes_per_token_full_precision")]
        return measured[0]["bytes_per_token_full_precision"] if measured else None
    return ((kvq.get("bytes") or {}).get(str(bits)) or {}).get("bytes_per_quantized_token")


def _quantized_rows(r: dict, header: list[str], labels: bool) -> list[list]:
    """One row per quantized cache width of a variant: its KV change on element bits against the original's
    16-bit cache (the paper's Table 2 convention), the decoded loss and its paired change, speed."""
    out = []
    for bits, entry in ((r["kv_quant"] or {}).get("bits") or {}).items():
        if bits == "16" or entry.get("status") != "ok":
            continue
        b = int(bits)
        row = dict.fromkeys(header)
        name = f"{r['variant']} · {b}-bit cache"
        row.update({"variant": name, "d_kv": r["d_kv"],
                    "KV mem. change %": _pct_change(None if r["kv_ratio"] is None else r["kv_ratio"] * b / 16),
                    "cache bits": b, "cache-decoded loss": entry["mean_loss"],
                    "cache-decoded loss" + SE_SUFFIX: entry.get("mean_loss_stderr"),
                    "Δ loss vs 16-bit": entry.get("loss_change"),
                    "Δ loss vs 16-bit" + SE_SUFFIX: entry.get("loss_change_stderr"),
                    "KV bytes/token": _bytes_per_token(r, b)})
        if labels:
            row["label"] = f"{r['label'] or r['variant']} · {b}-bit cache"
        if PASSKEY in header:
            row[PASSKEY], row[PASSKEY + SE_SUFFIX] = _passkey(r, bits)
        if "decode speedup" in header:
            point = _decode_point(r["decode"], f"speedup_q{b}")
            row.update({"decode speedup": point.get(f"speedup_q{b}"),
                        "at BxT": f"{point['batch']}x{point['context']}" if point else None})
        out.append([row[c] for c in header])
    return out


def _decode_point(decode: dict | None, key: str) -> dict:
    """The grid point with the largest B·T that measured `key`, or {}."""
    points = [g for g in (decode or {}).get("grid") or [] if g.get(key) is not None]
    return max(points, key=lambda g: g["batch"] * g["context"]) if points else {}


MMLU_CLOZE = "MMLU (cloze)"


def _mmlu_cloze_header(paper_model) -> list[str]:
    return [MMLU_CLOZE, MMLU_CLOZE + SE_SUFFIX, *([f"Δ {MMLU_CLOZE}"] if paper_model else [])]


def _mmlu_cloze_cells(r: dict, paper: dict | None, paper_model) -> list:
    """Our MMLU cloze in points, its SE, and (with the paper's columns) ours − the paper's MMLU."""
    ours = None if r["mmlu_cloze"] is None else r["mmlu_cloze"] * 100.0
    se = None if ours is None or r["mmlu_cloze_se"] is None else r["mmlu_cloze_se"] * 100.0
    if not paper_model:
        return [ours, se]
    return [ours, se, _diff(ours, None if paper is None else paper["mmlu"])]


def _diff(a, b):
    return None if a is None or b is None else a - b


def _fmt(value, column: str) -> str:
    if value is None:
        return "–"
    if isinstance(value, str):
        return value
    if column in ("d_kv",) or (column == "params" and isinstance(value, int)):
        return f"{int(value):,}" if column == "params" else str(int(value))
    if column in (PASSKEY, LONGBENCH, KEY_ARGMAX):
        return f"{value:.1f}"
    if column == KEY_LOGPROB:
        return f"{value:.3f}"
    if column == GRAD_MAX_RATIO:
        return f"{value:.1f}x"
    if column in ("cache bits",):
        return str(int(value))
    if column == "KV bytes/token":
        return f"{value:,.1f}"
    if column.startswith(("served decode", "served KV")):
        return f"{value:,.0f}"
    if column == "served greedy agreement %":
        return f"{value:.1f}"
    if column in ("cache-decoded loss", "Δ loss vs 16-bit"):
        return f"{value:.4f}" if column.startswith("cache") else f"{value:+.4f}"
    if column.startswith(("KV mem", "Δ KV")):
        return f"{value:+.2f}%"
    if column in ("decode speedup", "predicted S(B,T)"):
        return f"{value:.2f}x"
    if column.startswith("Δ"):
        return f"{value:+.2f}"
    if column in ("step-1 train loss", "final train loss", "held-out perplexity", "local task acc_norm"):
        return f"{value:.4f}" if column != "held-out perplexity" else f"{value:.3f}"
    return f"{value:.2f}"


def to_markdown(header: list[str], rows: list[list], title: str | None = None, notes: list[str] = ()) -> str:
    """Markdown table; a column `X_se` right after `X` is shown inside it as `value ± se`."""
    values = pd.DataFrame(rows, columns=header, dtype=object)
    text = values.apply(lambda col: col.map(lambda v: _fmt(v, col.name.removesuffix(SE_SUFFIX))))
    folded = {x: se for x, se in zip(header, header[1:]) if se == x + SE_SUFFIX}
    for x, se in folded.items():
        both = values[x].notna() & values[se].notna()
        text.loc[both, x] += " ± " + text.loc[both, se].str.lstrip("+")
    shown = text.drop(columns=list(folded.values()))
    table = shown.to_markdown(index=False, tablefmt="github", disable_numparse=True)   # cells stay as formatted
    return "\n".join([*([f"### {title}", ""] if title else []), table, *(["", *notes] if notes else [])]) + "\n"


def write_table(header, rows, out: str | Path, title: str | None = None, notes: list[str] = ()) -> list[Path]:
    """Write OUT.csv (raw numbers, floats to 6 significant digits, empty for missing) and OUT.md (formatted)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = out.with_suffix(".csv"), out.with_suffix(".md")
    pd.DataFrame([[f"{v:.6g}" if isinstance(v, float) else v for v in row] for row in rows],
                 columns=header, dtype=object).to_csv(csv_path, index=False)
    md_path.write_text(to_markdown(header, rows, title, notes))
    return [csv_path, md_path]


def table_notes(paper_model: str | None, model_name: str | None, variants: list[Variant] = (),
                any_mmlu_cloze: bool = False, any_cache_rows: bool = False,
                any_served: bool = False) -> list[str]:
    notes = [f"KV mem. change: cached elements per token vs the original model. Step-1 train loss: the first "
             f"batch's loss before any update (right after conversion and fit). Final train loss: mean of "
             f"the last {FINAL_LOSS_STEPS} logged steps. Benchmark scores in %, zero-shot acc_norm; Avg = "
             f"unweighted mean of the six columns (ARC = mean of Easy and Challenge), as in the paper. "
             f"± = one standard error (perplexity: across held-out blocks, delta method; accuracies: lm-eval's "
             f"per-question SE, combined over tasks as independent estimates). Grad norm: the median of the "
             f"logged gradient norms (before clipping) and the largest as a multiple of it. Pass key all-argmax "
             f"and log-prob (where measured): pass-key prompts scored teacher-forced, the share whose answer "
             f"tokens are all the argmax (± binomial SE) and the answer tokens' mean log-probability (± SE over "
             f"prompts), mean over the prompt lengths."]
    if any_cache_rows:
        notes.append("Rows \"· N-bit cache\": the same checkpoint decoding with its KV cache quantized to N bits "
                     "(asymmetric, one scale and zero point per group of channels of a token; the newest tokens in "
                     "full precision: MLA's own latent cache, the original and baseline through transformers' "
                     "quantized cache with optimum-quanto's procedure, in torch; a prompt is read in full "
                     "precision by its prefill and quantized for later steps in both). KV mem. change on element bits against the original's 16-bit cache, "
                     "as the paper's Table 2; KV bytes/token as stored here (quantized: scales included, every "
                     "token quantized). Cache-decoded loss: the last tokens of held-out blocks decoded one at a "
                     "time against the cache; Δ loss vs 16-bit: mean of per-block differences ± its SE. "
                     "Pass-key acc: offline needle-in-a-haystack retrieval, mean over the prompt lengths, ± binomial SE.")
    if any_served:
        notes.append("Served columns (evaluate.serve): the checkpoint exported for a stock engine and its original "
                     "model served by it the same way (vLLM: the DeepSeek-V3 format, bf16; llama.cpp: f16 GGUF "
                     "files, the unquantized K cache; serve.json has every cache type): decode tokens/s of each at "
                     "the largest batch x context measured, the KV cache's bytes per token as the engine allocated "
                     "it for each, and the share of greedy tokens (before each prompt's first difference) in which "
                     "the engine on the export agrees with transformers on the MLA checkpoint.")
    if any_mmlu_cloze:
        notes.append(f"{MMLU_CLOZE}: the paper's zero-shot MMLU prompt (\"The following are questions about "
                     f"{{topic}}. Question: … Answer:\", answer texts as choices, acc_norm) on a sample of "
                     f"MMLU's test split stratified by subject (size and seed: benchmarks.mmlu of the eval "
                     f"JSON); ± = lm-eval's per-question SE.")
    if paper_model:
        src = f" (our model: {model_name})" if model_name and paper_numbers.paper_model(model_name) != paper_model else ""
        notes.append(f"Paper columns: MHA2MLA v1 Table 1, {paper_model}{src}; Δ = ours − paper.")
        ablation = [v.name for v in variants if isinstance(v.paper_row, str) and v.paper_row != AUTO
                    and v.paper_row in paper_numbers.ABLATIONS.get(paper_model, {})]
        if ablation:
            notes.append(f"Rows {', '.join(ablation)}: the paper's ablations instead (Table 5: partial RoPE "
                         "only, r = 4 unless named; Table 3: the SVD rows at d_kv = 16), which give scores but "
                         "no KV column.")
    return notes
