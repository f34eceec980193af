"""`mla calibrate` on a device: scores equal the former CPU implementation, batches sized to free memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mla.cli import main
from mla.conversion import calibrate
from mla.tiny_models import tiny_llama


@torch.no_grad()
def reference_scores(model, blocks, batch_size: int) -> torch.Tensor:
    """The implementation before device support (commit 38120e1), kept verbatim as the reference."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    layers = model.model.layers
    q_sum = torch.zeros(len(layers), cfg.num_attention_heads, head_dim // 2, dtype=torch.float64)
    k_sum = torch.zeros(len(layers), cfg.num_key_value_heads, head_dim // 2, dtype=torch.float64)
    count = 0

    def hook_for(i, attn):
        def hook(_module, args, kwargs):
            h = kwargs.get("hidden_states", args[0] if args else None)
            q = calibrate.pair_norms(attn.q_proj(h).float(), head_dim).mean(dim=1)
            k = calibrate.pair_norms(attn.k_proj(h).float(), head_dim).mean(dim=1)
            q_sum[i] += q.sum(dim=0).double()
            k_sum[i] += k.sum(dim=0).double()
        return hook

    handles = [layer.self_attn.register_forward_pre_hook(hook_for(i, layer.self_attn), with_kwargs=True)
               for i, layer in enumerate(layers)]
    try:
        batch = []
        for block in blocks:
            batch.append(torch.as_tensor(block, dtype=torch.long))
            if len(batch) == batch_size:
                model.model(input_ids=torch.stack(batch), use_cache=False)
                count += len(batch)
                batch = []
        if batch:
            model.model(input_ids=torch.stack(batch), use_cache=False)
            count += len(batch)
    finally:
        for h in handles:
            h.remove()
    return calibrate.group_scores((q_sum / count).float(), (k_sum / count).float())


@pytest.fixture(scope="module")
def blocks():
    return np.random.default_rng(0).integers(1, 512, (7, 40)).astype(np.uint16)


def test_scores_equal_the_former_implementation(blocks):
    model = tiny_llama(num_kv_heads=2, seed=3)
    ref = reference_scores(model, list(blocks), batch_size=2)
    for batch_size in (2, 3, 7):       # the batch only changes how samples are grouped
        got = calibrate.two_norm_scores(model, list(blocks), batch_size=batch_size)
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)
    # ... and the comparison can fail: another model's scores differ
    other = calibrate.two_norm_scores(tiny_llama(num_kv_heads=2, seed=4), list(blocks), batch_size=2)
    assert not torch.allclose(other, ref, rtol=1e-3)


def test_cli_auto_batch_on_cpu_equals_reference(blocks, tiny_checkpoint, tmp_path, monkeypatch, capsys):
    """`mla calibrate --device cpu` (batch auto) writes the reference scores; the token blocks come from
    a stand-in for the `mla data` reader (that format is another module's concern)."""
    import mla.data

    monkeypatch.setattr(mla.data, "open_blocks", lambda folder, split: blocks)
    out = tmp_path / "scores.pt"
    assert main(["calibrate", "--model", str(tiny_checkpoint), "--data", str(tmp_path), "--samples", "5",
                 "--device", "cpu", "--out", str(out)]) == 0
    saved = torch.load(out)
    assert (saved["samples"], saved["block_length"], saved["device"], saved["dtype"]) == (5, 40, "cpu", "float32")
    from mla.checkpoint import load_model

    ref = reference_scores(load_model(tiny_checkpoint), list(blocks[:5]), batch_size=2)
    torch.testing.assert_close(saved["scores"], ref, rtol=1e-6, atol=0)
    assert "calibrate: batch size 5 " in capsys.readouterr().out   # all 5 fit: capped by the sample count


def _peak_cpu_bytes(fn) -> int:
    """Peak of allocated CPU memory while fn runs (torch.profiler's memory timeline)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(torch.device("cpu"))
    return int(np.asarray(sizes).sum(axis=1).max())


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_per_sample_estimate_bounds_the_measured_memory(attn):
    """The batch-size estimate is an upper bound of what one more sequence really costs, and not a loose
    one (within 2x), for both attention kernels (eager materialises the T x T scores)."""
    model = tiny_llama(hidden_size=128, intermediate_size=512, num_attention_heads=8, num_kv_heads=2,
                       attn_implementation=attn)
    t = 256
    gen = torch.Generator().manual_seed(0)
    peaks = {}
    for b in (1, 8):
        seqs = [torch.randint(1, 500, (t,), generator=gen) for _ in range(b)]
        peaks[b] = _peak_cpu_bytes(lambda: calibrate.two_norm_scores(model, seqs, batch_size=b))
    measured = (peaks[8] - peaks[1]) / 7
    estimate = calibrate.activation_bytes_per_sample(model.config, t, 4)
    assert measured <= estimate <= 2 * measured, (measured, estimate)


def test_auto_batch_size_arithmetic():
    cfg = tiny_llama().config
    per = calibrate.activation_bytes_per_sample(cfg, 128, 4)
    free = 10 * per
    b = calibrate.auto_batch_size(cfg, 128, 4, free, samples=1000)
    assert b * per <= calibrate.MEMORY_FRACTION * free < (b + 1) * per
    assert calibrate.auto_batch_size(cfg, 128, 4, free, samples=3) == 3
    assert calibrate.auto_batch_size(cfg, 128, 4, per // 10, samples=3) == 1           # never zero
    assert calibrate.auto_batch_size(cfg, 128, 4, 10 ** 15, samples=10 ** 6) == calibrate.MAX_AUTO_BATCH


def test_paper_calibration_batch_on_an_80gb_gpu():
    """Llama-2-7B, 4096-token blocks, bf16: ~0.75 GiB per sequence, so an 80 GB card (13.5 GB of weights
    resident) takes ~60 sequences per pass: 1,024 samples in 17 forward passes instead of 512 at batch 2."""
    from transformers import LlamaConfig

    from mla.shapes import read_config

    cfg = LlamaConfig(**{k: v for k, v in read_config("llama-2-7b").items() if k not in ("architectures",)})
    per = calibrate.activation_bytes_per_sample(cfg, 4096, 2)
    assert 0.6 * 2 ** 30 < per < 0.9 * 2 ** 30
    free = 80 * 10 ** 9 - 6_738_415_616 * 2
    b = calibrate.auto_batch_size(cfg, 4096, 2, free, samples=1024)
    assert 50 <= b <= 64 and b * per <= 0.7 * free
