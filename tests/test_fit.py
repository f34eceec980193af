"""Layer-wise fitting (`mla fit`, mla/conversion/fit.py): fitted layers reproduce the source's attention
outputs better on held-out blocks, fit.json reports what was measured, the fitted checkpoint loads with
plain transformers, an interrupted fit resumes to the same weights, and bad input is named."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from fault_injection import InjectedFault, StopAfterLayer

from mla.checkpoint import load_model
from mla.cli import main as mla_main
from mla.conversion import fit
from mla.conversion.convert import convert_checkpoint, convert_model
from mla.tiny_models import save_tiny_checkpoint, tiny_llama, tiny_tokenizer

TRAIN_BLOCKS, HELDOUT_BLOCKS, LENGTH = 48, 16, 32


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A real `mla data` folder (Python's docs and stdlib, the tiny tokenizer): 48 train, 16 validation blocks."""
    from mla.data import build_dataset
    from mla.tiny_models import tiny_tokenizer

    root = tmp_path_factory.mktemp("fitdata")
    tiny_tokenizer().save_pretrained(root / "tok")
    build_dataset("pydoc-stdlib", root / "tok", root / "data", block_length=LENGTH,
                  train_tokens=LENGTH * TRAIN_BLOCKS, validation_tokens=LENGTH * HELDOUT_BLOCKS, workers=1,
                  log=lambda *a: None)
    return root / "data"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny random 3-layer GQA Llama and its MLA conversion (d_kv 4, r 1: a lossy one, errors near 1)."""
    root = tmp_path_factory.mktemp("fitpair")
    source = save_tiny_checkpoint(root / "src", num_kv_heads=2, num_hidden_layers=3)
    convert_checkpoint(source, root / "conv", d_kv=4, r=1, strategy="high")
    return source, root / "conv"


def _blocks(seed, n):
    return np.random.default_rng(seed).integers(1, 512, (n, LENGTH))


def _independent_error(source, converted, layer: int, blocks) -> float:
    """Layer `layer`'s relative output error, computed another way: the source's attention input and output
    caught by hooks during a full forward pass, the converted attention called with position embeddings from
    the converted model's own rotary module and no mask (SDPA's causal path)."""
    caught = {}
    attn = source.model.layers[layer].self_attn
    handles = [attn.register_forward_pre_hook(lambda m, a, kw: caught.update(x=kw["hidden_states"]), with_kwargs=True),
               attn.register_forward_hook(lambda m, a, out: caught.update(y=out[0]))]
    ids = torch.as_tensor(blocks)
    with torch.no_grad():
        source.model(input_ids=ids, use_cache=False)
        for h in handles:
            h.remove()
        positions = torch.arange(ids.shape[1])[None]
        cos_sin = converted.model.rotary_emb(caught["x"], positions)
        pred = converted.model.layers[layer].self_attn(caught["x"], position_embeddings=cos_sin)[0]
    return float(((pred - caught["y"]) ** 2).sum() / (caught["y"] ** 2).sum())


def test_fitting_lowers_every_layers_output_error_on_heldout_blocks():
    source = tiny_llama(num_kv_heads=2, num_hidden_layers=3)
    converted, _ = convert_model(source, d_kv=4, r=1, strategy="high")   # shares o_proj etc. with the source
    teacher = {k: v.clone() for k, v in source.state_dict().items()}
    train, heldout = _blocks(1, 64), _blocks(2, 16)
    before = [_independent_error(source, converted, i, heldout) for i in range(3)]
    report = fit.fit_model(source, converted, train, heldout, fit.FitSettings(steps=80, lr=1e-2, batch=8),
                           log=lambda *a: None)
    for i, entry in enumerate(report["layers"]):
        assert entry["error_before"] == pytest.approx(before[i], rel=1e-4)
        after = _independent_error(source, converted, i, heldout)
        assert entry["error_after"] == pytest.approx(after, rel=1e-4)
        assert after < 0.95 * before[i], (i, before[i], after)
    # the teacher did not move, though the in-memory conversion shared tensors with it
    assert all(torch.equal(teacher[k], v) for k, v in source.state_dict().items())


def test_a_bf16_model_is_fitted_in_fp32_and_cast_back_once():
    """The GPU path's precision on the CPU: models in bf16, the fitted layer in fp32 during its fit."""
    source = tiny_llama(num_kv_heads=2, num_hidden_layers=2).to(torch.bfloat16)
    converted, _ = convert_model(source, d_kv=4, r=1, strategy="high")
    progress = fit.FitProgress()
    report = fit.fit_model(source, converted, _blocks(1, 32), _blocks(2, 8), fit.FitSettings(steps=20, lr=3e-3),
                           progress=progress, log=lambda *a: None)
    assert (report["dtype"], report["fit_dtype"], report["device"]) == ("bfloat16", "float32", "cpu (bf16)")
    assert report["stream_bytes"] == 3 * (32 + 8) * LENGTH * 64 * 2
    for i, layer in enumerate(converted.model.layers):
        state = progress.load(i)["state"]
        assert all(t.dtype == torch.float32 for t in state.values())
        for name, p in layer.self_attn.state_dict().items():          # the model holds the fp32 fit, cast once
            assert p.dtype == torch.bfloat16 and torch.equal(p, state[name].to(torch.bfloat16)), name
        assert report["layers"][i]["error_after"] <= report["layers"][i]["error_before"]
    # random weights and data: the fit helps held out in some layers (a layer it would worsen keeps its conversion)
    assert any(e["error_after"] < e["error_before"] for e in report["layers"])
    assert all(p.dtype == torch.bfloat16 for p in converted.parameters())


