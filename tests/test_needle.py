"""Pass-key retrieval (mla.evaluation.needle) and LongBench's offline behaviour (mla.evaluation.longbench)."""

from __future__ import annotations

import math

import pytest

from mla.errors import UserError
from mla.evaluation import needle


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: on a 2-core CPU shared with other jobs, two OpenMP threads waiting on each
    other made SmolLM2's forward ~9x slower (and the tiny runs ~20x)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tok():
    from mla.tiny_models import tiny_tokenizer

    return tiny_tokenizer()


@pytest.fixture(scope="module")
def tiny_model():
    from mla.tiny_models import tiny_llama

    return tiny_llama()


def _sentence_tokens(tokenizer) -> int:
    """Most tokens one filler sentence adds: how far below its target a fitted prompt may fall."""
    return max(needle.count_tokens(tokenizer, " " + s) for s in needle.FILLER)


# -- prompts -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("length", [200, 333, 700, 1500])
def test_prompt_tokens_within_one_sentence_of_target(tok, length):
    slack = _sentence_tokens(tok)
    for sample in needle.draw_samples(tok, length, samples=3, seed=1):
        assert sample["prompt_tokens"] == needle.count_tokens(tok, sample["prompt"])
        assert length - slack <= sample["prompt_tokens"] <= length


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.8, 1.0])
def test_needle_once_at_requested_depth(tok, depth):
    prompt, _ = needle.fit_prompt(tok, 1200, 54321, depth)
    sentence = needle.needle_sentence(54321)
    assert prompt.count(sentence) == 1 and prompt.count("54321") == 2
    haystack = prompt.split("\n\n")[1]
    before, after = haystack.split(sentence)
    n_before = sum(before.count(s) for s in needle.FILLER)
    n_total = n_before + sum(after.count(s) for s in needle.FILLER)
    assert n_total > 80
    assert abs(n_before / n_total - depth) <= 1 / n_total
    assert prompt.endswith(needle.QUESTION)


def test_too_short_length_and_bad_depth_refused(tok):
    with pytest.raises(UserError, match="shorter than the pass-key prompt"):
        needle.fit_prompt(tok, 20, 12345, 0.5)
    with pytest.raises(UserError, match="outside"):
        needle.build_prompt(10, 12345, 1.5)


def test_length_above_max_position_embeddings_refused(tok):
    from mla.tiny_models import tiny_llama

    model = tiny_llama(max_position_embeddings=256)
    with pytest.raises(UserError, match="max_position_embeddings = 256"):
        needle.needle_accuracy(model, tok, lengths=[200, 300], samples=1)
    # the generated tokens count too: 250 + 10 > 256
    with pytest.raises(UserError, match="250 \\+ 10 generated tokens"):
        needle.needle_accuracy(model, tok, lengths=[250], samples=1)


# -- scoring -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,ok", [("12345.", True), (" 12345", True), (" 12345. Remember it.", True),
                                     ("1234", False), ("123456", False), (" the key", False),
                                     (" 54321 or 12345", False)])
def test_scoring_first_digit_run(text, ok):
    assert needle.is_correct(text, 12345) is ok


def test_binomial_stderr():
    assert needle.binomial_stderr(3, 4) == pytest.approx(math.sqrt(0.75 * 0.25 / 4))
    assert needle.binomial_stderr(0, 8) == 0.0 and needle.binomial_stderr(8, 8) == 0.0
    assert needle.binomial_stderr(5, 10) == pytest.approx(0.5 / math.sqrt(10))


def test_samples_reproducible_with_seed(tok):
    a = needle.draw_samples(tok, 300, samples=5, seed=7)
    assert a == needle.draw_samples(tok, 300, samples=5, seed=7)
    assert [s["key"] for s in a] != [s["key"] for s in needle.draw_samples(tok, 300, samples=5, seed=8)]
    # default depths: evenly spread over [0, 1], each once
    assert sorted(s["depth"] for s in a) == [0.0, 0.25, 0.5, 0.75, 1.0]
    given = needle.draw_samples(tok, 300, samples=4, seed=7, depths=[0.1, 0.9])
    assert [s["depth"] for s in given] == [0.1, 0.9, 0.1, 0.9]


