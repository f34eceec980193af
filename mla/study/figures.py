"""Loss-vs-step figures in the style of the paper's Fig. 5 (MHA2MLA panel above the GQA2MLA panel).

Input: per-step metrics files written by `mla train` (CSV, header
`step,loss,lr,grad_norm,tokens,tokens_per_second`), one per run. A *panel* is one experiment (one
source model): the fine-tuned, unconverted baseline in black and the converted runs coloured from
light (most compressed, smallest d_kv) to dark (least compressed): pink, purple, dark purple.
Each curve is drawn twice: the raw per-step loss faint, an exponentially smoothed loss over it.

A panel spec is a plain dict (also what `mla plot --spec FILE` reads, JSON or YAML):

    {"title": "GQA2MLA: SmolLM-135M", "kind": "GQA",
     "runs": [{"d_kv": 8, "metrics": "results/train/.../metrics.csv"},
              {"baseline": true, "metrics": ".../metrics.csv"}]}

`kind` is "MHA" or "GQA": it names the legend entries ("GQA2MLA d_kv = 8", baseline "GQA").
"""

from __future__ import annotations

import csv
import math
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

# light -> dark as the compression eases; the paper's figure uses these three hues
MLA_COLOURS = ["#f7a1c4", "#a05cc4", "#4b1166"]
BASELINE_COLOUR = "#000000"
TITLE_CHARS = 70          # a panel title's line: about the width of the axes at 12 pt
RAW_ALPHA = 0.25
KINDS = ("MHA", "GQA")


@dataclass
class Run:
    metrics: Path
    d_kv: int | None = None          # latent size per KV head, when the run has one
    label: str | None = None         # overrides the automatic legend label
    baseline: bool = False           # the unconverted model, fine-tuned (drawn in black)
    kv_reduction: float | None = None   # % of the KV cache saved (from conversion.json), shown in the legend

    @property
    def is_baseline(self) -> bool:
        return self.baseline


@dataclass
class Panel:
    title: str
    kind: str                        # "MHA" or "GQA"
    runs: list[Run] = field(default_factory=list)


class FigureInputError(ValueError):
    """A panel spec or a metrics file that cannot be plotted; the message names the cause."""


def read_loss_curve(path: str | Path) -> tuple[list[int], list[float]]:
    """(steps, losses) from a metrics CSV; rows without a finite loss are skipped."""
    path = Path(path)
    if not path.is_file():
        raise FigureInputError(f"metrics file not found: {path}")
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = {"step", "loss"} - set(reader.fieldnames or [])
        if missing:
            raise FigureInputError(f"{path}: missing column(s) {sorted(missing)} "
                                   f"(header is {reader.fieldnames})")
        steps, losses = [], []
        for line_no, row in enumerate(reader, start=2):
            try:
                step, loss = int(float(row["step"])), float(row["loss"])
            except (TypeError, ValueError):
                raise FigureInputError(f"{path}:{line_no}: step/loss not numeric: {row}") from None
            if math.isfinite(loss):
                steps.append(step)
                losses.append(loss)
    if not steps:
        raise FigureInputError(f"{path}: no rows with a finite loss")
    return steps, losses


def smooth(values: list[float], weight: float) -> list[float]:
    """Debiased exponential moving average (TensorBoard-style); weight 0 returns the input."""
    if not 0.0 <= weight < 1.0:
        raise FigureInputError(f"smoothing weight must be in [0, 1), got {weight}")
    out, avg, norm = [], 0.0, 0.0
    for v in values:
        avg = weight * avg + (1.0 - weight) * v
        norm = weight * norm + (1.0 - weight)
        out.append(avg / norm)
    return out


def mla_colours(n: int) -> list[str]:
    """n colours from pink (most compressed) to dark purple (least compressed)."""
    if n <= len(MLA_COLOURS):
        return MLA_COLOURS[len(MLA_COLOURS) - n:] if n < len(MLA_COLOURS) else list(MLA_COLOURS)
    from matplotlib.colors import LinearSegmentedColormap, to_hex

    cmap = LinearSegmentedColormap.from_list("mla", MLA_COLOURS)
    return [to_hex(cmap(i / (n - 1))) for i in range(n)]


def run_label(run: Run, kind: str) -> str:
    label = run.label or (kind if run.is_baseline else f"{kind}2MLA d_kv = {run.d_kv}")
    if run.kv_reduction is not None and not run.is_baseline:
        change = -run.kv_reduction + 0.0          # + 0.0: no "−0.00" for an unchanged cache
        label += f" ({change:+.2f} % KV)".replace("-", "−")
    return label


