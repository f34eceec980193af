"""`mla evaluate`: KV bytes vs formula, perplexity parity at full rank, the lm-eval path, the JSON, MLflow."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
import torch

from mla.cli import main
from mla.conversion.convert import convert_model
from mla.evaluation import decode, harness
from mla.perplexity import perplexity
from mla.evaluation.report import TOP_LEVEL_FIELDS
from mla.kv import measure_bytes
from mla.evaluation.lm_eval_tasks import LOCAL_TASK, TASKS_DIR
from mla.tiny_models import tiny_llama, tiny_tokenizer

D_H = 16  # tiny_llama: hidden 64, 4 query heads


def save_model(model, tokenizer, path):
    """save_pretrained, with parameters made contiguous first (converted weights may be views)."""
    with torch.no_grad():
        for p in model.parameters():
            if not p.is_contiguous():
                p.data = p.data.contiguous()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def mla_dir(tmp_path_factory, tok):
    mla, _ = convert_model(tiny_llama(num_kv_heads=2), d_kv=4, strategy="high")
    return save_model(mla, tok, tmp_path_factory.mktemp("mla") / "dkv4")


@pytest.fixture(scope="module")
def blocks_npy(tmp_path_factory):
    path = tmp_path_factory.mktemp("blocks") / "validation.npy"
    np.save(path, np.random.default_rng(0).integers(0, 512, (3, 48)).astype(np.uint16))
    return path


# -- KV cache bytes ----------------------------------------------------------------------------------

@pytest.mark.parametrize("n_kv", [2, 4])              # GQA and MHA
@pytest.mark.parametrize("d_kv", [None, 2, 6])        # original, converted
def test_measured_cache_bytes_match_formula(n_kv, d_kv):
    model = tiny_llama(num_kv_heads=n_kv)
    layers = model.config.num_hidden_layers
    if d_kv is None:
        expected_per_token = 2 * n_kv * D_H * layers * 4                  # K and V, fp32
    else:
        model, report = convert_model(model, d_kv=d_kv, strategy="high")
        expected_per_token = n_kv * (d_kv + 2 * report["r"]) * layers * 4  # latent + RoPE'd keys
    res = measure_bytes.measure_kv_bytes(model, batch=3, prompt_len=10, new_tokens=5)
    assert res["cached_tokens"] == 10 + 5 - 1
    assert res["cache_bytes"] == 3 * 14 * expected_per_token
    assert res["bytes_per_token_measured"] == expected_per_token == res["bytes_per_token_formula"]
    assert res["matches_formula"] is True
    assert res["cache_class"] == ("DynamicCache" if d_kv is None else "MLACache")


# -- perplexity -------------------------------------------------------------------------------------------

def test_perplexity_full_rank_equals_original(blocks_npy):
    original = tiny_llama(num_kv_heads=2)
    blocks = np.load(blocks_npy)
    ref = perplexity(original, blocks)
    assert ref["tokens"] == 3 * 47 and ref["blocks"] == 3
    # all RoPE pairs kept (r = d_h/2) and the full latent rank: the conversion is exact
    full, _ = convert_model(original, d_kv=D_H, r=D_H // 2, strategy="high")
    got = perplexity(full, blocks, batch_size=2)
    assert got["mean_loss"] == pytest.approx(ref["mean_loss"], rel=1e-5)
    assert got["perplexity"] == pytest.approx(ref["perplexity"], rel=1e-5)
    assert ref["perplexity"] == pytest.approx(math.exp(ref["mean_loss"]))
    # ... while a compressed one is measurably different (the comparison can fail)
    low, _ = convert_model(original, d_kv=1, strategy="high")
    assert abs(perplexity(low, blocks)["mean_loss"] - ref["mean_loss"]) > 1e-3


def test_perplexity_standard_error_across_blocks(blocks_npy):
    """SE of the mean loss = sd of per-block mean losses / sqrt(blocks), recomputed here block by block
    with log_softmax; perplexity SE by the delta method exp(m)·SE(m)."""
    model = tiny_llama(num_kv_heads=2)
    blocks = np.load(blocks_npy)
    res = perplexity(model, blocks, batch_size=2)
    per_block = []
    with torch.no_grad():
        for row in blocks:
            ids = torch.tensor(row, dtype=torch.long)[None]
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1)
            per_block.append(-float(logp[torch.arange(ids.shape[1] - 1), ids[0, 1:]].mean()))
    per_block = np.array(per_block)
    assert res["mean_loss"] == pytest.approx(per_block.mean(), rel=1e-5)
    se = per_block.std(ddof=1) / math.sqrt(len(per_block))
    assert res["mean_loss_stderr"] == pytest.approx(se, rel=1e-4) and se > 0
    assert res["perplexity_stderr"] == pytest.approx(math.exp(per_block.mean()) * se, rel=1e-4)
    one = perplexity(model, blocks, max_blocks=1)
    assert one["mean_loss_stderr"] is None and one["perplexity_stderr"] is None   # one block: no spread to measure


def test_perplexity_rejects_foreign_tokens():
    with pytest.raises(ValueError, match="vocab size"):
        perplexity(tiny_llama(), np.full((1, 8), 9999))


# -- lm-eval on the local task -------------------------------------------------------------------------

def test_local_task_documents_are_true_next_lines():
    sys.path.insert(0, str(TASKS_DIR))
    try:
        import stdlib_next_line as task
    finally:
        sys.path.remove(str(TASKS_DIR))
    import sysconfig
    from pathlib import Path

    from mla.data import in_validation
    from mla.options import DEFAULT_VALIDATION_FRACTION

    root = Path(sysconfig.get_paths()["stdlib"])
    docs = task.load(num_docs=25)["test"]
    assert len(docs) == 25
    for doc in docs:
        assert in_validation("python-stdlib", doc["file"], DEFAULT_VALIDATION_FRACTION)  # held-out files only
        lines = [l.rstrip() for l in (root / doc["file"]).read_text(encoding="utf-8").splitlines()]
        i = doc["line"] - 1
        assert doc["choices"][doc["gold"]] == lines[i]
        assert doc["context"].endswith(lines[i - 1] + "\n")
        assert len(set(doc["choices"])) == 4
    assert list(task.load(num_docs=25)["test"]) == list(docs)             # deterministic


def _own_predictions(model, tok, docs):
    """acc / acc_norm predictions computed here, the way lm-eval scores multiple choice."""
    preds, preds_norm = [], []
    for doc in docs:
        ctx = doc["context"]
        lls = []
        for choice in doc["choices"]:
            stripped = ctx.rstrip()                     # trailing whitespace moves to the continuation
            cont = ctx[len(stripped):] + choice
            whole = tok(stripped + cont, add_special_tokens=False)["input_ids"]
            n_ctx = len(tok(stripped, add_special_tokens=False)["input_ids"])
            ids = torch.tensor([whole])
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
            target = ids[0, 1:]
            lls.append(float(logp[torch.arange(len(target)), target][n_ctx - 1:].sum()))
        lls = np.array(lls)
        preds.append(int(np.argmax(lls)))
        preds_norm.append(int(np.argmax(lls / np.array([len(c) for c in doc["choices"]], dtype=float))))
    gold = np.array([d["gold"] for d in docs])
    return np.array(preds), np.array(preds_norm), gold


@pytest.mark.slow
def test_lm_eval_local_task_on_mla_model(tok):
    """The harness runs end to end on an MLA model and returns exactly our own scoring's accuracy; a
    broken model (output head zeroed: uniform next-token distribution) gets different predictions.
    (Random tiny models are not better than chance; good > broken on real weights is the slow test.)"""
    sys.path.insert(0, str(TASKS_DIR))
    try:
        import stdlib_next_line as task
    finally:
        sys.path.remove(str(TASKS_DIR))
    docs = list(task.load(num_docs=24)["test"])
    good, _ = convert_model(tiny_llama(num_kv_heads=2, seed=1), d_kv=4, strategy="high")
    broken, _ = convert_model(tiny_llama(num_kv_heads=2, seed=1), d_kv=4, strategy="high")
    with torch.no_grad():
        good.lm_head.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(0))  # confident logits
        broken.lm_head.weight.zero_()
    results = {}
    for name, model in (("good", good), ("broken", broken)):
        res = harness.local_task(model, tok, num_docs=24, batch_size=4)
        assert res["task"] == LOCAL_TASK and res["n"] == 24
        preds, preds_norm, gold = _own_predictions(model, tok, docs)
        for key, hits in (("acc", preds == gold), ("acc_norm", preds_norm == gold)):
            assert res[key] == pytest.approx(float(np.mean(hits)))
            # SE of a mean of 0/1 outcomes: sample sd / sqrt(n)
            assert res[f"{key}_stderr"] == pytest.approx(float(np.std(hits, ddof=1) / math.sqrt(len(hits))))
        results[name] = preds_norm
    assert (results["good"] != results["broken"]).any()


def test_paper_tasks_skip_offline_with_reason(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv(harness.LOCAL_DATA_ENV, raising=False)
    res = harness.paper_tasks(model=None, tokenizer=None)
    assert res["status"] == "skipped" and "HF_HUB_OFFLINE is set" in res["reason"]
    assert "scores" not in res and "average" not in res
    assert set(res["tasks"]) == {"mmlu", "arc", "piqa", "hellaswag", "openbookqa", "winogrande"}


def test_paper_column_scores_from_lm_eval_results():
    results = {"arc_easy": {"acc,none": 0.6, "acc_norm,none": 0.5}, "arc_challenge": {"acc_norm,none": 0.3},
               "winogrande": {"acc,none": 0.55},
               "mmlu_anatomy_continuation": {"acc_norm,none": 0.4},
               "mmlu_astronomy_continuation": {"acc_norm,none": 0.1}, "mmlu_continuation": {"acc,none": 0.2}}
    n = {"mmlu_anatomy_continuation": {"effective": 30}, "mmlu_astronomy_continuation": {"effective": 10}}
    assert harness._column_score(results, n, ("arc_easy", "arc_challenge")) == pytest.approx(0.4)
    assert harness._column_score(results, n, ("winogrande",)) == pytest.approx(0.55)    # acc where no acc_norm
    assert harness._column_score(results, n, ("mmlu_continuation",)) == pytest.approx((0.4 * 30 + 0.1 * 10) / 40)
    assert harness._column_score(results, n, ("piqa",)) is None


def test_paper_column_standard_errors_combine_independent_tasks():
    results = {"arc_easy": {"acc_norm,none": 0.5, "acc_norm_stderr,none": 0.03},
               "arc_challenge": {"acc_norm,none": 0.3, "acc_norm_stderr,none": 0.04},
               "winogrande": {"acc,none": 0.55, "acc_stderr,none": 0.02},
               "mmlu_anatomy_continuation": {"acc_norm,none": 0.4, "acc_norm_stderr,none": 0.09},
               "mmlu_astronomy_continuation": {"acc_norm,none": 0.1, "acc_norm_stderr,none": 0.1}}
    n = {"mmlu_anatomy_continuation": {"effective": 30}, "mmlu_astronomy_continuation": {"effective": 10},
         "arc_easy": {"effective": 200}, "arc_challenge": {"effective": 100}}
    assert harness._column(results, n, ("arc_easy", "arc_challenge")) == pytest.approx((0.4, 0.025, 300))
    assert harness._column(results, n, ("winogrande",))[:2] == pytest.approx((0.55, 0.02))
    # MMLU = (30·0.4 + 10·0.1)/40: SE = sqrt(30²·0.09² + 10²·0.1²)/40
    value, se, count = harness._column(results, n, ("mmlu_continuation",))
    assert (value, count) == (pytest.approx(0.325), 40) and se == pytest.approx(math.sqrt(2.7 ** 2 + 1.0) / 40)
    # the check that this weighting matters: the pooled-sample formula would differ
    assert se != pytest.approx(math.sqrt((29 * 30 * 0.09 ** 2 + 9 * 10 * 0.1 ** 2) / 38 / 40))
    # simulated check of the ARC combination: SE of (a + c)/2 over many draws
    rng = np.random.default_rng(0)
    draws = (rng.binomial(200, 0.5, 20_000) / 200 + rng.binomial(100, 0.3, 20_000) / 100) / 2
    a_se, c_se = math.sqrt(0.25 / 200), math.sqrt(0.21 / 100)
    assert harness.mean_of_independent([0.5, 0.3], [a_se, c_se])[1] == pytest.approx(draws.std(), rel=0.03)
    assert harness.mean_of_independent([0.5, 0.3], [a_se, None]) == (0.4, None)


# -- the paper's six tasks from local files ($MLA_LM_EVAL_DATA) -----------------------------------------

@pytest.fixture(scope="module")
def local_task_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm-eval-data")
    env = harness.write_local_task_data(root, rows_per_task=3, seed=0)
    assert env == {harness.LOCAL_DATA_ENV: str(root)}
    return root


def test_local_task_data_layout_and_schema(local_task_data):
    root = local_task_data
    arc = [json.loads(line) for line in (root / "allenai/ai2_arc/ARC-Easy/test.jsonl").read_text().splitlines()]
    assert len(arc) == 3 and set(arc[0]) == {"id", "question", "choices", "answerKey"}
    assert arc[0]["answerKey"] in arc[0]["choices"]["label"]
    hs = json.loads((root / "Rowan/hellaswag/default/validation.jsonl").read_text().splitlines()[0])
    assert {"activity_label", "ctx_a", "ctx_b", "endings", "label"} <= set(hs) and isinstance(hs["label"], str)
    subjects = sorted(p.name for p in (root / "cais/mmlu").iterdir())
    assert len(subjects) == 57 and "abstract_algebra" in subjects
    mmlu = json.loads((root / "cais/mmlu/anatomy/test.jsonl").read_text().splitlines()[0])
    assert set(mmlu) == {"question", "subject", "choices", "answer"} and mmlu["subject"] == "anatomy"
    for path in ("baber/piqa/default/validation.jsonl", "allenai/winogrande/winogrande_xl/validation.jsonl",
                 "allenai/openbookqa/main/test.jsonl", "allenai/ai2_arc/ARC-Challenge/test.jsonl"):
        assert len((root / path).read_text().splitlines()) == 3, path


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_paper_tasks_from_local_files_offline(local_task_data, tok, monkeypatch):
    """lm-eval's own definitions of the six tasks, documents from local files, no Hub: six columns and the
    average with standard errors, each task scoring exactly the rows written."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv(harness.LOCAL_DATA_ENV, str(local_task_data))
    res = harness.paper_tasks(tiny_llama(num_kv_heads=2, seed=1), tok, batch_size=8)
    assert res["status"] == "ok" and res["missing"] == [] and str(local_task_data) in res["documents"]
    per_task = res["per_task"]
    assert len(per_task) == 6 + 57                      # ARC is two tasks, MMLU 57 subjects
    assert {t["n"] for t in per_task.values()} == {3}   # every task scored the 3 rows written, no more
    assert res["n"] == {"mmlu": 57 * 3, "arc": 6, "piqa": 3, "hellaswag": 3, "openbookqa": 3, "winogrande": 3}
    assert sum(0 < t["score"] < 1 for t in per_task.values()) >= 10   # SEs below are not all zero
    for name, t in per_task.items():                    # lm-eval's closed form for a mean of 0/1 outcomes
        assert t["stderr"] == pytest.approx(math.sqrt(t["score"] * (1 - t["score"]) / (t["n"] - 1))), name
    # the columns and their SEs, recomputed here from the per-task numbers
    mmlu = [t for k, t in per_task.items() if k.startswith("mmlu_")]
    expect = {"mmlu": (np.mean([t["score"] for t in mmlu]), math.sqrt(sum(t["stderr"] ** 2 for t in mmlu)) / 57),
              "arc": ((per_task["arc_easy"]["score"] + per_task["arc_challenge"]["score"]) / 2,
                      math.hypot(per_task["arc_easy"]["stderr"], per_task["arc_challenge"]["stderr"]) / 2)}
    for col in ("piqa", "hellaswag", "openbookqa", "winogrande"):
        expect[col] = (per_task[col]["score"], per_task[col]["stderr"])
    for col, (value, se) in expect.items():
        assert res["scores"][col] == pytest.approx(value) and res["scores_stderr"][col] == pytest.approx(se), col
    assert res["average"] == pytest.approx(np.mean([v for v, _ in expect.values()]))
    assert res["average_stderr"] == pytest.approx(math.sqrt(sum(se ** 2 for _, se in expect.values())) / 6)
    assert res["average_stderr"] > 0


