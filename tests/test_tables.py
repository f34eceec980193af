"""`mla table`: the experiment table holds our numbers, the paper's beside them, and the differences."""

from __future__ import annotations

import csv
import json
import re

import pytest

from mla.cli import main
from mla.study import paper_numbers
from mla.study.tables import Variant, build_table, final_loss


def test_paper_numbers_are_consistent():
    """Table 1 averages equal the mean of the six columns (±0.015, rounded cells; the paper's 7B baseline row is off)."""
    for model, entry in paper_numbers.TABLE1.items():
        for variant, row in entry["rows"].items():
            mean = sum(row[t] for t in paper_numbers.TASKS) / 6
            if (model, variant) == ("Llama-2-7B", "baseline"):
                assert mean == pytest.approx(60.11, abs=0.01)
                continue
            assert row["avg"] == pytest.approx(mean, abs=0.015), (model, variant)
            if isinstance(variant, int):
                assert row["kv_change"] == pytest.approx(
                    paper_numbers.kv_change_percent(variant, entry["d_h"]))
    assert paper_numbers.paper_model("HuggingFaceTB/SmolLM-135M") == "SmolLM-135M"
    assert paper_numbers.paper_model("meta-llama/Llama-2-7b-hf") == "Llama-2-7B"
    assert paper_numbers.paper_model("SmolLM2-135M") is None


def _eval_json(path, *, d_kv, elements, ppl, scores=None, decode=None, params=1000, ppl_se=0.25):
    """An eval JSON as `mla evaluate` writes it (the fields the table reads), with standard errors."""
    stderrs = None if scores is None else {t: 0.01 + 0.001 * i for i, t in enumerate(scores)}
    data = {"schema": "mla.evaluation/1", "d_kv": d_kv, "params": params,
            "kv_cache": {"elements_per_token": elements},
            "perplexity": {"perplexity": ppl, "perplexity_stderr": ppl_se, "mean_loss": 1.0},
            "benchmarks": {"local": {"acc": 0.5, "acc_stderr": 0.05, "acc_norm": 0.55, "acc_norm_stderr": 0.04},
                           "paper": ({"status": "ok", "scores": scores, "scores_stderr": stderrs,
                                      "average": sum(scores.values()) / len(scores),
                                      "average_stderr": 0.006} if scores
                                     else {"status": "skipped", "reason": "offline"})},
            "decode": decode}
    path.write_text(json.dumps(data))
    return path


def _metrics(path, losses):
    path.write_text("step,loss,lr,grad_norm,tokens,tokens_per_second\n" +
                    "".join(f"{i + 1},{x},1e-4,1,1,1\n" for i, x in enumerate(losses)))
    return path


@pytest.fixture
def experiment(tmp_path):
    scores = {t: 0.30 + 0.01 * i for i, t in enumerate(paper_numbers.TASKS)}
    orig = _eval_json(tmp_path / "orig.json", d_kv=None, elements=384 * 30, ppl=12.5, scores=scores)
    base = _eval_json(tmp_path / "base.json", d_kv=None, elements=384 * 30, ppl=11.0)
    decode = {"grid": [{"batch": 1, "context": 128, "speedup": 0.9, "speedup_absorbed": 1.0,
                        "predicted_speedup": 1.01},
                       {"batch": 8, "context": 4096, "speedup": 1.5, "speedup_absorbed": 2.4,
                        "predicted_speedup": 2.8},
                       {"batch": 32, "context": 4096, "status": "skipped", "reason": "needs 130 GiB",
                        "need_bytes": 130 * 2 ** 30, "free_bytes": 60 * 2 ** 30}]}
    d8 = _eval_json(tmp_path / "d8.json", d_kv=8, elements=48 * 30, ppl=15.0, scores=scores, decode=decode)
    conv = tmp_path / "conversion.json"
    conv.write_text(json.dumps({"d_kv": 8, "params_before": 1000, "params_after": 900,
                                "kv_elements_per_token_before": 11520, "kv_elements_per_token_after": 1440,
                                "kv_ratio": 0.125}))
    m_base = _metrics(tmp_path / "base.csv", [5.0] * 5 + [2.0] * 10)
    m_d8 = _metrics(tmp_path / "d8.csv", [9.0, 3.0, 2.5])
    return dict(orig=orig, base=base, d8=d8, conv=conv, m_base=m_base, m_d8=m_d8, scores=scores)


def test_final_loss_is_mean_of_last_steps(experiment):
    assert final_loss(experiment["m_base"]) == pytest.approx(2.0)
    assert final_loss(experiment["m_d8"]) == pytest.approx((9.0 + 3.0 + 2.5) / 3)


@pytest.mark.parametrize("text, message", [("", "empty, no 'loss' column"), ("step,lr\n1,0.1\n", "no 'loss' column"),
                                           ("step,loss\n1,nan\n", "no finite loss values")])
def test_a_metrics_file_without_losses_names_the_cause(tmp_path, text, message):
    from mla.study.tables import TableInputError

    metrics = tmp_path / "metrics.csv"
    metrics.write_text(text)
    with pytest.raises(TableInputError, match=message):
        final_loss(metrics)


