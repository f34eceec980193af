"""`mla plot`: the right runs land in the right panel, with the paper's labels and colours."""

from __future__ import annotations

import json
import math

import pytest
from matplotlib.colors import to_hex

from mla.cli import main
from mla.study.figures import BASELINE_COLOUR, MLA_COLOURS, Panel, Run, loss_figure, read_loss_curve, smooth


def write_metrics(path, start, slope, steps=40):
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["step,loss,lr,grad_norm,tokens,tokens_per_second"]
    for s in range(1, steps + 1):
        loss = start * math.exp(-slope * s) + 2.0 + 0.05 * ((s * 7919) % 11 - 5) / 5
        lines.append(f"{s},{loss:.6f},1e-4,1.0,{s * 1024},1000.0")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def runs(tmp_path):
    gqa = {d: write_metrics(tmp_path / f"smol/dkv{d}/metrics.csv", 6.0, 0.05 + d / 1000) for d in (8, 16, 32)}
    gqa["baseline"] = write_metrics(tmp_path / "smol/base/metrics.csv", 1.0, 0.1)
    mha = {d: write_metrics(tmp_path / f"llama/dkv{d}/metrics.csv", 5.0, 0.04 + d / 2000) for d in (16, 32, 64)}
    mha["baseline"] = write_metrics(tmp_path / "llama/base/metrics.csv", 0.5, 0.1)
    return gqa, mha


def legend_lines(ax):
    """Smoothed curves (the ones with a legend label), in drawing order."""
    return [l for l in ax.get_lines() if not l.get_label().startswith("_")]


def test_smooth_is_debiased_ema():
    assert smooth([2.0, 2.0, 2.0], 0.9) == pytest.approx([2.0, 2.0, 2.0])
    assert smooth([0.0, 1.0], 0.5) == pytest.approx([0.0, 0.5 / 0.75])
    assert smooth([1.0, 5.0], 0.0) == [1.0, 5.0]


def test_cli_panels_runs_labels_colours(runs, tmp_path, monkeypatch):
    gqa, mha = runs
    captured = {}
    import mla.study.figures as figures

    real = figures.loss_figure

    def spy(panels, smoothing=0.9):
        captured["fig"] = real(panels, smoothing)
        return captured["fig"]

    monkeypatch.setattr(figures, "loss_figure", spy)
    out = tmp_path / "figs" / "loss"
    # runs given out of order on purpose: the panel sorts them light -> dark
    rc = main(["plot", "--out", str(out),
               "--panel", "Llama-2-7B", "--kind", "MHA",
               "--run", f"64={mha[64]}", "--run", f"baseline={mha['baseline']}",
               "--run", f"16={mha[16]}", "--run", f"32={mha[32]}",
               "--panel", "SmolLM-135M", "--kind", "GQA",
               "--run", f"8={gqa[8]}", "--run", f"16={gqa[16]}", "--run", f"32={gqa[32]}",
               "--run", f"baseline={gqa['baseline']}"])
    assert rc == 0
    assert (tmp_path / "figs/loss.png").stat().st_size > 10_000
    assert (tmp_path / "figs/loss.pdf").read_bytes()[:4] == b"%PDF"

    ax_mha, ax_gqa = captured["fig"].axes
    assert ax_mha.get_title() == "Llama-2-7B" and ax_gqa.get_title() == "SmolLM-135M"
    # stacked as the paper draws them, in the order given: the first panel on top, same width
    top, bottom = ax_mha.get_position(), ax_gqa.get_position()
    assert top.y0 > bottom.y1 and top.x0 == pytest.approx(bottom.x0)
    for ax in (ax_mha, ax_gqa):
        assert ax.get_xlabel() == "#Step" and ax.get_ylabel() == "Loss"
    assert [l.get_label() for l in legend_lines(ax_mha)] == [
        "MHA2MLA d_kv = 16", "MHA2MLA d_kv = 32", "MHA2MLA d_kv = 64", "MHA"]
    assert [l.get_label() for l in legend_lines(ax_gqa)] == [
        "GQA2MLA d_kv = 8", "GQA2MLA d_kv = 16", "GQA2MLA d_kv = 32", "GQA"]
    expected_colours = [to_hex(c) for c in MLA_COLOURS] + [BASELINE_COLOUR]
    for ax in (ax_mha, ax_gqa):
        assert [to_hex(l.get_color()) for l in legend_lines(ax)] == expected_colours
        assert [t.get_text() for t in ax.get_legend().get_texts()] == [l.get_label() for l in legend_lines(ax)]
        # each curve drawn twice: faint raw + smoothed
        raw = [l for l in ax.get_lines() if l.get_label().startswith("_raw")]
        assert len(raw) == 4 and all(l.get_alpha() < 0.5 for l in raw)

    # the data behind each curve is the right file: the raw MHA d_kv=32 curve equals its CSV
    steps, losses = read_loss_curve(mha[32])
    raw32 = next(l for l in ax_mha.get_lines() if l.get_label() == "_raw MHA2MLA d_kv = 32")
    assert list(raw32.get_xdata()) == steps and list(raw32.get_ydata()) == pytest.approx(losses)
    sm32 = next(l for l in legend_lines(ax_mha) if l.get_label() == "MHA2MLA d_kv = 32")
    assert list(sm32.get_ydata()) == pytest.approx(smooth(losses, 0.9))
    # pink is lighter than purple is lighter than dark purple
    from matplotlib.colors import to_rgb

    lum = [sum(to_rgb(c)) for c in MLA_COLOURS]
    assert lum[0] > lum[1] > lum[2]


