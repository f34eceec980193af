"""The paper's Hub mixture (`--corpus smollm`) through `mla data`, offline: the five datasets in their real
layout and columns in a local mirror (MLA_HUB_DATASETS_MIRROR), python-edu's blobs over file://
(MLA_SWH_CONTENT_URL), read by the same `datasets.load_dataset(..., streaming=True)` calls as online."""

from __future__ import annotations

import csv
import gzip
import hashlib

import pyarrow.parquet as pq
import pytest

from mla.cli import main
from mla.data import SMOLLM_MIXTURE, build_dataset, open_blocks, read_manifest
from mla.data.mirror import write_smollm_mirror
from mla.errors import UserError

BLOCK, TRAIN, VAL = 64, 12_000, 1_280


@pytest.fixture(scope="module")
def mirror(tmp_path_factory):
    root = tmp_path_factory.mktemp("mirror")
    return root, write_smollm_mirror(root, docs_per_source=60)


@pytest.fixture(scope="module")
def built(mirror, tokenizer_dir, tmp_path_factory):
    root, env = mirror
    out = tmp_path_factory.mktemp("smollm") / "data"
    with pytest.MonkeyPatch.context() as mp:
        for k, v in {**env, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}.items():
            mp.setenv(k, v)
        assert main(["data", "--tokenizer", str(tokenizer_dir), "--out", str(out), "--corpus", "smollm",
                     "--block-length", str(BLOCK), "--train-tokens", str(TRAIN), "--validation-tokens", str(VAL),
                     "--validation-fraction", "0.1", "--workers", "2"]) == 0
    return out


def test_the_mirror_has_the_real_layout_and_columns(mirror):
    root, env = mirror
    assert env["MLA_SWH_CONTENT_URL"].startswith("file://")
    columns = {
        "HuggingFaceTB/smollm-corpus/fineweb-edu-dedup": ["text", "id", "metadata"],
        "HuggingFaceTB/smollm-corpus/cosmopedia-v2": ["prompt", "text", "token_length", "audience", "format",
                                                      "seed_data"],
        "HuggingFaceTB/smollm-corpus/python-edu": ["blob_id", "repo_name", "path", "length_bytes", "score",
                                                   "int_score"],
        "open-web-math/open-web-math/data": ["url", "text", "date", "metadata"],
        "bigcode/stackoverflow-clean/data": ["content"],
    }
    for folder, names in columns.items():
        shards = sorted((root / folder).glob("train-*.parquet"))
        assert shards and pq.read_schema(shards[0]).names == names, folder
    readme = (root / "HuggingFaceTB/smollm-corpus/README.md").read_text()
    assert "config_name: python-edu" in readme and "path: python-edu/train-*" in readme


def test_all_five_datasets_feed_both_splits_in_their_shares(built):
    m = read_manifest(built)
    assert m["corpus"] == "smollm" and [s["name"] for s in m["request"]["sources"]] == [s.name for s in SMOLLM_MIXTURE]
    for split, budget in (("train", TRAIN), ("validation", VAL)):
        s = m["splits"][split]
        assert s["n_blocks"] == budget // BLOCK and open_blocks(built, split).shape == (budget // BLOCK, BLOCK)
        for source in SMOLLM_MIXTURE:
            entry = s["sources"][source.name]
            assert entry["documents"] >= 1 and not entry["ran_dry"], (split, source.name)
            assert abs(entry["tokens"] - source.weight * s["tokens"]) <= 1, (split, source.name)
    assert m["warnings"] == [] and all(v["blobs_missing"] == 0 for v in m["sources"].values())


def test_python_edu_documents_are_the_fetched_blobs_and_stackoverflow_is_its_content_column(built, mirror,
                                                                                          tokenizer_dir):
    from transformers import AutoTokenizer

    root, _ = mirror
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    m = read_manifest(built)
    stream = open_blocks(built, "train").reshape(-1)
    with open(built / "documents-train.tsv", newline="") as f:
        rows = [dict(r, offset=int(r["offset"]), tokens=int(r["tokens"])) for r in csv.DictReader(f, delimiter="\t")]
    blob_ids = {r["blob_id"] for shard in (root / "HuggingFaceTB/smollm-corpus/python-edu").glob("*.parquet")
                for r in pq.read_table(shard).to_pylist()}
    contents = {r["content"] for shard in (root / "bigcode/stackoverflow-clean/data").glob("*.parquet")
                for r in pq.read_table(shard).to_pylist()}

    def tokens_of(row):
        return stream[row["offset"]:row["offset"] + row["tokens"]].tolist()

    def whole(text):
        return tok(text, add_special_tokens=False)["input_ids"] + [m["eos_token_id"]]

    checked = {"python-edu": 0, "stackoverflow-clean": 0}
    for row in rows:
        if row["source"] == "python-edu":
            # the mirror names each blob by the sha1 of its text, which is also the document's key
            assert row["key"] in blob_ids
            text = gzip.decompress((root / "swh-content" / row["key"]).read_bytes()).decode()
        elif row["source"] == "stackoverflow-clean":
            text = next(c for c in contents if hashlib.sha1(c.encode()).hexdigest() == row["key"])
        else:
            continue
        expected = whole(text)
        got = tokens_of(row)
        assert got == expected or (len(got) < len(expected) and got == expected[:len(got) - 1] + expected[-1:])
        checked[row["source"]] += 1
    assert checked["python-edu"] >= 1 and checked["stackoverflow-clean"] >= 1


