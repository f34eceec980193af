"""MHA/GQA -> MLA conversion of a Llama-family model: Llama, Mistral, Qwen2 (paper §3).

Per layer: the query rows are permuted per head to [rope dims | nope dims] (the order of the key's
dims in the converted attention, so q·k is unchanged); the kept RoPE rows of W_k become k_rope_proj;
[W_k,nope ; W_v] is factorised by SVD into kv_down and k_up / v_up. Everything else is reused as is.
The `rotated` strategy instead mixes the K/V heads per frequency pair (mla/conversion/rotation.py): one RoPE
key shared by all query heads, each query head [its rotated RoPE rows | its whole query]. A shared latent
(mla/conversion/layout.py) repeats each K/V head's k_up / v_up rows for its query heads.

The conversion streams layer by layer: the MLA model is built on the meta device and each layer's new
weights are assigned as they are computed, while the source layer's K/V weights are released, so the
process never holds two copies of the model.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import torch

from mla import atomic, checkpoint, shapes
from mla.conversion import layout as layouts
from mla.conversion import balance, freqfold, lowrank, partial_rope, readers, rotation
from mla.conversion.ladder import ladder_for
from mla.errors import UserError
from mla.options import CALIBRATED_ROPE_STRATEGIES, DEFAULT_LATENT, DEFAULT_ROPE_STRATEGY, DEFAULT_SVD


def _mla_config(src_config, kv_lora_rank: int, pairs: list, split: bool, provenance: dict,
                rope_layout: str = "per_head", latent: str = DEFAULT_LATENT):
    from mla.modeling import MLAConfig  # lazy: transformers; the GPU memory check reads this module at parse

    allowed = {f.name for f in fields(MLAConfig)}
    values = {k: v for k, v in src_config.to_dict().items() if k in allowed}
    qkv_bias, o_bias = shapes.attention_biases(src_config.to_dict())
    values.update(kv_lora_rank=kv_lora_rank, rope_pairs=pairs, latent_split=split, mha2mla=provenance,
                  attention_bias=qkv_bias, o_proj_bias=o_bias, rope_layout=rope_layout, latent_layout=latent)
    config = MLAConfig(**values)
    config.architectures = ["MLAForCausalLM"]
    config._attn_implementation = src_config._attn_implementation
    return config


def _gather_rows(weight: torch.Tensor, index: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of a per-head projection [heads·d_h, ...] picked per head: index [heads, k] -> [heads·k, ...]."""
    heads = index.shape[0]
    w = weight.reshape(heads, head_dim, *weight.shape[1:])
    idx = index.reshape(heads, -1, *([1] * (weight.dim() - 1))).expand(-1, -1, *weight.shape[1:])
    return torch.gather(w, 1, idx).reshape(-1, *weight.shape[1:])


def _scale_nope_rows(weight: torch.Tensor, rope_dim: int, head_width: int, scale: float) -> torch.Tensor:
    """Rows [heads·head_width, ...] laid out per head as [rope | nope], with the nope rows multiplied by `scale`."""
    w = weight.reshape(-1, head_width, *weight.shape[1:]).clone()
    w[:, rope_dim:] *= scale
    return w.reshape(weight.shape)


def _repeat_heads(rows: torch.Tensor, heads: int, groups: int) -> torch.Tensor:
    """Rows [heads·w, ...] with each head's block repeated for the `groups` query heads that read it."""
    if groups == 1:
        return rows
    return rows.reshape(heads, -1, *rows.shape[1:]).repeat_interleave(groups, dim=0).reshape(-1, *rows.shape[1:])


