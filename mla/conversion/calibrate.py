"""2-norm calibration (paper §3.1, App. A): per-pair importance of RoPE frequencies.

score[layer, kv_head, k] = Σ_{query heads h of the group} mean‖q_h^{[k]}‖ · mean‖k_g^{[k]}‖, the means
taken over tokens and then over samples, q and k pre-RoPE (the pair norm is rotation-invariant).

The same pass gives what the `rotated` strategy needs (mla/conversion/rotation.py): each query head's mean
pair norms (before they are summed into group scores) and the second moment of the keys' pair vectors across
the K/V heads, C_k = E_t[K_k K_kᵀ] (K_k: the n_kv x 2 matrix of every K/V head's pair-k components).

The model runs where it lies (CPU or GPU, in its dtype); the pair norms are taken in fp32 and summed
over samples in fp64, so the scores do not depend on the batch size.
"""

from __future__ import annotations

import numpy as np
import torch

from mla.conversion.rotation import pair_second_moment

MAX_AUTO_BATCH = 64        # beyond this a forward pass gains nothing but a larger memory spike
MEMORY_FRACTION = 0.7      # of the free memory: allocator slack, fragmentation, other processes


def pair_norms(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[B, T, heads*d_h] -> per-pair L2 norms [B, T, heads, d_h/2] (pair k = dims k, k + d_h/2)."""
    b, t, _ = x.shape
    x = x.reshape(b, t, -1, 2, head_dim // 2)
    return x.norm(dim=-2)


def group_scores(q_mean: torch.Tensor, k_mean: torch.Tensor) -> torch.Tensor:
    """Mean pair norms q [L, n_h, d_h/2], k [L, n_kv, d_h/2] -> scores [L, n_kv, d_h/2]."""
    layers, n_h, half = q_mean.shape
    n_kv = k_mean.shape[1]
    per_query = q_mean * k_mean.repeat_interleave(n_h // n_kv, dim=1)
    return per_query.reshape(layers, n_kv, n_h // n_kv, half).sum(dim=2)


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def activation_bytes_per_sample(cfg, block_length: int, element_size: int) -> int:
    """Upper estimate of the memory one sequence needs during the calibration forward (no grad, no cache,
    no LM head): residual and normed hidden states, q/k/v with their RoPE'd copies and the GQA-expanded
    k/v, the MLP's gate/up/product, the hook's fp32 q/k and pair norms, and the attention matrix when
    the model uses eager attention (SDPA kernels do not materialise it)."""
    t, b = block_length, element_size
    d_h, n_h, n_kv = _head_dim(cfg), cfg.num_attention_heads, cfg.num_key_value_heads
    hidden = 4 * t * cfg.hidden_size * b
    attention = t * d_h * b * (2 * n_h + 3 * n_kv + 2 * n_h + n_h)     # q,k,v + RoPE'd q,k + expanded k,v + out
    mlp = 4 * t * cfg.intermediate_size * b
    hook = t * (n_h + n_kv) * d_h * 4 * 2                                # fp32 copy + norm intermediates
    scores = n_h * t * t * (b + 4) if getattr(cfg, "_attn_implementation", None) == "eager" else 0
    return hidden + max(attention + scores, mlp) + hook


def auto_batch_size(cfg, block_length: int, element_size: int, free_bytes: int, samples: int) -> int:
    """Sequences per forward pass that fit MEMORY_FRACTION of `free_bytes` (the model already loaded)."""
    per_sample = activation_bytes_per_sample(cfg, block_length, element_size)
    fit = int(free_bytes * MEMORY_FRACTION) // per_sample
    return max(1, min(fit, MAX_AUTO_BATCH, samples))


def covariance_bytes(cfg) -> int:
    """Memory of the fp64 input-covariance accumulators, one [d, d] per layer (Llama-2-7B: 4.3 GB)."""
    return cfg.num_hidden_layers * cfg.hidden_size ** 2 * 8


@torch.no_grad()
def _attention_inputs(model, blocks, batch_size: int, consume) -> int:
    """Run the decoder over token blocks; `consume(i, attn, h)` sees layer i's attention input h
    (after the input RMSNorm) through a forward pre-hook. Returns the number of samples."""
    device = next(model.parameters()).device
    count = 0

    def hook_for(i, attn):
        def hook(_module, args, kwargs):
            consume(i, attn, kwargs.get("hidden_states", args[0] if args else None))
        return hook

    def forward(batch):
        nonlocal count
        model.model(input_ids=torch.stack(batch).to(device), use_cache=False)
        count += len(batch)

    handles = [layer.self_attn.register_forward_pre_hook(hook_for(i, layer.self_attn), with_kwargs=True)
               for i, layer in enumerate(model.model.layers)]
    try:
        model.eval()
        batch: list[torch.Tensor] = []
        for block in blocks:
            if isinstance(block, np.ndarray):   # rows of a read-only memmap: a writable int64 copy
                block = block.astype(np.int64)
            batch.append(torch.as_tensor(block, dtype=torch.long))
            if len(batch) == batch_size:
                forward(batch)
                batch = []
        if batch:
            forward(batch)
    finally:
        for h in handles:
            h.remove()
    if count == 0:
        raise ValueError("no calibration samples: the token block source is empty")
    return count


def calibration_pass(model, blocks, batch_size: int = 2, scores: bool = True, covariance: bool = False):
    """One pass over the blocks: 2-norm scores [L, n_kv, d_h/2] and/or the second moment of every layer's
    attention input, E[x xᵀ] [L, d, d] (fp64 sums, returned in fp32 on the CPU), as {"scores", "covariance",
    "tokens"}. With the scores come "query_pair_norms" [L, n_h, d_h/2] (mean ‖q_h^[k]‖ per query head) and
    "pair_covariance" [L, d_h/2, n_kv, n_kv] (E_t[K_k K_kᵀ]), for the rotated strategy. Batches go to the
    model's device."""
    cfg = model.config
    head_dim = _head_dim(cfg)
    device = next(model.parameters()).device
    layers = len(model.model.layers)
    q_sum = torch.zeros(layers, cfg.num_attention_heads, head_dim // 2, dtype=torch.float64, device=device)
    k_sum = torch.zeros(layers, cfg.num_key_value_heads, head_dim // 2, dtype=torch.float64, device=device)
    cov = torch.zeros(layers, cfg.hidden_size, cfg.hidden_size, dtype=torch.float64, device=device) if covariance else None
    n_kv = cfg.num_key_value_heads
    pair_cov = torch.zeros(layers, head_dim // 2, n_kv, n_kv, dtype=torch.float64, device=device) if scores else None
    tokens = 0

    def consume(i, attn, h):
        nonlocal tokens
        if scores:
            q_sum[i] += pair_norms(attn.q_proj(h).float(), head_dim).mean(dim=1).sum(dim=0).double()
            keys = attn.k_proj(h).float()
            k_sum[i] += pair_norms(keys, head_dim).mean(dim=1).sum(dim=0).double()
            pair_cov[i] += pair_second_moment(keys, head_dim)
        if i == 0:
            tokens += h.shape[0] * h.shape[1]
        if covariance:
            x = h.reshape(-1, h.shape[-1]).double()
            cov[i] += x.T @ x

    count = _attention_inputs(model, blocks, batch_size, consume)
    out: dict = {"tokens": tokens}
    if scores:
        out["scores"] = group_scores((q_sum / count).float().cpu(), (k_sum / count).float().cpu())
        out["query_pair_norms"] = (q_sum / count).float().cpu()
        out["pair_covariance"] = (pair_cov / tokens).float().cpu()
    if covariance:
        out["covariance"] = (cov / tokens).float().cpu()
    return out


def two_norm_scores(model, blocks, batch_size: int = 2) -> torch.Tensor:
    """Scores [L, n_kv, d_h/2] of a Llama-family model over token blocks (an iterable of 1-D tensors).

    A forward pre-hook on each attention module captures its input (after the input RMSNorm);
    q_proj/k_proj are applied to it directly. The result is on the CPU.
    """
    return calibration_pass(model, blocks, batch_size)["scores"]
