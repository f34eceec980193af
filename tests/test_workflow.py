"""The smoke workflow end to end with the local profile: every output appears, a second run does
nothing, changing one d_kv's setting reruns only what depends on it, changing how runs are launched reruns
nothing, renaming (labels, panels, the MLflow experiment and tracking URI) reruns only the figure and
tables, and each checkpoint's two evaluation jobs (quality, inference) are planned, rerun and lost
independently of each other."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import yaml
from workflow_helpers import (
    ONE_THREAD,
    SMOKE,
    copy_run,
    failed_logs,
    job_counts,
    planned_jobs,
    smoke_config,
    smoke_study,
    snakemake,
    write_config,
)

pytestmark = pytest.mark.slow   # the smoke workflow end to end (minutes); `pytest -m "not slow"` leaves it out


@pytest.fixture(scope="module")
def smoke_run(finished_smoke):
    return finished_smoke


def test_smoke_workflow_produces_every_output(smoke_run):
    work, r = smoke_run
    cfg = smoke_config()
    the_study = smoke_study()
    counts = job_counts(r.stdout + r.stderr)
    assert counts["finetune"] == sum(len(e["d_kv"]) + 1 for e in cfg["experiments"].values())
    assert counts["convert"] == sum(len(e["d_kv"]) for e in cfg["experiments"].values())
    res = work / "results"
    for name in ("loss.png", "loss.pdf"):
        assert (res / "figures" / name).stat().st_size > 1000
    assert (res / "figures/loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for e in cfg["experiments"]:
        assert (res / f"tables/{e}.csv").is_file() and (res / f"tables/{e}.md").is_file()
        table = {row["variant"]: row for row in csv.DictReader((res / f"tables/{e}.csv").open())}
        for v in the_study.experiment(e):
            rows = list(csv.DictReader((work / v.run_dir / "metrics.csv").open()))
            # the inference measurements: their own JSON, in the table beside the quality numbers
            inf = json.loads((work / v.inference_path).read_text())
            assert inf["part"] == "inference" and inf["perplexity"] is None and inf["benchmarks"] is None
            assert list(inf["kv_quant"]["bits"]) == [str(b) for b in cfg["evaluate"]["kv_bits"]]
            assert inf["decode"]["steps"] == cfg["evaluate"]["decode_steps"]
            quantized = [b for b in cfg["evaluate"]["kv_bits"] if b != 16]
            assert f"{v.name} · {quantized[0]}-bit cache" in table
            loss = inf["kv_quant"]["bits"][str(quantized[0])]["mean_loss"]
            assert float(table[f"{v.name} · {quantized[0]}-bit cache"]["cache-decoded loss"]) == pytest.approx(loss, rel=1e-5)
            assert [int(row["step"]) for row in rows][-1] == cfg["train"]["steps"]
            assert all(float(row["loss"]) > 0 for row in rows)
            ev = json.loads((work / v.eval_path).read_text())
            assert ev["part"] == "quality" and ev["kv_quant"] is None and ev["decode"] is None
            assert list(ev["long_context"]["needle"]) == ["16"]     # pass keys with the full cache
            ppl = ev["perplexity"]
            # the evaluation scored the configured held-out blocks, and the table carries its numbers
            assert ppl["blocks"] == cfg["evaluate"]["perplexity_blocks"] and 1 < ppl["perplexity"] < 1e4
            assert ppl["perplexity_stderr"] > 0
            assert float(table[v.name]["held-out perplexity"]) == pytest.approx(ppl["perplexity"], rel=1e-5)
            assert table[v.name]["label"] == v.label
            # MMLU cloze ran inside a job with HF_HUB_OFFLINE set, on the data the prefetch rule cached
            mmlu = ev["benchmarks"]["mmlu"]
            assert mmlu["questions"] == cfg["evaluate"]["mmlu"]
            correct = mmlu["acc_norm"] * mmlu["questions"]       # an accuracy of n questions is k / n
            assert correct == pytest.approx(round(correct), abs=1e-6) and 0 <= round(correct) <= mmlu["questions"]
            assert mmlu["acc_norm_stderr"] > 0
            assert "HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1" in r.stdout + r.stderr
            assert (work / v.run_dir / "final/config.json").is_file()
            if not v.is_baseline:
                conv = json.loads((work / v.convert_dir / "conversion.json").read_text())
                assert conv["kv_elements_per_token_after"] < conv["kv_elements_per_token_before"]
                assert (conv["d_kv"], conv["rope_strategy"]) == (v.d_kv, v.rope_strategy)
                # every conversion reports its output error on held-out blocks (the calibration pass)
                assert conv["output_error_on"] == "heldout" and 0 < conv["output_error_mean"] < 10
                assert int(table[v.name]["d_kv"]) == v.d_kv
    manifest = json.loads((res / "evaluation-data/manifest.json").read_text())
    assert manifest["mmlu"]["questions"] == 14042 and manifest["paper_tasks"] == {"status": "off"}
    # every rule logged and the heavy ones benchmarked
    for rule in ("download", "data", "calibrate", "convert", "finetune", "evaluate", "evaluate_inference", "plot",
                 "table", "evaluation_data"):
        assert list((work / "logs" / rule).rglob("*.log")), rule
    for rule in ("download", "data", "calibrate", "convert", "finetune", "evaluate", "evaluate_inference"):
        assert list((work / "benchmarks" / rule).rglob("*.tsv")), rule
    # the verbs read the config the Snakefile validated, written once under its content's hash
    [written] = (res / "config").iterdir()
    assert yaml.safe_load(written.read_text())["evaluate"]["decode_steps"] == cfg["evaluate"]["decode_steps"]
    assert f"--config results/config/{written.name}" in r.stdout + r.stderr


def test_smoke_workflow_tracks_runs_in_mlflow(smoke_run):
    from mlflow.tracking import MlflowClient

    work, _ = smoke_run
    cfg = smoke_config()
    client = MlflowClient(tracking_uri=f"sqlite:///{work}/results/mlflow.db")
    exp = client.get_experiment_by_name(cfg["mlflow"]["experiment"])
    assert exp is not None
    runs = client.search_runs([exp.experiment_id], max_results=100)
    by_name = {run.info.run_name: run for run in runs}
    for v in smoke_study().variants:
        info = json.loads((work / v.run_dir / "run.json").read_text())
        run = client.get_run(info["mlflow_run_id"])
        # named after the job (model/start/recipe), tagged with the panel and label it appears under
        assert run.info.run_name == f"{v.model}/{v.start}/{v.recipe}" and run.info.run_name in by_name
        assert run.data.tags.get(f"study.{v.experiment}") == v.label
        assert run.data.tags.get("snakemake_rule") == "finetune"
        history = client.get_metric_history(run.info.run_id, "loss")
        assert sorted(m.step for m in history) == list(range(1, cfg["train"]["steps"] + 1))
        assert "eval/perplexity" in run.data.metrics  # both evaluations were logged to the same run
        assert f"eval/kv{cfg['evaluate']['kv_bits'][-1]}bit_mean_loss" in run.data.metrics
        artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "evaluation")}
        assert artifacts == {"evaluation/eval.json", "evaluation/inference.json"}


def test_report_holds_the_figure_and_the_tables(smoke_run, tmp_path):
    work, _ = smoke_run
    report = tmp_path / "report.zip"
    r = snakemake(work, "--report", str(report))
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    import zipfile

    names = zipfile.ZipFile(report).namelist()
    assert any(n.endswith("loss.png") for n in names), names
    cfg = smoke_config()
    for e in cfg["experiments"]:
        assert any(n.endswith(f"{e}.csv") for n in names), names
    assert any(n.endswith("report.html") for n in names)


def test_second_run_does_nothing_even_when_the_config_file_is_written_again(smoke_run):
    work, _ = smoke_run
    again = snakemake(work, "-n")
    assert again.returncode == 0
    assert "Nothing to be done" in again.stdout + again.stderr, (again.stdout + again.stderr)[-3000:]
    # the config file the verbs read is neither an input nor a param: a newer copy of it reruns nothing
    [written] = (work / "results/config").iterdir()
    content = written.read_text()
    shutil.rmtree(work / "results/config")
    again = snakemake(work, "-n")
    assert "Nothing to be done" in again.stdout + again.stderr, (again.stdout + again.stderr)[-3000:]
    assert written.read_text() == content


def test_a_changed_d_kv_reruns_only_its_jobs(smoke_run, tmp_path):
    work = copy_run(smoke_run[0], tmp_path / "work")
    cfg = smoke_config()
    exp_name = "gqa2mla"
    d_kv = cfg["experiments"][exp_name]["d_kv"][0]
    cfg["experiments"][exp_name]["overrides"] = {f"dkv{d_kv}": {"r": 2}}
    changed = write_config(tmp_path / "changed.yaml", cfg)
    stages = ("models", "data", "calibrate", "convert", "finetune", "evaluate", "evaluation-data")
    untouched = {p: p.stat().st_mtime_ns for stage in stages for p in (work / "results" / stage).rglob("*")
                 if p.is_file()}
    new = next(v for v in smoke_study(cfg).experiment(exp_name) if v.name == f"dkv{d_kv}")
    assert new.conversion == f"2-norm-r2-joint-dkv{d_kv}"

    plan = snakemake(work, "-n", configfile=changed)
    assert plan.returncode == 0, plan.stderr[-3000:]
    jobs = planned_jobs(plan.stdout + plan.stderr)
    run = f"model={new.model}, start={new.start}, recipe={new.recipe}"
    assert jobs == {("convert", f"model={new.model}, conversion={new.conversion}"), ("finetune", run),
                    ("evaluate", run), ("evaluate_inference", run), ("table", f"experiment={exp_name}"),
                    ("plot", ""), ("all", "")}, jobs

    rerun = snakemake(work, *ONE_THREAD, configfile=changed)
    assert rerun.returncode == 0, (rerun.stdout + rerun.stderr)[-4000:]
    counts = job_counts(rerun.stdout + rerun.stderr)
    assert counts == {"convert": 1, "finetune": 1, "evaluate": 1, "evaluate_inference": 1, "table": 1, "plot": 1,
                      "all": 1, "total": 7}
    assert all(p.stat().st_mtime_ns == mtime for p, mtime in untouched.items())  # nothing else was rewritten
    conv = json.loads((work / new.convert_dir / "conversion.json").read_text())
    assert conv["r"] == 2  # the new setting reached the conversion


def test_launch_settings_rerun_nothing_and_reach_the_next_job(smoke_run, tmp_path):
    """nproc, micro batch, ZeRO stage, offload, checkpointing and the save interval say how a run is launched, not
    what it computes: after a finished run, changing them plans no job (they are a resource read when a job
    starts, not a param); a job run again gets them on its command line. The load and accumulation dtypes of
    the smoke's fp32 runs are recorded."""
    work, _ = smoke_run
    cfg = yaml.safe_load(SMOKE.read_text())
    cfg["train"].update(nproc=2, micro_batch_size=1, zero_stage=1, offload_optimizer=True,
                        gradient_checkpointing=True, save_steps=1, gpu_tokens_per_second=1000, max_job_hours=2)
    launched = tmp_path / "launched.yaml"
    launched.write_text(yaml.safe_dump(cfg))
    assert {v.recipe for v in smoke_study(cfg).variants} == {v.recipe for v in smoke_study().variants}
    plan = snakemake(work, "-n", configfile=launched)
    assert plan.returncode == 0, (plan.stdout + plan.stderr)[-3000:]
    # no training, evaluation or anything upstream (the figure and tables may follow an earlier test's config)
    rules = {rule for rule, _ in planned_jobs(plan.stdout + plan.stderr)}
    assert rules <= {"table", "plot", "all"}, (plan.stdout + plan.stderr)[-3000:]
    v = smoke_study().variants[0]
    forced = snakemake(work, "-n", "-p", "--forcerun", "finetune", f"{v.run_dir}/run.json", configfile=launched)
    assert forced.returncode == 0, (forced.stdout + forced.stderr)[-3000:]
    lines = [ln for ln in (forced.stdout + forced.stderr).splitlines() if " mla train " in ln]
    assert lines, (forced.stdout + forced.stderr)[-3000:]
    line = lines[-1]
    for flag in ("--nproc 2", "--micro-batch 1", "--zero-stage 1", "--offload True", "--gradient-checkpointing True",
                 "--save-steps 1", f"--steps {cfg['train']['steps']}", "--global-batch 2"):
        assert flag in line, (flag, line)
    info = json.loads((work / v.run_dir / "run.json").read_text())
    assert (info["loaded_dtype"], info["grad_accum_dtype"]) == ("float32", "float32")


