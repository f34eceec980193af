"""How much each conversion method loses right after conversion, at one cache width, on real weights.

The methods of the recovery ablation, cumulatively, at the cache width of the paper's d_kv 16 + r 4
(n_kv·(16 + 8) elements per token and layer: 72 for SmolLM2's 3 K/V heads):

  1. the paper's method: 2-norm partial RoPE per KV head (r 4), plain joint SVD, d_kv 16
  2. + activation-aware SVD (the joint SVD fitted to the attention inputs' covariance)
  3. + rotated partial RoPE: n_kv·r = 12 rotated components in one shared RoPE key (the same width)
  4. + shared latent: up-projections per query head. It is the same function at conversion (it only gives
     training more to separate), so its logits are checked equal to row 3's on 2 held-out blocks and row 3's
     losses are reported for it rather than scored again.
  5. + each width split: the RoPE key takes 24/36/48/60 of the 72 (rope_share = dims / width), the latent the
     rest (24 is row 4's conversion itself: reported from it); the per-head 2-norm layout is measured beside
     the splits named by --per-head-splits (default 48) so that the rotation's gain at that split shows.
  With --ladder, beside each rotated row: the same width in the ladder layout (at most one component per
  frequency, on DeepSeek's RoPE ladder: the layout `mla export --format deepseek_v3` takes), against that row.

One calibration pass over training blocks gives the 2-norm scores, the rotation's statistics and the
covariances. Every model is scored on the same held-out blocks (evenly spaced over the validation split);
`loss_se` is the paired standard error of the per-block loss change against the original model (the
blocks are shared, so most of the between-block variance cancels), `original_loss_se` the SE of the
original's own mean loss; `change_vs_previous_row` (± its paired SE) is each step of the cumulative ablation (a "beside" row's: against
the step it stands beside),
and every row carries its per-block losses (`block_losses`, `original_block_losses`) for other comparisons.
`loss_after_fit` stays null unless `--fit-steps N` (or a fitting function passed to `run`,
`fit(converted, original, train_blocks) -> fitted model`): then each conversion is also fitted layer by layer
to the original's attention outputs (mla/conversion/fit.py, on a copy) and scored again on the same blocks.
With `--passkey N` each row also carries the teacher-forced pass-key score (mla/evaluation/needle.py
passkey_scores: N prompts per length of `--passkey-lengths`) right after conversion and after the fit, and the
original's: `passkey_after_conversion`, `passkey_after_fit`, `original_passkey` (all-argmax share and the
answer's log-probability, each ± SE).

`--only-splits` measures just the width splits (the RoPE budget at one cache width: retrieval against the
number of RoPE components), with `--split-latent per_head` for the default's per-head latents, `--split-folds 1 2 4`
for each split once per RoPE fold (mla/conversion/freqfold.py) and `--attention-aware` for the attention-aware SVD
(mla/conversion/readers.py; `both`: each row without and with): the default's GQA conversions are
`--only-splits --split-strategy ladder --split-latent per_head --attention-aware on` at --d-kv 8 / 16 / 32
(widths 48 / 72 / 120) with its splits and folds.

    OMP_NUM_THREADS=2 python benchmarks/bench_recovery.py --model ~/.cache/mla/smollm2-135m-instruct-fp32 \\
        --data /tmp/rope/data --out recovery.json [--calibration-blocks 32] [--blocks 64] [--fit-steps 30]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction


@dataclass
class Method:
    """One row of the ablation: a name and the conversion options (mla.conversion.convert.convert_model).
    `same_function` marks a method whose model equals the previous row's function (checked, not scored)."""

    name: str
    options: dict = field(default_factory=dict)
    whiten: bool = False
    same_function: bool = False
    beside: bool = False          # another layout at the row above's split, not a step of the ablation

    def key(self) -> str:
        """What the conversion computes: equal keys are one conversion, measured once."""
        options = dict(self.options)
        if "kv_width" in options:   # a width budget is the d_kv/r one when it gives the same numbers
            options["rope_share"] = str(Fraction(str(options["rope_share"])))
        return json.dumps({**options, "whiten": self.whiten}, sort_keys=True)


