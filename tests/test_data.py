"""`mla data`: packed blocks match the manifest; train/validation are disjoint by document; EOS kept."""

from __future__ import annotations

import csv
import hashlib
import json

import numpy as np
import pytest

from mla.cli import UserError, main
from mla.data import build_dataset, in_validation, open_blocks, read_manifest
from mla.sources import sha256_of

BLOCK, TRAIN_CAP, VAL_CAP = 64, 30_000, 3_000


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from mla.testing import tiny_tokenizer

    path = tmp_path_factory.mktemp("tok")
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def built(tokenizer_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "pydoc"
    rc = main(["data", "--tokenizer", str(tokenizer_dir), "--out", str(out), "--block-length", str(BLOCK),
               "--max-tokens", str(TRAIN_CAP), "--max-validation-tokens", str(VAL_CAP)])
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
        assert s["n_blocks"] == cap // BLOCK  # the caps are met exactly, only the tail is dropped
        assert s["tokens"] + s["tokens_dropped"] == sum(d["tokens"] for d in documents(built, split))
        assert s["sha256"] == sha256_of(built / s["file"])
        # documents per source = documents that reach into the kept blocks
        kept = [d for d in documents(built, split) if d["offset"] < blocks.size]
        for name, stats in s["sources"].items():
            assert stats["documents"] == sum(d["source"] == name for d in kept)
    # mixture weights 0.7 / 0.3 of the training cap, up to the dropped tail
    src = m["splits"]["train"]["sources"]
    assert abs(src["pydoc-topics"]["tokens"] - 0.7 * TRAIN_CAP) <= BLOCK
    assert abs(src["python-stdlib"]["tokens"] - 0.3 * TRAIN_CAP) <= BLOCK


def test_documents_are_tokenized_text_followed_by_eos(built, tokenizer_dir):
    from pydoc_data.topics import topics
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
    # a pydoc topic that was not cut: exactly its tokenization + EOS
    d = next(d for d in whole if d["source"] == "pydoc-topics"
             and d["tokens"] == len(tok(topics[d["key"]], add_special_tokens=False)["input_ids"]) + 1)
    expected = tok(topics[d["key"]], add_special_tokens=False)["input_ids"] + [eos]
    assert stream[d["offset"]:d["offset"] + d["tokens"]].tolist() == expected


def test_validation_and_training_documents_are_disjoint(built):
    train, val = documents(built, "train"), documents(built, "validation")
    assert val and train
    train_keys = {(d["source"], d["key"]) for d in train}
    val_keys = {(d["source"], d["key"]) for d in val}
    assert not train_keys & val_keys
    assert all(in_validation(s, k, 0.05) for s, k in val_keys)
    assert not any(in_validation(s, k, 0.05) for s, k in train_keys)
    # and by content: no validation document's token sequence occurs as a training document
    t_stream = open_blocks(built, "train").reshape(-1)
    v_stream = open_blocks(built, "validation").reshape(-1)

    def digests(stream, docs):
        return {hashlib.sha1(stream[d["offset"]:d["offset"] + d["tokens"]].tobytes()).hexdigest()
                for d in docs if d["offset"] + d["tokens"] <= stream.size}

    assert digests(v_stream, val)
    assert not digests(t_stream, train) & digests(v_stream, val)


def test_rerun_is_a_no_op_and_a_different_request_needs_force(built, tokenizer_dir, capsys):
    before = (built / "train.npy").stat().st_mtime_ns
    args = ["data", "--tokenizer", str(tokenizer_dir), "--out", str(built), "--block-length", str(BLOCK),
            "--max-tokens", str(TRAIN_CAP), "--max-validation-tokens", str(VAL_CAP)]
    assert main(args) == 0
    assert "up to date" in capsys.readouterr().out
    assert (built / "train.npy").stat().st_mtime_ns == before
    args[args.index("--block-length") + 1] = "32"
    assert main(args) == 2
    assert "different request" in capsys.readouterr().err
    assert json.loads((built / "manifest.json").read_text())["block_length"] == BLOCK


def test_failed_build_leaves_no_output(tokenizer_dir, tmp_path):
    out = tmp_path / "data"
    # one held-out document in a million: the validation split cannot fill a block, after train was written
    with pytest.raises(UserError, match="validation split has fewer than"):
        build_dataset("pydoc-stdlib", tokenizer_dir, out, block_length=BLOCK, max_train_tokens=2_000,
                      max_validation_tokens=BLOCK, validation_fraction=1e-6, log=lambda *_: None)
    assert list(tmp_path.iterdir()) == []


def test_hub_mixture_fails_offline_with_a_clear_message(tokenizer_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(UserError, match="smollm-corpus.*Hub"):
        build_dataset("smollm", tokenizer_dir, tmp_path / "hub", block_length=BLOCK, max_train_tokens=10_000,
                      log=lambda *_: None)
    assert list(tmp_path.iterdir()) == []


def test_bad_inputs_are_named(tokenizer_dir, tmp_path, built):
    with pytest.raises(UserError, match="unknown corpus 'nope'"):
        build_dataset("nope", tokenizer_dir, tmp_path / "x")
    with pytest.raises(UserError, match="smaller than one block"):
        build_dataset("pydoc-stdlib", tokenizer_dir, tmp_path / "x", block_length=128, max_train_tokens=100)
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
                      log=lambda *_: None)
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
                 "--max-tokens", "3200", "--max-validation-tokens", "320", "--weight", "python-stdlib=3",
                 "--weight", "pydoc-topics=1"]) == 0
    src = read_manifest(out)["splits"]["train"]["sources"]
    assert abs(src["python-stdlib"]["tokens"] - 0.75 * 3200) <= 32
    assert main(["data", "--tokenizer", str(tokenizer_dir), "--out", str(tmp_path / "v"),
                 "--weight", "fineweb=1"]) == 2
    assert "unknown source(s) ['fineweb']" in capsys.readouterr().err