def test_cli_writes_a_fitted_checkpoint_and_fit_json(pair, data_dir, tmp_path):
    source, converted = pair
    out = tmp_path / "fitted"
    assert mla_main(["fit", "--model", str(converted), "--source", str(source), "--data", str(data_dir),
                     "--out", str(out), "--steps", "15", "--lr", "3e-3", "--blocks", "40", "--batch", "8",
                     "--heldout", "12", "--device", "cpu"]) == 0
    report = json.loads((out / "fit.json").read_text())
    assert report["settings"] == {"steps": 15, "lr": 3e-3, "blocks": 40, "batch": 8, "heldout": 12, "seed": 0,
                                  "span": 1, "echo": 0, "schedule": "constant"}
    assert (report["train_blocks"], report["heldout_blocks"], report["block_length"]) == (40, 12, LENGTH)
    assert (report["device"], report["dtype"], report["fit_dtype"]) == ("cpu (fp32)", "float32", "float32")
    assert report["stream_bytes"] == 3 * (40 + 12) * LENGTH * 64 * 4
    assert [e["layer"] for e in report["layers"]] == [0, 1, 2]
    for e in report["layers"]:
        assert e["error_after"] < e["error_before"] and e["seconds"] > 0 and not e["resumed"]
    assert report["seconds_total"] >= report["seconds_layers"] > 0
    b, a, change = report["heldout_loss_before"], report["heldout_loss_after"], report["heldout_loss_change"]
    assert b["blocks"] == a["blocks"] == change["blocks"] == 12
    assert b["mean_loss_stderr"] > 0 and a["mean_loss_stderr"] > 0 and change["stderr"] > 0
    assert change["mean"] == pytest.approx(a["mean_loss"] - b["mean_loss"], abs=1e-9)
    assert not fit.work_folder(out).exists()                     # removed once the output is complete

    # every attention layer changed, every other tensor is the converted checkpoint's, bit for bit
    fitted, conv = load_model(out).state_dict(), load_model(converted).state_dict()
    assert fitted.keys() == conv.keys()
    for k in fitted:
        assert torch.equal(fitted[k], conv[k]) != (".self_attn." in k and k.endswith("weight")), k
    assert json.loads((out / "config.json").read_text())["mha2mla"]["fit"]["steps"] == 15
    assert (out / "conversion.json").is_file() and (out / "tokenizer.json").is_file()

    # plain transformers (no `mla` package) loads it, and its held-out loss is the one fit.json reports
    from mla.conversion.fit import select_blocks

    _, heldout = select_blocks(data_dir, fit.FitSettings(blocks=40, heldout=12), log=lambda *a: None)
    np.save(tmp_path / "heldout.npy", heldout)
    code = textwrap.dedent(f"""
        import sys, json, numpy as np, torch
        sys.modules["mla"] = None
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True, dtype=torch.float32)
        ids = torch.from_numpy(np.load({str(tmp_path / "heldout.npy")!r}))
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        print(json.dumps({{"cls": type(model).__name__, "loss": nll.double().mean().item()}}))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["cls"] == "MLAForCausalLM"
    assert result["loss"] == pytest.approx(a["mean_loss"], abs=1e-5)


def test_an_interrupted_fit_resumes_to_the_same_weights(pair, data_dir, tmp_path):
    source, converted = pair
    settings = fit.FitSettings(steps=6, lr=3e-3, blocks=16, batch=4, heldout=4)
    quiet = {"log": lambda *a: None}
    whole = fit.fit_checkpoint(source, converted, data_dir, tmp_path / "whole", settings, device="cpu", **quiet)

    out = tmp_path / "resumed"
    with pytest.raises(InjectedFault):
        fit.fit_checkpoint(source, converted, data_dir, out, settings, device="cpu", on_layer_done=StopAfterLayer(1),
                           **quiet)
    assert not out.exists()                                       # nothing that looks finished
    assert sorted(p.name for p in fit.work_folder(out).glob("layer-*.pt")) == ["layer-000.pt", "layer-001.pt"]
    report = fit.fit_checkpoint(source, converted, data_dir, out, settings, device="cpu", **quiet)
    assert [e["resumed"] for e in report["layers"]] == [True, True, False]
    for key in ("error_before", "error_after"):
        assert [e[key] for e in report["layers"]] == pytest.approx([e[key] for e in whole["layers"]], rel=1e-6)
    a, b = load_model(tmp_path / "whole").state_dict(), load_model(out).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert report["heldout_loss_after"]["mean_loss"] == pytest.approx(whole["heldout_loss_after"]["mean_loss"], abs=1e-6)
    assert not fit.work_folder(out).exists()

    # progress made with other settings is not reused
    with pytest.raises(InjectedFault):
        fit.fit_checkpoint(source, converted, data_dir, tmp_path / "other", settings, device="cpu",
                           on_layer_done=StopAfterLayer(0), **quiet)
    changed = fit.FitSettings(steps=7, lr=3e-3, blocks=16, batch=4, heldout=4)
    report = fit.fit_checkpoint(source, converted, data_dir, tmp_path / "other", changed, device="cpu", **quiet)
    assert [e["resumed"] for e in report["layers"]] == [False, False, False]


def test_bad_fit_inputs_stop_with_a_message_naming_the_cause(pair, data_dir, tmp_path, capsys):
    source, converted = pair
    out = tmp_path / "o"

    def error_of(*extra, model=converted, data=data_dir):
        argv = ["fit", "--model", str(model), "--source", str(source), "--data", str(data), "--out", str(out),
                "--device", "cpu", *extra]
        assert mla_main(argv) == 2
        return capsys.readouterr().err.strip()

    assert "--steps must be a positive integer, got 0" in error_of("--steps", "0")
    assert "--blocks must be a positive integer, got -1" in error_of("--blocks", "-1")
    assert "--heldout must be a positive integer, got 0" in error_of("--heldout", "0")
    assert "--lr must be positive" in error_of("--lr", "0")
    assert "--span must be a positive integer, got 0" in error_of("--span", "0")
    assert "--echo must be 0 or more tokens, got -2" in error_of("--echo", "-2")
    message = error_of("--echo", str(LENGTH), "--blocks", "4", "--heldout", "2")
    assert f"--echo {LENGTH}" in message and f"at most {LENGTH // 2}" in message
    message = error_of(data=tmp_path / "nowhere")
    assert "--data" in message and "no such folder" in message and "training blocks" in message
    assert "not a data folder made by `mla data`" in error_of(data=tmp_path)
    assert "is not an MLA checkpoint" in error_of(model=source)
    other = save_tiny_checkpoint(tmp_path / "other", num_kv_heads=2, num_hidden_layers=2)
    other_mla = tmp_path / "other-mla"
    convert_checkpoint(other, other_mla, d_kv=4, r=1, strategy="high")
    assert "was not converted from --source: num_hidden_layers 2 vs 3" in error_of(model=other_mla)
    assert not out.exists()


def test_bench_recovery_scores_each_method_after_a_layer_fit_too():
    """benchmarks/bench_recovery.py with a fit: every row gets `loss_after_fit` on the same held-out blocks, each
    fitted model is a copy (the unfitted conversion keeps the losses reported for it) and scores differently.
    (A random model's loss says little about closeness to the original: the layer errors' fall is tested above.)"""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_recovery

    torch.manual_seed(0)
    source = tiny_llama(num_kv_heads=2, num_hidden_layers=2)
    methods = [bench_recovery.Method("paper", {"strategy": "2-norm", "d_kv": 4, "r": 1, "svd": "joint"}),
               bench_recovery.Method("+ rotated", {"strategy": "rotated", "d_kv": 4, "r": 1, "svd": "joint"})]
    fit_ = bench_recovery.layer_fit(fit.FitSettings(steps=40, lr=3e-3, blocks=48, batch=8, heldout=4), _blocks(3, 4))
    retrieval = bench_recovery.passkey_scorer(tiny_tokenizer(), [160], samples=3)
    rows = bench_recovery.run(source, _blocks(1, 48), _blocks(2, 16), methods, calibration_blocks=16, blocks=16,
                              batch_size=8, fit=fit_, retrieval=retrieval, log=lambda *a: None)
    again = bench_recovery.run(source, _blocks(1, 48), _blocks(2, 16), methods, calibration_blocks=16, blocks=16,
                               batch_size=8, log=lambda *a: None)
    for row, plain in zip(rows, again):
        assert row["loss_after_conversion"] == pytest.approx(plain["loss_after_conversion"], abs=1e-6)
        assert plain["loss_after_fit"] is None and row["loss_after_fit"] is not None
        assert row["loss_after_fit"] != pytest.approx(row["loss_after_conversion"], abs=1e-7), row["method"]
        assert row["loss_se_after_fit"] > 0
        # teacher-forced pass keys of the original, the conversion and the fitted copy: three different models
        assert plain["passkey_after_conversion"] is None and row["original_passkey"]["samples"] == 3
        logprobs = [row[k]["key_logprob"] for k in ("original_passkey", "passkey_after_conversion", "passkey_after_fit")]
        assert len(set(logprobs)) == 3 and all(x < 0 for x in logprobs)
    assert "| paper |" in bench_recovery.passkey_markdown(rows)


def test_bench_recovery_splits_run_once_per_fold_and_svd():
    """The width splits of benchmarks/bench_recovery.py: each split once per RoPE fold and, with `both`, once with
    the activation-aware SVD alone and once attention-aware, all at the one cache width."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_recovery

    methods = bench_recovery.ablation(3, 32, 4, splits=(48, 32), per_head_splits=(), only_splits=True,
                                      split_latent="per_head", split_strategy="ladder", split_folds=(1, 2),
                                      attention_aware="both")
    options = [(m.options["rope_share"], m.options.get("rope_fold", 1), m.options.get("attention_aware", False))
               for m in methods]
    assert options == [(s, f, a) for s in ("2/5", "4/15") for f in (1, 2) for a in (False, True)]
    assert all(m.whiten and m.options["kv_width"] == 120 and m.options["strategy"] == "ladder" for m in methods)
    assert len({m.key() for m in methods}) == 8 and "folded by 2" in methods[2].name


def test_a_layer_the_fit_makes_worse_keeps_its_converted_weights():
    """Full rank with every RoPE pair kept, the conversion is exact: any fit (here a learning rate far too high)
    can only make a layer err more, so every layer keeps its converted weights and the model stays exact."""
    source = tiny_llama(num_kv_heads=2, num_hidden_layers=2)
    d_h = source.config.hidden_size // source.config.num_attention_heads
    converted, _ = convert_model(source, None, r=d_h // 2, strategy="high", svd="none")
    ids = torch.as_tensor(_blocks(4, 2))
    with torch.no_grad():
        reference = source(input_ids=ids).logits
    report = fit.fit_model(source, converted, _blocks(1, 16), _blocks(2, 8),
                           fit.FitSettings(steps=5, lr=1.0, batch=8), log=lambda *a: None)
    for entry in report["layers"]:
        assert entry["kept"] == "conversion" and entry["error_fitted"] > entry["error_before"]
        assert entry["error_after"] == entry["error_before"] < 1e-8
    with torch.no_grad():
        assert torch.allclose(converted(input_ids=ids).logits, reference, atol=1e-4)


def test_span_joins_consecutive_blocks_into_running_text(data_dir):
    """--span 3: the fit reads sequences of 3 consecutive train blocks (the first `blocks` of them) and held-out
    sequences of 3 consecutive validation blocks from evenly spaced starts, each the data's own token order."""
    from mla.data import open_blocks

    train, valid = open_blocks(data_dir, "train"), open_blocks(data_dir, "validation")
    seqs, held = fit.select_blocks(data_dir, fit.FitSettings(blocks=5, heldout=4, span=3), log=lambda *a: None)
    assert seqs.shape == (5, 3 * LENGTH) and held.shape == (4, 3 * LENGTH)
    for i in range(5):
        assert np.array_equal(seqs[i], np.concatenate([train[3 * i + j] for j in range(3)]))
    starts = [next(s for s in range(len(valid) - 2) if np.array_equal(h[:LENGTH], valid[s])) for h in held]
    assert starts[0] == 0 and starts[-1] == len(valid) - 3 and starts == sorted(set(starts))
    for h, s in zip(held, starts):
        assert np.array_equal(h, np.concatenate([valid[s], valid[s + 1], valid[s + 2]]))
    one, _ = fit.select_blocks(data_dir, fit.FitSettings(blocks=5, heldout=4), log=lambda *a: None)
    assert np.array_equal(one, np.asarray(train[:5]))          # span 1: the blocks as they are


def test_echo_repeats_a_span_of_the_first_half_in_the_second():
    ids = torch.as_tensor(_blocks(3, 50))
    echoed = fit.with_echoes(ids, 6, seed=0)
    assert torch.equal(ids, torch.as_tensor(_blocks(3, 50)))    # the input is left as it was
    half = LENGTH // 2
    places = set()
    for row, new in zip(ids, echoed):
        changed = (row != new).nonzero().flatten().tolist()
        assert all(half <= c < LENGTH for c in changed)          # only the second half is written
        b = next(b for b in range(half, LENGTH - 5) if any(torch.equal(new[b:b + 6], row[a:a + 6]) for a in range(half - 5))
                 and (not changed or b <= changed[0]))
        places.add(b)
    assert len(places) > 5                                       # random places, not one
    assert torch.equal(fit.with_echoes(ids, 6, seed=0), echoed)  # and the same ones for the same seed
    assert torch.equal(fit.with_echoes(ids, 0, seed=0), ids)
    with pytest.raises(ValueError, match="at least 40 tokens"):
        fit.with_echoes(ids, 20, seed=0)


def test_a_fit_with_span_and_echo_writes_its_settings(pair, data_dir, tmp_path):
    source, converted = pair
    out = tmp_path / "fitted"
    settings = fit.FitSettings(steps=4, lr=1e-3, blocks=4, batch=2, heldout=2, span=2, echo=8)
    report = fit.fit_checkpoint(source, converted, data_dir, out, settings, device="cpu", log=lambda *a: None)
    assert report["block_length"] == 2 * LENGTH and report["train_blocks"] == 4 and report["heldout_blocks"] == 2
    assert json.loads((out / "fit.json").read_text())["settings"]["echo"] == 8
    assert load_model(out).config.mha2mla["fit"]["span"] == 2


def test_a_cosine_schedule_decays_each_layers_lr_to_zero_and_constant_keeps_it():
    """The optimizer's learning rate at every step, caught as Adam sees it: cosine from lr to near 0 over each
    layer's steps (restarting per layer), constant by default; the fit's workflow key ignores the default."""
    from mla.study.experiments import fit_key

    source = tiny_llama(num_kv_heads=2, num_hidden_layers=2)
    seen = []
    original_step = torch.optim.Adam.step

    def spy(self, *args, **kwargs):
        seen.append(self.param_groups[0]["lr"])
        return original_step(self, *args, **kwargs)

    for schedule in ("cosine", "constant"):
        converted, _ = convert_model(source, d_kv=4, r=1, strategy="high")
        seen.clear()
        settings = fit.FitSettings(steps=8, lr=1e-2, batch=4, schedule=schedule)
        torch.optim.Adam.step = spy
        try:
            fit.fit_model(source, converted, _blocks(1, 16), _blocks(2, 4), settings, log=lambda *a: None)
        finally:
            torch.optim.Adam.step = original_step
        per_layer = [seen[:8], seen[8:]]
        assert len(seen) == 16
        for lrs in per_layer:
            if schedule == "constant":
                assert lrs == [1e-2] * 8
            else:
                assert lrs[0] == pytest.approx(1e-2) and lrs[4] == pytest.approx(5e-3)
                assert all(a > b for a, b in zip(lrs, lrs[1:])) and 0 < lrs[-1] < 1e-3
    base = {"steps": 8, "lr": 1e-2}
    assert fit_key({**base, "schedule": "constant"}) == fit_key(base) != fit_key({**base, "schedule": "cosine"})
    with pytest.raises(ValueError, match="fit schedule must be one of constant, cosine, got 'linear'"):
        fit.FitSettings(schedule="linear")