def _rotated_rows(attn, rotated: rotation.RotatedLayer, head_dim: int) -> tuple[dict, torch.Tensor, torch.Tensor | None]:
    """The shared RoPE layout's query and RoPE-key weights (and biases), and the no-RoPE key rows [n_kv·d_h, d]
    with their bias: per query head [rotated RoPE rows (2m) | the whole unrotated query (d_h)]."""
    n_h = attn.q_proj.weight.shape[0] // head_dim
    w_q, w_k = attn.q_proj.weight.data, attn.k_proj.weight.data
    q_rows = torch.cat([rotation.rope_query_rows(w_q, rotated, head_dim), w_q.reshape(n_h, head_dim, -1)], dim=1)
    out = {"q_proj.weight": q_rows.reshape(-1, w_q.shape[1]),
           "k_rope_proj.weight": rotation.rope_key_rows(w_k, rotated, head_dim)}
    nope_bias = None
    if attn.q_proj.bias is not None:
        b_q, b_k = attn.q_proj.bias.data, attn.k_proj.bias.data
        out["q_proj.bias"] = torch.cat([rotation.rope_query_rows(b_q, rotated, head_dim),
                                        b_q.reshape(n_h, head_dim)], dim=1).reshape(-1)
        out["k_rope_proj.bias"] = rotation.rope_key_rows(b_k, rotated, head_dim)
        nope_bias = rotation.nope_key_rows(b_k, rotated, head_dim)
    return out, rotation.nope_key_rows(w_k, rotated, head_dim), nope_bias


def convert_layer(attn, pairs: torch.Tensor | None, kv_lora_rank: int, svd: str, head_dim: int,
                  nope_query_scale: float = 1.0, fit_covariance: torch.Tensor | None = None,
                  report_covariance: torch.Tensor | None = None, *, rotated: rotation.RotatedLayer | None = None,
                  shared_latent: bool = False, attention_aware: bool = False) -> tuple[dict, dict]:
    """New attention weights of one layer (state-dict keys of MLAAttention) and the SVD's errors:
    {"weight": ‖M − A‖/‖M‖, "output": the relative error of M x on inputs with `report_covariance`}.

    `pairs` [n_kv, r] are the kept pairs of the per-head layout; `rotated` (instead) the rotation and kept
    components of the shared layout (mla/conversion/rotation.py). `shared_latent` repeats the key and value
    up-projections for every query head (mla/conversion/layout.py).

    `fit_covariance` (the layer's input second moment) makes the SVD activation-aware (mla.conversion.lowrank);
    `attention_aware` weighs its errors by the queries and o_proj that read them (mla/conversion/readers.py).

    `nope_query_scale` multiplies the query's no-RoPE rows: the square of the RoPE attention factor
    (yarn), which the original applied to every dim through cos/sin and partial RoPE applies to the
    kept pairs only.
    """
    n_h = attn.q_proj.weight.shape[0] // head_dim
    n_kv = attn.k_proj.weight.shape[0] // head_dim
    groups = n_h // n_kv
    if rotated is not None:
        out, k_nope, k_nope_bias = _rotated_rows(attn, rotated, head_dim)
        out["o_proj.weight"] = attn.o_proj.weight.data.clone()   # balanced later: not the source's tensor
        rope_dim, head_width = 2 * rotated.kept.shape[0], 2 * rotated.kept.shape[0] + head_dim
        # W_k,nope has d_h rows per head but rank n_kv·d_h − 2m: "none" is the joint SVD at that full rank
        method = "joint" if svd == "none" else svd
    else:
        perm_q = partial_rope.head_permutation(pairs, head_dim).repeat_interleave(groups, dim=0)
        rope_k = partial_rope.rope_dims(pairs, head_dim)
        nope_k = partial_rope.nope_dims(pairs, head_dim)
        out = {"q_proj.weight": _gather_rows(attn.q_proj.weight.data, perm_q, head_dim),
               "k_rope_proj.weight": _gather_rows(attn.k_proj.weight.data, rope_k, head_dim),
               "o_proj.weight": attn.o_proj.weight.data.clone()}
        k_nope = _gather_rows(attn.k_proj.weight.data, nope_k, head_dim)
        if attn.q_proj.bias is not None:  # biases follow their rows; the latent has none
            out["q_proj.bias"] = _gather_rows(attn.q_proj.bias.data, perm_q, head_dim)
            out["k_rope_proj.bias"] = _gather_rows(attn.k_proj.bias.data, rope_k, head_dim)
        k_nope_bias = None if attn.k_proj.bias is None else _gather_rows(attn.k_proj.bias.data, nope_k, head_dim)
        rope_dim, head_width, method = 2 * pairs.shape[1], head_dim, svd
    row_weight = None
    if attention_aware:   # the no-RoPE query rows of each head, aligned with its K/V head's no-RoPE key rows
        query_nope = out["q_proj.weight"].reshape(n_h, head_width, -1)[:, rope_dim:]
        row_weight = readers.row_weight(query_nope, attn.o_proj.weight.data, k_nope, attn.v_proj.weight.data,
                                        fit_covariance)
    factors = lowrank.factorize(k_nope, attn.v_proj.weight.data, kv_lora_rank, method, covariance=fit_covariance,
                                row_weight=row_weight)
    errors = {"weight": factors.relative_error, "output": None}
    if report_covariance is not None:
        m = torch.cat([k_nope, attn.v_proj.weight.data]).float()
        errors["output"] = lowrank.relative_output_error(m, factors.approximation(), report_covariance.to(m.device))
    dtype = attn.q_proj.weight.dtype
    # a shared latent rebuilds a key and a value for every query head: its K/V head's rows, repeated
    up_groups = groups if shared_latent else 1
    out.update({"kv_down.weight": factors.down.to(dtype),
                "k_up.weight": _repeat_heads(factors.up_k.to(dtype), n_kv, up_groups),
                "v_up.weight": _repeat_heads(factors.up_v.to(dtype), n_kv, up_groups)})
    if k_nope_bias is not None:
        out["k_up.bias"] = _repeat_heads(k_nope_bias, n_kv, up_groups)
        out["v_up.bias"] = _repeat_heads(attn.v_proj.bias.data.clone(), n_kv, up_groups)   # balanced later
    if attn.o_proj.bias is not None:
        out["o_proj.bias"] = attn.o_proj.bias.data
    if nope_query_scale != 1.0:
        for key in ("q_proj.weight", "q_proj.bias"):
            if key in out:
                out[key] = _scale_nope_rows(out[key], rope_dim, head_width, nope_query_scale)
    # SVD factors and gathered rows may be strided views; checkpoints need plain dense tensors
    return {k: v.contiguous() for k, v in out.items()}, errors


