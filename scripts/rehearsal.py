"""Offline rehearsal of `configs/paper.yaml`: the paper's DAG at tiny size, with only locations swapped.

`scripts/paper-rehearsal DIR` (= `python scripts/rehearsal.py DIR`) does it all:

1. Stand-ins under DIR for what lives on the Hugging Face Hub (everything else is the real thing):
   - `DIR/hf`: a pre-filled Hugging Face cache (`HF_HOME`, the hub cache layout: `hub/models--<org>--<name>/`
     with `blobs/`, `snapshots/<sha>/` links and `refs/<branch>`) holding tiny random Llamas under the paper's
     repo ids at the paper's revisions: MHA under Llama-2-7B, GQA under SmolLM-135M, saved in the dtype of
     the real repository, each with a small real tokenizer. `mla download --source hub` reads them with
     `HF_HUB_OFFLINE=1` through huggingface_hub's own cache lookup.
   - `DIR/datasets`: the smollm mixture in its real schema (`mla.data.mirror.write_smollm_mirror`;
     `MLA_HUB_DATASETS_MIRROR`, `MLA_SWH_CONTENT_URL`).
   - `DIR/lm-eval`: a few rows of each of the paper's six lm-eval tasks and of LongBench's 16 English
     subsets in their schemas (`mla.evaluation.harness.write_local_task_data`,
     `mla.evaluation.longbench.write_local_data`; `MLA_LM_EVAL_DATA`), which `mla prefetch` passes on.
2. A copy of the workflow (Snakefile, workflow/, configs/) in DIR, run there with
   `--configfile configs/paper.yaml configs/paper-rehearsal.yaml` (the overlay changes sizes only).
3. Checks of the outputs: every evaluation, table and figure; the paper tasks and LongBench scored
   (numbers, not "skipped"), the staged documents read offline; training with the paper's process count > 1, bf16 (the start model loaded in bf16, the
   micro-batches summed in fp32), gradient accumulation and ZeRO stage; conversions of the bf16 source written
   in bf16; data holding exactly the budgets of `mla.study.budgets`. Any failure: exit status 1 and the reasons.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # the checkout's package, without installing
from mla.study.config_schema import validated  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PAPER = "configs/paper.yaml"
OVERLAY = "configs/paper-rehearsal.yaml"
WORKFLOW_FILES = ("Snakefile", "config.yaml", "workflow", "configs")

# dtype each real repository stores its weights in (Llama-2-7b-hf: fp16 shards; SmolLM-135M: 269 MB of bf16)
HUB_DTYPES = {"meta-llama/Llama-2-7b-hf": "float16", "HuggingFaceTB/SmolLM-135M": "bfloat16"}
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
DOCS_PER_SOURCE = 64     # documents per smollm source in the mirror: more than the tiny budgets read
SMOLLM_SOURCES = ("fineweb-edu-dedup", "cosmopedia-v2", "python-edu", "open-web-math", "stackoverflow-clean")
ROWS_PER_TASK = 8        # rows per lm-eval task (evaluate.paper_limit reads at most that many)
LONGBENCH_ROWS = 2       # rows per LongBench subset (evaluate.longbench_limit)


# ---------------------------------------------------------------- stand-in: the Hugging Face cache
def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def write_hub_cache(hub_cache: Path, repo_id: str, revision: str, files: Path) -> Path:
    """Put the files of folder `files` into `hub_cache` as repo `repo_id` at `revision`; return the snapshot.

    The layout is huggingface_hub's: content-addressed `blobs/` (sha256 for weights, git sha1 otherwise, like
    the Hub's etags), `snapshots/<commit>/<file>` as relative links to them, and `refs/<revision>` naming the
    commit when `revision` is a branch or tag (a commit hash names its snapshot directly).
    """
    repo = hub_cache / ("models--" + repo_id.replace("/", "--"))
    is_commit = re.fullmatch("[0-9a-f]{40}", revision) is not None
    contents = {p.name: p.read_bytes() for p in sorted(files.iterdir()) if p.is_file()}
    commit = revision if is_commit else hashlib.sha1(
        b"".join(name.encode() + _git_blob_sha1(data).encode() for name, data in contents.items())).hexdigest()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for name, data in contents.items():
        etag = hashlib.sha256(data).hexdigest() if name.endswith(".safetensors") else _git_blob_sha1(data)
        (repo / "blobs" / etag).write_bytes(data)
        link = snapshot / name
        link.unlink(missing_ok=True)
        link.symlink_to(Path("..") / ".." / "blobs" / etag)
    (repo / "refs").mkdir(exist_ok=True)
    if not is_commit:
        (repo / "refs" / revision).write_text(commit)
    return snapshot


def tiny_hub_model(out: Path, *, num_kv_heads: int, dtype: str, seed: int) -> Path:
    """A tiny random Llama (hidden 64, 2 layers, 4 query heads) with a real small tokenizer, in `dtype`."""
    import torch

    from mla import tiny_models

    model = tiny_models.tiny_llama(num_kv_heads=num_kv_heads, seed=seed, **TINY)
    model.to(getattr(torch, dtype)).save_pretrained(out)
    tiny_models.tiny_tokenizer(model.config.vocab_size).save_pretrained(out)
    return out


def write_model_cache(hf_home: Path, paper: dict, work: Path) -> dict[str, Path]:
    """Every Hub model of the paper config as a tiny stand-in in `hf_home`; MHA where the repo is Llama-2."""
    snapshots = {}
    for i, (name, model) in enumerate(sorted(paper["models"].items())):
        if model["source"] != "hub":
            continue
        repo_id, revision = model["repo_id"], model.get("revision", "main")
        # Llama-2-7B is MHA (32 K/V heads for 32 query heads); the others here are GQA like SmolLM-135M
        kv_heads = TINY["num_attention_heads"] if "Llama-2" in repo_id else TINY["num_attention_heads"] // 2
        files = tiny_hub_model(work / name, num_kv_heads=kv_heads, dtype=HUB_DTYPES.get(repo_id, "float32"), seed=i)
        snapshots[name] = write_hub_cache(hf_home / "hub", repo_id, revision, files)
        shutil.rmtree(files)
    return snapshots


# ---------------------------------------------------------------- the configuration as the workflow sees it
def load_config(*paths: str | Path) -> dict:
    """Config files merged in order as Snakemake merges several --configfile, then validated."""
    from snakemake.utils import update_config

    cfg: dict = {}
    for path in paths:
        update_config(cfg, yaml.safe_load(Path(path).read_text()) or {})
    return validated(cfg)


# ---------------------------------------------------------------- stand-ins and workflow copy
@contextlib.contextmanager
def _timed(what: str, log):
    t0 = time.perf_counter()
    yield
    log(f"stand-ins: {what} ({time.perf_counter() - t0:.1f} s)")


def prepare(workdir: Path, *, log=print) -> dict[str, str]:
    """Build every offline stand-in under `workdir`; return the environment the workflow runs with."""
    workdir.mkdir(parents=True, exist_ok=True)
    marker = workdir / "stand-ins.json"
    if marker.is_file():
        log(f"stand-ins: reusing {marker}")
        return json.loads(marker.read_text())
    paper = yaml.safe_load((ROOT / PAPER).read_text())
    env = {"HF_HOME": str(workdir / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    hub_repos = ", ".join(m["repo_id"] for m in paper["models"].values() if m["source"] == "hub")
    with _timed(f"Hugging Face cache with {hub_repos}", log), tempfile.TemporaryDirectory(dir=workdir) as build:
        write_model_cache(workdir / "hf", paper, Path(build))
    from mla.data.mirror import write_smollm_mirror
    from mla.evaluation import longbench
    from mla.evaluation.harness import write_local_task_data

    with _timed("smollm mixture mirror", log):
        env.update(write_smollm_mirror(workdir / "datasets", docs_per_source=DOCS_PER_SOURCE))
    with _timed("lm-eval task rows", log):
        env.update(write_local_task_data(workdir / "lm-eval", rows_per_task=ROWS_PER_TASK))
        env.update(longbench.write_local_data(workdir / "lm-eval", rows_per_task=LONGBENCH_ROWS))
    env = {k: str(v) for k, v in env.items()}
    marker.write_text(json.dumps(env, indent=2) + "\n")
    return env


def copy_workflow(workdir: Path) -> None:
    """The workflow's files (not the package: jobs run the installed `mla`) into `workdir`."""
    for name in WORKFLOW_FILES:
        src, dst = ROOT / name, workdir / name
        if src.is_dir():
            shutil.copytree(src, dst, dirs_exist_ok=True)
        else:
            shutil.copy2(src, dst)