def test_renaming_reruns_only_the_figure_and_tables(smoke_run, tmp_path):
    """Labels, a panel's name, the MLflow experiment and the tracking URI name things; they decide no job."""
    work, _ = smoke_run
    cfg = smoke_config()
    cfg["mlflow"] = {"experiment": "renamed", "tracking_uri": f"sqlite:///{tmp_path}/elsewhere.db"}
    cfg["experiments"]["gqa2mla"]["overrides"] = {"dkv4": {"label": "four"}, "baseline": {"label": "GQA (ft)"}}
    cfg["experiments"]["gqa-panel"] = cfg["experiments"].pop("gqa2mla")
    renamed = write_config(tmp_path / "renamed.yaml", cfg)
    plan = snakemake(work, "-n", configfile=renamed)
    assert plan.returncode == 0, (plan.stdout + plan.stderr)[-3000:]
    jobs = planned_jobs(plan.stdout + plan.stderr)
    assert {rule for rule, _ in jobs} == {"table", "plot", "all"}, jobs


# ---------------------------------------------------------------- a variant with a layer-wise fit
FIT = {"steps": 3, "lr": 3.0e-3, "blocks": 4, "batch": 2, "heldout": 4}


def _fit_config(tmp_path: Path) -> tuple[Path, dict]:
    """The smoke config plus a variant that fits dkv4's conversion before fine-tuning."""
    cfg = yaml.safe_load(SMOKE.read_text())
    cfg["experiments"]["gqa2mla"]["variants"] = {"fitted": {"d_kv": 4, "fit": FIT, "label": "d_kv = 4, fitted"}}
    path = tmp_path / "fit.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, cfg