def ablation(n_kv: int, d_kv: int = 16, r: int = 4, splits=(24, 36, 48, 60), per_head_splits=(48,),
             only_splits: bool = False, split_latent: str = "shared", ladder: int = 0,
             split_strategy: str = "rotated", split_folds=(1,), attention_aware: str = "off") -> list[Method]:
    """The cumulative methods at the width n_kv·(d_kv + 2r), then the width splits (only those: `only_splits`).
    `ladder` > 0: beside each rotated row of at most that many components, the same width in the ladder layout
    (one component per frequency, DeepSeek's RoPE ladder: what `mla export` needs), so its cost shows."""
    width = n_kv * (d_kv + 2 * r)
    paper = dict(d_kv=d_kv, r=r, strategy="2-norm", svd="joint")
    rotated = dict(paper, strategy="rotated")

    def on_ladder(options: dict, components: int) -> list[Method]:
        if not 0 < components <= ladder:
            return []
        return [Method(f"  beside: ladder RoPE ({components} components, one per frequency)",
                       dict(options, strategy="ladder"), whiten=True, beside=True)]

    methods = [Method(f"paper: 2-norm per head r {r}, joint SVD, d_kv {d_kv}", paper),
               Method("+ activation-aware SVD", paper, whiten=True),
               Method(f"+ rotated RoPE ({n_kv * r} components, one shared key)", rotated, whiten=True),
               Method("+ shared latent", dict(rotated, latent="shared"), whiten=True, same_function=True),
               *on_ladder(rotated, n_kv * r)]    # after the same-function check, which reads the row above it
    if only_splits:
        methods = []
    for dims in splits:
        split = dict(kv_width=width, rope_share=str(Fraction(dims, width)), svd="joint")
        if dims == 2 * n_kv * r:          # the split of the rows above
            split = dict(rotated)
        for fold in split_folds:
            for aware in {"off": (False,), "on": (True,), "both": (False, True)}[attention_aware]:
                extra = {**({"rope_fold": fold} if fold != 1 else {}), **({"attention_aware": True} if aware else {})}
                methods.append(Method(f"{'' if only_splits else '+ '}split: {dims} RoPE dims ({split_strategy}, "
                                      f"{dims // 2} components{f', folded by {fold}' if fold != 1 else ''}) + latent "
                                      f"{width - dims}{', attention-aware' if aware else ''}",
                                      dict(split, strategy=split_strategy, latent=split_latent, **extra), whiten=True))
        if only_splits or dims != 2 * n_kv * r:       # else the ladder row above stands beside this split
            methods += on_ladder(dict(split, latent=split_latent), dims // 2)
        if dims in per_head_splits and dims % (2 * n_kv) == 0:
            methods.append(Method(f"  beside: 2-norm per head r {dims // (2 * n_kv)} + latent {width - dims}, "
                                  "activation-aware", dict(split, strategy="2-norm"), whiten=True, beside=True))
    return methods


def max_logit_gap(a, b, valid_blocks, blocks: int = 2) -> float:
    """The largest |logit difference| of two models on the first held-out blocks."""
    import numpy as np
    import torch

    ids = torch.from_numpy(np.array(valid_blocks[:blocks], dtype=np.int64))
    with torch.inference_mode():
        return (a(input_ids=ids).logits - b(input_ids=ids).logits).abs().max().item()


def paired(losses: list[float], reference: list[float]) -> tuple[float, float]:
    """Mean change against the reference's per-block losses and its paired standard error."""
    from mla.stats import mean_and_stderr

    return mean_and_stderr([a - b for a, b in zip(losses, reference)])


def passkey_summary(scores: dict) -> dict:
    """The headline of needle.passkey_scores: all-argmax share and answer log-probability, each ± SE."""
    keys = ("mean_all_argmax", "mean_all_argmax_stderr", "mean_key_logprob", "mean_key_logprob_stderr")
    return {**{k.removeprefix("mean_"): scores[k] for k in keys}, "samples": scores["samples"],
            "lengths": sorted(scores["lengths"])}


def passkey_scorer(tokenizer, lengths: list[int], samples: int) -> Callable:
    """`retrieval` of `run`: a model -> passkey_summary of its teacher-forced pass-key scores."""
    from mla.evaluation.needle import passkey_scores

    def score(model) -> dict:
        return passkey_summary(passkey_scores(model, tokenizer, lengths=lengths, samples=samples))

    return score


def run(model, train_blocks, valid_blocks, methods: list[Method], *, calibration_blocks: int = 32,
        blocks: int = 64, batch_size: int = 8, fit: Callable | None = None, retrieval: Callable | None = None,
        log=print) -> list[dict]:
    """Calibrate once, convert with every method, score each on the same held-out blocks; JSON-ready rows."""
    from mla.conversion import calibrate
    from mla.conversion.convert import convert_model
    from mla.perplexity import per_block_losses
    from mla.stats import mean_and_stderr

    start = time.perf_counter()
    n = min(calibration_blocks, len(train_blocks))
    cal = calibrate.calibration_pass(model, (train_blocks[i] for i in range(n)), batch_size=batch_size,
                                     covariance=True)
    covariances = {"covariance": cal["covariance"]}
    log(f"calibration: {n} training blocks ({cal['tokens']} tokens) in {time.perf_counter() - start:.0f} s")
    original, tokens = per_block_losses(model, valid_blocks, batch_size, blocks)
    original_loss, original_se = mean_and_stderr(original)
    log(f"original: {original_loss:.3f} ± {original_se:.3f} on {len(original)} held-out blocks ({tokens} tokens)")
    original_passkey = retrieval(model) if retrieval else None
    rows, steps, measured, previous = [], [], {}, None
    for method in methods:
        t0 = time.perf_counter()
        if method.key() in measured:        # the very same conversion as an earlier row
            row = dict(measured[method.key()], method=method.name, note=f"the conversion of "
                       f"'{measured[method.key()]['method']}'", seconds=0.0)
            row["change_vs_previous_row"], row["change_vs_previous_row_se"] = paired(row["block_losses"],
                                                                                     steps[-1]["block_losses"])
            rows.append(row)
            steps += [] if method.beside else [row]
            log(f"{method.name}: {row['note']}")
            continue
        converted, report = convert_model(model, scores=cal, covariances=covariances, whiten=method.whiten,
                                          **method.options)
        note = None
        if method.same_function and previous is not None:
            gap = max_logit_gap(converted, previous[0], valid_blocks)
            if gap > 1e-3:
                raise AssertionError(f"{method.name}: not the same function as '{previous[1]['method']}' "
                                     f"(logits differ by {gap:.2e})")
            losses = previous[2]
            note = f"logits equal to '{previous[1]['method']}' on 2 held-out blocks (max |diff| {gap:.1e}): its losses"
        else:
            losses, _ = per_block_losses(converted, valid_blocks, batch_size, blocks)
        fit_losses, passkey_fit = None, None
        passkey = retrieval(converted) if retrieval else None
        if fit is not None:   # a fit may use what makes two equal functions differ (a shared latent's heads)
            fitted = fit(converted, model, train_blocks)
            fit_losses, _ = per_block_losses(fitted, valid_blocks, batch_size, blocks)
            passkey_fit = retrieval(fitted) if retrieval else None
        change, change_se = paired(losses, original)
        row = {"method": method.name, "kv_elements_per_token_layer": report["kv_elements_per_token_layer"],
               "rope_dims_per_layer": report["rope_dims_per_layer"], "latent_per_layer": report["latent_per_layer"],
               "rope_layout": report["rope_layout"], "latent": report["latent"], "whitened": method.whiten,
               "loss_after_conversion": sum(losses) / len(losses), "loss_change": change, "loss_se": change_se,
               "loss_after_fit": None, "loss_change_after_fit": None, "loss_se_after_fit": None,
               "original_loss": original_loss, "original_loss_se": original_se,
               "output_error_mean": report.get("output_error_mean"), "params_after": report["params_after"],
               "passkey_after_conversion": passkey, "passkey_after_fit": passkey_fit,
               "original_passkey": original_passkey, "note": note}
        if steps:   # the step of the cumulative ablation; a "beside" row against the step it stands beside
            row["change_vs_previous_row"], row["change_vs_previous_row_se"] = paired(losses, steps[-1]["block_losses"])
        row["block_losses"] = losses
        if fit_losses is not None:
            row["loss_after_fit"] = sum(fit_losses) / len(fit_losses)
            row["loss_change_after_fit"], row["loss_se_after_fit"] = paired(fit_losses, original)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        log(f"{method.name}: {row['loss_after_conversion']:.3f} ({change:+.3f} ± {change_se:.3f}) "
            f"[{row['rope_dims_per_layer']} RoPE + {row['latent_per_layer']} latent] {row['seconds']} s"
            + (f" ({note})" if note else "")
            + ("" if fit_losses is None else f"; after fit {row['loss_after_fit']:.3f}")
            + "".join(f"; pass key {when}: {_passkey_text(pk)}" for when, pk in
                      (("after conversion", passkey), ("after fit", passkey_fit)) if pk))
        rows.append(row)
        steps += [] if method.beside else [row]
        measured[method.key()] = row
        previous = (converted, row, losses)
    for row in rows:
        row.update(blocks=len(original), tokens=tokens, calibration_blocks=n, original_block_losses=original,
                   loss_se_kind="paired SE of the per-block loss change against the original model")
    return rows


def _passkey_text(pk: dict | None) -> str:
    if not pk:
        return ""
    return (f"{100 * pk['all_argmax']:.0f} ± {100 * pk['all_argmax_stderr']:.0f} % all-argmax, "
            f"log-prob {pk['key_logprob']:.2f} ± {pk['key_logprob_stderr']:.2f}")


def passkey_markdown(rows: list[dict]) -> str:
    """Retrieval per row: teacher-forced pass keys after conversion and after the fit."""
    lines = ["| method | cached (RoPE + latent) | pass key after conversion | after fit |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['kv_elements_per_token_layer']} ({r['rope_dims_per_layer']} + "
                     f"{r['latent_per_layer']}) | {_passkey_text(r.get('passkey_after_conversion'))} | "
                     f"{_passkey_text(r.get('passkey_after_fit'))} |")
    o = rows[0].get("original_passkey")
    lines.append(f"\noriginal: {_passkey_text(o)} ({o['samples']} prompts at each of {o['lengths']} tokens)")
    return "\n".join(lines)


def markdown(rows: list[dict]) -> str:
    fitted = any(r.get("loss_after_fit") is not None for r in rows)
    lines = ["| method | cached per layer (RoPE + latent) | loss after conversion | change vs original ± paired SE "
             "| vs the step above ± paired SE |" + (" loss after fit | change vs original ± paired SE |" if fitted else ""),
             "|---|---|---|---|---|" + ("---|---|" if fitted else "")]
    for r in rows:
        step = r.get("change_vs_previous_row")
        step = "" if step is None else f"{step:+.3f} ± {r['change_vs_previous_row_se']:.3f}"
        after = ""
        if fitted:
            after = (" | |" if r.get("loss_after_fit") is None else
                     f" {r['loss_after_fit']:.3f} | {r['loss_change_after_fit']:+.3f} ± {r['loss_se_after_fit']:.3f} |")
        lines.append(f"| {r['method']} | {r['kv_elements_per_token_layer']} ({r['rope_dims_per_layer']} + "
                     f"{r['latent_per_layer']}) | {r['loss_after_conversion']:.3f} | {r['loss_change']:+.3f} ± "
                     f"{r['loss_se']:.3f} | {step} |{after}")
    o = rows[0]
    lines.append(f"\noriginal: {o['original_loss']:.3f} ± {o['original_loss_se']:.3f} on {o['blocks']} held-out "
                 f"blocks ({o['tokens']} tokens); calibration on {o['calibration_blocks']} training blocks")
    return "\n".join(lines)


def layer_fit(settings, heldout_blocks) -> Callable:
    """The `fit` of `run`: mla fit's layer-wise fit of a copy of the converted model on the first
    `settings.blocks` training sequences (`settings.span` blocks each; its own report's held-out sequences:
    `heldout_blocks`)."""
    import copy

    from mla.conversion.fit import fit_model, join_blocks

    def fit(converted, original, train_blocks):
        fitted = copy.deepcopy(converted)
        train = join_blocks(train_blocks, settings.span, settings.blocks)
        fit_model(original, fitted, train, heldout_blocks, settings, log=lambda *a, **k: None)
        return fitted

    return fit


def main() -> None:
    import torch

    from mla import atomic, checkpoint
    from mla.conversion.ladder import ladder_for
    from mla.data import open_blocks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF checkpoint folder (a Llama-family model)")
    p.add_argument("--data", required=True, help="`mla data` folder made with the model's tokenizer")
    p.add_argument("--out", required=True, help="JSON file: a list of rows")
    p.add_argument("--calibration-blocks", type=int, default=32, help="training blocks for scores and covariances")
    p.add_argument("--blocks", type=int, default=64, help="held-out blocks scored (evenly spaced; at least 64)")
    p.add_argument("--d-kv", type=int, default=16)
    p.add_argument("--r", type=int, default=4)
    p.add_argument("--splits", type=int, nargs="+", default=[24, 36, 48, 60], help="RoPE dims of the width splits")
    p.add_argument("--per-head-splits", type=int, nargs="*", default=[48],
                   help="splits at which the per-head 2-norm layout is measured beside the rotated one (default 48)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--fit-steps", type=int, default=0, help="layer-wise fit after each conversion: Adam steps per "
                   "layer (0: no fit, loss_after_fit null)")
    p.add_argument("--fit-lr", type=float, default=3e-3)
    p.add_argument("--fit-blocks", type=int, default=32, help="training blocks the fit reads (the first)")
    p.add_argument("--fit-batch", type=int, default=4)
    p.add_argument("--fit-heldout", type=int, default=8, help="held-out blocks of the fit's own report")
    p.add_argument("--fit-echo", type=int, default=0, help="tokens of each fit sequence's first half repeated "
                   "in its second half (0: none)")
    p.add_argument("--fit-span", type=int, default=1, help="consecutive blocks joined into one fit sequence "
                   "(--fit-blocks and --fit-heldout then count sequences)")
    p.add_argument("--passkey", type=int, default=0, metavar="N",
                   help="teacher-forced pass keys per length after conversion and fit (0: none)")
    p.add_argument("--passkey-lengths", type=int, nargs="+", default=[256, 512])
    p.add_argument("--only-splits", action="store_true", help="measure only the width splits (the RoPE budget)")
    p.add_argument("--split-latent", choices=("shared", "per_head"), default="shared",
                   help="latent layout of the split rows (default shared, as in the recovery ablation)")
    p.add_argument("--split-strategy", choices=("rotated", "ladder"), default="rotated",
                   help="RoPE layout of the split rows (default rotated)")
    p.add_argument("--split-folds", type=int, nargs="+", default=[1], metavar="F",
                   help="each split row once per RoPE fold (mla/conversion/freqfold.py; default 1: unfolded)")
    p.add_argument("--attention-aware", choices=("off", "on", "both"), default="off",
                   help="split rows with the attention-aware SVD (mla/conversion/readers.py), without, or both")
    p.add_argument("--ladder", action="store_true",
                   help="beside each rotated row, the ladder layout at the same width (one RoPE component per "
                        "frequency: what `mla export --format deepseek_v3` needs), to show its cost")
    args = p.parse_args()

    torch.manual_seed(0)
    start = time.perf_counter()
    model = checkpoint.load_model(args.model)
    n_kv = model.config.num_key_value_heads
    ladder = len(ladder_for(model.config.head_dim).pairs) if args.ladder else 0
    methods = ablation(n_kv, args.d_kv, args.r, args.splits, per_head_splits=tuple(args.per_head_splits),
                       only_splits=args.only_splits, split_latent=args.split_latent, ladder=ladder,
                       split_strategy=args.split_strategy, split_folds=tuple(args.split_folds),
                       attention_aware=args.attention_aware)
    fit = None
    if args.fit_steps:
        from mla.conversion.fit import FitSettings, join_blocks

        settings = FitSettings(steps=args.fit_steps, lr=args.fit_lr, blocks=args.fit_blocks, batch=args.fit_batch,
                               heldout=args.fit_heldout, span=args.fit_span, echo=args.fit_echo)
        valid = open_blocks(args.data, "validation")
        fit = layer_fit(settings, join_blocks(valid, args.fit_span, args.fit_heldout, evenly=True))
    retrieval = None
    if args.passkey:
        retrieval = passkey_scorer(checkpoint.load_tokenizer(args.model), args.passkey_lengths, args.passkey)
    rows = run(model, open_blocks(args.data, "train"), open_blocks(args.data, "validation"), methods,
               calibration_blocks=args.calibration_blocks, blocks=args.blocks, batch_size=args.batch_size, fit=fit,
               retrieval=retrieval)
    for row in rows:
        row["model"] = str(args.model)
    with atomic.staged(args.out) as tmp:
        tmp.write_text(json.dumps(rows, indent=1))
    print(markdown(rows))
    if retrieval:
        print(passkey_markdown(rows))
    print(f"total {time.perf_counter() - start:.0f} s (threads: {torch.get_num_threads()}); wrote {args.out}")
    best = min(rows, key=lambda r: r["loss_after_conversion"])
    print(f"best: {best['method']}: {best['loss_after_conversion']:.3f} (goal <= 4.0; original "
          f"{best['original_loss']:.3f}){'' if math.isfinite(best['loss_after_conversion']) else ' (not finite)'}")


if __name__ == "__main__":
    main()
