"""The study module: variants with any settings, jobs keyed by what they compute (shared work once),
names and MLflow settings outside every key, bad variants named; and `svd: none` (partial RoPE only)."""

from __future__ import annotations

import copy
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import yaml

from mla.study import budgets, experiments
from mla.study.config_schema import validated

ROOT = Path(__file__).resolve().parents[1]


def default_config() -> dict:
    return validated(yaml.safe_load((ROOT / "config.yaml").read_text()))


def short_form(cfg: dict) -> dict:
    """The GQA panel by the paper's short form (d_kv 8/16/32, r 4), not the default's measured splits: the tests
    of variant mechanics start from it."""
    cfg["experiments"]["gqa2mla"].update(d_kv=[8, 16, 32], r=4, variants={})
    return cfg


def config_of(path: str) -> dict:
    return validated(yaml.safe_load((ROOT / path).read_text()))


def test_short_form_names_labels_and_paths():
    cfg = default_config()
    variants = experiments.experiment_variants(cfg, "gqa2mla")
    assert [v.name for v in variants] == ["dkv8", "dkv16", "dkv32", "baseline"]
    # the paper's cache widths (d_kv + 2r per K/V head: n_kv 3, r 4), split as measured; each legend says the
    # split its layout really caches
    from mla import shapes
    from mla.conversion import layout

    shape = shapes.read_config("smollm-135m")
    assert [(v.kv_width, v.paper) for v in variants[:3]] == [(48, 8), (72, 16), (120, 32)]
    for v in variants[:3]:
        cached = layout.resolve(shape, **v.budget())
        assert v.label == f"GQA2MLA d_kv = {v.paper}: {cached.rope_dims} RoPE + {cached.kv_lora_rank} latent"
    assert variants[-1].label == "GQA"
    v8 = variants[0]
    assert v8.whiten and v8.attention_aware and v8.latent == "per_head"   # the SVD, ladder RoPE, a layer fit
    assert v8.conversion == f"ladder-fold{v8.rope_fold}-kv48-rope16-joint-white-attn"
    assert v8.convert_dir == f"results/convert/smollm2-135m/{v8.conversion}"
    assert v8.fit_dir == f"results/fit/smollm2-135m/{v8.conversion}/{v8.fit_key}"
    assert v8.run_dir == f"results/finetune/smollm2-135m/{v8.conversion}-{v8.fit_key}/{v8.recipe}"
    assert variants[-1].run_dir.startswith("results/finetune/smollm2-135m/baseline/t")
    assert variants[-1].is_baseline and variants[-1].conversion is None


def test_named_variants_with_their_own_settings_and_overrides():
    cfg = default_config()
    exp = cfg["experiments"]["gqa2mla"]
    exp["d_kv"], exp["r"] = [8, 16, 32], 4                 # the short form, then the named variants
    exp["variants"] = {"high-split": {"d_kv": 8, "rope_strategy": "high", "svd": "split", "lr": 3e-4,
                                      "label": "S_high + SVD_split"},
                       "rope-only": {"svd": "none", "rope_strategy": "uniform", "paper": "S_uniform"}}
    exp["overrides"] = {"dkv16": {"whiten": False}, "rope-only": {"r": 2}}
    by_name = {v.name: v for v in experiments.experiment_variants(cfg, "gqa2mla")}
    assert list(by_name) == ["dkv8", "dkv16", "dkv32", "high-split", "rope-only", "baseline"]
    hs = by_name["high-split"]
    assert (hs.d_kv, hs.rope_strategy, hs.svd, hs.train["lr"], hs.label) == (8, "high", "split", 3e-4,
                                                                              "S_high + SVD_split")
    assert hs.recipe != by_name["dkv8"].recipe            # another learning rate: another training run
    assert by_name["dkv16"].conversion == "ladder-r4-joint-dkv16"
    ro = by_name["rope-only"]
    assert (ro.d_kv, ro.r, ro.conversion, ro.paper) == (None, 2, "uniform-r2-none", "S_uniform")
    assert experiments.variant_errors(cfg) == []


