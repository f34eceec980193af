"""Layer-wise fitting of a converted model to its source: each converted attention layer is trained, on its
own, to reproduce the original layer's attention output on the original model's hidden states.

Teacher-forced, one layer at a time (the attention-transfer step of LoLCATs, arXiv 2410.10254, applied to
the MLA layers of mla/conversion/convert.py): the source model's embeddings run on the blocks; for layer i,
x = the source layer's input RMSNorm of the source residual stream (the converted model has the same norm
weights) and the target y = the source layer's attention output (after o_proj); every parameter of the
converted layer's `self_attn` is trained with Adam on ‖ŷ − y‖² / ‖y‖² for `steps` steps of `batch`
blocks; then the residual stream advances through the *source* layer i, so every layer is fitted to the
original hidden states and the layers' fits are independent of one another. A layer whose fitted weights
err more on the held-out blocks than its converted ones keeps the converted ones (`kept` in fit.json). The
layer is fitted from the scale the conversion's SVD gives it (o_proj and the query as the source has them), and
the kept layer's weights are then balanced per channel (mla/conversion/balance.py; `factor_imbalance` in
fit.json is the ratio they had).

The converted attention module is a black box: it is called with exactly the keyword arguments its own
model passes it (position embeddings from the converted model's rotary module, the causal mask, ...),
recorded once by forward pre-hooks on a one-block forward pass; the source decoder layers likewise.

Precision: both models run in the job's dtype (bf16 on GPUs that support it, fp32 on the CPU); the layer
being fitted is cast to fp32 for its fit and its error measurements, its inputs and targets are cast to
fp32 per batch and the loss is computed in fp32; the fitted fp32 weights are kept (the checkpoint is
written from them) and cast back to the job's dtype once.

Memory: both models, plus three arrays of blocks × T × d in the job's dtype for the training blocks and
three for the held-out blocks (the source residual stream, the current layer's attention input and its
target), plus one layer's activations and gradients for `batch` blocks: 3 × (blocks + heldout) × T × d ×
bytes per element. (The converted layer's weights, kept in case the fit makes it worse, wait in CPU memory.) SmolLM2-135M, 64 + 64 blocks of 128, fp32: 3 × 128 × 128 × 576 × 4 B = 113 MB.
Llama-2-7B, 64 + 64 blocks of 2048, bf16: 3 × 128 × 2048 × 4096 × 2 B = 6.4 GB (one stream of 64
blocks in fp32 would be 2.1 GB).

Resumable: `FitProgress` keeps each finished layer's fp32 weights and report entry in a work folder; a
rerun restores finished layers instead of fitting them (their residual stream is recomputed, which is
cheap) and, since each layer's fit depends only on the source model, the converted layer's initial
weights and a generator seeded by (seed, layer), ends with the same weights as an uninterrupted run.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch

from mla import atomic, checkpoint, devices, shapes
from mla.conversion import balance
from mla.data import join_consecutive, open_blocks
from mla.errors import UserError
from mla.options import FIT_DEFAULTS, FIT_SCHEDULES
from mla.perplexity import perplexity
from mla.stats import evenly_spaced, mean_and_stderr

ERROR_DEFINITION = ("relative output error of a layer's attention = Σ‖ŷ − y‖² / Σ‖y‖² over the held-out blocks' "
                    "tokens, y the source layer's attention output on the source hidden states (teacher-forced), "
                    "ŷ the converted layer's output on the same inputs, the layer in fp32")


def fit_lr(settings: "FitSettings", step: int) -> float:
    """The learning rate of a layer's step (0-based): constant, or cosine from lr at the first step to 0 after
    the last (ends nearer the fit's minimum at wide caches, yet retrieved less after fine-tuning at narrow ones:
    docs/fitting.md)."""
    if settings.schedule == "constant":
        return settings.lr
    return settings.lr * 0.5 * (1.0 + math.cos(math.pi * step / settings.steps))


@dataclass(frozen=True)
class FitSettings:
    """What a fit computes (all of it is part of a workflow fit's key, mla/study/experiments.py)."""

    steps: int = FIT_DEFAULTS["steps"]        # Adam steps per layer
    lr: float = FIT_DEFAULTS["lr"]            # constant learning rate
    blocks: int = FIT_DEFAULTS["blocks"]      # training blocks (the first of the train split)
    batch: int = FIT_DEFAULTS["batch"]        # blocks per step (and per forward pass elsewhere)
    heldout: int = FIT_DEFAULTS["heldout"]    # validation blocks (evenly spaced) for errors and losses
    seed: int = 0                             # the order in which each layer's steps draw blocks
    span: int = FIT_DEFAULTS["span"]          # consecutive data blocks joined into one fit sequence: heads
                                              # that attend far are fitted only on sequences as long as their reach
    echo: int = FIT_DEFAULTS["echo"]          # tokens of each training sequence's first half repeated in its second
                                              # half (0: none): copying from far back, what pass-key retrieval does
    schedule: str = FIT_DEFAULTS["schedule"]  # learning rate over a layer's steps: constant | cosine (to 0)

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "schedule":
                if value not in FIT_SCHEDULES:
                    raise ValueError(f"fit schedule must be one of {', '.join(FIT_SCHEDULES)}, got {value!r}")
            elif f.name not in ("seed", "echo") and not value > 0:
                raise ValueError(f"fit setting {f.name} must be positive, got {value}")


# ---------------------------------------------------------------- calling one layer as its model does
@torch.no_grad()
def layer_call_kwargs(model, modules, length: int) -> list[dict]:
    """The keyword arguments `model` passes to each of `modules` (one per layer, e.g. every decoder layer or
    every `self_attn`) for one block of `length` tokens, recorded by forward pre-hooks during a forward pass
    of a dummy block. Batch dimensions of 1 (position ids, cos/sin, masks) broadcast over any batch."""
    calls: list[dict | None] = [None] * len(modules)

    def hook_for(i):
        def hook(_module, _args, kwargs):
            calls[i] = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        return hook

    handles = [m.register_forward_pre_hook(hook_for(i), with_kwargs=True) for i, m in enumerate(modules)]
    try:
        device = next(model.parameters()).device
        model.model(input_ids=torch.zeros(1, length, dtype=torch.long, device=device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    missing = [i for i, c in enumerate(calls) if c is None]
    if missing:
        raise RuntimeError(f"the model's forward pass never called layers {missing}")
    return calls


def _first(output):
    return output[0] if isinstance(output, tuple) else output


def _attention_output(attn, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
    return _first(attn(x, **kwargs))


# ---------------------------------------------------------------- the teacher
@torch.no_grad()
def embed(source, ids: torch.Tensor, batch: int, dtype) -> torch.Tensor:
    """The source model's input embeddings of token blocks [N, T] -> the residual stream [N, T, d] on its device."""
    emb = source.get_input_embeddings()
    device = emb.weight.device
    h = torch.empty(ids.shape[0], ids.shape[1], emb.weight.shape[1], dtype=dtype, device=device)
    for s in range(0, ids.shape[0], batch):
        h[s:s + batch] = emb(ids[s:s + batch].to(device))
    return h


@torch.no_grad()
def teacher_pass(layer, kwargs: dict, h: torch.Tensor, batch: int, keep: bool = True):
    """Advance the residual stream h [N, T, d] through a source decoder layer in place; with `keep`, return
    the layer's attention input x (after its input RMSNorm) and output y (after o_proj), caught by hooks."""
    x = torch.empty_like(h) if keep else None
    y = torch.empty_like(h) if keep else None
    seen = {}

    def before(_module, args, kw):
        seen["x"] = args[0] if args else kw["hidden_states"]

    def after(_module, _args, _kw, output):
        seen["y"] = _first(output)

    attn = layer.self_attn
    handles = [attn.register_forward_pre_hook(before, with_kwargs=True),
               attn.register_forward_hook(after, with_kwargs=True)] if keep else []
    try:
        for s in range(0, h.shape[0], batch):
            out = _first(layer(h[s:s + batch], **kwargs))
            if keep:
                x[s:s + batch], y[s:s + batch] = seen["x"], seen["y"]
            h[s:s + batch] = out
    finally:
        for handle in handles:
            handle.remove()
    return x, y


# ---------------------------------------------------------------- what the fit reads
def with_echoes(ids: torch.Tensor, echo: int, seed: int) -> torch.Tensor:
    """A copy of token sequences [N, T] in which each sequence repeats `echo` of its tokens: a span from its
    first half written again at a random place in its second half. The source model's induction heads copy
    such a span by attending back to its first occurrence, as pass-key retrieval does over the filler; fitted
    on these, the converted layers must reproduce that far attention, which running text of one block rarely asks."""
    n, length = ids.shape
    if echo <= 0:
        return ids
    if 2 * echo > length:
        raise ValueError(f"fit echo {echo} needs sequences of at least {2 * echo} tokens, got {length}")
    rng = np.random.default_rng([seed, 7919])
    out = ids.clone()
    half = length // 2
    for i in range(n):
        a = int(rng.integers(0, half - echo + 1))
        b = int(rng.integers(half, length - echo + 1))
        out[i, b:b + echo] = ids[i, a:a + echo]
    return out


# ---------------------------------------------------------------- one layer
@torch.no_grad()
def relative_error(attn, kwargs: dict, x: torch.Tensor, y: torch.Tensor, batch: int) -> float:
    """Σ‖attn(x) − y‖² / Σ‖y‖² over all tokens (fp64 sums), x cast to the layer's dtype."""
    dtype = next(attn.parameters()).dtype
    num = torch.zeros((), dtype=torch.float64, device=x.device)
    den = torch.zeros((), dtype=torch.float64, device=x.device)
    for s in range(0, x.shape[0], batch):
        target = y[s:s + batch].double()
        num += (_attention_output(attn, x[s:s + batch].to(dtype), kwargs).double() - target).pow(2).sum()
        den += target.pow(2).sum()
    return float(num / den)


def fit_layer(attn, kwargs: dict, x: torch.Tensor, y: torch.Tensor, settings: FitSettings, layer: int) -> list[float]:
    """Train every parameter of `attn` (already in fp32) with Adam on the relative squared error to y; returns
    the training loss of every step. Blocks are drawn without replacement, a new permutation per epoch."""
    params = list(attn.parameters())
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.Adam(params, lr=settings.lr)
    rng = np.random.default_rng([settings.seed, layer])   # per layer: a resumed run draws the same blocks
    n = x.shape[0]
    b = min(settings.batch, n)
    order, pos, losses = rng.permutation(n), 0, []
    try:
        for step in range(settings.steps):
            for group in optimizer.param_groups:
                group["lr"] = fit_lr(settings, step)
            if pos + b > n:
                order, pos = rng.permutation(n), 0
            idx = torch.as_tensor(order[pos:pos + b], device=x.device)
            pos += b
            target = y[idx].float()
            pred = _attention_output(attn, x[idx].float(), kwargs).float()
            # relative to the target's energy: attention outputs differ in scale by orders of magnitude
            # between layers, so one learning rate serves all of them, and the loss reads the same in every
            # layer (0 = exact, 1 = no better than an output of zeros)
            loss = (pred - target).pow(2).sum() / target.pow(2).sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
    finally:
        for p in params:
            p.requires_grad_(False)
            p.grad = None
    return torch.stack(losses).tolist() if losses else []


# ---------------------------------------------------------------- progress (resume)
class FitProgress:
    """Each finished layer's fp32 attention weights and report entry: in a work folder (`folder`, resumable
    across processes; files written atomically) or, without one, in memory.

    `identity` (settings, inputs, dtype) is stored in the folder; a folder made for another identity is
    emptied first, so a rerun never mixes layers of two different fits."""

    IDENTITY = "identity.json"

    def __init__(self, folder: str | Path | None = None, identity: dict | None = None, log=print):
        self.folder = None if folder is None else Path(folder)
        self._memory: dict[int, dict] = {}
        if self.folder is None:
            return
        stamp = self.folder / self.IDENTITY
        wanted = json.loads(json.dumps(identity or {}))
        if self.folder.exists() and (not stamp.is_file() or json.loads(stamp.read_text()) != wanted):
            log(f"fit: {self.folder} holds the progress of another fit; starting afresh")
            shutil.rmtree(self.folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        if not stamp.is_file():
            atomic.write_json(stamp, wanted)

    def _path(self, layer: int) -> Path:
        return self.folder / f"layer-{layer:03d}.pt"

    def done(self, layer: int) -> bool:
        return layer in self._memory if self.folder is None else self._path(layer).is_file()

    def load(self, layer: int) -> dict:
        """{"state": the fitted fp32 state dict (CPU), "entry": the layer's report entry}."""
        if self.folder is None:
            return self._memory[layer]
        return torch.load(self._path(layer), map_location="cpu", weights_only=True)

    def save(self, layer: int, state: dict, entry: dict) -> None:
        record = {"state": state, "entry": entry}
        if self.folder is None:
            self._memory[layer] = record
            return

        with atomic.staged(self._path(layer)) as tmp:
            torch.save(record, tmp)

    def remove(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


# ---------------------------------------------------------------- the whole model
def unshare_attention(source, converted) -> int:
    """Give every attention parameter of `converted` that shares memory with a tensor of `source` its own copy
    (an in-memory conversion reuses the source's o_proj, say): fitting it must not move the teacher.
    Returns how many were copied."""
    taken = {t.data_ptr() for t in list(source.parameters()) + list(source.buffers())}
    copied = 0
    for layer in converted.model.layers:
        for p in layer.self_attn.parameters():
            if p.data_ptr() in taken:
                p.data = p.data.clone()
                copied += 1
    return copied


def _as_ids(blocks) -> torch.Tensor:
    return torch.as_tensor(np.asarray(blocks, dtype=np.int64))


def _paired_change(before: list[float], after: list[float]) -> dict:
    mean, se = mean_and_stderr(np.asarray(after) - np.asarray(before))
    return {"mean": mean, "stderr": se, "blocks": len(before), "stderr_method": "paired: SE of per-block differences"}


def heldout_loss(model, blocks, batch: int) -> dict:
    """Mean held-out loss ± SE of a causal LM on token blocks [N, T], with per-block losses."""
    return perplexity(model, np.asarray(blocks, dtype=np.int64), batch_size=batch, per_block=True)


def fit_model(source, converted, train_blocks, heldout_blocks, settings: FitSettings = FitSettings(), *,
              progress: FitProgress | None = None, on_layer_done=None, log=print) -> dict:
    """Fit every attention layer of `converted` (an MLA model, changed in place) to `source` (the model it was
    converted from), both loaded on one device in one dtype; returns the report (fit.json's content).

    Uses all of `train_blocks` and `heldout_blocks` (token arrays [N, T]; `select_blocks` picks them from a
    data folder by the settings). `progress` keeps finished layers (resume); the fitted fp32 weights are in
    it afterwards (`progress.load(i)["state"]`). `on_layer_done(i)` is called once layer i is kept.
    """
    t_start = time.perf_counter()
    progress = progress or FitProgress()
    device, dtype = next(converted.parameters()).device, next(converted.parameters()).dtype
    layers_src, layers_conv = source.model.layers, converted.model.layers
    if len(layers_src) != len(layers_conv):
        raise ValueError(f"the source has {len(layers_src)} layers, the converted model {len(layers_conv)}")
    train_ids, held_ids = _as_ids(train_blocks), _as_ids(heldout_blocks)
    train_ids = with_echoes(train_ids, settings.echo, settings.seed)
    if train_ids.shape[0] == 0 or held_ids.shape[0] == 0:
        raise ValueError("fitting needs at least one training block and one held-out block")
    if train_ids.shape[1] != held_ids.shape[1]:
        raise ValueError(f"training blocks of {train_ids.shape[1]} tokens, held-out blocks of {held_ids.shape[1]}")
    length, batch = int(train_ids.shape[1]), min(settings.batch, int(train_ids.shape[0]))
    source.eval()
    converted.eval()
    source.requires_grad_(False)
    converted.requires_grad_(False)
    unshare_attention(source, converted)

    log(f"fit: held-out loss before, {held_ids.shape[0]} blocks")
    before = heldout_loss(converted, held_ids, batch)
    src_kwargs = layer_call_kwargs(source, list(layers_src), length)
    conv_kwargs = layer_call_kwargs(converted, [layer.self_attn for layer in layers_conv], length)
    streams = {"train": embed(source, train_ids, batch, dtype), "heldout": embed(source, held_ids, batch, dtype)}
    hidden = streams["train"].shape[-1]

    entries = []
    for i, (src_layer, conv_layer) in enumerate(zip(layers_src, layers_conv)):
        attn = conv_layer.self_attn
        if progress.done(i):                 # fitted by an earlier run: restore, and only advance the streams
            record = progress.load(i)
            attn.load_state_dict(record["state"])
            for h in streams.values():
                teacher_pass(src_layer, src_kwargs[i], h, batch, keep=False)
            entries.append({**record["entry"], "resumed": True})
            log(f"fit: layer {i} restored from the work folder")
            continue
        t0 = time.perf_counter()
        x_train, y_train = teacher_pass(src_layer, src_kwargs[i], streams["train"], batch)
        x_held, y_held = teacher_pass(src_layer, src_kwargs[i], streams["heldout"], batch)
        attn.float()
        balance.at_source_scale(attn, src_layer.self_attn)   # the scale the fit's learning rate was chosen at
        error_before = relative_error(attn, conv_kwargs[i], x_held, y_held, batch)
        converted_state = {k: v.detach().to("cpu", copy=True) for k, v in attn.state_dict().items()}   # off the GPU
        losses = fit_layer(attn, conv_kwargs[i], x_train, y_train, settings, i)
        error_fitted = relative_error(attn, conv_kwargs[i], x_held, y_held, batch)
        # A layer the conversion already got nearly right can come out worse from a constant-lr fit (measured:
        # the K/V-expanded MHA model at d_kv 32, error 0.05 -> 0.20): keep whichever is better held out.
        kept = "fit" if error_fitted < error_before else "conversion"
        if kept == "conversion":
            attn.load_state_dict(converted_state)
        error_after = min(error_fitted, error_before)
        del converted_state
        # Adam's steps scale the two sides of each product unevenly; fine-tuning starts from balanced ones
        imbalance = balance.balance_attention(attn)
        state = {k: v.detach().to("cpu", copy=True) for k, v in attn.state_dict().items()}
        attn.to(dtype)                        # back to the job's dtype, once
        del x_train, y_train, x_held, y_held
        devices.synchronize(device)
        last = losses[-min(10, len(losses)):]
        entry = {"layer": i, "error_before": error_before, "error_after": error_after, "error_fitted": error_fitted,
                 "kept": kept, "factor_imbalance": imbalance, "train_loss_first": losses[0], "train_loss_last10": sum(last) / len(last),
                 "seconds": time.perf_counter() - t0}
        progress.save(i, state, entry)
        entries.append({**entry, "resumed": False})
        log(f"fit: layer {i}: held-out relative error {error_before:.4f} -> {error_fitted:.4f}"
            f"{'' if kept == 'fit' else ' (worse: the conversion kept)'} ({entry['seconds']:.1f} s)")
        if on_layer_done is not None:
            on_layer_done(i)
    del streams

    log(f"fit: held-out loss after, {held_ids.shape[0]} blocks")
    after = heldout_loss(converted, held_ids, batch)
    change = _paired_change(before.pop("block_losses"), after.pop("block_losses"))
    elem = torch.empty((), dtype=dtype).element_size()
    return {
        "settings": asdict(settings),
        "device": devices.describe(device, dtype), "dtype": str(dtype).removeprefix("torch."),
        "fit_dtype": "float32",
        "train_blocks": int(train_ids.shape[0]), "heldout_blocks": int(held_ids.shape[0]), "block_length": length,
        "blocks_per_step": batch,
        "stream_bytes": 3 * (train_ids.shape[0] + held_ids.shape[0]) * length * hidden * elem,
        "layers": entries,
        "error_before_mean": sum(e["error_before"] for e in entries) / len(entries),
        "error_after_mean": sum(e["error_after"] for e in entries) / len(entries),
        "heldout_loss_before": before, "heldout_loss_after": after, "heldout_loss_change": change,
        "seconds_layers": sum(e["seconds"] for e in entries),
        "seconds_total": time.perf_counter() - t_start,
        "error_definition": ERROR_DEFINITION,
    }


# ---------------------------------------------------------------- checkpoints on disk
def join_blocks(blocks, span: int, count: int, evenly: bool = False) -> np.ndarray:
    """Sequences of `span` consecutive blocks [N, T] joined end to end -> [≤ count, span·T]: the first `count`
    or, with `evenly`, `count` starting blocks spread evenly over those with span − 1 blocks after them. Packed
    blocks continue one another (mla/data), so a joined sequence is running text; span 1 gives the blocks."""
    if not evenly:
        return np.asarray(join_consecutive(blocks, span)[:count], dtype=np.int64)
    starts_available = len(blocks) - span + 1
    if starts_available <= 0:
        return np.zeros((0, span * blocks.shape[1]), dtype=np.int64)
    starts = evenly_spaced(starts_available, min(count, starts_available))
    return np.stack([np.asarray(blocks[s:s + span], dtype=np.int64).reshape(-1) for s in starts])


def select_blocks(data_dir: str | Path, settings: FitSettings, log=print) -> tuple[np.ndarray, np.ndarray]:
    """The fit's token sequences from a `mla data` folder: the first `settings.blocks` of the train split (as
    `mla calibrate` reads them) and `settings.heldout` validation blocks evenly spaced (as perplexity does);
    with `settings.span` > 1, each sequence is that many consecutive blocks joined."""
    if not Path(data_dir).is_dir():
        raise UserError(f"--data {data_dir}: no such folder (fitting needs training blocks from `mla data`)")
    train, valid = open_blocks(data_dir, "train"), open_blocks(data_dir, "validation")
    if len(train) == 0:
        raise UserError(f"--data {data_dir} holds no train blocks: fitting needs calibration data")
    if len(valid) == 0:
        raise UserError(f"--data {data_dir} holds no validation blocks for the held-out errors (--heldout)")
    train_seq = join_blocks(train, settings.span, settings.blocks)
    held_seq = join_blocks(valid, settings.span, settings.heldout, evenly=True)
    if len(train_seq) == 0 or len(held_seq) == 0:
        raise UserError(f"fit span {settings.span}: the data holds {len(train)} train and {len(valid)} validation "
                        f"blocks, too few to join {settings.span} of them")
    if len(train_seq) < settings.blocks:
        log(f"note: only {len(train_seq)} train sequences available, fitting on all of them (asked for {settings.blocks})")
    if len(held_seq) < settings.heldout:
        log(f"note: only {len(held_seq)} validation sequences available (asked for {settings.heldout})")
    return train_seq, held_seq


def _fingerprint(folder: Path) -> dict:
    """Size and modification time of a folder's files: enough to tell a rebuilt input from the one a work
    folder was made from, without reading gigabytes."""
    return {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(Path(folder).iterdir()) if p.is_file()}


def work_folder(out: str | Path) -> Path:
    """Where an interrupted fit of `out` keeps its finished layers: beside it, never inside the output."""
    out = Path(out)
    return out.with_name(f".{out.name}.fit-work")


def check_pair(source_config: dict, mla_config: dict, model: str | Path) -> None:
    """The converted checkpoint must be an MLA model of the source's shape."""
    if "kv_lora_rank" not in mla_config or "mha2mla" not in mla_config:
        raise UserError(f"--model {model} is not an MLA checkpoint (its config.json has no kv_lora_rank); "
                        "give the output of `mla convert`")
    for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
        if source_config.get(key) != mla_config.get(key):
            raise UserError(f"--model {model} was not converted from --source: {key} {mla_config.get(key)} "
                            f"vs {source_config.get(key)}")


def fit_checkpoint(source: str | Path, model: str | Path, data: str | Path, out: str | Path,
                   settings: FitSettings = FitSettings(), device: str = "auto", on_layer_done=None,
                   log=print) -> dict:
    """Fit the MLA checkpoint `model` to its source checkpoint on blocks of `data`; write the fitted
    checkpoint (the converted one's files with every attention layer replaced, + conversion.json, fit.json)
    atomically to `out`. Finished layers persist in `work_folder(out)` until the output is complete."""
    source, model, out = checkpoint.require_checkpoint(source), checkpoint.require_checkpoint(model), Path(out)
    check_pair(shapes.read_config(source), shapes.read_config(model), model)
    where = devices.resolve_device(device, config_key="calibrate.device")       # before any loading
    train, heldout = select_blocks(data, settings, log=log)
    if 2 * settings.echo > train.shape[1]:
        raise UserError(f"--echo {settings.echo}: a training sequence of {train.shape[1]} tokens cannot repeat "
                        f"{settings.echo} tokens of its first half in its second; use at most {train.shape[1] // 2}")
    dtype = devices.compute_dtype(where)
    identity = {"settings": asdict(settings), "dtype": str(dtype), "train": train.shape[0], "heldout": heldout.shape[0],
                "source": _fingerprint(source), "model": _fingerprint(model),
                "data": _fingerprint(Path(data))}
    progress = FitProgress(work_folder(out), identity, log=log)
    log(f"fit: {len(train)} train + {len(heldout)} held-out blocks of {train.shape[1]} tokens on "
        f"{devices.describe(where, dtype)}; {settings.steps} steps of {settings.batch} blocks per layer, lr {settings.lr}")
    teacher = checkpoint.load_model(source, dtype=dtype).to(where)
    student = checkpoint.load_model(model, dtype=dtype).to(where)
    report = fit_model(teacher, student, train, heldout, settings, progress=progress,
                       on_layer_done=on_layer_done, log=log)
    del teacher, student
    if where.type == "cuda":
        torch.cuda.empty_cache()

    # the checkpoint from the fitted fp32 weights and the converted checkpoint's other tensors as stored
    fitted = checkpoint.load_model(model)
    for i, layer in enumerate(fitted.model.layers):
        layer.self_attn.load_state_dict(progress.load(i)["state"])
    fitted.config.mha2mla = {**fitted.config.mha2mla, "fit": {**asdict(settings), "converted": str(model)}}
    report.update(source=str(source), model=str(model), data=str(data))
    with atomic.staged(out, folder=True) as tmp:
        fitted.save_pretrained(tmp)
        checkpoint.copy_tokenizer_files(model, tmp)
        if (model / "conversion.json").is_file():
            shutil.copy2(model / "conversion.json", tmp / "conversion.json")
        (tmp / "fit.json").write_text(json.dumps(report, indent=2))
    progress.remove()
    return report


def report_line(report: dict) -> str:
    b, a, c = report["heldout_loss_before"], report["heldout_loss_after"], report["heldout_loss_change"]
    se = (lambda v: "" if v is None else f" ± {v:.3f}")
    return (f"held-out loss {b['mean_loss']:.3f}{se(b['mean_loss_stderr'])} -> {a['mean_loss']:.3f}"
            f"{se(a['mean_loss_stderr'])} (change {c['mean']:+.3f}{se(c['stderr'])}, paired, "
            f"{c['blocks']} blocks); mean layer error {report['error_before_mean']:.4f} -> "
            f"{report['error_after_mean']:.4f}; {report['seconds_total']:.0f} s on {report['device']}")


__all__ = ["FitProgress", "FitSettings", "fit_checkpoint", "fit_model", "select_blocks", "work_folder"]