def test_a_fitted_variant_is_fitted_between_its_conversion_and_its_fine_tuning(tmp_path):
    path, cfg = _fit_config(tmp_path)
    v = next(v for v in smoke_study(cfg).variants if v.name == "fitted")
    plan = snakemake(tmp_path / "work", "-n", "-p", configfile=path)
    out = plan.stdout + plan.stderr
    assert plan.returncode == 0, out[-3000:]
    counts, smoke = job_counts(out), smoke_study()
    assert counts["fit"] == 1
    assert counts["convert"] == smoke.jobs()["conversions"]          # it reuses dkv4's conversion
    assert counts["finetune"] == smoke.jobs()["runs"] + 1
    assert ("fit", f"model={v.model}, conversion={v.conversion}, fit={v.fit_key}") in planned_jobs(out)
    finetune = next(b for b in re.split(r"\n(?=\[.*\]\n)", out) if "rule finetune:" in b and f"start={v.start}," in b)
    assert re.search(rf"input: {re.escape(v.fit_dir)}, ", finetune), finetune
    assert (f"fit --model {v.convert_dir} --source results/models/{v.model} --data results/data/{v.model} "
            f"--out {v.fit_dir} --steps 3 --lr 0.003 --blocks 4 --batch 2 --heldout 4 --span 1 --echo 0 --device cpu") in out