def kv_reduction_of(conversion: str | Path) -> float:
    """The KV-cache saving in % that a conversion.json reports."""
    import json

    path = Path(conversion)
    if not path.is_file():
        raise FigureInputError(f"conversion file not found: {path}")
    try:
        return float(json.loads(path.read_text())["kv_reduction_percent"])
    except (ValueError, KeyError) as exc:
        raise FigureInputError(f"{path}: no kv_reduction_percent ({exc})") from None


def panel_from_dict(spec: dict, base_dir: Path | None = None) -> Panel:
    """Validate one panel spec (see module doc); relative metrics paths resolve against base_dir."""
    if not isinstance(spec, dict) or "title" not in spec:
        raise FigureInputError(f"a panel needs a 'title': {spec!r}")
    kind = str(spec.get("kind", "")).upper()
    if kind not in KINDS:
        raise FigureInputError(f"panel {spec['title']!r}: kind must be one of {KINDS}, got {spec.get('kind')!r}")
    runs = []
    for r in spec.get("runs", []):
        if "metrics" not in r:
            raise FigureInputError(f"panel {spec['title']!r}: run without 'metrics': {r!r}")
        path = Path(r["metrics"])
        if base_dir is not None and not path.is_absolute():
            path = base_dir / path
        baseline = bool(r.get("baseline")) or (r.get("d_kv") is None and not r.get("label"))
        conversion = r.get("conversion")
        if conversion is not None and base_dir is not None and not Path(conversion).is_absolute():
            conversion = base_dir / conversion
        runs.append(Run(metrics=path, d_kv=None if r.get("d_kv") is None else int(r["d_kv"]), label=r.get("label"),
                        baseline=baseline, kv_reduction=None if conversion is None else kv_reduction_of(conversion)))
    if not runs:
        raise FigureInputError(f"panel {spec['title']!r} has no runs")
    return Panel(title=str(spec["title"]), kind=kind, runs=runs)


def ordered_runs(panel: Panel) -> list[tuple[Run, str]]:
    """Runs with their colours, light -> dark, then the baseline(s) in black: MLA runs by increasing d_kv
    when each has its own, else in the given order (a sweep of strategies or SVD methods)."""
    mla = [r for r in panel.runs if not r.is_baseline]
    d_kvs = [r.d_kv for r in mla]
    if None not in d_kvs and len(set(d_kvs)) == len(d_kvs):
        mla.sort(key=lambda r: r.d_kv)
    labels = [run_label(r, panel.kind) for r in mla]
    if len(set(labels)) != len(labels):
        raise FigureInputError(f"panel {panel.title!r}: two runs share a legend label ({labels}); give labels")
    colours = mla_colours(len(mla))
    out = list(zip(mla, colours))
    out += [(r, BASELINE_COLOUR) for r in panel.runs if r.is_baseline]
    return out


def draw_panel(ax, panel: Panel, smoothing: float = 0.9) -> None:
    for run, colour in ordered_runs(panel):
        steps, losses = read_loss_curve(run.metrics)
        label = run_label(run, panel.kind)
        ax.plot(steps, losses, color=colour, alpha=RAW_ALPHA, linewidth=0.8, zorder=1,
                label=f"_raw {label}")
        ax.plot(steps, smooth(losses, smoothing), color=colour, linewidth=1.6, zorder=2, label=label)
    ax.set_title("\n".join(textwrap.wrap(panel.title, TITLE_CHARS)))   # a long title would run off the figure
    ax.set_xlabel("#Step")
    ax.set_ylabel("Loss")
    ax.grid(True, alpha=0.3)
    if len(panel.runs) > 4:   # a sweep: the legend beside the axes, not over the curves
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize="small")
    else:
        ax.legend(loc="upper right", frameon=False)


def loss_figure(panels: list[Panel], smoothing: float = 0.9):
    """A matplotlib Figure with one loss-vs-step panel per experiment, stacked top to bottom in the
    given order (the paper's Fig. 5: MHA2MLA above GQA2MLA)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    if not panels:
        raise FigureInputError("no panels to draw")
    wide = any(len(p.runs) > 4 for p in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(10.0 if wide else 6.4, 3.6 * len(panels)), squeeze=False)
    for ax, panel in zip(axes[:, 0], panels):
        draw_panel(ax, panel, smoothing)
    fig.tight_layout()
    return fig


def save_figure(fig, out: str | Path) -> list[Path]:
    """Write OUT.png and OUT.pdf (any suffix on OUT is replaced); returns the paths."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    paths = [out.with_suffix(".png"), out.with_suffix(".pdf")]
    fig.savefig(paths[0], dpi=150)
    fig.savefig(paths[1])
    return paths