def test_identical_work_is_one_job_across_variants_and_experiments():
    """Two experiments on one model with one recipe: one baseline run and one original evaluation; two
    variants with the same settings under different names: one conversion and one run."""
    cfg = default_config()
    cfg["experiments"]["again"] = copy.deepcopy(cfg["experiments"]["gqa2mla"])
    same_as_16 = dict(cfg["experiments"]["gqa2mla"]["variants"]["dkv16"], label="another name")
    own8 = cfg["experiments"]["gqa2mla"]["variants"]["dkv8"]          # dkv8 spelled another way
    share = Fraction(own8["rope_share"])
    spelled = {"kv_width": 48, "rope_share": f"{2 * share.numerator}/{2 * share.denominator}",
               "rope_fold": own8["rope_fold"], "attention_aware": True}
    cfg["experiments"]["again"]["variants"] = {"dkv8": spelled, "same-as-16": same_as_16}
    s = experiments.Study(validated(cfg))
    jobs = s.jobs()
    assert jobs["variants"] == 8 + 3
    assert jobs["runs"] == 8 and jobs["conversions"] == 6 and jobs["original_evaluations"] == 2
    rows = {name: path for name, path, _ in s.evaluated("again")}
    assert rows["original"] == dict((n, p) for n, p, _ in s.evaluated("gqa2mla"))["original"]
    assert rows["same-as-16"] == dict((n, p) for n, p, _ in s.evaluated("gqa2mla"))["dkv16"]
    # the shared runs count once in the token budget too
    assert budgets.train_tokens(s.config, "smollm2-135m") == budgets.train_tokens(default_config(), "smollm2-135m")


def test_names_labels_and_mlflow_settings_are_not_part_of_any_job():
    cfg = default_config()
    before = experiments.Study(cfg)
    renamed = copy.deepcopy(cfg)
    renamed["mlflow"] = {"experiment": "elsewhere", "tracking_uri": "sqlite:////tmp/other.db"}
    exp = renamed["experiments"].pop("gqa2mla")
    exp["overrides"] = {"dkv8": {"label": "eight"}, "baseline": {"label": "the baseline"}}
    renamed["experiments"]["renamed-panel"] = exp
    after = experiments.Study(renamed)
    assert set(before.runs()) == set(after.runs()) and set(before.conversions()) == set(after.conversions())
    jobs = [p for p in before.targets() if p.startswith("results/evaluate")]
    assert jobs == [p for p in after.targets() if p.startswith("results/evaluate")]
    # a launch setting does not change the run either; a recipe setting does
    launch = copy.deepcopy(cfg)
    launch["train"]["nproc"], launch["train"]["micro_batch_size"] = 2, 2
    assert set(experiments.Study(launch).runs()) == set(before.runs())
    recipe = copy.deepcopy(cfg)
    recipe["train"]["lr"] = 2e-4
    assert not set(experiments.Study(recipe).runs()) & set(before.runs())


@pytest.mark.parametrize("change, key, message", [
    ({"variants": {"baseline": {"d_kv": 8}}}, "experiments.gqa2mla.variants.baseline", "reserved"),
    ({"variants": {"dkv8": {"d_kv": 8}}}, "experiments.gqa2mla.variants.dkv8", "already a variant"),
    ({"variants": {"x": {"svd": "joint"}}}, "experiments.gqa2mla.variants.x.d_kv", "needs a latent size"),
    ({"variants": {"x": {"svd": "none", "d_kv": 8}}}, "experiments.gqa2mla.variants.x.d_kv", "full rank"),
    ({"variants": {"x": {"svd": "none", "whiten": True}}}, "experiments.gqa2mla.variants.x.whiten", "joint or split"),
    ({"overrides": {"dkv64": {"r": 2}}}, "experiments.gqa2mla.overrides.dkv64", "no such variant"),
    ({"variants": {"x": {"d_kv": 4, "label": "GQA"}}}, "experiments.gqa2mla", "share the legend label 'GQA'"),
    ({"d_kv": [], "baseline": False}, "experiments.gqa2mla", "no variants"),
])
def test_bad_variants_are_named(change, key, message):
    cfg = short_form(default_config())
    cfg["experiments"]["gqa2mla"].update(change)
    errors = experiments.variant_errors(validated(cfg))
    assert any(k == key and message in m for k, m in errors), errors