def test_the_fit_rule_writes_a_fitted_checkpoint(tmp_path):
    """The fit job and what it needs (download, data, calibrate, convert of one tiny model), nothing else."""
    path, cfg = _fit_config(tmp_path)
    v = next(v for v in smoke_study(cfg).variants if v.name == "fitted")
    work = tmp_path / "work"
    done = snakemake(work, v.fit_dir, *ONE_THREAD, configfile=path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:] + failed_logs(work)
    assert job_counts(done.stdout + done.stderr) == {"download": 1, "data": 1, "calibrate": 1, "convert": 1, "fit": 1,
                                                     "total": 5}
    report = json.loads((work / v.fit_dir / "fit.json").read_text())
    assert {k: report["settings"][k] for k in FIT} == FIT
    assert len(report["layers"]) == 2 and report["heldout_loss_after"]["blocks"] == FIT["heldout"]
    assert all(0 < e["error_before"] < 10 and 0 < e["error_after"] < 10 for e in report["layers"])
    assert (work / v.fit_dir / "config.json").is_file() and (work / v.fit_dir / "modeling_mla.py").is_file()
    assert list((work / "logs/fit").rglob("*.log")) and list((work / "benchmarks/fit").rglob("*.tsv"))
    again = snakemake(work, "-n", v.fit_dir, configfile=path)
    assert "Nothing to be done" in again.stdout + again.stderr