def full_rank_d_kv(config: dict, r: int | None) -> int:
    """d_kv of `--svd none`: the full rank of [W_k,nope; W_v] per KV head, min(2·d_h − 2r, hidden / n_kv)."""
    s = shapes.shape_of(config)
    r = shapes.default_r(s.head_dim) if r is None else r
    full = lowrank.max_rank("none", s.kv_heads * (s.head_dim - 2 * r), s.kv_heads * s.head_dim, s.hidden)
    if full % s.kv_heads:
        raise UserError(f"--svd none: the full rank {full} of [W_k,nope; W_v] is not a multiple of the "
                        f"{s.kv_heads} KV heads; give --svd joint with --d-kv {full // s.kv_heads}")
    return full // s.kv_heads


def check_rope_fold(fold: int, layout: layouts.Layout, has_covariances: bool) -> None:
    """Folding needs the shared RoPE layout, a fold that divides a head's pairs, and the input covariances."""
    if not layout.shared_rope:
        raise UserError(f"--rope-fold {fold} needs --rope-strategy rotated or ladder (one RoPE key for all heads)")
    if fold < 1 or (layout.head_dim // 2) % fold:
        raise UserError(f"--rope-fold {fold} must divide the {layout.head_dim // 2} frequency pairs of a head")
    if not has_covariances:
        raise UserError(f"--rope-fold {fold} needs the input covariances (--whiten or --covariance FILE)")


def resolve_options(config: dict, d_kv: int | None, r: int | None, strategy: str,
                    svd: str) -> tuple[int | None, int]:
    """Validate the conversion options against a model config; returns (r, kv_lora_rank).
    With svd "none", d_kv must be None or the full rank (`full_rank_d_kv`)."""
    layout = layouts.resolve(config, strategy=strategy, svd=svd, d_kv=d_kv, r=r)
    return layout.r, layout.kv_lora_rank


def load_covariances(path: str | Path, config: dict) -> dict:
    """A covariance file from `mla calibrate --covariance-out`, checked against the model it will convert."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"covariance file {p} does not exist (run `mla calibrate --covariance-out {p}` first)")
    data = torch.load(p, map_location="cpu", weights_only=True)
    if not isinstance(data, dict) or "covariance" not in data:
        raise UserError(f"{p} is not a covariance file from `mla calibrate --covariance-out`")
    s = shapes.shape_of(config)
    got = tuple(data["covariance"].shape)
    if got != (s.layers, s.hidden, s.hidden):
        raise UserError(f"covariance file {p} is for another model shape: {got[0]} layers of {got[1]} inputs, "
                        f"but this model has {s.layers} layers of {s.hidden}")
    return data


def load_calibration(path: str | Path | None) -> dict | None:
    """A scores file of `mla calibrate` as a dict ("scores", and for newer files the rotation's statistics)."""
    if path is None:
        return None
    p = Path(path)
    if not p.is_file():
        raise UserError(f"scores file {p} does not exist (run `mla calibrate` first)")
    data = torch.load(p, map_location="cpu", weights_only=True)
    return {**(data if isinstance(data, dict) else {"scores": data}), "path": str(p)}


def load_scores(path: str | Path | None) -> torch.Tensor | None:
    data = load_calibration(path)
    return None if data is None else data["scores"]


ROTATION_KEYS = ("pair_covariance", "query_pair_norms")


def rotated_layers(calibration, layout: layouts.Layout, layers: int, fold: int = 1, key_weights=None,
                   covariances=None) -> list[rotation.RotatedLayer]:
    """The rotation and kept components of every layer, from a scores file's statistics (load_calibration);
    with `fold` > 1, folded (mla/conversion/freqfold.py) from each layer's k_proj weight and input covariance."""
    where = (calibration or {}).get("path", "the scores") if isinstance(calibration, dict) else "the scores"
    if not isinstance(calibration, dict) or any(k not in calibration for k in ROTATION_KEYS):
        strategy = "ladder" if layout.ladder else "rotated"
        raise UserError(f"--rope-strategy {strategy} needs the keys' pair covariances, which {where} lacks (written "
                        "by an older `mla calibrate`, or not a scores file): run `mla calibrate` again")
    cov, norms = calibration["pair_covariance"], calibration["query_pair_norms"]
    half = layout.head_dim // 2
    expected = {"pair_covariance": (layers, half, layout.kv_heads, layout.kv_heads),
                "query_pair_norms": (layers, layout.heads, half)}
    for key, shape in expected.items():
        if tuple(calibration[key].shape) != shape:
            raise UserError(f"{key} in {where} has shape {tuple(calibration[key].shape)} but this model needs "
                            f"{list(shape)}: the scores file belongs to another model")
    ladder_pairs = ladder_for(layout.head_dim).pairs if layout.ladder else None
    if fold != 1:
        return freqfold.fold_layers(key_weights, covariances, norms, layout.rope_components, fold, layout.head_dim,
                                    ladder_pairs)
    return rotation.rotate_layers(cov, norms, layout.rope_components, ladder_pairs)


@torch.no_grad()
def convert_model(model, d_kv: int | None = None, r: int | None = None, strategy: str = DEFAULT_ROPE_STRATEGY, scores=None,
                  svd: str = DEFAULT_SVD, release_source: bool = False, covariances: dict | None = None,
                  whiten: bool = False, *, latent: str = DEFAULT_LATENT, kv_width: int | None = None,
                  rope_share=None, attention_aware: bool = False, rope_fold: int = 1):
    """Convert a loaded LlamaForCausalLM; returns (MLAForCausalLM, report dict).

    `scores`: the 2-norm scores [L, n_kv, d_h/2], or a scores file's dict / path (load_calibration), which
    the rotated strategy needs. `latent`, `kv_width` and `rope_share`: mla/conversion/layout.py.
    With `release_source`, each source layer's attention is dropped once converted (streaming).
    `covariances` (load_covariances) adds each layer's output error to the report (on its held-out part
    when it has one); with `whiten` the SVD is fitted to the calibration part (activation-aware), and with
    `attention_aware` as well to what reads the latent (mla/conversion/readers.py). `rope_fold` > 1 folds
    that many adjacent frequency pairs into each rotated RoPE component (mla/conversion/freqfold.py).
    """
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from mla.modeling import MLAForCausalLM  # lazy: transformers, as above

    src_cfg = model.config
    cfg_dict = src_cfg.to_dict()
    layout = layouts.resolve(cfg_dict, strategy=strategy, svd=svd, d_kv=d_kv, r=r, kv_width=kv_width,
                             rope_share=rope_share, latent=latent)
    rank = layout.kv_lora_rank
    if whiten and svd == "none":
        raise UserError("activation-aware SVD (--whiten) needs --svd joint or split; none keeps the full rank")
    if whiten and covariances is None:
        raise UserError("activation-aware SVD (whiten) needs input covariances from `mla calibrate --covariance-out`")
    if attention_aware and not whiten:
        raise UserError("attention-aware SVD (--attention-aware) needs the activation-aware one (--whiten FILE)")
    if rope_fold != 1:
        check_rope_fold(rope_fold, layout, covariances is not None)
    s = shapes.shape_of(cfg_dict)
    calibration = load_calibration(scores) if isinstance(scores, (str, Path)) else scores
    rotated = None
    if layout.shared_rope:
        keys = [layer.self_attn.k_proj.weight.data for layer in model.model.layers] if rope_fold != 1 else None
        rotated = rotated_layers(calibration, layout, s.layers, rope_fold, keys,
                                 covariances["covariance"] if rope_fold != 1 else None)
        pairs = [[layer.pairs] for layer in rotated]
    else:
        if isinstance(calibration, dict):
            calibration = calibration.get("scores")
        try:
            pair_tensor = partial_rope.select_pairs(strategy, layout.r, s.layers, s.kv_heads, s.head_dim, calibration)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        pairs = pair_tensor.tolist()
    provenance = {"d_kv": layout.d_kv, "r": layout.r, "rope_strategy": strategy, "svd": svd, "whitened": whiten,
                  "source": getattr(src_cfg, "_name_or_path", "") or ""}
    if attention_aware:
        provenance["attention_aware"] = True
    if rope_fold != 1:
        provenance["rope_fold"] = rope_fold
    if layout.shared_rope or layout.latent != DEFAULT_LATENT or layout.budget != "d_kv":
        provenance.update(layout.describe(), kv_width=layout.kv_width)
    config = _mla_config(src_cfg, rank, pairs, svd == "split", provenance, layout.rope_layout, layout.latent)
    dtype = next(model.parameters()).dtype
    config.dtype = dtype

    rotary = LlamaRotaryEmbedding(config=config)
    nope_query_scale = float(rotary.attention_scaling) ** 2   # 1 unless the RoPE scaling has an attention factor
    if nope_query_scale != 1.0:
        config.mha2mla = {**config.mha2mla, "nope_query_scale": nope_query_scale}
    with torch.device("meta"):
        mla_model = MLAForCausalLM(config)
    new_state = {}
    for name, tensor in model.state_dict().items():
        if ".self_attn." not in name:
            new_state[name] = tensor
    errors, output_errors = [], []
    report_cov = None                     # output errors on the held-out inputs when the file has them
    if covariances is not None:
        report_cov = covariances.get("heldout")
        if report_cov is None:
            report_cov = covariances["covariance"]
    for i, layer in enumerate(model.model.layers):
        weights, err = convert_layer(
            layer.self_attn, None if rotated else pair_tensor[i], rank, svd, s.head_dim, nope_query_scale,
            fit_covariance=covariances["covariance"][i] if whiten else None,
            report_covariance=None if report_cov is None else report_cov[i],
            rotated=rotated[i] if rotated else None, shared_latent=layout.latent == "shared",
            attention_aware=attention_aware)
        errors.append(err["weight"])
        output_errors.append(err["output"])
        new_state.update({f"model.layers.{i}.self_attn.{k}": v for k, v in weights.items()})
        if release_source:
            layer.self_attn = torch.nn.Identity()
    missing, unexpected = mla_model.load_state_dict(new_state, strict=False, assign=True)
    missing = [k for k in missing if not k.startswith("lm_head.") or not src_cfg.tie_word_embeddings]
    if missing or unexpected:
        raise RuntimeError(f"conversion produced a mismatched state dict: missing {missing}, unexpected {unexpected}")
    mla_model.model.rotary_emb = rotary   # non-persistent buffers: built outside the meta device
    mla_model.tie_weights()
    leftovers = [n for n, t in list(mla_model.named_parameters()) + list(mla_model.named_buffers()) if t.is_meta]
    if leftovers:
        raise RuntimeError(f"conversion left uninitialised tensors: {leftovers}")
    mla_model.eval()
    # the SVD balanced each latent; the value and key channels against o_proj / q_proj are balanced here
    imbalances = [balance.balance_attention(layer.self_attn) for layer in mla_model.model.layers]

    plan = shapes.plan_layout(cfg_dict, layout)
    report = {**plan, "rope_strategy": strategy, "svd": svd,
              "params_before_counted": count_parameters(model) if not release_source else None,
              "params_after_counted": count_parameters(mla_model),
              "reconstruction_error_per_layer": errors,
              "reconstruction_error_mean": sum(errors) / len(errors),
              "factor_imbalance_per_layer": imbalances,   # what balancing removed (mla/conversion/balance.py)
              "whitened": whiten, "attention_aware": attention_aware, "rope_fold": rope_fold}
    if rotated is not None:   # per layer, the kept (frequency pair, rotated component) of the shared RoPE key
        report["rotated_components_per_layer"] = [layer.kept.tolist() for layer in rotated]
    if covariances is not None:
        report.update(output_error_per_layer=output_errors,
                      output_error_mean=sum(output_errors) / len(output_errors),
                      output_error_on="heldout" if covariances.get("heldout") is not None else "calibration")
    return mla_model, report


def count_parameters(model) -> int:
    """Unique parameters without the output head (the paper's Table 4 convention)."""
    seen, total = set(), 0
    head = model.get_output_embeddings()
    head_ids = {id(p) for p in head.parameters()} if head is not None else set()
    embed_ids = {id(p) for p in model.get_input_embeddings().parameters()}
    for p in model.parameters():
        if id(p) in seen or (id(p) in head_ids and id(p) not in embed_ids):
            continue
        seen.add(id(p))
        total += p.numel()
    return total


def convert_checkpoint(src: str | Path, out: str | Path, d_kv: int | None, r: int | None = None, strategy: str = DEFAULT_ROPE_STRATEGY,
                       scores_path: str | Path | None = None, svd: str = DEFAULT_SVD,
                       whiten_path: str | Path | None = None, covariance_path: str | Path | None = None, *,
                       latent: str = DEFAULT_LATENT, kv_width: int | None = None, rope_share=None,
                       attention_aware: bool = False, rope_fold: int = 1) -> dict:
    """Read an HF checkpoint folder, write the MLA checkpoint (+ conversion.json) atomically to `out`.

    `whiten_path`: covariances to fit the SVD to (activation-aware); `covariance_path`: covariances used
    only to report output errors of the plain SVD.
    """
    src, out = checkpoint.require_checkpoint(src), Path(out)
    config = shapes.read_config(src)
    budget = dict(latent=latent, kv_width=kv_width, rope_share=rope_share)
    layout = layouts.resolve(config, strategy=strategy, svd=svd, d_kv=d_kv, r=r, **budget)   # before any loading
    if strategy in CALIBRATED_ROPE_STRATEGIES and scores_path is None:
        raise UserError(f"--rope-strategy {strategy} needs --scores (from `mla calibrate`)")
    if whiten_path is not None and svd == "none":
        raise UserError("activation-aware SVD (--whiten) needs --svd joint or split; none keeps the full rank")
    if whiten_path is not None and covariance_path is not None:
        raise UserError("give --whiten FILE (fit and report) or --covariance FILE (report only), not both")
    if attention_aware and whiten_path is None:
        raise UserError("attention-aware SVD (--attention-aware) needs the activation-aware one (--whiten FILE)")
    if rope_fold != 1:
        check_rope_fold(rope_fold, layout, (whiten_path or covariance_path) is not None)
    scores = load_calibration(scores_path)
    if layout.shared_rope:     # refuse an old or foreign scores file before loading the weights
        rotated_layers(scores, layout, shapes.shape_of(config).layers)
    cov_path = whiten_path or covariance_path
    covariances = None if cov_path is None else load_covariances(cov_path, config)
    model = checkpoint.load_model(src)
    mla_model, report = convert_model(model, d_kv, r, strategy, scores, svd, release_source=True,
                                      covariances=covariances, whiten=whiten_path is not None,
                                      attention_aware=attention_aware, rope_fold=rope_fold, **budget)
    report["source_checkpoint"] = str(src)
    report["covariance_file"] = str(cov_path) if cov_path else None
    report["scores_file"] = str(scores_path) if scores_path else None
    mla_model.config.mha2mla["source"] = str(src)

    if stored_dtype(config) == "bfloat16":  # computed in fp32, written as the source was: bf16 trains in bf16
        mla_model.to(torch.bfloat16)
        mla_model.config.dtype = torch.bfloat16
    report["saved_dtype"] = str(next(mla_model.parameters()).dtype).removeprefix("torch.")

    with atomic.staged(out, folder=True) as tmp:
        mla_model.save_pretrained(tmp)
        checkpoint.copy_tokenizer_files(src, tmp)
        (tmp / "conversion.json").write_text(json.dumps(report, indent=2))
    return report


def stored_dtype(config: dict) -> str | None:
    """The dtype a checkpoint's config.json says its weights are stored in (`dtype`; `torch_dtype` before
    transformers 5), e.g. "bfloat16"; None when it does not say."""
    value = config.get("dtype") or config.get("torch_dtype")
    return str(value).removeprefix("torch.") if value else None


def main_report_line(report: dict) -> str:
    layout = (f"{report['rope_layout']} RoPE {report['rope_dims_per_layer']} + latent {report['latent_per_layer']}"
              f" ({report['latent']} latent) per layer, " if report.get("rope_layout") else "")
    return (f"{layout}d_kv={report['d_kv']} r={report['r']} params {report['params_before'] / 1e6:.2f}M -> "
            f"{report['params_after'] / 1e6:.2f}M, KV/token {report['kv_elements_per_token_before']} -> "
            f"{report['kv_elements_per_token_after']} ({report['kv_reduction_percent']:.2f}% less), "
            f"mean SVD error {report['reconstruction_error_mean']:.4f}"
            + (f", output error {report['output_error_mean']:.4f} on {report['output_error_on']} inputs"
               if report.get("output_error_mean") is not None else "")
            + (" (attention-aware)" if report.get("attention_aware") else
               " (activation-aware)" if report.get("whitened") else ""))


__all__ = ["convert_model", "convert_checkpoint", "count_parameters", "resolve_options"]