def test_spec_file_and_single_panel(runs, tmp_path, monkeypatch):
    import mla.study.figures as figures

    gqa, _ = runs
    captured, real = {}, figures.loss_figure
    monkeypatch.setattr(figures, "loss_figure", lambda panels, smoothing=0.9: captured.setdefault(
        "fig", real(panels, smoothing)))
    spec = {"panels": [{"title": "SmolLM2-135M", "kind": "gqa",
                        "runs": [{"d_kv": 16, "metrics": str(gqa[16].relative_to(tmp_path))},
                                 {"baseline": True, "metrics": str(gqa["baseline"])}]}]}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    assert main(["plot", "--spec", str(tmp_path / "spec.json"), "--out", str(tmp_path / "one")]) == 0
    assert (tmp_path / "one.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    [ax] = captured["fig"].axes
    assert ax.get_title() == "SmolLM2-135M"
    assert [l.get_label() for l in legend_lines(ax)] == ["GQA2MLA d_kv = 16", "GQA"]
    # the relative path resolved against the spec's folder: the curve is that file's
    raw = next(l for l in ax.get_lines() if l.get_label() == "_raw GQA2MLA d_kv = 16")
    assert list(raw.get_ydata()) == pytest.approx(read_loss_curve(gqa[16])[1])


def test_more_runs_than_colours_are_graded():
    from matplotlib.colors import to_rgb

    from mla.study.figures import mla_colours

    cols = mla_colours(5)
    assert len(set(cols)) == 5
    lum = [sum(to_rgb(c)) for c in cols]
    assert lum == sorted(lum, reverse=True)


@pytest.mark.parametrize("argv, message", [
    (["--run", "8=x.csv"], "before any --panel"),
    (["--panel", "A", "--kind", "MLA", "--run", "8=x.csv"], "kind must be one of"),
    (["--panel", "A", "--kind", "GQA", "--label", "S_high"], "before any --run"),
    (["--panel", "A", "--kind", "GQA", "--run", "8=x.csv", "--conversion", "/nonexistent/conversion.json"],
     "conversion file not found"),
    (["--panel", "A", "--kind", "GQA", "--run", "8=/nonexistent/metrics.csv"], "metrics file not found"),
])
def test_bad_input_names_the_cause(tmp_path, capsys, argv, message):
    assert main(["plot", "--out", str(tmp_path / "x"), *argv]) == 2
    assert message in capsys.readouterr().err


def test_missing_loss_column(tmp_path, capsys):
    bad = tmp_path / "m.csv"
    bad.write_text("step,lr\n1,0.1\n")
    assert main(["plot", "--out", str(tmp_path / "x"), "--panel", "A", "--kind", "GQA",
                 "--run", f"8={bad}"]) == 2
    assert "missing column(s) ['loss']" in capsys.readouterr().err


def test_panel_object_api(runs):
    gqa, _ = runs
    fig = loss_figure([Panel("SmolLM-135M", "GQA", [Run(gqa["baseline"], baseline=True), Run(gqa[32], d_kv=32)])])
    labels = [l.get_label() for l in legend_lines(fig.axes[0])]
    assert labels == ["GQA2MLA d_kv = 32", "GQA"]
    assert fig.axes[0].get_title() == "SmolLM-135M"


def test_a_long_panel_title_is_wrapped_to_the_axes(runs):
    gqa, _ = runs
    title = "From the paper's conversion to one that keeps the model, SmolLM2-135M-Instruct, 72 cached elements"
    fig = loss_figure([Panel(title, "GQA", [Run(gqa["baseline"], baseline=True), Run(gqa[32], d_kv=32)])])
    lines = fig.axes[0].get_title().split("\n")
    assert len(lines) == 2 and " ".join(lines) == title
    fig.canvas.draw()
    box = fig.axes[0].title.get_window_extent()
    assert box.x0 >= 0 and box.x1 <= fig.bbox.x1          # the title stays inside the figure


def test_figure_logged_to_mlflow_summary_run(runs, tmp_path):
    from mlflow.tracking import MlflowClient

    gqa, _ = runs
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert main(["plot", "--out", str(tmp_path / "fig" / "loss"), "--panel", "SmolLM-135M", "--kind", "GQA",
                 "--run", f"8={gqa[8]}", "--run", f"baseline={gqa['baseline']}",
                 "--tracking-uri", uri, "--experiment", "study"]) == 0
    client = MlflowClient(tracking_uri=uri)
    run = client.search_runs([client.get_experiment_by_name("study").experiment_id])[0]
    assert run.info.run_name == "summary" and run.info.status == "FINISHED"
    assert sorted(a.path for a in client.list_artifacts(run.info.run_id)) == ["loss.pdf", "loss.png"]


def test_sweep_runs_keep_their_order_labels_and_kv_saving(tmp_path):
    """A sweep of strategies at one d_kv: labels from the config, colours in the given order, the KV
    saving of each conversion.json in its legend entry; two runs with one label are refused."""
    import json

    from mla.study.figures import FigureInputError, ordered_runs, panel_from_dict, run_label

    runs, conv = [], tmp_path / "conversion.json"
    conv.write_text(json.dumps({"kv_reduction_percent": 81.25}))
    unchanged = tmp_path / "full.json"
    unchanged.write_text(json.dumps({"kv_reduction_percent": 0.0}))
    assert run_label(panel_from_dict({"title": "t", "kind": "GQA", "runs": [
        {"label": "S_low", "metrics": str(write_metrics(tmp_path / "x.csv", 2.0, 0.1)),
         "conversion": str(unchanged)}]}).runs[0], "GQA") == "S_low (+0.00 % KV)"
    for i, name in enumerate(["S_low", "S_high", "S_2-norm"]):
        runs.append({"label": name, "metrics": str(write_metrics(tmp_path / f"{name}.csv", 2.0 + i, 0.1)),
                     "conversion": str(conv)})
    runs.append({"baseline": True, "metrics": str(write_metrics(tmp_path / "b.csv", 1.0, 0.1))})
    panel = panel_from_dict({"title": "ablation", "kind": "GQA", "runs": runs})
    ordered = ordered_runs(panel)
    assert [run_label(r, "GQA") for r, _ in ordered] == [
        "S_low (−81.25 % KV)", "S_high (−81.25 % KV)", "S_2-norm (−81.25 % KV)", "GQA"]
    assert len({c for _, c in ordered[:3]}) == 3 and ordered[3][1] == "#000000"
    runs[1]["label"] = "S_low"
    with pytest.raises(FigureInputError, match="share a legend label"):
        ordered_runs(panel_from_dict({"title": "ablation", "kind": "GQA", "runs": runs}))