def test_missing_local_task_file_stops_before_loading(local_task_data, tmp_path, tiny_checkpoint, capsys, monkeypatch):
    import shutil

    root = tmp_path / "data"
    shutil.copytree(local_task_data, root)
    (root / "allenai/openbookqa/main/test.jsonl").unlink()
    (root / "Rowan/hellaswag/default/train.jsonl").unlink()      # an unscored split may be absent
    monkeypatch.setenv(harness.LOCAL_DATA_ENV, str(root))
    assert main(["evaluate", "--model", str(tiny_checkpoint), "--out", str(tmp_path / "e.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "MLA_LM_EVAL_DATA" in err and "openbookqa/main/test.jsonl not found" in err
    assert not (tmp_path / "e.json").exists()


# -- decode speed --------------------------------------------------------------------------------------

def test_predicted_speedup_formula():
    # SmolLM-135M shape: κ 384 -> 48 per layer, 30 layers, bf16: S_max = 8
    kv_orig, kv_mla = 384 * 30 * 2, 48 * 30 * 2
    assert decode.predicted_speedup(0, 0, kv_orig, kv_mla, 1, 1) == pytest.approx(8.0)
    w = kv_orig * 12_000                                 # ~276 MB of weights
    crossover = 12_000                                   # B·T where KV reads equal weight reads
    assert decode.predicted_speedup(w, w, kv_orig, kv_mla, 4, crossover // 4) == pytest.approx(2 / (1 + 1 / 8))
    assert decode.predicted_speedup(w, w, kv_orig, kv_mla, 1, 10 ** 9) > 7.9


def test_weight_bytes_counts_tied_head_once():
    m = tiny_llama(tie_word_embeddings=True)
    n_unique = sum(p.numel() for p in m.parameters())
    assert decode.weight_bytes(m) == 4 * n_unique
    untied = tiny_llama(tie_word_embeddings=False)
    emb = untied.get_input_embeddings().weight.numel()
    assert decode.weight_bytes(untied) == 4 * (sum(p.numel() for p in untied.parameters()) - emb)


def test_meta_twin_of_an_untied_model_reads_no_input_embedding():
    """The original twin is sized on the meta device, where every data_ptr is 0: an untied head must not be
    taken for a tied one (that counted the 512 x 64 input embedding and inflated S(B,T))."""
    model, _ = convert_model(tiny_llama(num_kv_heads=2, tie_word_embeddings=False), d_kv=4, r=2, strategy="uniform")
    assert model.config.tie_word_embeddings is False
    # by hand, fp32: per layer q and o 64·64, k and v 64·32, gate/up/down 64·128, two norms of 64
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64
    w_orig = 4 * (2 * per_layer + 64 + 512 * 64)                  # 2 layers, final norm, output head = 427,264
    assert w_orig == 427_264
    twin = decode.original_twin(model, device="meta")
    assert decode.weight_bytes(twin) == w_orig == decode.weight_bytes(decode.original_twin(model, device="cpu"))
    out = decode.decode_grid(model, [], log=None)                   # sizes the twin on the meta device
    assert out["original_weight_bytes"] == w_orig
    # S(B,T) at 1 x 256 by hand: KV bytes per token 2 layers x 2·2·16 (K, V) x 4 B = 512 against the latent
    # 2 layers x 2·(4 + 2·2) x 4 B = 128; the MLA model's weights are read without its input embedding too
    assert (out["original_kv_bytes_per_token"], out["kv_bytes_per_token"]) == (512, 128)
    w_mla = 4 * (sum(p.numel() for p in model.parameters()) - 512 * 64)
    assert out["weight_bytes"] == w_mla
    assert decode.predicted_speedup(w_orig, w_mla, 512, 128, 1, 256) == pytest.approx(
        (427_264 + 256 * 512) / (w_mla + 256 * 128))


def test_decode_steps_are_timed_between_device_synchronisations(monkeypatch):
    """Each timed step waits for the device before its clock starts and after its last kernel (on a GPU,
    CUDA calls return before the work is done); on the CPU the wait is a no-op."""
    from mla import devices

    real_synchronize, events = devices.synchronize, []
    monkeypatch.setattr(devices, "synchronize", lambda device: events.append(("sync", str(device))))
    real_counter = decode.time.perf_counter
    monkeypatch.setattr(decode.time, "perf_counter", lambda: events.append(("clock",)) or real_counter())
    stepper = decode._Stepper(tiny_llama(), batch=2, context=8)
    stepper.run(3)
    assert events == [("sync", "cpu"), ("clock",), ("sync", "cpu"), ("clock",)] * 3
    assert len(stepper.step_seconds) == 3
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    real_synchronize(torch.device("cuda:0"))
    real_synchronize(torch.device("cpu"))
    assert calls == [torch.device("cuda:0")]


def test_decode_steps_on_cuda_are_timed_by_events_after_one_synchronisation(monkeypatch):
    """On a GPU a run of n steps is bracketed by two CUDA events after ONE synchronisation (not one per
    step, which would measure launch overhead); a step's time is the run's elapsed time / n. The device,
    events and synchronisation are stand-ins here (no GPU): what is checked is the order of the calls."""
    from mla import devices

    events = []

    class FakeEvent:
        def __init__(self, enable_timing=False):
            assert enable_timing

        def record(self):
            events.append(("record",))

        def synchronize(self):
            events.append(("end waits",))

        def elapsed_time(self, end):
            return 30.0                                           # milliseconds

    monkeypatch.setattr(devices, "synchronize", lambda device: events.append(("sync", str(device))))
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    model = tiny_llama()
    stepper = decode._Stepper(model, batch=2, context=8)
    stepper.device = torch.device("cuda")
    model.register_forward_hook(lambda *a: events.append(("step",)))
    stepper.run(3)
    assert events == [("sync", "cuda"), ("record",), ("step",), ("step",), ("step",), ("record",), ("end waits",)]
    assert stepper.step_seconds == [pytest.approx(0.030 / 3)]
    assert stepper.tokens_per_second() == pytest.approx(2 / 0.010)


@pytest.mark.parametrize("kind", ["original", "mla"])
def test_preallocated_decode_cache_gives_the_growing_caches_logits(kind):
    """The decode benchmark's preallocated caches (StaticCache, MLAStaticCache) hold the same random
    entries as the growing ones and give the same steps."""
    from transformers import StaticCache

    from mla.modeling import MLAStaticCache

    model = tiny_llama()
    if kind == "mla":
        model, _ = convert_model(model, d_kv=4, r=2, strategy="uniform")
    ids = torch.tensor([[5], [7]])
    with torch.inference_mode():                                      # as the benchmark steps run
        grown, static = decode.filled_cache(model, 2, 9), decode.filled_cache(model, 2, 9, capacity=12)
        assert isinstance(static, MLAStaticCache if kind == "mla" else StaticCache)
        assert static.layers[0].keys.shape[-2] == 12 and static.get_seq_length() == 9
        for _ in range(2):
            a, b = (model(input_ids=ids, cache=c, use_cache=True).logits for c in (grown, static))
            assert (a - b).abs().max().item() <= 1e-5
            ids = a[:, -1:].argmax(-1)


def test_decode_grid_reports_the_batch_one_floor_beside_the_prediction():
    model, _ = convert_model(tiny_llama(), d_kv=4, r=2, strategy="uniform")
    res = decode.decode_grid(model, [(2, 8)], steps=2, warmup=1, log=None)
    floor, point = res["floor"], res["grid"][0]
    assert (floor["batch"], floor["context"]) == (1, 1) and "preallocated" in res["cache"]
    names = ("mla_tps", "mla_absorbed_tps", "original_tps")
    assert set(point["floor_share"]) == set(names)
    for name in names:
        step = floor[name.replace("_tps", "_step_s")]
        assert step > 0 and point["floor_share"][name] == pytest.approx(step * point[name] / 2)
    assert floor["predicted_speedup"] == pytest.approx(decode.predicted_speedup(
        res["original_weight_bytes"], res["weight_bytes"], res["original_kv_bytes_per_token"],
        res["kv_bytes_per_token"], 1, 1))
    print("batch-1 floor (s/step, under load):", {k: v for k, v in floor.items() if k.endswith("_step_s")})


def test_decode_grid_skips_points_that_cannot_fit(mla_dir):
    """A point whose caches exceed the free memory is skipped before anything is allocated, with the
    numbers; the others are measured."""
    from mla.checkpoint import load_model

    model = load_model(mla_dir).eval()
    huge = (4096, 10 ** 7)                               # ~10^10 cached tokens per variant: petabytes
    res = decode.decode_grid(model, [(1, 16), huge], steps=2, warmup=1, log=None)
    ok, skipped = res["grid"]
    assert ok["status"] == "ok" and ok["mla_absorbed_tps"] > 0 and ok["need_bytes"] < ok["free_bytes"]
    assert skipped["status"] == "skipped" and (skipped["batch"], skipped["context"]) == huge
    assert skipped["to_allocate_bytes"] > skipped["free_bytes"] and "GiB" in skipped["reason"]
    assert "mla_tps" not in skipped and "speedup" not in skipped
    tokens = huge[1] + 2 + 1 + 1                          # context + steps + warmup + the first step
    per_token = 2 * res["kv_bytes_per_token"] + res["original_kv_bytes_per_token"]   # two MLA caches + original
    assert skipped["caches_bytes"] == huge[0] * tokens * per_token
    assert skipped["need_bytes"] == (skipped["weights_bytes"] + skipped["original_weights_bytes"]
                                     + skipped["caches_bytes"] + skipped["margin_bytes"])
    assert skipped["original_weights_bytes"] == decode.resident_bytes(decode.original_twin(model, device="meta"))


def test_paper_decode_point_32x4096_needs_128gib_for_the_fp32_original():
    """Llama-2-7B's original at 32 x 4096 in fp32 caches 32·4096·(2·32·128·32)·4 B = 128 GiB; against a
    64 GB job it is skipped, never allocated (the model here lives on the meta device: no memory)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from mla.shapes import read_config

    cfg = LlamaConfig(**{k: v for k, v in read_config("llama-2-7b").items() if k != "architectures"})
    with torch.device("meta"):
        llama = LlamaForCausalLM._from_config(cfg, dtype=torch.float32)
    res = decode.decode_grid(llama, [(32, 4096)], steps=32, free_memory=lambda: 64 * 10 ** 9, log=None)
    point = res["grid"][0]
    assert point["status"] == "skipped"
    assert 32 * 4096 * res["kv_bytes_per_token"] == 128 * 2 ** 30
    assert point["caches_bytes"] == 32 * (4096 + 32 + 2 + 1) * 2 * 32 * 128 * 32 * 4
    assert point["weights_bytes"] == pytest.approx(6.74e9 * 4, rel=0.01)
    # the margin: one layer's cache copied by the update (1/32 of the caches) and a little more
    assert point["caches_bytes"] / 32 < point["margin_bytes"] < point["caches_bytes"] / 32 + 2 ** 30
    assert 155 < point["need_bytes"] / 2 ** 30 < 160       # 25 GiB of weights + 129 GiB of cache + margin
    assert point["reason"].startswith(f"needs {point['need_bytes'] / 2 ** 30:.2f} GiB")
    assert point["reason"].endswith("but 59.60 GiB is free on meta")


@pytest.mark.parametrize("text, message", [("8x", "BATCHxCONTEXT"), ("0x16", "BATCHxCONTEXT"), ("a", "BATCHxCONTEXT")])
def test_parse_grid_errors(text, message):
    with pytest.raises(ValueError, match=message):
        decode.parse_grid(text)
    assert decode.parse_grid(" 1x2,8X4096") == [(1, 2), (8, 4096)]


# -- the command, the JSON, MLflow, the table ----------------------------------------------------------

def test_evaluate_cli_json_has_every_field(mla_dir, blocks_npy, tmp_path, monkeypatch, tiny_checkpoint):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = tmp_path / "eval" / "dkv4.json"
    rc = main(["evaluate", "--model", str(mla_dir), "--out", str(out), "--variant", "dkv4",
               "--blocks", str(blocks_npy), "--local-docs", "16", "--decode-grid", "1x32,2x48",
               "--decode-steps", "2", "--tracking-uri", uri, "--experiment", "exp", "--run-name", "dkv4",
               "--kv-bits", "16,4", "--kv-group-size", "2", "--kv-residual", "4", "--kv-scored", "4",
               "--needle", "160", "--needle-samples", "1"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert set(TOP_LEVEL_FIELDS) <= set(res)
    assert all(res[k] is not None for k in TOP_LEVEL_FIELDS), [k for k in TOP_LEVEL_FIELDS if res[k] is None]
    assert res["is_mla"] and res["model_type"] == "mla_llama" and res["d_kv"] == 4 and res["variant"] == "dkv4"
    kv = res["kv_cache"]
    assert kv["matches_formula"] and kv["bytes_per_token_measured"] == 2 * (4 + 2 * res["r"]) * 2 * 4
    assert (res["device"], res["dtype"]) == ("cpu", "float32")
    ppl = res["perplexity"]
    assert ppl["blocks"] == 3 and ppl["tokens"] == 3 * 47 and ppl["perplexity"] == pytest.approx(
        math.exp(ppl["mean_loss"]))
    assert ppl["mean_loss_stderr"] > 0
    assert ppl["perplexity_stderr"] == pytest.approx(ppl["perplexity"] * ppl["mean_loss_stderr"])
    local = res["benchmarks"]["local"]
    assert local["task"] == LOCAL_TASK and local["n"] == 16
    p_hat = local["acc_norm"]                         # a fraction of 16 questions, with its SE
    assert p_hat * 16 == pytest.approx(round(p_hat * 16))
    assert local["acc_norm_stderr"] == pytest.approx(math.sqrt(p_hat * (1 - p_hat) / 15))
    paper = res["benchmarks"]["paper"]
    assert paper["status"] == "skipped" and "Hub" in paper["reason"]
    dec = res["decode"]
    assert [(p["batch"], p["context"]) for p in dec["grid"]] == [(1, 32), (2, 48)]
    assert dec["device"] == "cpu" and "synchronisation" in dec["timing"]
    for p in dec["grid"]:
        assert p["status"] == "ok"
        assert p["speedup"] == pytest.approx(p["mla_tps"] / p["original_tps"])
        assert p["speedup_absorbed"] == pytest.approx(p["mla_absorbed_tps"] / p["original_tps"])
        assert p["predicted_speedup"] == pytest.approx(decode.predicted_speedup(
            dec["original_weight_bytes"], dec["weight_bytes"], dec["original_kv_bytes_per_token"],
            dec["kv_bytes_per_token"], p["batch"], p["context"]))
    assert dec["original_kv_bytes_per_token"] == 2 * 2 * D_H * 2 * 4
    # the speeds are tokens per second of real steps: the timed steps they imply fit in the stage's wall time
    timed = sum(dec["steps"] * p["batch"] / p[k] for p in dec["grid"] for k in ("mla_tps", "mla_absorbed_tps",
                                                                                  "original_tps"))
    assert timed <= res["seconds"]["decode"]

    # logged to the variant's MLflow run
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    run = client.search_runs([client.get_experiment_by_name("exp").experiment_id])[0]
    assert run.info.run_name == "dkv4"
    assert run.data.metrics["eval/perplexity"] == pytest.approx(ppl["perplexity"])
    assert run.data.metrics["eval/perplexity_stderr"] == pytest.approx(ppl["perplexity_stderr"])
    assert run.data.metrics[f"eval/{LOCAL_TASK}_acc_norm_stderr"] == pytest.approx(local["acc_norm_stderr"])
    assert run.data.metrics[f"eval/{LOCAL_TASK}_acc_norm"] == pytest.approx(local["acc_norm"])
    assert "decode/speedup_absorbed_B2_T48" in run.data.metrics
    assert [a.path for a in client.list_artifacts(run.info.run_id, "evaluation")] == ["evaluation/dkv4.json"]

    # the original checkpoint: same command, no MLA fields, and the table reads both JSONs
    out0 = tmp_path / "eval" / "original.json"
    assert main(["evaluate", "--model", str(tiny_checkpoint), "--out", str(out0), "--variant", "original",
                 "--no-local-task", "--decode-grid", "none", "--paper-tasks", "off"]) == 0
    res0 = json.loads(out0.read_text())
    assert not res0["is_mla"] and res0["d_kv"] is None and res0["decode"] is None
    assert res0["kv_cache"]["bytes_per_token_measured"] == 2 * 2 * D_H * 2 * 4

    from mla.study.tables import Variant, build_table

    header, rows = build_table([Variant("original", eval=out0), Variant("dkv4", eval=out)])
    kv_col = header.index("KV mem. change %")
    assert rows[1][kv_col] == pytest.approx(((4 + 2 * res["r"]) / (2 * D_H) - 1) * 100)
    assert rows[1][header.index("decode speedup")] == pytest.approx(dec["grid"][-1]["speedup_absorbed"])
    assert rows[1][header.index("held-out perplexity_se")] == pytest.approx(ppl["perplexity_stderr"])


def test_bf16_path_of_gpu_jobs_runs_on_cpu(mla_dir, blocks_npy, tok, monkeypatch):
    """What a GPU job runs differs from the CPU default in dtype (bf16) and device; the dtype part runs
    here: bytes per token halve, the original twin follows the model's dtype, numbers stay finite."""
    from mla.checkpoint import load_model
    from mla.evaluation.report import EvalOptions, evaluate_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = load_model(mla_dir, dtype=torch.bfloat16).eval()
    opts = EvalOptions(blocks=str(blocks_npy), local_docs=8, paper_tasks="off", decode_grid=[(1, 16)],
                       decode_steps=2, kv_new_tokens=4)
    res = evaluate_model(model, tok, opts, log=lambda *_: None)
    assert (res["device"], res["dtype"]) == ("cpu", "bfloat16")
    assert res["kv_cache"]["bytes_per_token_measured"] == res["kv_cache"]["elements_per_token"] * 2
    assert math.isfinite(res["perplexity"]["mean_loss"]) and res["perplexity"]["mean_loss_stderr"] > 0
    local = res["benchmarks"]["local"]
    assert local["n"] == 8 and local["acc_norm_stderr"] == pytest.approx(
        math.sqrt(local["acc_norm"] * (1 - local["acc_norm"]) / 7))
    dec = res["decode"]
    assert dec["dtype"] == "bfloat16" and dec["original_kv_bytes_per_token"] == 2 * 2 * D_H * 2 * 2
    point = dec["grid"][0]
    assert point["status"] == "ok" and dec["steps"] * point["batch"] / point["mla_absorbed_tps"] <= res["seconds"]["decode"]


@pytest.mark.parametrize("argv, message", [
    (["--model", "/nonexistent"], "missing checkpoint"),
    (["--decode-grid", "8by4096"], "BATCHxCONTEXT"),
    (["--experiment", "e"], "--experiment and --run-name go together"),
    (["--blocks", "/nonexistent.npy"], "--blocks not found"),
])
def test_evaluate_bad_input(tmp_path, capsys, tiny_checkpoint, argv, message):
    base = ["evaluate", "--out", str(tmp_path / "e.json")]
    if "--model" not in argv:
        base += ["--model", str(tiny_checkpoint)]
    assert main(base + argv) == 2
    assert message in capsys.readouterr().err


# -- SmolLM2-135M (real weights; cached once per machine) ---------------------------------------------

@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    from mla.checkpoint import load_model, load_tokenizer

    return load_model(smollm2_dir), load_tokenizer(smollm2_dir)


@pytest.mark.slow
def test_smollm2_cache_bytes_match_formula(smollm2):
    model, _ = smollm2
    c = model.config
    assert (c.num_hidden_layers, c.num_key_value_heads, c.head_dim) == (30, 3, 64)
    res = measure_bytes.measure_kv_bytes(model, batch=2, prompt_len=8, new_tokens=4)
    assert res["bytes_per_token_measured"] == 30 * 2 * 3 * 64 * 4 and res["matches_formula"]
    mla, report = convert_model(model, d_kv=8, strategy="high")
    assert report["r"] == 4
    res = measure_bytes.measure_kv_bytes(mla, batch=2, prompt_len=8, new_tokens=4)
    assert res["bytes_per_token_measured"] == 30 * 3 * (8 + 8) * 4 and res["matches_formula"]


@pytest.mark.slow
def test_smollm2_lm_eval_good_vs_broken(smollm2):
    """A lossless MLA SmolLM2 (all RoPE pairs, full latent rank) picks true next lines far above chance;
    the same model with permuted token embeddings does not."""
    model, tok = smollm2
    mla, _ = convert_model(model, d_kv=64, r=32, strategy="high")
    good = harness.local_task(mla, tok, num_docs=32)
    with torch.no_grad():
        e = mla.model.embed_tokens.weight
        e.copy_(e[torch.randperm(e.shape[0], generator=torch.Generator().manual_seed(0))])
    broken = harness.local_task(mla, tok, num_docs=32)
    assert good["acc_norm"] >= 0.5
    assert good["acc_norm"] - broken["acc_norm"] >= 0.2
    # and the difference exceeds two standard errors of itself (independent question outcomes)
    se_diff = math.hypot(good["acc_norm_stderr"], broken["acc_norm_stderr"])
    assert good["acc_norm"] - broken["acc_norm"] > 2 * se_diff