# -- generation ----------------------------------------------------------------------------------------

class _RecordingModel:
    """Stands in for a causal LM: records generate's arguments, answers "12345." after each prompt."""

    def __init__(self, tokenizer):
        import torch

        self.config = type("C", (), {"max_position_embeddings": 4096})()
        self.calls, self.tokenizer = [], tokenizer
        self._param = torch.nn.Parameter(torch.zeros(1))

    def parameters(self):
        return iter([self._param])

    def generate(self, input_ids, **kwargs):
        import torch

        self.calls.append({"input_ids": input_ids, **kwargs})
        answer = torch.tensor(self.tokenizer(" 12345.")["input_ids"]).expand(input_ids.shape[0], -1)
        return torch.cat([input_ids, answer], dim=1)


def test_generate_kwargs_passed_through_greedy_with_mask(tok):
    model = _RecordingModel(tok)
    cache = {"cache_implementation": "quantized", "cache_config": {"backend": "quanto", "nbits": 4}}
    answers = needle.generate_answers(model, tok, ["a b c", "a much longer prompt here"],
                                      generate_kwargs=cache, batch_size=2)
    assert answers == [" 12345.", " 12345."]
    (call,) = model.calls
    assert call["cache_implementation"] == "quantized" and call["cache_config"]["nbits"] == 4
    assert call["do_sample"] is False and call["num_beams"] == 1
    assert call["pad_token_id"] == tok.pad_token_id and call["max_new_tokens"] == needle.MAX_NEW_TOKENS
    mask, ids = call["attention_mask"], call["input_ids"]
    short = len(tok("a b c")["input_ids"])
    assert mask[0].tolist() == [0] * (ids.shape[1] - short) + [1] * short       # padded on the left
    assert mask[1].all()
    with pytest.raises(UserError, match="greedily"):
        needle.generate_answers(model, tok, ["x"], generate_kwargs={"do_sample": True})


def test_batched_generation_equals_one_by_one(tiny_model, tok):
    prompts = [s["prompt"] for s in needle.draw_samples(tok, 300, samples=4, seed=3)]
    prompts[1] = prompts[1][:-200] + needle.QUESTION        # different lengths: padding really happens
    one = needle.generate_answers(tiny_model, tok, prompts)
    assert needle.generate_answers(tiny_model, tok, prompts, batch_size=4) == one


