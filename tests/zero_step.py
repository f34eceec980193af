"""One bf16 ZeRO-2 optimizer step of DeepSpeed with the workflow's config against an fp32 reference, on one device;
run in a fresh process by tests/test_gpu.py (CUDA) and tests/test_train.py (CPU), so that DeepSpeed picks its
accelerator from this process's environment alone.

    python tests/zero_step.py OUT.json cuda|cpu

The same tiny Llama twice: an fp32 copy, whose gradient of two micro-batches (each loss / 2, summed: what
DeepSpeed's accumulation computes) and one torch AdamW step are the reference, and a bf16 copy under
`deepspeed.initialize` (ZeRO-2, `data_types.grad_accum_dtype: fp32`, 2 accumulation steps, no clipping). Written
to OUT.json: the cosine and norm ratio between DeepSpeed's accumulated fp32 gradient and the reference, the same
for the gradient of the first micro-batch alone (what a lost micro-step would give), the largest change of an fp32
master weight against the reference step in units of the learning rate, and the dtypes DeepSpeed used.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

LR = 1e-3


def main(out: Path, device: str) -> None:
    import torch

    from mla.tiny_models import tiny_llama
    from mla.training import launch
    from mla.training.config import TrainConfig, resolve
    from mla.training.deepspeed_config import deepspeed_config

    cuda = device == "cuda"
    launch.prepare_environment(cuda)
    launch.single_process_environment(None)
    if not cuda:
        launch.skip_shm_build()
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    torch.backends.cuda.matmul.allow_tf32 = False   # an fp32 reference, not TF32
    ref = tiny_llama(num_kv_heads=2, tie_word_embeddings=False).to(device).train()
    with torch.no_grad():   # realistic attention logits (tiny_llama sharpens them for other tests)
        for layer in ref.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                proj.weight.mul_(1 / 3)
    model = tiny_llama(num_kv_heads=2, tie_word_embeddings=False).to(device)
    model.load_state_dict(ref.state_dict())
    model = model.to(torch.bfloat16).train()
    names = [n for n, _ in ref.named_parameters()]
    # the reference's own weights rounded to bf16, as DeepSpeed's fp32 master weights start from the bf16 copy
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.to(torch.bfloat16).float())

    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(1, 512, (2, 64), generator=g).to(device) for _ in range(2)]

    # reference: fp32 gradient of the mean over the two micro-batches, then one AdamW step
    grads = []
    for ids in batches:
        (ref(input_ids=ids, labels=ids).loss / 2).backward()
        grads.append(torch.cat([p.grad.flatten().clone() for p in ref.parameters()]))
    reference = grads[-1]                       # .grad accumulated both
    first_only = grads[0]
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    opt.step()

    cfg = TrainConfig(model="-", data="-", out="-", zero_stage=2, micro_batch=2, grad_accum=2, precision="bf16",
                      clip=0.0)
    cfg = resolve(cfg)
    ds = deepspeed_config(cfg, cuda=cuda)
    ds.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2, train_batch_size=4,
              bf16={"enabled": True})
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds)
    for i, ids in enumerate(batches):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        if i == len(batches) - 1:   # the accumulated gradient, before the step consumes it
            got = torch.cat([safe_get_full_grad(p).float().flatten() for p in engine.module.parameters()])
        engine.step()
    masters = torch.cat([safe_get_full_fp32_param(p).flatten() for p in engine.module.parameters()])
    reference_weights = torch.cat([p.detach().flatten() for p in ref.parameters()])

    def cosine(a, b):
        return float(torch.nn.functional.cosine_similarity(a, b, dim=0))

    report = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "accelerator": type(deepspeed.get_accelerator()).__name__,
        "grad_accum_dtype": str(engine.get_data_types()[1]), "model_dtype": str(engine.get_data_types()[0]),
        "master_dtype": str(masters.dtype), "parameters": int(reference.numel()), "names": len(names),
        "grad_cosine": cosine(got, reference), "grad_norm_ratio": float(got.norm() / reference.norm()),
        "first_micro_batch_cosine": cosine(first_only * 2, reference),
        "first_micro_batch_norm_ratio": float((first_only * 2).norm() / reference.norm()),
        "max_master_diff_in_lr": float((masters - reference_weights).abs().max() / LR),
        "mean_master_diff_in_lr": float((masters - reference_weights).abs().mean() / LR),
    }
    engine.destroy()
    out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(Path(sys.argv[1]), sys.argv[2])
