"""2-norm calibration (paper App. A, code §2.3): per-pair importance of RoPE frequencies.

score[layer, kv_head, k] = Σ_{query heads h of the group} mean‖q_h^{[k]}‖ · mean‖k_g^{[k]}‖, the means
taken over tokens and then over samples, q and k pre-RoPE (the pair norm is rotation-invariant).
"""

from __future__ import annotations

import torch


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


@torch.no_grad()
def two_norm_scores(model, blocks, batch_size: int = 2) -> torch.Tensor:
    """Scores [L, n_kv, d_h/2] of a Llama-family model over token blocks (an iterable of 1-D tensors).

    A forward pre-hook on each attention module captures its input (after the input RMSNorm);
    q_proj/k_proj are applied to it directly.
    """
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    layers = model.model.layers
    q_sum = torch.zeros(len(layers), cfg.num_attention_heads, head_dim // 2, dtype=torch.float64)
    k_sum = torch.zeros(len(layers), cfg.num_key_value_heads, head_dim // 2, dtype=torch.float64)
    count = 0

    def hook_for(i, attn):
        def hook(_module, args, kwargs):
            h = kwargs.get("hidden_states", args[0] if args else None)
            q = pair_norms(attn.q_proj(h).float(), head_dim).mean(dim=1)  # mean over tokens
            k = pair_norms(attn.k_proj(h).float(), head_dim).mean(dim=1)
            q_sum[i] += q.sum(dim=0).double()                           # sum over samples
            k_sum[i] += k.sum(dim=0).double()
        return hook

    handles = [layer.self_attn.register_forward_pre_hook(hook_for(i, layer.self_attn), with_kwargs=True)
               for i, layer in enumerate(layers)]
    try:
        model.eval()
        batch: list[torch.Tensor] = []
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
    if count == 0:
        raise ValueError("no calibration samples: the token block source is empty")
    return group_scores((q_sum / count).float(), (k_sum / count).float())
