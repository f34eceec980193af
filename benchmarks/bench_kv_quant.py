"""The quantized KV cache on a workflow run's checkpoints: what `mla evaluate --kv-bits` adds, alone.

    python benchmarks/bench_kv_quant.py --workdir DIR [--config config.yaml] [--out kv_quant.json]

For the original model and every fine-tuned checkpoint of a finished run in DIR (the folder given to
`snakemake -d`), with the settings of the config's `evaluate.kv_*` and `needle_*` keys: held-out loss
decoded against the cache at each width, with its paired change from 16 bits; bytes held after
generate against the formula; pass-key accuracy per width; and, for MLA checkpoints, decode tokens/s
with the 4-bit latent cache against the original model's full cache (the checkpoint's own original,
so weights are real on both sides). Widths a cache cannot take are recorded as skipped, with the reason,
as in the eval JSON. Prints one line per checkpoint and writes every result as JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import yaml

from mla.checkpoint import load_model, load_tokenizer
from mla.evaluation import decode, report
from mla.data import load_blocks
from mla.kv import quantized
from mla.study.kv_check import group_size_for
from mla.study import experiments
from mla.study.config_schema import validated


def checkpoints(workdir: Path, cfg: dict) -> list[tuple[str, str, Path]]:
    """(model, start, folder) of each original model and each fine-tuned checkpoint, once."""
    out = []
    for model in dict.fromkeys(v.model for v in experiments.all_variants(cfg)):
        out.append((model, "original", workdir / experiments.model_dir(model)))
        for folder in sorted((workdir / "results" / "finetune" / model).glob("*/*/final")):
            out.append((model, folder.parent.parent.name, folder))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", required=True, type=Path)
    p.add_argument("--config", default="config.yaml")
    p.add_argument("--out", default="kv_quant.json")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--decode", default="1x256", help="BATCHxCONTEXT of the decode timing (none = skip)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfg = validated(yaml.safe_load(Path(args.config).read_text()))
    e = cfg["evaluate"]
    results = []
    for model_key, start, folder in checkpoints(args.workdir, cfg):
        t0 = time.perf_counter()
        model, tok = load_model(folder).eval(), load_tokenizer(folder)
        group = group_size_for(e, model_key)
        blocks = load_blocks(args.workdir / "results" / "data" / experiments.root_model(cfg, model_key), "validation")
        opts = report.EvalOptions(kv_bits=e["kv_bits"], kv_group_size=group, kv_residual=e["kv_residual"],
                                  kv_scored=e["kv_scored"], kv_blocks=e["kv_blocks"],
                                  needle_lengths=e["needle_lengths"], needle_samples=e["needle_samples"])
        losses = report.measure_kv_quant(model, blocks, opts, log=lambda *_: None)   # as `mla evaluate`
        held = losses.pop("bytes")
        res = {"model": model_key, "start": start, "checkpoint": str(folder), "group_size": group,
               "losses": losses, "bytes": held,
               "needle": report.measure_long_context(model, tok, opts, log=lambda *_: None,
                                                     widths=sorted(set(e["kv_bits"]) | {16}, reverse=True),
                                                     longbench=False)["needle"] or {}}
        if quantized.is_mla(model) and args.decode != "none":
            original = load_model(args.workdir / experiments.model_dir(model_key)).eval()
            res["decode"] = decode.decode_grid(model, decode.parse_grid(args.decode), steps=8, rounds=2,
                                               original=original, log=None,
                                               quant=quantized.KVQuant(4, group, e["kv_residual"]))["grid"][0]
        res["seconds"] = round(time.perf_counter() - t0, 1)
        results.append(res)
        bits = res["losses"]["bits"]
        print(f"{model_key}/{start}: " + ", ".join(
            f"{b}-bit {v['mean_loss']:.3f}" + (f" (Δ {v['loss_change']:+.4f} ± {v['loss_change_stderr']:.4f})"
                                                if "loss_change" in v else "")
            for b, v in bits.items() if v.get("status") == "ok")
            + "; pass key " + ", ".join(f"{b}: {100 * v['mean']:.0f}%" for b, v in res["needle"].items()
                                        if v["status"] == "ok")
            + (f"; decode q4/original {res['decode'].get('speedup_q4', float('nan')):.2f}x, absorbed/original "
               f"{res['decode'].get('speedup_absorbed', float('nan')):.2f}x" if "decode" in res else "")
            + f" [{res['seconds']} s]", flush=True)
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