def test_the_ablation_configs_express_the_papers_ablations():
    rope = experiments.Study(config_of("configs/ablation-rope.yaml"))
    vs = rope.experiment("ablation-rope")
    assert [v.rope_strategy for v in vs if not v.is_baseline] == ["high", "low", "uniform", "2-norm"]
    assert {(v.svd, v.r, v.d_kv) for v in vs if not v.is_baseline} == {("none", 4, None)}
    assert vs[-1].is_baseline
    svd = experiments.Study(config_of("configs/ablation-svd.yaml"))
    vs = [v for v in svd.experiment("ablation-svd") if not v.is_baseline]
    assert {(v.svd, v.whiten) for v in vs} == {("joint", False), ("split", False), ("joint", True), ("split", True)}
    assert sorted({v.d_kv for v in vs}) == [8, 16]
    from mla.study import paper_numbers

    for v in [*vs, *rope.variants]:   # every paper row a variant names exists
        assert v.paper is None or paper_numbers.paper_row("SmolLM-135M", v.paper) is not None, v


def test_the_default_mha_panel_compresses_by_the_papers_fractions_of_d_h():
    """Paper, Llama-2-7B (d_h 128): d_kv 16/32/64 = d_h/8, /4, /2; the default's SmolLM2 has d_h 64."""
    cfg = default_config()
    d_h = 64
    assert [v.d_kv / d_h for v in experiments.experiment_variants(cfg, "mha2mla") if v.d_kv] == [1 / 8, 1 / 4, 1 / 2]
    paper = config_of("configs/paper.yaml")
    assert [v.d_kv / 128 for v in experiments.experiment_variants(paper, "mha2mla") if v.d_kv] == [1 / 8, 1 / 4, 1 / 2]


