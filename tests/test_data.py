"""`mla data`: packed blocks match the manifest; exact budgets and shares; train/validation disjoint by
document; EOS kept; the mixture's real shares when a source runs dry; bad input named before any work.
The default corpus needs nothing but Python: its data is built here with Debian's documentation hidden."""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from mla.cli import UserError, main
from mla.data import PYDOC_STDLIB, build_dataset, in_validation, join_consecutive, open_blocks, read_manifest
from mla.data.readers import PYTHON_DOCS_ENV, PythonDocstrings, docstrings
from mla.sources import sha256_of
from mla.options import DEFAULT_VALIDATION_FRACTION

BLOCK, TRAIN_CAP, VAL_CAP = 64, 30_000, 3_000
SHARES = {"python-docstrings": 0.6, "pydoc-topics": 0.1, "python-stdlib": 0.3}  # prose 0.7, code 0.3


@pytest.fixture(scope="module")
def built(tokenizer_dir, tmp_path_factory):
    """The default corpus, built as on a bare machine: Debian's documentation folder is hidden."""
    out = tmp_path_factory.mktemp("data") / "pydoc"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(PYTHON_DOCS_ENV, str(tmp_path_factory.mktemp("no-docs") / "missing"))
        mp.setattr("mla.data.readers.PYTHON_DOCS_ROOT", "/nonexistent/python3.11-doc")
        rc = main(["data", "--tokenizer", str(tokenizer_dir), "--out", str(out), "--block-length", str(BLOCK),
                   "--train-tokens", str(TRAIN_CAP), "--validation-tokens", str(VAL_CAP), "--workers", "2"])
    assert rc == 0
    return out


def documents(out, split):
    with open(out / f"documents-{split}.tsv", newline="") as f:
        return [dict(r, offset=int(r["offset"]), tokens=int(r["tokens"])) for r in csv.DictReader(f, delimiter="\t")]


def test_block_counts_and_token_totals_match_manifest(built):
    m = read_manifest(built)
    for split, cap in (("train", TRAIN_CAP), ("validation", VAL_CAP)):
        s = m["splits"][split]
        blocks = open_blocks(built, split)
        assert blocks.shape == (s["n_blocks"], BLOCK)
        assert blocks.dtype == np.uint16
        assert s["tokens"] == blocks.size == sum(v["tokens"] for v in s["sources"].values())
        assert s["n_blocks"] == cap // BLOCK  # the budgets are met exactly, in whole blocks
        assert s["tokens_dropped"] == 0
        assert s["tokens"] == sum(d["tokens"] for d in documents(built, split))
        assert s["sha256"] == sha256_of(built / s["file"])
        assert s["documents_sha256"] == sha256_of(built / s["documents_file"])
        # documents per source = documents that reach into the kept blocks
        kept = [d for d in documents(built, split) if d["offset"] < blocks.size]
        for name, stats in s["sources"].items():
            assert stats["documents"] == sum(d["source"] == name for d in kept)
    # mixture weights 0.6 / 0.1 / 0.3 of each split's tokens, to the token (the last document of a source is cut)
    assert {s["name"]: s["weight"] for s in m["request"]["sources"]} == SHARES
    for split in ("train", "validation"):
        s = m["splits"][split]
        src = s["sources"]
        assert set(src) == set(SHARES)
        for name, share in SHARES.items():
            assert abs(src[name]["tokens"] - share * s["tokens"]) <= 1
            assert src[name]["configured_share"] == share and not src[name]["ran_dry"]
    assert m["warnings"] == []


