"""How exactly `mla export --format deepseek_v3` reproduces the MLA model in transformers' DeepseekV3ForCausalLM.

For tiny random Llama models (GQA and MHA, d_h 32/64/128) and, with --smollm2, the real SmolLM2-135M converted
as the default workflow does (d_kv 16, r 4, activation-aware joint SVD) but with `--rope-strategy ladder`:
convert, export (fp32, and bf16 with --bf16), load the export with transformers' own class, and print the
largest |logit difference| on held-out text or random tokens, the greedy tokens' agreement on a few prompts,
the identity latent norm's α range and error, and the residual scale that keeps the source's RMSNorm eps. A bf16
export is compared with the fp32 MLA model, beside the MLA model's own weights rounded to bf16.

    OMP_NUM_THREADS=2 python benchmarks/bench_export.py [--smollm2] [--bf16] [--out export.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path

TINY = {"tiny GQA d_h 64": dict(num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5),
        "tiny MHA d_h 64": dict(num_kv_heads=4, head_dim=64),
        "tiny GQA d_h 128": dict(num_kv_heads=2, head_dim=128),
        "tiny GQA d_h 32": dict(num_kv_heads=2, head_dim=32)}
PROMPTS = ["The for statement in Python", "def fibonacci(n):", "A list comprehension", "import os\n"]


def tiny_case(options: dict, folder: Path):
    """A tiny random Llama converted with the ladder layout; returns (source folder, token prompts)."""
    import torch

    from mla.conversion import calibrate
    from mla.conversion.convert import convert_model
    from mla.tiny_models import tiny_llama, tiny_tokenizer

    model = tiny_llama(**options)
    with torch.no_grad():
        model.lm_head.weight.mul_(50)      # logits of several units, as a trained model's
    blocks = torch.randint(1, 512, (8, 32), generator=torch.Generator().manual_seed(1))
    cal = calibrate.calibration_pass(model, list(blocks), batch_size=4)
    converted, _ = convert_model(model, d_kv=6, r=4, strategy="ladder", scores=cal)
    converted.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    prompts = torch.randint(1, 512, (4, 12), generator=torch.Generator().manual_seed(2))
    return folder, [p[None] for p in prompts], torch.randint(1, 512, (2, 64), generator=torch.Generator().manual_seed(3))


def smollm2_case(folder: Path):
    """SmolLM2-135M converted as the default workflow's conversion, with the ladder layout."""
    import torch
    from pydoc_data.topics import topics

    from mla.checkpoint import load_model, load_tokenizer
    from mla.conversion import calibrate
    from mla.conversion.convert import convert_model
    from mla.sources import smollm2_checkpoint

    src = smollm2_checkpoint()
    model, tok = load_model(src), load_tokenizer(src)
    ids = [torch.tensor(tok(topics[k]).input_ids[:128]) for k in sorted(topics)]
    blocks = [b for b in ids if len(b) == 128]
    cal = calibrate.calibration_pass(model, blocks[:16], batch_size=4, covariance=True)
    converted, _ = convert_model(model, d_kv=16, r=4, strategy="ladder", scores=cal,
                                 covariances={"covariance": cal["covariance"]}, whiten=True)
    converted.save_pretrained(folder)
    tok.save_pretrained(folder)
    prompts = [torch.tensor([tok(p).input_ids]) for p in PROMPTS]
    return folder, prompts, torch.stack(blocks[16:20])


def measure(name: str, src: Path, prompts, text, dtype: str, new_tokens: int = 24) -> dict:
    import torch
    from transformers import DeepseekV3ForCausalLM

    from mla.checkpoint import load_model
    from mla.export.deepseek_v3 import export_checkpoint

    out = src.parent / f"ds-{dtype}"
    t0 = time.perf_counter()
    report = export_checkpoint(src, out, dtype=dtype)
    seconds = time.perf_counter() - t0
    mla, exported = load_model(src), DeepseekV3ForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        expected, got = mla(text).logits, exported(text).logits
    rounding = None
    if dtype != "float32":       # the same weights merely rounded to the dtype: what any such export costs
        rounded = copy.deepcopy(mla).to(getattr(torch, dtype)).to(torch.float32)
        with torch.no_grad():
            rounding = (rounded(text).logits - expected).abs().max().item()
    agree = 0
    for p in prompts:
        greedy = dict(max_new_tokens=new_tokens, do_sample=False, attention_mask=torch.ones_like(p))
        agree += int(torch.equal(mla.generate(p, **greedy), exported.generate(p, **greedy)))
    row = {"model": name, "dtype": dtype, "max_logit_diff": (got - expected).abs().max().item(),
           "max_logit_diff_of_rounding": rounding,
           "max_logit": expected.abs().max().item(), "greedy_equal": agree, "prompts": len(prompts),
           "new_tokens": new_tokens, "alpha_min": min(report["latent_norm_alpha_per_layer"]),
           "alpha_max": max(report["latent_norm_alpha_per_layer"]),
           "latent_error_measured": report["latent_error_measured"], "latent_error_bound": report["latent_error_bound"],
           "rms_norm_eps_source": report["rms_norm_eps_source"], "residual_scale": report["residual_scale"],
           "eps_logit_change_unscaled": report["eps_logit_change_unscaled"], "export_seconds": round(seconds, 1)}
    rounded_text = "" if rounding is None else f" (the MLA model's weights rounded to {dtype}: {rounding:.2e})"
    print(f"{name} [{dtype}]: largest |logit diff| {row['max_logit_diff']:.2e}{rounded_text} (logits up to "
          f"{row['max_logit']:.1f}), "
          f"greedy equal {agree}/{len(prompts)} x {new_tokens} tokens; alpha {row['alpha_min']:.1e}..{row['alpha_max']:.1e}, "
          f"latent norm error {row['latent_error_measured']:.1e} (bound {row['latent_error_bound']:.1e}); eps "
          f"{row['rms_norm_eps_source']:g} -> 1e-06 via residual scale {row['residual_scale']:.4f} (unscaled it would "
          f"move logits by {row['eps_logit_change_unscaled']:.1e}); export {seconds:.1f} s", flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smollm2", action="store_true", help="also the real SmolLM2-135M (a few minutes)")
    p.add_argument("--bf16", action="store_true", help="also export in bfloat16")
    p.add_argument("--out", help="JSON file of the rows")
    args = p.parse_args()

    dtypes = ["float32"] + (["bfloat16"] if args.bf16 else [])
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for i, (name, options) in enumerate(TINY.items()):
            src, prompts, text = tiny_case(options, Path(work) / f"tiny{i}" / "mla")
            rows += [measure(name, src, prompts, text, dtype) for dtype in dtypes]
        if args.smollm2:
            src, prompts, text = smollm2_case(Path(work) / "smollm2" / "mla")
            rows += [measure("SmolLM2-135M", src, prompts, text, dtype) for dtype in dtypes]
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