# ---------------------------------------------------------------- svd: none (partial RoPE only)
def test_svd_none_keeps_keys_and_values_exact():
    """Keeping every RoPE pair, `svd: none` is the original model; with r < d_h/2 only RoPE changed, so
    the K/V factorisation is exact and a GQA model's cache is the original size (d_kv + 2r = 2 d_h)."""
    from mla.conversion.convert import convert_model
    from mla.tiny_models import tiny_llama

    torch.manual_seed(0)
    ids = torch.randint(0, 500, (2, 20))
    model = tiny_llama(num_kv_heads=2)
    d_h = model.config.hidden_size // model.config.num_attention_heads
    ref = model(ids).logits
    every_pair, report = convert_model(model, None, r=d_h // 2, strategy="high", svd="none")
    assert torch.allclose(every_pair(ids).logits, ref, atol=1e-4)
    _, report = convert_model(tiny_llama(num_kv_heads=2), None, r=2, strategy="high", svd="none")
    assert report["d_kv"] == 2 * d_h - 4 and report["reconstruction_error_mean"] < 1e-5
    assert report["kv_reduction_percent"] == 0.0


def test_convert_cli_svd_none_refuses_a_d_kv_and_whitening(tmp_path):
    from mla.tiny_models import tiny_llama

    src = tmp_path / "src"
    tiny_llama(num_kv_heads=2).save_pretrained(src)
    base = [sys.executable, "-m", "mla", "convert", "--model", str(src), "--out", str(tmp_path / "out"),
            "--rope-strategy", "high", "--r", "2", "--svd", "none"]
    r = subprocess.run([*base, "--d-kv", "8"], capture_output=True, text=True)
    assert r.returncode == 2 and "leave out --d-kv 8" in r.stderr
    r = subprocess.run([*base, "--whiten", str(tmp_path / "cov.pt")], capture_output=True, text=True)
    assert r.returncode == 2 and "needs --svd joint or split" in r.stderr
    r = subprocess.run(base[:-2] + ["--svd", "joint"], capture_output=True, text=True)
    assert r.returncode == 2 and "needs --d-kv" in r.stderr
    r = subprocess.run(base, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "d_kv=28" in r.stdout


# ---------------------------------------------------------------- fit: layer-wise fitting after conversion
def test_a_fit_gets_its_own_start_and_leaves_the_other_variants_alone():
    cfg = short_form(default_config())
    for exp in cfg["experiments"].values():
        exp.pop("fit")                                # from a default without fits
    before = {v.name: v for v in experiments.experiment_variants(cfg, "gqa2mla")}
    exp = cfg["experiments"]["gqa2mla"]
    exp["fit"] = {"steps": 10}                        # the experiment's default for its MLA variants ...
    exp["overrides"] = {"dkv8": {"fit": None}}        # ... which one variant turns off
    exp["variants"] = {"same-fit": {"d_kv": 16, "fit": {"steps": 10, "lr": 1e-3}, "label": "fitted 16"}}
    s = experiments.Study(validated(cfg))
    by_name = {v.name: v for v in s.experiment("gqa2mla")}
    for name in ("dkv8", "baseline"):                 # unfitted: the same paths and jobs as before
        v = by_name[name]
        assert v.fit is None and (v.start, v.run_dir) == (before[name].start, before[name].run_dir)
    v16 = by_name["dkv16"]
    assert v16.fit == {"steps": 10, "lr": 1e-3, "blocks": 64, "batch": 8, "heldout": 64, "span": 1, "echo": 0,
                       "schedule": "constant"}
    assert v16.conversion == before["dkv16"].conversion        # the fit starts from the same conversion
    assert v16.fit_dir == f"results/fit/smollm2-135m/{v16.conversion}/{v16.fit_key}" == v16.start_dir
    assert v16.start == f"{v16.conversion}-{v16.fit_key}" and v16.run_dir != before["dkv16"].run_dir
    assert s.start_dir("smollm2-135m", v16.start) == v16.fit_dir
    assert s.start_dir("smollm2-135m", "baseline") == "results/models/smollm2-135m"
    # the same settings, spelled out differently: one fit, one run
    assert by_name["same-fit"].start == v16.start and by_name["same-fit"].run_dir == v16.run_dir
    assert s.jobs()["fits"] == 2 and s.jobs()["conversions"] == experiments.Study(cfg).jobs()["conversions"]
    # another setting is another fit
    other = copy.deepcopy(cfg)
    other["experiments"]["gqa2mla"]["fit"] = {"steps": 20}
    v16_other = next(v for v in experiments.experiment_variants(validated(other), "gqa2mla") if v.name == "dkv16")
    assert v16_other.fit_key != v16.fit_key and v16_other.conversion == v16.conversion
    # the fit reads its 64 training blocks from the model's data, which must hold them (and the runs' tokens and
    # the calibration's blocks)
    t = s.config["train"]
    run_tokens = t["steps"] * t["batch_size"] * t.get("span", 1) * 128
    calibration_tokens = s.config["calibrate"]["samples"] * 128
    assert budgets.train_tokens(s.config, "smollm2-135m") == max(64 * 128, run_tokens, calibration_tokens)
    small = copy.deepcopy(cfg)
    small["experiments"]["gqa2mla"]["fit"] = {"blocks": 200}
    assert budgets.train_tokens(validated(small), "smollm2-135m") == 200 * 128


@pytest.mark.parametrize("change, key, message", [
    ({"overrides": {"baseline": {"fit": {"steps": 5}}}}, "experiments.gqa2mla.overrides.baseline.fit",
     "baseline is not converted"),
    ({"fit": {"steps": 0}}, "experiments.gqa2mla.fit.steps", "less than the minimum of 1"),
    ({"variants": {"x": {"d_kv": 4, "fit": {"blocks": 0}}}}, "experiments.gqa2mla.variants.x.fit.blocks",
     "less than the minimum of 1"),
    ({"fit": {"step": 10}}, "experiments.gqa2mla.fit", "'step' was unexpected"),
    ({"fit": {"heldout": 513}}, "experiments.gqa2mla.fit.heldout", "data.validation_tokens holds 512 blocks"),
    ({"overrides": {"dkv8": {"fit": {"blocks": 10000}}}}, "data.max_tokens", "fit.blocks 10000 blocks x 128"),
    ({"fit": {"span": 0}}, "experiments.gqa2mla.fit.span", "less than the minimum of 1"),
    ({"fit": {"echo": -1}}, "experiments.gqa2mla.fit.echo", "less than the minimum of 0"),
    ({"fit": {"echo": 65}}, "experiments.gqa2mla.fit.echo", "fit sequence of 128 tokens"),
    ({"fit": {"schedule": "linear"}}, "experiments.gqa2mla.fit.schedule", "'linear' is not one of ['constant', 'cosine']"),
    ({"fit": {"heldout": 129, "span": 4}}, "experiments.gqa2mla.fit.heldout", "129 held-out sequences of 4 blocks"),
    ({"overrides": {"dkv8": {"fit": {"blocks": 2500, "span": 4}}}}, "data.max_tokens",
     "fit.blocks 2500 sequences x 4 blocks x 128"),
])
def test_bad_fits_are_named_before_any_job(change, key, message):
    from mla.study.config_schema import config_problems

    cfg = yaml.safe_load((ROOT / "config.yaml").read_text())
    cfg["experiments"]["gqa2mla"].update(change)
    problems = config_problems(cfg)
    assert any(k == key and message in m for k, m in problems), problems


def test_the_config_file_the_verbs_read_keeps_the_order_and_is_written_once(tmp_path):
    """mla/study/config_file.py: the validated config, named after its content; the experiments keep their
    order (the figure's panels, top to bottom), and an existing file is never rewritten (no mtime change)."""
    import yaml

    from mla.study import config_file, reports
    from mla.study.config_schema import validated

    cfg = validated(yaml.safe_load((Path(__file__).parents[1] / "configs" / "smoke.yaml").read_text()))
    assert list(cfg["experiments"]) == ["mha2mla", "gqa2mla"]
    path = Path(config_file.write(cfg, tmp_path))
    loaded = config_file.load(path)
    assert loaded == cfg and list(loaded["experiments"]) == ["mha2mla", "gqa2mla"]
    assert [p["title"] for p in reports.figure_panels(loaded)] == [p["title"] for p in reports.figure_panels(cfg)]
    before = path.stat().st_mtime_ns
    assert config_file.write(cfg, tmp_path) == str(path) and path.stat().st_mtime_ns == before
    changed = dict(cfg, experiments=dict(reversed(list(cfg["experiments"].items()))))
    assert config_file.write(changed, tmp_path) != str(path)          # another order is another figure


def test_the_recovery_ablation_adds_one_method_per_variant_at_one_cache_width():
    """configs/ablation-recovery.yaml: every converted variant caches the 72 elements per token and layer of
    d_kv 16 + r 4 for SmolLM's 3 K/V heads, and each differs from the one before in the method it adds."""
    from mla import shapes
    from mla.conversion import layout

    study = experiments.Study(config_of("configs/ablation-recovery.yaml"))
    vs = study.experiment("ablation-recovery")
    assert vs[-1].is_baseline
    converted = vs[:-1]
    shape = shapes.read_config("smollm-135m")
    assert [layout.resolve(shape, **v.budget()).kv_width for v in converted] == [72] * 10
    steps = [(v.whiten, v.rope_strategy, v.latent, v.kv_width, v.fit is not None, bool(v.train.get("distill")))
             for v in converted]
    assert steps == [(False, "2-norm", "per_head", None, False, False), (True, "2-norm", "per_head", None, False, False),
                     (True, "rotated", "per_head", None, False, False), (True, "rotated", "shared", None, False, False),
                     (True, "rotated", "shared", 72, False, False), (True, "rotated", "shared", 72, False, False),
                     (True, "rotated", "shared", 72, False, False), (True, "rotated", "shared", 72, True, False),
                     (True, "rotated", "shared", 72, True, True), (True, "rotated", "per_head", 72, True, False)]
    assert [(v.attention_aware, v.rope_fold) for v in converted[4:7]] == [(False, 1), (True, 1), (True, 2)]
    fit, distill, per_head = converted[-3:]
    assert distill.start == fit.start                    # distillation: the same fitted start ...
    assert distill.run_dir != fit.run_dir                # ... trained another way
    assert per_head.fit == fit.fit and per_head.start != fit.start   # the same fit of another layout


def test_paper_plus_overlays_the_papers_experiments_at_the_same_cache_widths():
    """configs/paper-plus.yaml merged after configs/paper.yaml (Snakemake merges key by key): the paper's two
    experiments stay as they are, and two more convert the same models at the same cached widths with rotated
    RoPE, activation-aware SVD and a layer fit."""
    from mla import shapes
    from mla.conversion import layout

    paper = yaml.safe_load((ROOT / "configs/paper.yaml").read_text())
    overlay = yaml.safe_load((ROOT / "configs/paper-plus.yaml").read_text())
    merged = copy.deepcopy(paper)
    merged["experiments"].update(overlay["experiments"])
    assert set(overlay) == {"experiments"}
    study = experiments.Study(validated(merged))
    for name, shape in (("mha2mla", "llama-2-7b"), ("gqa2mla", "smollm-135m")):
        base = [v for v in study.experiment(name) if not v.is_baseline]
        plus = study.experiment(f"{name}-plus")
        assert [v.model for v in plus] == [v.model for v in base]
        widths = [[layout.resolve(shapes.read_config(shape), **v.budget()).kv_width for v in vs] for vs in (base, plus)]
        assert widths[0] == widths[1]
        assert all(v.rope_strategy == "rotated" and v.latent == "per_head" and v.whiten and v.fit for v in plus)
        assert [v.train for v in base] == [v.train for v in plus]     # the same recipe: only the conversion differs


def test_paper_serve_overlay_serves_llama2_in_deepseeks_own_shape():
    """configs/paper-serve.yaml after configs/paper.yaml: one Llama-2-7B variant at DeepSeek's 512 latent + 64 RoPE
    in the ladder layout, the one variant evaluate.serve exports and serves; the paper's experiments unchanged."""
    from mla import shapes
    from mla.conversion import layout

    paper = yaml.safe_load((ROOT / "configs/paper.yaml").read_text())
    overlay = yaml.safe_load((ROOT / "configs/paper-serve.yaml").read_text())
    merged = copy.deepcopy(paper)
    merged["experiments"].update(overlay["experiments"])
    merged["evaluate"].update(overlay["evaluate"])
    assert set(overlay) == {"experiments", "evaluate"}
    study = experiments.Study(validated(merged))
    served = study.served()
    assert [(v.experiment, v.model, v.rope_strategy) for v in served] == [("mha2mla-serve", "llama2-7b", "ladder")]
    resolved = layout.resolve(shapes.read_config("llama-2-7b"), **served[0].budget())
    assert (resolved.kv_lora_rank, resolved.rope_dims) == (512, 64)       # what FlashMLA takes, unpadded
    assert [v.name for v in study.experiment("mha2mla")] == [v.name for v in experiments.Study(validated(paper)).experiment("mha2mla")]
