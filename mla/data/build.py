"""`build_dataset`: check the request, then stream every source once into both splits, resumably.

Flow: readers (one per source) -> `TokenizedStream` (worker processes, in order) -> per-split queues
-> `SplitPlan` decides which source's document comes next -> `SplitWriter` appends it to disk.
Nothing grows with the corpus: documents are tokenized in bounded batches, a queue holds at most
`QUEUE_TOKENS` tokens (a document that would overflow it is skipped and counted), and tokens go to
disk as they are mixed. The train split drives the reading while it is open; documents of the other
split wait in that split's queue of their source until it takes them.

The output is built in the hidden sibling ``.<out>.partial`` and renamed into place when complete,
so nothing that looks finished exists before the end. Every `checkpoint_tokens` tokens the build
records a checkpoint there (file sizes, source positions, queues, mixing state; files synced first);
a rerun of the same request resumes from the last checkpoint, and a partial folder of another
request is removed. The result is the same whether the build ran in one go or resumed, and whatever
the number of workers.
"""

from __future__ import annotations

import csv
import fcntl
import json
import os
import shutil
import sys
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import numpy as np

from mla import atomic
from mla.data.corpus import SPLITS, check_sources, load_corpus, with_weights
from mla.data.manifest import MANIFEST, DataRequest, read_manifest, tokenizer_fingerprint
from mla.data.mix import SplitPlan
from mla.data.readers import READERS, reader_for
from mla.data.tokenize import Doc, TokenizedStream, TokenizerPool, tokenizer_info
from mla.data.writer import SplitWriter
from mla.errors import UserError
from mla.sources import sha256_of
from mla.options import DEFAULT_VALIDATION_FRACTION, DEFAULT_VALIDATION_TOKENS

CHECKPOINT_TOKENS = 1 << 26   # ~67M tokens between resume checkpoints (~190 for the paper's 12.6B)
QUEUE_TOKENS = 1 << 20        # per source and split: documents read for the other split wait here
STATE = "state.json"
FLAGS = {"train": "--train-tokens", "validation": "--validation-tokens"}


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def build_dataset(corpus: str, tokenizer_path: str | os.PathLike, out_dir: str | os.PathLike, *,
                  block_length: int = 2048, train_tokens: int | None = None,
                  validation_tokens: int | None = DEFAULT_VALIDATION_TOKENS,
                  validation_fraction: float = DEFAULT_VALIDATION_FRACTION,
                  seed: int = 0, workers: int | None = None, weights: dict[str, float] | None = None,
                  force: bool = False, log=print, checkpoint_tokens: int = CHECKPOINT_TOKENS,
                  on_checkpoint=None) -> dict:
    """Build (or reuse, or resume) the data folder `out_dir`; returns its manifest.

    `train_tokens` / `validation_tokens`: exact budgets (each split holds budget // block_length blocks
    unless the corpus runs dry, which the manifest and log report); None = until the first source of
    the split runs dry (local corpora only). `weights` overrides named sources' mixture weights.
    `on_checkpoint(n)` is called after the n-th resumable state is written (the tests kill the build there).
    """
    budgets = {"train": train_tokens, "validation": validation_tokens}
    workers = default_workers() if workers is None else workers
    tokenizer_path, out_dir = Path(tokenizer_path), Path(out_dir)
    corpus_name, sources = _check_request(corpus, tokenizer_path, block_length, budgets, validation_fraction,
                                          workers, weights)
    request = DataRequest(corpus_name, [asdict(s) for s in sources], tokenizer_fingerprint(tokenizer_path),
                          block_length, train_tokens, validation_tokens, validation_fraction, seed)
    if (out_dir / MANIFEST).is_file():
        old = read_manifest(out_dir)
        if old.get("request") == asdict(request):
            log(f"{out_dir} is up to date (same corpus, tokenizer, block length, budgets and seed)")
            return old
        if not force:
            raise UserError(f"{out_dir} holds data built from a different request; pass --force to rebuild")
    elif out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not force:
        raise UserError(f"{out_dir} exists, is not empty and has no {MANIFEST}; pass --force to replace it")

    info = tokenizer_info(tokenizer_path)
    # The workers fork now, before any reader starts a thread (datasets' HTTP loop, blob fetchers).
    pool = TokenizerPool(tokenizer_path, info, workers)
    try:
        readers = {s.name: reader_for(s, seed) for s in sources}
        for reader in readers.values():  # missing folders, empty sources, unreachable datasets: before any work
            reader.check()
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        with _exclusive(out_dir):
            partial = out_dir.with_name(f".{out_dir.name}.partial")
            manifest = _load_if_same_request(partial / MANIFEST, request)
            if manifest is not None:  # a complete build, killed between the last write and the rename
                log(f"{out_dir}: moving the finished build from {partial} into place")
            else:
                state = _resumable_state(partial, request, log)
                try:
                    manifest = _Build(request, sources, readers, pool, tokenizer_path, info, budgets, partial, state,
                                      checkpoint_tokens, log, on_checkpoint).run()
                except UserError:  # the request cannot succeed: nothing worth resuming
                    shutil.rmtree(partial, ignore_errors=True)
                    raise
            atomic.replace_dir(partial, out_dir)
    except BaseException:
        pool.close(abort=True)
        raise
    pool.close()
    return manifest