def test_documents_are_tokenized_text_followed_by_eos(built, tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    m = read_manifest(built)
    stream = open_blocks(built, "train").reshape(-1)
    eos = m["eos_token_id"]
    docs = documents(built, "train")
    whole = [d for d in docs if d["offset"] + d["tokens"] <= stream.size]
    # every complete document ends with EOS, and EOS appears nowhere else
    assert int((stream == eos).sum()) == len(whole)
    assert all(stream[d["offset"] + d["tokens"] - 1] == eos for d in whole)
    # every docstring document is its module's docstrings, tokenized + EOS (the last one of the source cut, EOS kept)
    reader = PythonDocstrings(PYDOC_STDLIB[0], seed=0)
    prose = [d for d in whole if d["source"] == "python-docstrings"]
    assert len(prose) >= 2
    for d in prose:
        text = reader.text(d["key"])
        assert d["key"].endswith(".py") and text.startswith(d["key"][:-3].replace("/", ".").removesuffix(".__init__"))
        expected = tok(text, add_special_tokens=False)["input_ids"] + [eos]
        got = stream[d["offset"]:d["offset"] + d["tokens"]].tolist()
        assert got == expected or (d is prose[-1] and got == expected[:d["tokens"] - 1] + [eos])


def test_validation_and_training_documents_are_disjoint(built):
    train, val = documents(built, "train"), documents(built, "validation")
    assert val and train
    train_keys = {(d["source"], d["key"]) for d in train}
    val_keys = {(d["source"], d["key"]) for d in val}
    assert not train_keys & val_keys
    # a module's docstrings split with its source file (split_as: python-stdlib), so no held-out module is
    # trained on, as prose or as code
    split_name = {"python-docstrings": "python-stdlib"}
    fraction = DEFAULT_VALIDATION_FRACTION
    assert all(in_validation(split_name.get(s, s), k, fraction) for s, k in val_keys)
    assert not any(in_validation(split_name.get(s, s), k, fraction) for s, k in train_keys)
    val_modules = {k for s, k in val_keys if s == "python-docstrings"}
    assert val_modules and not val_modules & {k for s, k in train_keys if s == "python-stdlib"}
    # and by content: no validation document's token sequence occurs as a training document
    t_stream = open_blocks(built, "train").reshape(-1)
    v_stream = open_blocks(built, "validation").reshape(-1)

    def digests(stream, docs):
        return {hashlib.sha1(stream[d["offset"]:d["offset"] + d["tokens"]].tobytes()).hexdigest()
                for d in docs if d["offset"] + d["tokens"] <= stream.size}

    assert digests(v_stream, val)
    assert not digests(t_stream, train) & digests(v_stream, val)


def test_rerun_is_a_no_op_and_a_different_request_needs_force(built, tokenizer_dir, capsys):
    before = (built / "train.bin").stat().st_mtime_ns
    args = ["data", "--tokenizer", str(tokenizer_dir), "--out", str(built), "--block-length", str(BLOCK),
            "--train-tokens", str(TRAIN_CAP), "--validation-tokens", str(VAL_CAP)]
    assert main(args) == 0
    assert "up to date" in capsys.readouterr().out
    assert (built / "train.bin").stat().st_mtime_ns == before
    args[args.index("--block-length") + 1] = "32"
    assert main(args) == 2
    assert "different request" in capsys.readouterr().err
    assert json.loads((built / "manifest.json").read_text())["block_length"] == BLOCK


def test_failed_build_leaves_no_output(tokenizer_dir, tmp_path):
    corpus = _text_corpus(tmp_path / "texts", {"notes": 40})
    out = tmp_path / "data"
    # one held-out document in a million: the validation split cannot fill a block, after train was written
    with pytest.raises(UserError, match="validation split has fewer than"):
        build_dataset(str(corpus), tokenizer_dir, out, block_length=BLOCK, train_tokens=2_000,
                      validation_tokens=BLOCK, validation_fraction=1e-6, workers=1, log=lambda *_: None)
    assert list(tmp_path.iterdir()) == [tmp_path / "texts"]


def test_hub_mixture_fails_offline_with_a_clear_message(tokenizer_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(UserError, match="smollm-corpus.*Hub"):
        build_dataset("smollm", tokenizer_dir, tmp_path / "hub", block_length=BLOCK, train_tokens=10_000,
                      log=lambda *_: None)
    assert list(tmp_path.iterdir()) == []


def test_bad_inputs_are_named(tokenizer_dir, tmp_path, built):
    with pytest.raises(UserError, match="unknown corpus 'nope'"):
        build_dataset("nope", tokenizer_dir, tmp_path / "x")
    with pytest.raises(UserError, match="smaller than one block"):
        build_dataset("pydoc-stdlib", tokenizer_dir, tmp_path / "x", block_length=128, train_tokens=100)
    with pytest.raises(UserError, match="unknown split"):
        open_blocks(built, "test")
    with pytest.raises(UserError, match="no manifest.json"):
        open_blocks(tmp_path, "train")


def test_corpus_file_with_local_text_files(tokenizer_dir, tmp_path):
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(40):
        (texts / f"doc{i}.txt").write_text(f"document number {i}. " * 30)
    corpus = tmp_path / "corpus.yaml"
    corpus.write_text(f"name: mine\nsources:\n  - name: notes\n    weight: 1\n    kind: text_files\n"
                      f"    root: {texts}\n    glob: '*.txt'\n")
    m = build_dataset(str(corpus), tokenizer_dir, tmp_path / "out", block_length=32, validation_fraction=0.25,
                      validation_tokens=None, workers=1, log=lambda *_: None)
    n_val_docs = sum(in_validation("notes", f"doc{i}.txt", 0.25) for i in range(40))
    assert m["corpus"] == "mine"
    assert 0 < n_val_docs < 40
    total = {s: sum(d["tokens"] for d in documents(tmp_path / "out", s)) for s in ("train", "validation")}
    for split in ("train", "validation"):
        assert m["splits"][split]["n_blocks"] == total[split] // 32
    assert len(documents(tmp_path / "out", "validation")) == n_val_docs


def test_weight_overrides(tokenizer_dir, tmp_path, capsys):
    out = tmp_path / "w"
    assert main(["data", "--tokenizer", str(tokenizer_dir), "--out", str(out), "--block-length", "32",
                 "--train-tokens", "3200", "--validation-tokens", "320", "--weight", "python-stdlib=3",
                 "--weight", "python-docstrings=0.9", "--workers", "1"]) == 0
    src = read_manifest(out)["splits"]["train"]["sources"]
    assert src["python-stdlib"]["tokens"] == 0.75 * 3200 and src["pydoc-topics"]["tokens"] == 0.025 * 3200
    assert main(["data", "--tokenizer", str(tokenizer_dir), "--out", str(tmp_path / "v"),
                 "--weight", "fineweb=1"]) == 2
    assert "unknown source(s) ['fineweb']" in capsys.readouterr().err


# -- the mixture: exact shares, dry sources, worker-count independence ------------------------------------

def test_split_plan_quotas_and_a_dry_source():
    from mla.data.mix import SplitPlan, allocate

    assert allocate(10, [0.7, 0.2, 0.1]) == [7, 2, 1]
    assert sum(allocate(12_582_912_000, [0.70, 0.15, 0.08, 0.06, 0.01])) == 12_582_912_000
    plan = SplitPlan(["a", "b", "c"], [0.5, 0.3, 0.2], 1000)
    assert plan.quota == [500, 300, 200]
    order = []
    for _ in range(6):  # equal documents of 50 tokens: always the source furthest below its quota
        i = plan.next_source()
        order.append(plan.names[i])
        plan.record(i, 50)
    assert order == ["a", "b", "c", "a", "b", "a"]  # filled fractions then: a 0.3, b 0.33, c 0.25
    plan.mark_dry(2)  # c stops at 50 of 200: a and b share its 150 by weight (5:3)
    assert plan.quota == [500 + 94, 300 + 56, 50] and sum(plan.quota) == 1000
    assert plan.next_source() != 2
    shares = plan.shares()
    assert shares["c"]["ran_dry"] and shares["c"]["configured_share"] == 0.2


def _text_corpus(tmp_path, sizes: dict[str, int], words: int = 60) -> Path:
    """A corpus file with one text_files source per entry: `n` documents of `words` words each."""
    tmp_path.mkdir(exist_ok=True)
    lines = ["name: texts", "sources:"]
    for name, n in sizes.items():
        root = tmp_path / name
        root.mkdir()
        for i in range(n):
            (root / f"{i:04d}.txt").write_text(" ".join(f"{name}{(i * 7 + j) % 97}" for j in range(words)) + ".\n")
        lines += [f"  - name: {name}", "    weight: 1", "    kind: text_files",
                  f"    root: {root}"]
    corpus = tmp_path / "corpus.yaml"
    corpus.write_text("\n".join(lines) + "\n")
    return corpus


def test_a_source_that_runs_dry_is_reported_and_the_others_fill_the_budget(tokenizer_dir, tmp_path):
    corpus = _text_corpus(tmp_path, {"big": 300, "small": 4})
    logged = []
    m = build_dataset(str(corpus), tokenizer_dir, tmp_path / "out", block_length=32, train_tokens=8_000,
                      validation_tokens=None, validation_fraction=0.1, workers=2, log=logged.append)
    train = m["splits"]["train"]
    small = train["sources"]["small"]
    assert train["tokens"] == 8_000 // 32 * 32            # the budget is still met, by the other source
    assert small["ran_dry"] and small["configured_share"] == 0.5
    assert small["tokens"] == sum(d["tokens"] for d in documents(tmp_path / "out", "train") if d["source"] == "small")
    assert small["share"] == pytest.approx(small["tokens"] / train["tokens"], abs=1e-6) and small["share"] < 0.35
    assert any("small" in w and "ran dry" in w for w in m["warnings"])
    assert any(line.startswith("warning:") and "small" in line for line in logged)
    # no budget: the split stops when its first source runs dry (here: small has at most a few held-out documents)
    val = m["splits"]["validation"]
    assert val["budget_tokens"] is None and val["sources"]["small"]["ran_dry"]


def test_output_does_not_depend_on_the_number_of_workers(tokenizer_dir, tmp_path):
    hashes = []
    for workers in (1, 2):
        m = build_dataset("pydoc-stdlib", tokenizer_dir, tmp_path / f"w{workers}", block_length=BLOCK,
                          train_tokens=20_000, validation_tokens=2_000, workers=workers, log=lambda *_: None)
        assert m["workers"] == workers
        hashes.append((m["splits"]["train"]["sha256"], m["splits"]["validation"]["sha256"],
                       (tmp_path / f"w{workers}" / "documents-train.tsv").read_bytes()))
    assert hashes[0] == hashes[1]


def test_open_blocks_is_a_read_only_memory_map(built):
    blocks = open_blocks(built, "train")
    assert isinstance(blocks, np.memmap) and not blocks.flags.writeable
    assert len(blocks) == blocks.shape[0] and blocks[3].shape == (BLOCK,) and blocks[2:5].shape == (3, BLOCK)


# -- bad input: one line naming the file / flag, before any work -----------------------------------------

def test_bad_corpus_files_and_block_length_are_named(tokenizer_dir, tmp_path):
    def corpus(text):
        path = tmp_path / "c.yaml"
        path.write_text(text)
        return str(path)

    missing = tmp_path / "nowhere"
    with pytest.raises(UserError, match=f"source 'notes' \\(text_files\\): folder {missing} does not exist"):
        build_dataset(corpus(f"sources: [{{name: notes, weight: 1, kind: text_files, root: {missing}}}]"),
                      tokenizer_dir, tmp_path / "x")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="source 'notes' \\(text_files\\): no documents under"):
        build_dataset(corpus(f"sources: [{{name: notes, weight: 1, kind: text_files, root: {tmp_path / 'empty'}}}]"),
                      tokenizer_dir, tmp_path / "x")
    with pytest.raises(UserError, match=f"not at {missing}; install Debian's python3.11-doc .*{PYTHON_DOCS_ENV}"):
        build_dataset(corpus(f"sources: [{{name: docs, weight: 1, kind: python_docs, root: {missing}}}]"),
                      tokenizer_dir, tmp_path / "x")
    with pytest.raises(UserError, match="corpus file .*c.yaml: expected a mapping"):
        build_dataset(corpus("just a string"), tokenizer_dir, tmp_path / "x")
    # a block longer than the model's context, read from the checkpoint's config.json
    model = tmp_path / "model"
    model.mkdir()
    for f in tokenizer_dir.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 256}))
    with pytest.raises(UserError, match="--block-length 512 exceeds the model's context: max_position_embeddings "
                                        "256 in .*config.json"):
        build_dataset("pydoc-stdlib", model, tmp_path / "x", block_length=512, train_tokens=4096)
    with pytest.raises(UserError, match="--train-tokens is required"):
        build_dataset("smollm", model, tmp_path / "x", block_length=64, train_tokens=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml", "empty", "model"]  # nothing was written


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_default_config_gets_its_validation_budget_at_70_30(smollm2_dir, tmp_path, monkeypatch):
    """config.yaml's data with the real SmolLM2 tokenizer, Debian's documentation hidden: the held-out split holds
    data.validation_tokens in the configured shares (enough held-out prose at data.validation_fraction, no source
    ran dry), and train what the experiments need."""
    import yaml

    monkeypatch.setenv(PYTHON_DOCS_ENV, str(tmp_path / "no-docs"))
    monkeypatch.setattr("mla.data.readers.PYTHON_DOCS_ROOT", str(tmp_path / "no-docs"))
    from mla.study import budgets

    config = yaml.safe_load((Path(__file__).parents[1] / "config.yaml").read_text())
    d = config["data"]
    model = next(iter(config["experiments"].values()))["model"]
    m = build_dataset(d["corpus"], smollm2_dir, tmp_path / "data", block_length=d["block_length"],
                      train_tokens=budgets.train_tokens(config, model), validation_tokens=d["validation_tokens"],
                      validation_fraction=d["validation_fraction"], workers=2, log=lambda *_: None)
    assert m["warnings"] == []
    val = m["splits"]["validation"]
    assert val["tokens"] == d["validation_tokens"] // d["block_length"] * d["block_length"] >= 65536
    for name, share in SHARES.items():
        assert val["sources"][name]["tokens"] == pytest.approx(share * val["tokens"], abs=1)
    assert m["splits"]["train"]["tokens"] >= budgets.train_tokens(config, model)


# -- the prose of the default corpus, and Debian's documentation as an option ---------------------------------

def test_docstrings_in_source_order_under_qualified_names():
    source = '''
    """Module summary.

    More.
    """
    import os

    def f():
        """Function f."""

    class C:
        """Class C."""

        def method(self):
            """  Indented
                method doc.
            """

        def bare(self):
            return 1

    async def g():
        "Coroutine g."
    '''
    import textwrap

    assert docstrings(textwrap.dedent(source), "pkg.mod") == (
        "pkg.mod\n\nModule summary.\n\nMore.\n\npkg.mod.f\n\nFunction f.\n\npkg.mod.C\n\nClass C.\n\n"
        "pkg.mod.C.method\n\nIndented\nmethod doc.\n\npkg.mod.g\n\nCoroutine g.")
    assert docstrings("def broken(:\n", "m") == "" and docstrings("x = 1\n", "m") == ""


def test_debian_docs_corpus_reads_the_folder_that_MLA_PYTHON_DOCS_names(tokenizer_dir, tmp_path, monkeypatch):
    docs = tmp_path / "_sources"
    for i in range(60):
        (docs / "library").mkdir(parents=True, exist_ok=True)
        (docs / "library" / f"mod{i}.rst.txt").write_text(f"Module {i}\n========\n\n" + f"Prose of module {i}. " * 40)
    monkeypatch.setenv(PYTHON_DOCS_ENV, str(docs))
    m = build_dataset("debian-docs-stdlib", tokenizer_dir, tmp_path / "out", block_length=32, train_tokens=3200,
                      validation_tokens=320, validation_fraction=0.25, workers=1, log=lambda *_: None)
    src = m["splits"]["train"]["sources"]
    assert set(src) == {"python-docs", "python-stdlib"} and src["python-docs"]["tokens"] == 0.7 * 3200
    monkeypatch.setenv(PYTHON_DOCS_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(UserError, match=f"not at {tmp_path / 'nowhere'}; install Debian's python3.11-doc"):
        build_dataset("debian-docs-stdlib", tokenizer_dir, tmp_path / "x", block_length=32, train_tokens=3200)


def test_join_consecutive_is_a_view_of_whole_groups_of_blocks(tmp_path):
    path = tmp_path / "blocks.bin"
    np.arange(7 * 4, dtype=np.uint16).tofile(path)
    blocks = np.memmap(path, dtype=np.uint16, mode="r", shape=(7, 4))
    joined = join_consecutive(blocks, 3)
    assert joined.shape == (2, 12)                      # the 7th block cannot complete a third sequence
    assert joined[1].tolist() == list(range(12, 24))    # blocks 3, 4, 5 end to end
    assert np.shares_memory(joined, blocks)             # no copy of the memory map
    assert join_consecutive(blocks, 1).shape == (7, 4)
    with pytest.raises(UserError, match="span must be >= 1"):
        join_consecutive(blocks, 0)