def test_rerun_against_the_mirror_is_up_to_date(built, mirror, tokenizer_dir, monkeypatch):
    for k, v in mirror[1].items():
        monkeypatch.setenv(k, v)
    logged = []
    build_dataset("smollm", tokenizer_dir, built, block_length=BLOCK, train_tokens=TRAIN, validation_tokens=VAL,
                  validation_fraction=0.1, log=logged.append)
    assert any("up to date" in line for line in logged)


def test_without_a_mirror_offline_one_line_names_the_dataset(tokenizer_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MLA_HUB_DATASETS_MIRROR", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert main(["data", "--tokenizer", str(tokenizer_dir), "--out", str(tmp_path / "d"), "--corpus", "smollm",
                 "--block-length", "64", "--train-tokens", "6400"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("mla data: error: cannot stream dataset HuggingFaceTB/smollm-corpus (fineweb-edu-dedup) "
                          "from the Hugging Face Hub")
    assert list(tmp_path.iterdir()) == []


def test_a_mirror_without_the_dataset_or_the_blobs_is_named(mirror, tokenizer_dir, tmp_path, monkeypatch):
    root, env = mirror
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("MLA_HUB_DATASETS_MIRROR", str(tmp_path / "empty-mirror"))
    with pytest.raises(UserError, match="dataset HuggingFaceTB/smollm-corpus \\(fineweb-edu-dedup\\): "
                                        "MLA_HUB_DATASETS_MIRROR=.*empty-mirror has no folder"):
        build_dataset("smollm", tokenizer_dir, tmp_path / "d", block_length=64, train_tokens=6400)
    monkeypatch.setenv("MLA_HUB_DATASETS_MIRROR", env["MLA_HUB_DATASETS_MIRROR"])
    monkeypatch.setenv("MLA_SWH_CONTENT_URL", (tmp_path / "no-blobs").as_uri())
    with pytest.raises(UserError, match="dataset HuggingFaceTB/smollm-corpus \\(python-edu\\): blob [0-9a-f]{40} "
                                        "of its first row is not at file://.*no-blobs \\(MLA_SWH_CONTENT_URL\\)"):
        build_dataset("smollm", tokenizer_dir, tmp_path / "d", block_length=64, train_tokens=6400)
    assert not (tmp_path / "d").exists()


def test_blobs_are_fetched_in_row_order_by_a_thread_pool(mirror, monkeypatch):
    """Many requests in flight (one per file is latency-bound at scale), yet the documents keep the rows' order."""
    import threading
    import time

    from mla.data import readers

    root, env = mirror
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    threads, real = set(), readers.fetch_blob
    lock, in_flight, most = threading.Lock(), [0], [0]

    def slow_fetch(blob_id, *args, **kwargs):
        with lock:
            threads.add(threading.get_ident())
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        time.sleep(0.05)   # a request's latency: overlapping ones are in flight together
        with lock:
            in_flight[0] -= 1
        return real(blob_id, *args, **kwargs)

    monkeypatch.setattr(readers, "fetch_blob", slow_fetch)
    source = next(s for s in SMOLLM_MIXTURE if s.name == "python-edu")
    reader = readers.reader_for(source, seed=0)
    docs = list(reader.documents(start=5))
    rows = [r for shard in sorted((root / "HuggingFaceTB/smollm-corpus/python-edu").glob("*.parquet"))
            for r in pq.read_table(shard).to_pylist()]
    assert [key for key, _ in docs] == [r["blob_id"] for r in rows[5:]]   # order kept, resumed at row 5
    # counted, not timed (a loaded machine must not fail it): several requests were in flight at once
    assert len(threads) > 4 and most[0] > 4, (len(threads), most[0])