def _check_request(corpus, tokenizer_path, block_length, budgets, fraction, workers, weights):
    if block_length < 2:
        raise UserError(f"--block-length must be >= 2, got {block_length}")
    if not 0 < fraction < 1:
        raise UserError(f"--validation-fraction must be in (0, 1), got {fraction}")
    if workers < 1:
        raise UserError(f"--workers must be >= 1, got {workers}")
    for split, budget in budgets.items():
        if budget is not None and budget < block_length:
            raise UserError(f"{FLAGS[split]} {budget} is smaller than one block ({block_length} tokens)")
    corpus_name, sources = load_corpus(corpus)
    sources = with_weights(sources, weights, corpus_name)
    check_sources(sources, READERS)
    if not tokenizer_path.is_dir():
        raise UserError(f"tokenizer folder {tokenizer_path} does not exist")
    config = tokenizer_path / "config.json"
    if config.is_file():
        context = json.loads(config.read_text()).get("max_position_embeddings")
        if context is not None and block_length > context:
            raise UserError(f"--block-length {block_length} exceeds the model's context: max_position_embeddings "
                            f"{context} in {config}")
    if any(s.kind == "hub" for s in sources):
        for split, budget in budgets.items():
            if budget is None:
                raise UserError(f"corpus {corpus_name!r} streams Hub datasets, which have no end here: "
                                f"{FLAGS[split]} is required")
    return corpus_name, sources


@contextmanager
def _exclusive(out: Path):
    """An advisory lock next to `out`: two builds of one folder at once would corrupt each other."""
    path = out.with_name(f".{out.name}.lock")
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UserError(f"another `mla data` is building {out} right now") from None
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)  # releases the lock (a killed process releases it too)