def test_table_against_paper(experiment, tmp_path):
    e = experiment
    out = tmp_path / "tables" / "smol"
    rc = main(["table", "--out", str(out), "--model", "SmolLM2-135M", "--paper-model", "SmolLM-135M",
               "--variant", "original", "--eval", str(e["orig"]),
               "--variant", "baseline", "--eval", str(e["base"]), "--metrics", str(e["m_base"]),
               "--variant", "dkv8", "--eval", str(e["d8"]), "--conversion", str(e["conv"]),
               "--metrics", str(e["m_d8"])])
    assert rc == 0
    with (tmp_path / "tables/smol.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["variant"] for r in rows] == ["original", "baseline", "dkv8"]
    d8 = rows[2]
    assert d8["d_kv"] == "8"
    assert float(d8["KV mem. change %"]) == pytest.approx(-87.5)
    assert float(d8["KV mem. change % (paper)"]) == pytest.approx(-87.5)
    assert float(d8["Δ KV mem. change"]) == pytest.approx(0.0)
    assert d8["params"] == "900"
    assert float(d8["held-out perplexity"]) == pytest.approx(15.0)
    assert float(d8["held-out perplexity_se"]) == pytest.approx(0.25)
    assert float(d8["local task acc_norm_se"]) == pytest.approx(0.04)
    ours_avg = sum(e["scores"].values()) / 6 * 100
    assert float(d8["Avg"]) == pytest.approx(ours_avg, rel=1e-5)
    assert float(d8["Avg_se"]) == pytest.approx(0.6)                 # fractions -> points, like the value
    assert float(d8["MMLU_se"]) == pytest.approx(100 * (0.01 + 0.001 * paper_numbers.TASKS.index("mmlu")))
    assert float(d8["Avg (paper)"]) == pytest.approx(40.97)
    assert float(d8["Δ Avg"]) == pytest.approx(ours_avg - 40.97, rel=1e-5)
    assert float(d8["MMLU (paper)"]) == pytest.approx(28.37)
    assert float(d8["decode speedup"]) == pytest.approx(2.4)      # absorbed, largest measured B·T (32x4096 skipped)
    assert d8["at BxT"] == "8x4096"
    base = rows[1]
    assert float(base["final train loss"]) == pytest.approx(2.0)
    assert float(base["step-1 train loss"]) == pytest.approx(5.0)    # the first logged loss, before any update
    assert rows[0]["step-1 train loss"] == ""                        # the original model was not trained
    assert float(base["Avg (paper)"]) == pytest.approx(44.25)
    assert base["Avg"] == "" and base["Avg_se"] == ""              # skipped offline: empty, not faked
    assert float(rows[0]["Avg (paper)"]) == pytest.approx(44.50)
    md = re.sub(" +", " ", (tmp_path / "tables/smol.md").read_text())   # cells are padded to align columns
    assert "| dkv8 | 8 | -87.50% | -87.50% | +0.00% |" in md
    assert "_se" not in md                                          # SE columns fold into their values
    assert "| 15.000 ± 0.250 | 0.5500 ± 0.0400 |" in md
    assert f"| {ours_avg:.2f} ± 0.60 | 40.97 |" in md
    baseline_line = next(line for line in md.splitlines() if line.startswith("| baseline"))
    assert "| 11.000 ± 0.250 |" in baseline_line and "| – | 44.25 | – |" in baseline_line   # no "– ± –"
    assert "SmolLM-135M (our model: SmolLM2-135M)" in md


def test_kv_ratio_from_eval_jsons_and_no_paper_columns(experiment):
    e = experiment
    header, rows = build_table([Variant("original", eval=e["orig"]), Variant("dkv8", eval=e["d8"])])
    assert not any("paper" in h for h in header)
    kv = header.index("KV mem. change %")
    assert rows[1][kv] == pytest.approx(-87.5)       # 48·30 vs 384·30 elements


def test_spec_file(experiment, tmp_path):
    e = experiment
    spec = {"model": "Llama-2-7B", "variants": [
        {"name": "original", "eval": e["orig"].name}, {"name": "d16", "d_kv": 16, "eval": e["d8"].name}]}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    assert main(["table", "--spec", str(tmp_path / "spec.json"), "--out", str(tmp_path / "t")]) == 0
    with (tmp_path / "t.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert float(rows[1]["Avg (paper)"]) == pytest.approx(58.96)   # 7B d_kv=16 row, inferred from --model


@pytest.mark.parametrize("argv, message", [
    (["--eval", "x.json"], "comes before any --variant"),
    (["--variant", "d8", "--eval", "/nonexistent.json"], "file not found"),
    (["--variant", "d8"], "d_kv unknown"),
    (["--paper-model", "GPT-9", "--variant", "original"], "not in the paper's Table 1"),
    (["--variant", "d8", "--d-kv", "eight"], "is not an integer"),
])
def test_bad_input_names_the_cause(tmp_path, capsys, argv, message):
    assert main(["table", "--out", str(tmp_path / "t"), *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("text, message", [
    ("variants: [name: x\n", "not valid YAML/JSON"),       # a malformed file: one line, no traceback
    ("- a\n- b\n", "expected a mapping"),
    ("panels: []\n", "expected a mapping with a 'variants' list"),
])
def test_a_bad_spec_file_names_the_cause(tmp_path, capsys, text, message):
    spec = tmp_path / "spec.yaml"
    spec.write_text(text)
    assert main(["table", "--out", str(tmp_path / "t"), "--spec", str(spec)]) == 2
    err = capsys.readouterr().err
    assert message in err and str(spec) in err and "Traceback" not in err