# One core per job (tiny models gain nothing from two threads), so two jobs overlap on a 2-core machine;
# training keeps its `threads: 2`, one per process. Later --set-threads arguments override these.
ONE_THREAD = ("download", "data", "calibrate", "convert", "fit", "evaluate", "evaluate_inference")


def run_workflow(workdir: Path, env: dict[str, str], extra: list[str], *, log=print) -> int:
    cmd = [sys.executable, "-m", "snakemake", "--cores", "all", "--show-failed-logs",
           "--set-threads", *(f"{rule}=1" for rule in ONE_THREAD), *extra, "--configfile", PAPER, OVERLAY]
    log(f"rehearsal: cd {workdir} && {' '.join(f'{k}={v}' for k, v in env.items())} {' '.join(cmd)}")
    return subprocess.call(cmd, cwd=workdir, env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **env})


# ---------------------------------------------------------------- checks of the outputs
def _number(text) -> float | None:
    """A table cell as a number ('0.25', '0.25 ± 0.03'); None for anything else ('skipped', '')."""
    try:
        value = float(str(text).split("±")[0].strip())
    except ValueError:
        return None
    return None if math.isnan(value) else value  # NaN is not a score


def _table_problems(table: Path, where: Path, checkpoints: int, widths: list[int]) -> list[str]:
    """An experiment's table: one row per checkpoint and per quantized-cache width, every paper task a number."""
    import csv

    from mla.study import paper_numbers

    problems = []
    rows = list(csv.DictReader(table.open()))
    cache_rows = [r for r in rows if r.get("cache bits") not in (None, "", "16")]
    rows = [r for r in rows if r not in cache_rows]    # a quantized-cache row measures the cache alone
    if len(cache_rows) != checkpoints * len(widths):
        problems.append(f"{where}: {len(cache_rows)} quantized-cache rows, expected "
                        f"{checkpoints * len(widths)} ({len(widths)} widths x {checkpoints} checkpoints)")
    if any(_number(r.get("cache-decoded loss")) is None for r in cache_rows):
        problems.append(f"{where}: a quantized-cache row without its decoded loss")
    if len(rows) != checkpoints:
        problems.append(f"{where}: {len(rows)} rows, expected {checkpoints}")
    for task in paper_numbers.TASKS:
        title = paper_numbers.TASK_TITLES[task]
        column = next((h for h in (rows[0] if rows else {}) if h.split(" ±")[0].split(" (")[0] == title
                       and "(paper)" not in h and not h.startswith("Δ")), None)
        if column is None:
            problems.append(f"{where}: no column {title}")
        elif any(_number(r[column]) is None for r in rows):
            problems.append(f"{where}: column {column} is not a number in every row ({[r[column] for r in rows]})")
    return problems