def test_mla_model_at_full_rank_answers_as_the_original(tiny_model, tok):
    """The converted model (latent cache) through the same path, batched with left padding."""
    from mla.conversion.convert import convert_model
    from mla.tiny_models import tiny_llama

    d_h = tiny_model.config.head_dim
    converted, _ = convert_model(tiny_llama(), d_kv=d_h, r=d_h // 2, strategy="high")
    converted.eval()
    prompts = [s["prompt"] for s in needle.draw_samples(tok, 300, samples=4, seed=3)]
    prompts[1] = prompts[1][:-200] + needle.QUESTION
    original = needle.generate_answers(tiny_model, tok, prompts)
    assert needle.generate_answers(converted, tok, prompts) == original
    assert needle.generate_answers(converted, tok, prompts, batch_size=4) == original


def test_quantized_kv_cache_runs_with_a_fresh_cache_per_generate_call(tiny_model, tok):
    from mla.kv.quantized import KVQuant, cache_factory

    prompts = [s["prompt"] for s in needle.draw_samples(tok, 300, samples=3, seed=3)]
    plain = needle.generate_answers(tiny_model, tok, prompts)
    built = []
    factory = cache_factory(tiny_model, KVQuant(2, 16, 8))

    def counted():
        built.append(factory())
        return built[-1]

    quantized = needle.generate_answers(tiny_model, tok, prompts, cache_factory=counted)
    assert len(quantized) == len(plain) == 3
    assert len({id(c) for c in built}) == 3 and all(c.get_seq_length() > 0 for c in built)   # one per call


def test_quantized_kv_cache_errs_more_with_fewer_bits(tiny_model, tok):
    """Through the quanto cache the first answer token is the full-precision one (the prompt's own pass attends
    to exact keys; the cache is read from the second token on), and the answers then leave the full-precision
    ones sooner at 2 bits than at 4: the width reached the cache."""
    pytest.importorskip("optimum.quanto")
    prompts = [s["prompt"] for s in needle.draw_samples(tok, 300, samples=6, seed=3)]
    plain = [tok(a, add_special_tokens=False)["input_ids"] for a in needle.generate_answers(tiny_model, tok, prompts)]

    def agreeing_tokens(bits):
        answers = needle.generate_answers(tiny_model, tok, prompts, generate_kwargs={
            "cache_implementation": "quantized", "cache_config": {"backend": "quanto", "nbits": bits}})
        out = []
        for ref, ids in zip(plain, (tok(a, add_special_tokens=False)["input_ids"] for a in answers)):
            n = next((i for i, (a, b) in enumerate(zip(ref, ids)) if a != b), min(len(ref), len(ids)))
            out.append(n)
        return out

    four, two = agreeing_tokens(4), agreeing_tokens(2)
    assert min(two) >= 1 and min(four) >= 1
    assert all(f >= t for f, t in zip(four, two)) and sum(four) > sum(two)
    assert sum(two) < sum(len(ref) for ref in plain)      # 2 bits do change a random model's answers


def test_end_to_end_tiny_checkpoint(tiny_checkpoint):
    from mla.checkpoint import load_model, load_tokenizer

    model, tokenizer = load_model(tiny_checkpoint), load_tokenizer(tiny_checkpoint)
    out = needle.needle_accuracy(model, tokenizer, lengths=[200, 400], samples=3, seed=5, batch_size=2)
    assert set(out["lengths"]) == {200, 400}
    for length, r in out["lengths"].items():
        assert r["n"] == 3 and len(r["samples"]) == 3
        assert r["accuracy"] == r["correct"] / 3
        assert r["stderr"] == pytest.approx(needle.binomial_stderr(r["correct"], 3))
        assert length - _sentence_tokens(tokenizer) <= r["prompt_tokens_min"] <= r["prompt_tokens_max"] <= length
        assert all(s["correct"] == needle.is_correct(s["answer"], s["key"]) for s in r["samples"])
    accs = [r["accuracy"] for r in out["lengths"].values()]
    ses = [r["stderr"] for r in out["lengths"].values()]
    assert out["mean"] == pytest.approx(sum(accs) / 2)
    assert out["mean_stderr"] == pytest.approx(math.sqrt(sum(s * s for s in ses)) / 2)
    again = needle.needle_accuracy(model, tokenizer, lengths=[200], samples=3, seed=5)
    assert again["lengths"][200]["samples"] == out["lengths"][200]["samples"]


@pytest.mark.slow
def test_smollm2_retrieves_pass_key(smollm2_dir):
    import torch

    from mla.checkpoint import load_model, load_tokenizer

    model, tokenizer = load_model(smollm2_dir, dtype=torch.float32).eval(), load_tokenizer(smollm2_dir)
    out = needle.needle_accuracy(model, tokenizer, lengths=[256], samples=8, seed=0)
    r = out["lengths"][256]
    assert r["n"] == 8 and 250 <= r["prompt_tokens_min"] <= r["prompt_tokens_max"] <= 256
    assert r["correct"] >= 6, r["samples"]     # measured: 8/8 (keys at depths 0..1)


# -- LongBench -----------------------------------------------------------------------------------------

def test_longbench_task_names_exist_in_lm_eval():
    from mla.evaluation import longbench

    manager = longbench.task_manager()
    assert len(longbench.LONGBENCH_TASKS) == 16
    for task in longbench.LONGBENCH_TASKS.values():
        assert task in manager.task_index, task
        assert manager.task_index[task].kind.name == "TASK"


def test_longbench_offline_skips_without_loading_tasks(monkeypatch, tiny_model, tok):
    from mla.evaluation import harness, longbench

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(harness, "run_tasks", lambda *a, **k: pytest.fail("lm-eval was called offline"))
    monkeypatch.setattr(longbench, "task_manager", lambda: pytest.fail("tasks indexed offline"))
    out = longbench.longbench(tiny_model, tok, limit=2)
    assert out["status"] == "skipped" and "HF_DATASETS_OFFLINE is set" in out["skipped"]
    assert out["tasks"] == list(longbench.LONGBENCH_TASKS.values())


def _fake_results(tasks, scores, stderrs, n=5):
    results = {t: {"score,none": s, "score_stderr,none": e, "alias": t} for t, s, e in zip(tasks, scores, stderrs)}
    return {"results": results, "n-samples": {t: {"original": 200, "effective": n} for t in tasks}}


def test_longbench_online_path_wiring(monkeypatch, tok):
    """Hub reachable (pretended): the 16 tasks go to run_tasks with the longbench-only task manager and
    the prompt window given; the summary is the unweighted mean with SE sqrt(Σ SE²)/16."""
    from mla.evaluation import harness, longbench
    from mla.tiny_models import tiny_llama

    model = tiny_llama(max_position_embeddings=512)
    tasks = list(longbench.LONGBENCH_TASKS.values())
    scores = [i / 20 for i in range(16)]
    stderrs = [0.01 * (1 + i % 3) for i in range(16)]
    seen = {}

    def fake_run_tasks(m, t, names, **kwargs):
        seen.update(names=names, **kwargs)
        return _fake_results(names, scores, stderrs)

    monkeypatch.setattr(harness, "hub_unreachable_reason", lambda: None)
    monkeypatch.setattr(longbench, "missing_metric_modules", lambda: [])
    monkeypatch.setattr(harness, "run_tasks", fake_run_tasks)
    out = longbench.longbench(model, tok, limit=3, max_length=300, batch_size=2)
    assert seen["names"] == tasks and seen["limit"] == 3 and seen["batch_size"] == 2 and seen["max_length"] == 300
    assert set(seen["task_manager"].task_index) >= set(tasks)
    assert out["status"] == "ok" and out["missing"] == []
    assert out["scores"]["Qasper"] == {"task": "longbench_qasper", "score": 0.05, "stderr": 0.02, "n": 5}
    assert out["mean"] == pytest.approx(sum(scores) / 16)
    assert out["mean_stderr"] == pytest.approx(math.sqrt(sum(e * e for e in stderrs)) / 16)
    with pytest.raises(UserError, match="max_position_embeddings = 512"):
        longbench.longbench(model, tok, max_length=1024)


def test_longbench_partial_and_missing_dependencies(monkeypatch, tok, tiny_model):
    from mla.evaluation import harness, longbench

    tasks = list(longbench.LONGBENCH_TASKS.values())
    fake = _fake_results(tasks[:-1], [0.5] * 15, [0.1] * 15)
    summary = longbench.summarise(fake["results"], fake["n-samples"])
    assert summary["status"] == "partial" and summary["missing"] == ["RepoBench-P"] and summary["mean"] is None
    monkeypatch.setattr(harness, "hub_unreachable_reason", lambda: None)
    monkeypatch.setattr(longbench, "missing_metric_modules", lambda: ["jieba"])
    with pytest.raises(UserError, match="lm_eval\\[longbench\\]"):
        longbench.longbench(tiny_model, tok)