# -- the two evaluation jobs of each checkpoint ---------------------------------------------------------------

def planned_rules(work, cfg, tmp_path, name):
    plan = snakemake(work, "-n", configfile=write_config(tmp_path / f"{name}.yaml", cfg))
    assert plan.returncode == 0, (plan.stdout + plan.stderr)[-3000:]
    return job_counts(plan.stdout + plan.stderr)


@pytest.mark.parametrize("change", [{"decode_steps": 3}, {"decode_grid": ["1x8"]}, {"kv_bits": [16, 8]},
                                    {"kv_scored": 4}])
def test_an_inference_setting_plans_no_quality_job(smoke_run, tmp_path, change):
    work, _ = smoke_run
    cfg = smoke_config()
    cfg["evaluate"].update(change)
    runs = len(smoke_study().runs())
    assert planned_rules(work, cfg, tmp_path, "inference") == {
        "evaluate_inference": runs, "table": len(cfg["experiments"]), "all": 1, "total": runs + 3}


def test_a_quality_setting_plans_no_inference_job(smoke_run, tmp_path):
    work, _ = smoke_run
    cfg = smoke_config()
    cfg["evaluate"]["local_docs"] += 1
    runs = len(smoke_study().runs())
    assert planned_rules(work, cfg, tmp_path, "quality") == {
        "evaluate": runs, "table": len(cfg["experiments"]), "all": 1, "total": runs + 3}


def _failing(tmp_path, rule: str) -> dict:
    """Environment that makes every job of `rule` fail as it starts: a sitecustomize on PYTHONPATH reads the
    rule name the shell command exports (MLA_SNAKEMAKE_RULE) and exits (fault injection, kept in the tests)."""
    folder = tmp_path / f"fail-{rule}"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(
        "import os, sys\n"
        f"if os.environ.get('MLA_SNAKEMAKE_RULE') == {rule!r}:\n"
        f"    sys.exit('injected failure of rule {rule}')\n")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))}


def test_a_failed_evaluation_job_loses_nothing_of_the_other(smoke_run, tmp_path):
    """Both parts' settings change and the inference jobs fail: the quality jobs still run and stay done (the
    next run plans only the inference jobs); then the same with the quality jobs failing."""
    work = copy_run(smoke_run[0], tmp_path / "work")
    runs = list(smoke_study().runs().values())
    cfg = smoke_config()
    for failing, path_of in (("evaluate_inference", "inference_path"), ("evaluate", "eval_path")):
        cfg["evaluate"]["local_docs"] += 1          # a quality setting
        cfg["evaluate"]["decode_steps"] += 1        # an inference setting
        changed = write_config(tmp_path / f"{failing}.yaml", cfg)
        r = snakemake(work, *ONE_THREAD, "--keep-going", configfile=changed, env=_failing(tmp_path, failing))
        logs = "".join(p.read_text() for p in (work / "logs" / failing).rglob("*.log"))
        assert r.returncode != 0 and f"injected failure of rule {failing}" in logs, (r.stdout + r.stderr)[-3000:]
        for v in runs:
            assert not (work / getattr(v, path_of)).exists()      # a failed job leaves no output marked done
            assert (work / (v.eval_path if failing == "evaluate_inference" else v.inference_path)).is_file()
        if failing == "evaluate_inference":                      # the quality jobs ran with the new setting
            ev = json.loads((work / runs[0].eval_path).read_text())
            assert ev["benchmarks"]["local"]["n"] == cfg["evaluate"]["local_docs"]
        else:                                                    # and now the inference jobs did
            inf = json.loads((work / runs[0].inference_path).read_text())
            assert inf["decode"]["steps"] == cfg["evaluate"]["decode_steps"]
        plan = snakemake(work, "-n", configfile=changed)
        assert job_counts(plan.stdout + plan.stderr) == {
            failing: len(runs), "table": len(cfg["experiments"]), "all": 1, "total": len(runs) + 3}