def _longbench_problems(path: str, ev: dict, cfg: dict) -> list[str]:
    """LongBench ran offline from the staged documents: 16 scores on `longbench_limit` rows each, a mean."""
    if cfg["evaluate"]["longbench"] == "off":
        return []
    lb = (ev.get("long_context") or {}).get("longbench") or {}
    scores = lb.get("scores") or {}
    want_n = min(cfg["evaluate"]["longbench_limit"] or LONGBENCH_ROWS, LONGBENCH_ROWS)
    if lb.get("status") != "ok" or _number(lb.get("mean")) is None:
        return [f"{path}: LongBench {lb.get('status')} ({lb.get('skipped') or lb.get('missing')})"]
    if not str(lb.get("documents", "")).startswith("local files") or len(scores) != 16 or \
            any(s.get("n") != want_n for s in scores.values()):
        return [f"{path}: LongBench read {lb.get('documents')}, {len(scores)} tasks, n "
                f"{sorted({s.get('n') for s in scores.values()})}; expected the staged rows, 16 tasks, n {want_n}"]
    return []


def check_outputs(workdir: Path) -> list[str]:
    """Everything the rehearsal must have produced, as a list of problems (empty = passed)."""
    from mla.study import budgets, experiments, paper_numbers
    from mla.study.tables import merged_evaluation

    cfg = load_config(workdir / PAPER, workdir / OVERLAY)
    res = workdir / "results"
    problems = []

    def load_json(path: Path) -> dict | None:
        if not path.is_file():
            problems.append(f"{path.relative_to(workdir)}: missing")
            return None
        return json.loads(path.read_text())

    for name, model in cfg["models"].items():  # the stand-ins' attention kind came through the cache
        c = load_json(res / "models" / name / "config.json")
        if c and model["source"] == "hub":
            mha = c["num_key_value_heads"] == c["num_attention_heads"]
            if mha != ("Llama-2" in model["repo_id"]):
                problems.append(f"results/models/{name}: num_key_value_heads {c['num_key_value_heads']} "
                                f"for {c['num_attention_heads']} heads; expected {'MHA' if not mha else 'GQA'}")
    for root in dict.fromkeys(budgets.root_model(cfg, e["model"]) for e in cfg["experiments"].values()):
        m = load_json(res / "data" / root / "manifest.json")
        if not m:
            continue
        length = budgets.block_length(cfg, root)
        want = {"train": budgets.train_tokens(cfg, root),
                "validation": budgets.validation_tokens(cfg, root) // length * length}
        if m.get("block_length") != length:
            problems.append(f"results/data/{root}: block_length {m.get('block_length')}, configured {length}")
        for split, tokens in want.items():
            got = m["splits"][split]["tokens"]
            if got != tokens:
                problems.append(f"results/data/{root}: {split} holds {got} tokens, the budget is {tokens}")
        # the mixture path ran: every source of the smollm corpus (python-edu via blob fetches) gave tokens
        sources = m["splits"]["train"].get("sources", {})
        empty = [name for name, s in sources.items() if not s.get("tokens")]
        if len(sources) != len(SMOLLM_SOURCES) or empty:
            problems.append(f"results/data/{root}: train sources {sorted(sources)}, without tokens {empty}; "
                            f"expected the {len(SMOLLM_SOURCES)} sources of the smollm mixture")
    the_study = experiments.Study(cfg)
    for ename in cfg["experiments"]:
        for v in the_study.experiment(ename):
            t = v.train
            run = load_json(workdir / v.run_dir / "run.json")
            if not run:
                continue
            accum = t["batch_size"] // (t["micro_batch_size"] * t["nproc"])
            got_want = {"processes": (run["world_size"], t["nproc"]), "precision": (run["precision"], t["precision"]),
                        "accumulation": (run["config"].get("grad_accum"), accum),
                        "zero_stage": (run["config"].get("zero_stage"), t["zero_stage"]),
                        "steps": (run["steps"], t["steps"]),
                        # every rank loads the start model in the training dtype; the micro-batches sum in fp32
                        "loaded dtype": (run.get("loaded_dtype"), "bfloat16" if t["precision"] == "bf16" else "float32"),
                        "gradient accumulation dtype": (run.get("grad_accum_dtype"), "float32")}
            for key, (got, want) in got_want.items():
                if got != want:
                    problems.append(f"{v.run_dir}/run.json: {key} {got}, configured {want}")
            if run.get("train_loss") is None:
                problems.append(f"{v.run_dir}/run.json: no finite training loss")
            if v.is_baseline:
                continue
            conv = load_json(workdir / v.convert_dir / "conversion.json")
            configured_d_kv = (conv or {}).get("d_kv") if v.d_kv is None else v.d_kv   # a width budget: no d_kv
            source = v.model
            want_dtype = "bfloat16" if HUB_DTYPES.get(cfg["models"][source].get("repo_id")) == "bfloat16" else "float32"
            if conv and conv.get("saved_dtype") != want_dtype:   # conversions of a bf16 source are written in bf16
                problems.append(f"{v.convert_dir}/conversion.json: saved in {conv.get('saved_dtype')}, expected "
                                f"{want_dtype} (the source stores {HUB_DTYPES.get(cfg['models'][source].get('repo_id'))})")
            if conv and (conv.get("d_kv"), conv.get("rope_strategy"), conv.get("svd")) != (configured_d_kv,
                                                                                       v.rope_strategy, v.svd):
                problems.append(f"{v.convert_dir}/conversion.json: d_kv {conv.get('d_kv')}, "
                                f"{conv.get('rope_strategy')}, {conv.get('svd')}; configured {v.d_kv}, "
                                f"{v.rope_strategy}, {v.svd}")
        evaluated = the_study.evaluated(ename)
        inference_paths = dict(the_study.inference_measured(ename))   # LongBench: the inference job's JSON
        for name, path, _ in evaluated:
            ev = load_json(workdir / path)
            if not ev:
                continue
            paper = (ev.get("benchmarks") or {}).get("paper") or {}
            scores = paper.get("scores") or {}
            bad = [t for t in paper_numbers.TASKS if _number(scores.get(t)) is None]
            if paper.get("status") != "ok" or bad:
                problems.append(f"{path}: paper tasks {paper.get('status')}"
                                f" ({paper.get('reason') or 'no score for ' + ', '.join(bad)})")
            inference_path = inference_paths[name]
            inference = load_json(workdir / inference_path) or {}
            problems += _longbench_problems(inference_path, merged_evaluation(ev, inference), cfg)
        table = res / "tables" / f"{ename}.csv"
        if not table.is_file() or not (res / "tables" / f"{ename}.md").is_file():
            problems.append(f"results/tables/{ename}.csv/.md: missing")
            continue
        widths = [b for b in cfg["evaluate"]["kv_bits"] if b != 16]
        problems += _table_problems(table, table.relative_to(workdir), len(evaluated), widths)
    for name, magic in (("loss.png", b"\x89PNG"), ("loss.pdf", b"%PDF")):
        path = res / "figures" / name
        if not path.is_file() or not path.read_bytes().startswith(magic):
            problems.append(f"results/figures/{name}: missing or not a {name[-3:].upper()} file")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/paper-rehearsal", description=__doc__.splitlines()[0])
    parser.add_argument("dir", help="work folder: stand-ins, the workflow copy and its results")
    parser.add_argument("snakemake_args", nargs=argparse.REMAINDER,
                        help="extra Snakemake arguments (after the folder), e.g. --cores 2")
    args = parser.parse_args(argv)
    workdir = Path(args.dir).resolve()
    t0 = time.perf_counter()
    env = prepare(workdir)
    copy_workflow(workdir)
    status = run_workflow(workdir, env, args.snakemake_args)
    if status != 0:
        print(f"paper-rehearsal: error: snakemake exited with status {status} (logs under {workdir}/logs)",
              file=sys.stderr)
        return 1
    problems = check_outputs(workdir)
    for p in problems:
        print(f"paper-rehearsal: error: {p}", file=sys.stderr)
    if problems:
        return 1
    print(f"paper-rehearsal: passed in {time.perf_counter() - t0:.0f} s ({workdir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
