"""The converted model as transformers users call it, loaded as remote code in a process that has not
imported `mla`, beside the same calls on the unconverted Llama: AutoModel, continuing from a cache,
static cache and compiled `generate` (with every optional output), attention weights on absorbed decode steps,
the parallel plans,
and one-line errors for cache types the latent cannot live in (mla/modeling/, docs/model-api.md)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from mla.conversion.convert import convert_checkpoint

TOL = 1e-5

# Runs in a fresh interpreter; every part records its result or its error, so one failure does not hide the rest.
USER_SCRIPT = r'''
import json, re, sys, traceback
sys.modules["mla"] = None                      # any import of the package raises ImportError
import torch
from transformers import AutoModel, AutoModelForCausalLM, CompileConfig, DynamicCache
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer

MLA, LLAMA = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
x = torch.randint(1, 500, (2, 7), generator=torch.Generator().manual_seed(1))
mask = torch.ones_like(x)
results = {}


def part(name):
    def run(fn):
        try:
            with torch.no_grad():
                results[name] = fn()
        except Exception as e:               # recorded: the test names the part that failed
            results[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]}
    return run


def load(path, auto=AutoModelForCausalLM):
    return auto.from_pretrained(path, trust_remote_code=True, dtype=torch.float32, attn_implementation="eager").eval()


mla, llama = load(MLA), load(LLAMA)
models = {"mla": mla, "llama": llama}


def greedy(model, **kw):
    out = model.generate(x, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, **kw)
    return out


def diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a, b))


@part("auto_model")
def _():
    out = {}
    for name, path in (("mla", MLA), ("llama", LLAMA)):
        base = load(path, AutoModel)
        out[name] = {"cls": type(base).__name__,
                     "diff": (base(x).last_hidden_state - models[name].model(x).last_hidden_state).abs().max().item()}
    return out


@part("continue_from_cache")
def _():
    out = {}
    for name, path in (("mla", MLA), ("llama", LLAMA)):
        base = load(path, AutoModel)
        full = base(x).last_hidden_state[:, 4:]
        row = {}
        for kw in ("past_key_values", "cache"):
            cache = base(x[:, :4], use_cache=True).cache
            row[kw] = (base(x[:, 4:], use_cache=True, **{kw: cache}).last_hidden_state - full).abs().max().item()
        out[name] = row
    return out


@part("static_and_compiled")
def _():
    out = {}
    for name, model in models.items():
        dynamic, static = greedy(model), greedy(model, cache_implementation="static")
        compiled_calls = []
        original = model.get_compiled_call
        model.get_compiled_call = lambda cfg: compiled_calls.append(cfg) or original(cfg)
        config = CompileConfig(backend="eager", fullgraph=True, mode=None)   # fullgraph: a graph break raises
        config._compile_all_devices = True                                  # compile on the CPU too
        compiled = greedy(model, cache_implementation="static", compile_config=config)
        del model.get_compiled_call
        layer = static.cache.layers[0]
        out[name] = {"cache": type(static.cache).__name__, "buffer": list(layer.keys.shape),
                     "same_tokens": torch.equal(dynamic.sequences, static.sequences),
                     "static_diff": diff(dynamic.logits, static.logits),
                     "compiled_same_tokens": torch.equal(dynamic.sequences, compiled.sequences),
                     "compiled_diff": diff(dynamic.logits, compiled.logits), "compiled_calls": len(compiled_calls),
                     "can_compile_fullgraph": type(model)._can_compile_fullgraph}
    return out


@part("compiled_all_outputs")
def _():
    """transformers' test_generate_compilation_all_outputs, on our side: generate with automatic compilation (a
    static cache, compiled decode steps) asked for every optional output gives what the uncompiled call gives."""
    out = {}
    for name, model in models.items():
        kw = dict(output_attentions=True, output_hidden_states=True, output_scores=True, cache_implementation="static")
        plain = greedy(model, **kw)
        config = CompileConfig(backend="eager", fullgraph=True, mode=None)
        config._compile_all_devices = True
        compiled = greedy(model, compile_config=config, **kw)
        flat = lambda steps: [t for step in steps for t in step]
        out[name] = {"compiled": hasattr(model, "_compiled_call"),
                     "sequences": list(compiled.sequences.shape), "same_tokens": torch.equal(plain.sequences, compiled.sequences),
                     "scores": len(compiled.scores), "logits_diff": diff(plain.logits, compiled.logits),
                     "attention_shapes": [list(step[0].shape) for step in compiled.attentions],
                     "attentions_diff": diff(flat(plain.attentions), flat(compiled.attentions)),
                     "hidden_shapes": [list(step[-1].shape) for step in compiled.hidden_states],
                     "hidden_diff": diff(flat(plain.hidden_states), flat(compiled.hidden_states))}
    return out


@part("attentions")
def _():
    out = {}
    for name, model in models.items():
        steps = {}
        for absorb in ((True, False) if name == "mla" else (None,)):
            if absorb is not None:
                model.config.absorb_decode = absorb
            steps[absorb] = model.generate(x, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                                           output_attentions=True, return_dict_in_generate=True).attentions
        model.config.absorb_decode = True
        first = next(iter(steps.values()))
        row = {"shapes": [[list(a.shape) for a in step] for step in first]}
        if name == "mla":
            row["absorbed_vs_expanded"] = max(diff(a, b) for a, b in zip(steps[True], steps[False]))
            row["row_sums"] = [s.sum(-1).sub(1).abs().max().item() for s in steps[True][-1]]
        # assisted decoding that asks for attentions (the model assisting itself: every draft token accepted)
        single = x[:1]
        assisted = model.generate(single, attention_mask=torch.ones_like(single), max_new_tokens=5, min_new_tokens=5,
                                  do_sample=False, assistant_model=model, output_attentions=True,
                                  return_dict_in_generate=True)
        plain = model.generate(single, attention_mask=torch.ones_like(single), max_new_tokens=5, min_new_tokens=5,
                               do_sample=False)
        row["assisted_same_tokens"] = torch.equal(assisted.sequences, plain)
        row["assisted_attentions"] = sum(a.numel() for step in assisted.attentions for a in step) > 0
        out[name] = row
    return out


@part("parallel_plans")
def _():
    out = {}
    for name, model in models.items():
        modules = {n for n, _ in model.named_modules()}
        def exists(plan, prefix=""):
            return {key: any(re.fullmatch(re.escape(prefix + key).replace(r"\*", r"\d+"), m) for m in modules)
                    for key in plan}
        out[name] = {"tp_plan": dict(model.tp_plan), "config_tp_plan": model.config.base_model_tp_plan,
                     "tp_exists": exists(model.tp_plan), "pp_exists": exists(model.model.pp_plan, "model."),
                     "llama_tp_names_exist": exists(llama.config.base_model_tp_plan, "model.")}
    return out


@part("cache_errors")
def _():
    errors = {}
    def error(fn):
        try:
            fn()
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return None
    n = mla.config.num_hidden_layers
    sliding = Cache(layers=[DynamicSlidingWindowLayer(sliding_window=4) for _ in range(n)])
    errors["sliding_layers"] = error(lambda: mla(x, cache=sliding, use_cache=True))
    per_head = llama(x, use_cache=True).cache                  # a cache an MHA/GQA model filled
    errors["llama_cache"] = error(lambda: mla(x[:, :1], cache=per_head, use_cache=True))
    errors["not_a_cache"] = error(lambda: mla(x, cache=((torch.zeros(1),),), use_cache=True))
    for kind in ("offloaded", "offloaded_static", "sliding_window"):
        errors[kind] = error(lambda: greedy(mla, cache_implementation=kind))
        errors["llama_" + kind] = error(lambda: greedy(llama, cache_implementation=kind))
    try:
        from transformers import QuantizedCache
        quanto = QuantizedCache(backend="quanto", config=mla.config, nbits=4)
        errors["quanto"] = error(lambda: mla(x, cache=quanto, use_cache=True))
    except ImportError as e:                   # optimum-quanto not installed: nothing to refuse
        errors["quanto"] = f"skipped: {e}"
    return errors


print("RESULTS " + json.dumps(results))
'''


@pytest.fixture(scope="module")
def user_results(tmp_path_factory, tiny_checkpoint):
    """Convert the tiny GQA Llama (d_kv 4, r 2), then run USER_SCRIPT on both checkpoints (~1 min)."""
    out = tmp_path_factory.mktemp("model_api") / "mla"
    convert_checkpoint(tiny_checkpoint, out, d_kv=4, r=2, strategy="uniform")
    proc = subprocess.run([sys.executable, "-c", USER_SCRIPT, str(out), str(tiny_checkpoint)], capture_output=True,
                          text=True, cwd=out.parent, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULTS "))


def ok(results, name):
    value = results[name]
    assert not (isinstance(value, dict) and "error" in value), value
    return value


def test_auto_model_loads_the_base_model_as_remote_code(user_results):
    res = ok(user_results, "auto_model")
    assert res["mla"]["cls"] == "MLAModel" and res["llama"]["cls"] == "LlamaModel"
    assert res["mla"]["diff"] == 0.0 and res["llama"]["diff"] == 0.0     # the causal LM's own body, same weights


def test_base_model_continues_from_a_filled_cache_under_either_name(user_results):
    res = ok(user_results, "continue_from_cache")
    for name in ("mla", "llama"):
        for kw in ("past_key_values", "cache"):
            assert res[name][kw] <= TOL, (name, kw, res[name][kw])


def test_static_cache_and_compiled_generate_match_the_growing_cache(user_results):
    res = ok(user_results, "static_and_compiled")
    mla, llama = res["mla"], res["llama"]
    assert mla["cache"] == "MLAStaticCache" and llama["cache"] == "StaticCache"
    # preallocated in transformers' MLA layout: one head axis, 7 + 6 − 1 tokens (the last one is never fed
    # back), the latent's n_kv·d_kv = 8 channels
    assert mla["buffer"] == [2, 1, 12, 8]
    for row in (mla, llama):
        assert row["same_tokens"] and row["static_diff"] <= TOL
        # the compiled path was taken (fullgraph=True: any graph break would have raised) and agrees
        assert row["compiled_calls"] >= 1 and row["compiled_same_tokens"] and row["compiled_diff"] <= TOL
    assert mla["can_compile_fullgraph"] is True


def test_compiled_generate_gives_every_optional_output_as_the_uncompiled_one(user_results):
    res = ok(user_results, "compiled_all_outputs")
    mla, llama = res["mla"], res["llama"]
    for row in (mla, llama):
        assert row["compiled"] and row["same_tokens"] and row["sequences"] == [2, 13] and row["scores"] == 6
        assert max(row["logits_diff"], row["attentions_diff"], row["hidden_diff"]) <= TOL
    # the static cache's attentions span its whole buffer (7 + 6 − 1 = 12 slots), as Llama's do
    assert mla["attention_shapes"] == llama["attention_shapes"] == [[2, 4, 7, 12]] + [[2, 4, 1, 12]] * 5
    assert mla["hidden_shapes"] == llama["hidden_shapes"]


def test_absorbed_decode_steps_return_the_expanded_paths_attention_probabilities(user_results):
    res = ok(user_results, "attentions")
    mla, llama = res["mla"], res["llama"]
    # per generated token a tuple per layer of [B, n_h, new tokens, cached tokens], as Llama gives
    assert mla["shapes"] == llama["shapes"]
    assert [step[0] for step in mla["shapes"]] == [[2, 4, 7, 7], [2, 4, 1, 8], [2, 4, 1, 9], [2, 4, 1, 10]]
    assert mla["absorbed_vs_expanded"] <= TOL and max(mla["row_sums"]) <= TOL
    for row in (mla, llama):
        assert row["assisted_same_tokens"] and row["assisted_attentions"]


def test_parallel_plans_name_only_modules_that_exist(user_results):
    res = ok(user_results, "parallel_plans")
    mla, llama = res["mla"], res["llama"]
    # no TP plan, stated as transformers' configs state it: base_model_tp_plan None (an empty dict reads as "has a
    # plan" to transformers' own test_tp_plan_matches_params, which then finds the model's plan empty)
    assert mla["tp_plan"] == {} and mla["config_tp_plan"] is None
    assert mla["pp_exists"] and all(mla["pp_exists"].values())
    assert llama["tp_plan"] and all(llama["tp_exists"].values()) and all(llama["pp_exists"].values())
    # the check can fail: Llama's plan names k_proj/v_proj, which the converted model no longer has
    assert mla["llama_tp_names_exist"]["layers.*.self_attn.k_proj"] is False
    assert mla["llama_tp_names_exist"]["layers.*.self_attn.q_proj"] is True


def test_unsupported_cache_types_fail_with_one_line_naming_them(user_results):
    errors = ok(user_results, "cache_errors")
    expected = {
        "sliding_layers": "Cache with DynamicSlidingWindowLayer layers is not supported by this MLA model",
        "llama_cache": "holds tensors of shapes (2, 2, 7, 16)",
        "not_a_cache": "cache of type tuple is not supported by this MLA model",
        "offloaded": "an offloaded cache ('offloaded', 'offloaded_static')",
        "offloaded_static": "an offloaded cache ('offloaded', 'offloaded_static')",
        "sliding_window": "cache_implementation='sliding_window' is not supported by this MLA model",
    }
    if not torch.cuda.is_available():
        expected.update(offloaded="CUDA is not available here", offloaded_static="CUDA is not available here")
    for key, text in expected.items():
        assert errors[key] is not None and text in errors[key] and "\n" not in errors[key], (key, errors[key])
    if not errors["quanto"].startswith("skipped"):
        assert "QuantoQuantizedLayer layers is not supported by this MLA model" in errors["quanto"]
    print({k: v for k, v in errors.items() if k.startswith("llama_") or k == "quanto"})   # the same calls on Llama


def test_preallocated_latent_cache_allocates_the_models_layout_ahead_of_the_first_forward():
    """`MLAStaticCache.preallocate` (what a compiled chunked prefill needs) gives every layer its buffers
    before any forward pass, in the layout the forward then writes in place."""
    from mla.conversion.convert import convert_model
    from mla.modeling import MLAStaticCache
    from mla.tiny_models import tiny_llama

    model, _ = convert_model(tiny_llama(num_kv_heads=2), d_kv=4, r=2, strategy="uniform")
    cache = MLAStaticCache(model.config, max_cache_len=16).preallocate(2, torch.float32, torch.device("cpu"))
    buffers = [(layer.keys, layer.values) for layer in cache.layers]
    assert [tuple(k.shape) + tuple(v.shape) for k, v in buffers] == [(2, 1, 16, 8, 2, 1, 16, 8)] * 2
    x = torch.randint(1, 500, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got, expected = model(x, cache=cache).logits, model(x).logits
    assert (got - expected).abs().max().item() <= TOL
    assert all(layer.keys is k and layer.values is v for layer, (k, v) in zip(cache.layers, buffers))   # in place
    assert cache.get_seq_length() == 7 and cache.layers[0].latent.abs().sum() > 0