def _load_if_same_request(path: Path, request: DataRequest) -> dict | None:
    """The JSON record at `path` if it was written for this very request (None if missing or unreadable)."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return saved if saved.get("request") == asdict(request) else None


def _resumable_state(partial: Path, request: DataRequest, log) -> dict | None:
    """The last checkpoint of an interrupted build of the same request; anything else is removed."""
    if not partial.exists():
        return None
    state = _load_if_same_request(partial / STATE, request)
    if state is None:
        log(f"removing {partial}: an interrupted build of another request, or one without a checkpoint")
        shutil.rmtree(partial)
    return state


class _Build:
    def __init__(self, request, sources, readers, pool, tokenizer_path, info, budgets, partial, state,
                 checkpoint_tokens, log, on_checkpoint=None):
        self.request, self.readers, self.pool = request, readers, pool
        self.names = [s.name for s in sources]
        self.split_names = {s.name: s.split_name for s in sources}
        self.tokenizer_path, self.info = tokenizer_path, info
        self.partial, self.state, self.checkpoint_tokens = partial, state, checkpoint_tokens
        self.log, self.on_checkpoint = log, on_checkpoint
        if state is None:
            length = request.block_length  # a budget is met in whole blocks
            weights = [s.weight for s in sources]
            self.plans = {s: SplitPlan(self.names, weights, None if b is None else b // length * length)
                          for s, b in budgets.items()}
            self.checkpoints, self.positions, self.exhausted = 0, dict.fromkeys(self.names, 0), set()
            self.skipped = {n: dict.fromkeys(SPLITS, 0) for n in self.names}
            self.tokens_cut = dict.fromkeys(SPLITS, 0)
            self.blobs_before = dict.fromkeys(self.names, 0)
        else:
            self.plans = {s: SplitPlan(**state["plans"][s]) for s in SPLITS}
            self.checkpoints, self.positions = state["checkpoints"], state["positions"]
            self.exhausted = set(state["exhausted"])
            self.skipped, self.tokens_cut = state["skipped"], state["tokens_cut"]
            self.blobs_before = state["blobs_missing"]  # the readers count only the blobs they miss themselves
        self.queues = {n: {s: deque() for s in SPLITS} for n in self.names}
        self.queued = {n: dict.fromkeys(SPLITS, 0) for n in self.names}
        self.writers = {s: SplitWriter(partial, s, info.dtype) for s in SPLITS}
        self.since_checkpoint = 0
        self.started = time.time()
        self.last_log = self.started
        self.tokens_at_start = sum(p.written for p in self.plans.values())

    # -------------------------------------------------------------------------------- run

    def run(self) -> dict:
        if self.state is None:
            self.partial.mkdir(parents=True)
        self.streams = {}
        try:
            for n in self.names:
                self.streams[n] = TokenizedStream(self.split_names[n], self.readers[n], self.pool,
                                                  self.request.validation_fraction, self._wanted,
                                                  start=self.positions[n])
                self.streams[n].exhausted = n in self.exhausted
            self._open_outputs()
            self._mix()
            return self._finish()
        finally:
            for w in self.writers.values():
                w.close()
            for stream in self.streams.values():
                stream.close()

    def _open_outputs(self) -> None:
        if self.state is None:
            for w in self.writers.values():
                w.open()
            self._checkpoint()  # checkpoint 0: a build killed from here on resumes
            return
        for s, w in self.writers.items():
            w.open(self.state["writers"][s])
        queues = np.load(self.partial / self.state["queues"])
        for entry in self.state["queued"]:
            ids = np.split(queues[entry["array"]], np.cumsum(entry["lengths"])[:-1])
            for (position, key), doc_ids in zip(entry["documents"], ids):
                self._enqueue(entry["source"], Doc(position, key, entry["split"], doc_ids))
        self.log(f"resuming from checkpoint {self.checkpoints}: "
                 + ", ".join(f"{s} {self.plans[s].written:,} tokens" for s in SPLITS))

    def _wanted(self, split: str) -> bool:
        return not self.plans[split].done

    def _open_splits(self) -> list[str]:
        return [s for s in SPLITS if not self.plans[s].done]

    def _enqueue(self, name: str, doc: Doc) -> None:
        self.queues[name][doc.split].append(doc)
        self.queued[name][doc.split] += len(doc.ids)

    def _dequeue(self, name: str, split: str) -> Doc:
        doc = self.queues[name][split].popleft()
        self.queued[name][split] -= len(doc.ids)
        return doc

    def _choose(self, split: str) -> int | None:
        """The source the split takes next; sources with nothing left for it are marked dry."""
        plan = self.plans[split]
        while True:
            i = plan.next_source()
            if i is None:
                return None
            name = self.names[i]
            if not (self.streams[name].exhausted and not self.queues[name][split]):
                return i
            plan.mark_dry(i)
            if plan.budget is not None and not plan.done:
                self.log(f"warning: source {name} ran dry in the {split} split after {plan.tokens[i]:,} tokens "
                         f"(configured share {plan.shares()[name]['configured_share']:.3f}); "
                         f"the other sources fill its share")

    def _mix(self) -> None:
        while self._open_splits():
            if self._take_queued():
                continue
            # Train drives the reading while it takes documents: validation is the small split and gets
            # its documents as a by-product (1 in 1/fraction), so no train document waits for a held-out one.
            open_splits = self._open_splits()  # choosing may have marked a split's last sources dry
            if open_splits:
                self._read(open_splits[0])

    def _take_queued(self) -> bool:
        """Every open split writes its next document if earlier reads queued it; False if none could."""
        took = False
        for split in self._open_splits():
            i = self._choose(split)
            if i is not None and self.queues[self.names[i]][split]:
                self._write(split, i, self._dequeue(self.names[i], split))
                took = True
        return took

    def _read(self, split: str) -> None:
        """Read one document from the source `split` takes next and queue it for the split it belongs to."""
        i = self._choose(split)
        if i is None:
            return
        name = self.names[i]
        doc = self.streams[name].next()
        self.positions[name] = self.streams[name].position
        if doc is None:
            self.exhausted.add(name)
            return
        if self.plans[doc.split].done:
            return
        if doc.split != split and self.queued[name][doc.split] + len(doc.ids) > QUEUE_TOKENS:
            self.skipped[name][doc.split] += 1  # bounded memory: this document is never used
            return
        self._enqueue(name, doc)

    def _write(self, split: str, i: int, doc: Doc) -> None:
        plan, ids = self.plans[split], doc.ids
        room = plan.room(i)
        if room is not None and len(ids) > room:  # the source's quota is met: cut, keep the EOS
            self.tokens_cut[split] += len(ids) - room
            ids = np.concatenate([ids[:room - 1], ids[-1:]])
        self.writers[split].append(self.names[i], doc.key, ids)
        plan.record(i, len(ids))
        self.since_checkpoint += len(ids)
        if self.since_checkpoint >= self.checkpoint_tokens:
            self._checkpoint()
        elif time.time() - self.last_log > 60:
            self._progress()

    # -------------------------------------------------------------------------------- checkpoints

    def _checkpoint(self) -> None:
        """Sync the outputs, then atomically record where every stream and split stands."""
        sizes = {s: w.sync() for s, w in self.writers.items()}
        self.checkpoints += 1
        queues_file, queued = self._save_queues()
        state = {"request": asdict(self.request), "checkpoints": self.checkpoints, "writers": sizes,
                 "plans": {s: p.state() for s, p in self.plans.items()}, "positions": self.positions,
                 "exhausted": sorted(self.exhausted), "skipped": self.skipped, "tokens_cut": self.tokens_cut,
                 "blobs_missing": self._blobs_missing(), "queues": queues_file, "queued": queued}
        atomic.write_json(self.partial / STATE, state, indent=None)
        for old in self.partial.glob("queues-*.npz"):
            if old.name != queues_file:
                old.unlink()
        self.since_checkpoint = 0
        if self.checkpoints > 1:
            self._progress()
        if self.on_checkpoint is not None:
            self.on_checkpoint(self.checkpoints)

    def _save_queues(self) -> tuple[str, list[dict]]:
        """Write the queued documents' ids to this checkpoint's (synced) .npz; its name and the index of it."""
        arrays, queued = {}, []
        for n in self.names:
            for s in SPLITS:
                docs = self.queues[n][s]
                if docs:
                    name = f"q{len(arrays)}"
                    arrays[name] = np.concatenate([d.ids for d in docs])
                    queued.append({"source": n, "split": s, "array": name, "lengths": [len(d.ids) for d in docs],
                                   "documents": [[d.position, d.key] for d in docs]})
        queues_file = f"queues-{self.checkpoints}.npz"
        with open(self.partial / queues_file, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        return queues_file, queued

    def _blobs_missing(self) -> dict[str, int]:
        """Blobs found missing per source, those of the runs before a resume included."""
        return {n: self.blobs_before[n] + getattr(reader, "blobs_missing", 0) for n, reader in self.readers.items()}

    def _progress(self) -> None:
        self.last_log = time.time()
        new = sum(p.written for p in self.plans.values()) - self.tokens_at_start
        rate = new / max(self.last_log - self.started, 1e-9)
        self.log("progress: " + ", ".join(
            f"{s} {p.written:,}" + (f"/{p.budget:,}" if p.budget else "") for s, p in self.plans.items())
            + f" tokens; {rate:,.0f} tokens/s with {self.pool.workers} workers")

    # -------------------------------------------------------------------------------- the end

    def _finish(self) -> dict:
        warnings = []
        splits = {s: self._finish_split(s, warnings) for s in SPLITS}
        for line in warnings:
            self.log(f"warning: {line}")
        blobs_missing = self._blobs_missing()
        manifest = {
            "request": asdict(self.request),
            "corpus": self.request.corpus,
            "tokenizer": str(self.tokenizer_path.resolve()),
            "block_length": self.request.block_length,
            "eos_token_id": self.info.eos,
            "vocab_size": self.info.vocab_size,
            "dtype": self.info.dtype,
            "splits": splits,
            "sources": {n: {"documents_read": self.positions[n], "exhausted": n in self.exhausted,
                            "documents_skipped": self.skipped[n], "blobs_missing": blobs_missing[n]}
                        for n in self.names},
            "warnings": warnings,
            "workers": self.pool.workers,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "python": sys.version.split()[0],
        }
        for leftover in [self.partial / STATE, *self.partial.glob("queues-*.npz")]:
            leftover.unlink()
        atomic.write_json(self.partial / MANIFEST, manifest)
        return manifest

    def _finish_split(self, split: str, warnings: list[str]) -> dict:
        """Cut the split's files to whole blocks; its manifest entry (its warnings are appended to `warnings`)."""
        L = self.request.block_length
        plan, writer = self.plans[split], self.writers[split]
        n_blocks, dropped = writer.finish(L)
        if n_blocks == 0:
            raise UserError(f"the {split} split has fewer than {L} tokens (the corpus ran dry); lower the block "
                            f"length or raise --validation-fraction, or use a larger corpus")
        kept = n_blocks * L
        shares = plan.shares()
        sources = {n: {"documents": plan.documents[i], "tokens": plan.tokens[i], **shares[n]}
                   for i, n in enumerate(self.names)}
        if dropped:  # the tail beyond the last full block no longer counts for its source
            self._drop_tail(split, sources, kept)
        if plan.budget is not None and kept < plan.budget:
            warnings.append(f"the {split} split holds {kept:,} tokens, not the {plan.budget:,} asked: "
                            f"every source ran dry")
        for n, entry in sources.items():
            entry["share"] = round(entry["tokens"] / kept, 6)
            off = abs(entry["share"] - entry["configured_share"]) > 0.01
            if plan.budget is not None and entry["ran_dry"] and off:
                warnings.append(f"the {split} split's share of source {n} is {entry['share']:.3f}, not the "
                                f"configured {entry['configured_share']:.3f}: it ran dry")
        self.log(f"{split}: {n_blocks:,} blocks x {L} tokens from "
                 + ", ".join(f"{n} {e['documents']:,} docs/{e['tokens']:,} tokens ({e['share']:.3f} of "
                             f"{e['configured_share']:.3f})" for n, e in sources.items()))
        return {"file": writer.tokens_path.name, "documents_file": writer.documents_path.name,
                "n_blocks": int(n_blocks), "tokens": int(kept), "budget_tokens": plan.budget,
                "tokens_dropped": int(dropped), "tokens_cut": int(self.tokens_cut[split]),
                "documents": int(sum(e["documents"] for e in sources.values())),
                "sources": sources, "sha256": sha256_of(writer.tokens_path),
                "documents_sha256": sha256_of(writer.documents_path)}

    def _drop_tail(self, split: str, sources: dict, kept: int) -> None:
        """Subtract the tokens past `kept` (the tail that fills no block) from their documents' sources.

        Only a split that ran dry has such a tail; its TSV is streamed once (constant memory)."""
        with open(self.writers[split].documents_path, newline="") as f:
            for row in csv.DictReader(f, delimiter="\t"):
                offset, tokens = int(row["offset"]), int(row["tokens"])
                if offset + tokens > kept:
                    sources[row["source"]]["tokens"] -= offset + tokens - max(offset, kept)
                    if offset >= kept:
                        sources[row["source"]]["documents"] -= 1
