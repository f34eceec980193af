"""Per-GPU memory plan of one training job: model states per ZeRO stage, activations per micro-batch.

Pure arithmetic on the model config (no torch import), so `mla plan --train` and the workflow's config
check (mla/study/memory_check.py) can run it before any job. All sizes are bytes; "GB" is 10^9 bytes.

Model states (P = every parameter once, output head included, a tied head counted once; N = GPUs in the
job = nproc x nodes), as DeepSpeed 0.19.8 holds them with bf16 mixed precision and our config's
`data_types.grad_accum_dtype: fp32` (mla.training.deepspeed_config: the micro-batches of one optimizer step
are summed in fp32, not in bf16):

    stage        params            gradients                  optimizer (fp32 master + Adam m, v)
    0            2P                2P (bf16) + 4P (fp32)      4P + 8P      (no fp32 accumulation: 1 micro-step)
    1            2P                2P (bf16) + 4P (fp32)      (4P + 8P)/N
    2            2P                4P/N (fp32)                (4P + 8P)/N
    3            2P/N + 2L         8P/N + 2L                  (4P + 8P)/N
    1, offload   2P                2P (bf16) + 4P (fp32)      0          (master and Adam on the CPU)
    2, offload   2P                4P/N (fp32)                0
    3, offload   2P/N + 2L         2L                         0

Where the gradients live, per stage (read from DeepSpeed 0.19.8, sizes checked on 2 ranks by
tests/test_memory_plan.py): stage 1 runs DeepSpeed's BF16_Optimizer, which keeps every bf16 gradient and an
fp32 accumulation buffer of the whole model, partitioning only the master weights and Adam states (with
offload it stays DeepSpeed's ZeRO optimizer, whose fp32 `grad_accum` per parameter is as large); stage 2
reduces each micro-step's bf16 gradients in buckets straight into an fp32 partition (no bf16 partition
is kept, and the optimizer reads the fp32 one without a copy; with offload that partition is still built on
the GPU and copied to the CPU at the step); stage 3 keeps the fp32 partition and flattens a copy of it for the
step (4P/N + 4P/N). L is the largest module's parameter count (the layer a ZeRO-3 rank gathers whole).

DeepSpeed's own estimators assume bf16 accumulation: `estimate_zero2_model_states_mem_needs` = 2P + 18P/N
(a 2P/N bf16 gradient partition beside the 4P/N fp32 one), 2P offloaded; `estimate_zero3_model_states_mem_needs`
= 4L + 18P/N (the bf16 parameter partition included), 4L + 2P/N offloaded. The plan differs from them by
exactly the fp32 accumulation: -2P/N at stage 2, +4P/N offloaded; +4P/N at stage 3 (tests/test_memory_plan.py
checks both). Stage 0 is DeepSpeed's bf16 optimizer wrapper without partitioning (fp32 master + fp32
gradient flat copy). fp32 training: params 4P; stage 0 is the plain optimizer (4P grads, 8P Adam, no master
copy); stages 1-3 have no separate accumulation buffer (the gradients are already fp32) and keep DeepSpeed's
fp32 partition copy: gradients 4P + 4P/N at stage 1, 8P/N at stage 2 (0 offloaded), 8P/N + 2L at stage 3.

Buffers (not in the estimators; in `total_bytes`): the gradient-reduction buckets DeepSpeed allocates in
full whatever the model size: ZeRO-1/2 `reduce_bucket_size` (5e8 elements, as mla.training.deepspeed_config
writes it) in the model dtype, twice with `overlap_comm` (on for GPUs); ZeRO-3 one reduce bucket (5e8) and the
prefetch bucket (5e7, DeepSpeed's default).

Activations of one micro-batch (b sequences of s tokens; h hidden, i MLP width, V vocabulary, n_h / n_kv heads
of width d; w = 2 bytes in bf16, 4 in fp32), counted as the tensors autograd saves for the backward in
transformers' Llama (and mla.modeling's MLA) with SDPA attention, checked against the saved-tensor hooks and
the allocator's peak on CPU (tests/test_memory_plan.py):

    per RMSNorm        (4 + 2w)·bsh       its fp32 input copy, the normalised tensor, the output the linears keep
    attention (SDPA)   w·bs·(n_h·d [q after RoPE] + 2·n_kv·d [k, v] + n_h·d [output]) + 4·b·n_h·s [log-sum-exp]
                       flash / memory-efficient kernels keep no s x s matrix; RoPE keeps only cos/sin;
                       GQA goes to the kernel with its n_kv heads (`enable_gqa`, no repeated K/V)
    attention (eager)  q, repeated k and v (n_h heads each), the output copy, fp32 softmax 4·b·n_h·s² and its
                       w-byte cast (bf16 only): the s x s matrix is what SDPA avoids
    MLA attention      query and key after the [rope | nope] concatenation (n_h·d, n_kv·d), v (n_kv·d), the latent
                       c_kv (n_kv·d_kv), the output (n_h·d) and its head-major copy for o_proj (n_h·d), per-layer
                       cos/sin tables of the kept pairs; k_rope and k_nope live only until the concatenation
    SwiGLU MLP         4·w·bsi            gate (SiLU input), SiLU output, up, their product (down_proj input)
    loss               4·bsV              log-softmax of the fp32 upcast logits (the bf16 logits are not kept)

Peak: without checkpointing, all layers' saved tensors plus the loss backward (log-softmax output, its
gradient and the logits' fp32 gradient: 12·bsV in all), or the last MLP's backward (2·w·bsi + w·bsh of
gradients in flight), whichever is larger. With gradient checkpointing each layer keeps only its input (w·bsh);
during the backward one layer is recomputed (its saved tensors) plus its backward's gradients. The logits
(12·bsV at the loss) are often the largest single term: 19 GB for SmolLM at 16 x 2048 tokens.

Distillation (`teacher_params`, docs/distillation.md): the teacher is a whole copy on every GPU in the training
dtype (w·P_teacher, never partitioned), and its logits (w·bsV) live from before the student's forward until the
KL's backward. The KL keeps the student's logits (w·bsV) for its backward, writes their gradient (w·bsV) and works
in fp32 chunks of at most `kl_chunks.KL_CHUNK_ELEMENTS` logits (KL_CHUNK_TEMPORARIES such chunks at once):

    loss forward    + w·bsV (teacher logits) + chunk temporaries
    loss backward   + 3·w·bsV (teacher logits, student logits, KL gradient) + chunk temporaries

The teacher's own forward runs under no_grad before the student's, when nothing of the student is held: its
peak (its logits and one layer's temporaries) is below the student's and is not a candidate.

Attention-only training (`trainable="attention"`): gradients and optimizer states are counted for the attention
parameters only (P_t = P minus embeddings, output head, MLPs and norms), parameters for all P; the activations
are counted as for full training (the backward still runs through every layer), an upper bound.

`fits` compares the total with the GPU's memory less 10 % kept for the CUDA context, NCCL buffers and
allocator fragmentation, which no plan counts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mla import shapes
from mla.errors import UserError
from mla.options import DEFAULT_SVD
from mla.training.kl_chunks import KL_CHUNK_TEMPORARIES, chunk_rows

GB = 10**9
HEADROOM_FRACTION = 0.10         # of the GPU, kept for CUDA context, NCCL and fragmentation
REDUCE_BUCKET_ELEMENTS = 500_000_000    # zero_optimization.reduce_bucket_size (our config and DeepSpeed's default)
PREFETCH_BUCKET_ELEMENTS = 50_000_000   # stage3_prefetch_bucket_size, DeepSpeed's default
ADAM_STATE_BYTES = 8             # fp32 exp_avg + exp_avg_sq per parameter
PRECISIONS = ("bf16", "fp32")
ATTENTIONS = ("sdpa", "eager")

@dataclass(frozen=True)
class Latent:
    """The MLA conversion that changes the shapes: latent width per KV head, kept RoPE pairs, SVD split."""

    d_kv: int
    r: int
    split: bool = False


def _word_bytes(precision: str) -> int:
    return 2 if precision == "bf16" else 4


# ---------------------------------------------------------------- parameters
def total_params(s: shapes.Shape, latent: Latent | None = None, tied: bool = False) -> int:
    """Every parameter once, the output head included (Table 4's counts leave an untied head out)."""
    body = shapes.params_original(s) if latent is None else shapes.params_mla(s, latent.d_kv, latent.r, latent.split)
    return body + (0 if tied else s.vocab * s.hidden)


def non_attention_params(s: shapes.Shape, tied: bool = False) -> int:
    """Embeddings, output head (when untied), MLPs and norms: what `--trainable attention` freezes (the same for
    the original and every MLA layout, which differ in attention only)."""
    mb = int(s.mlp_bias)
    mlp = 3 * s.hidden * s.intermediate + mb * (2 * s.intermediate + s.hidden)
    return s.vocab * s.hidden * (1 if tied else 2) + s.layers * (mlp + 2 * s.hidden) + s.hidden


def trainable_params(s: shapes.Shape, latent: Latent | None = None, tied: bool = False,
                     trainable: str = "all") -> int:
    """Parameters that get gradients and optimizer states: all, or the attention modules' only."""
    P = total_params(s, latent, tied)
    return P if trainable == "all" else P - non_attention_params(s, tied)


def teacher_parameters(config: dict) -> int:
    """Parameters of an unconverted teacher model (output head included, a tied head once)."""
    return total_params(shapes.shape_of(config), None, bool(config.get("tie_word_embeddings", False)))


def largest_module_params(s: shapes.Shape, latent: Latent | None = None) -> int:
    """Parameters of the largest single module (DeepSpeed's `largest_layer_params`)."""
    ab, mb = int(s.qkv_bias), int(s.mlp_bias)
    sizes = [s.vocab * s.hidden,                                          # embedding, output head
             s.hidden * s.intermediate + mb * s.intermediate,             # gate / up
             s.intermediate * s.hidden + mb * s.hidden,                   # down
             s.hidden * s.heads * s.head_dim + ab * s.heads * s.head_dim,  # q, o
             s.hidden * s.kv_heads * s.head_dim + ab * s.kv_heads * s.head_dim]
    if latent is not None:
        latent_in = s.kv_heads * latent.d_kv // (2 if latent.split else 1)
        sizes += [s.hidden * s.kv_heads * latent.d_kv,
                  latent_in * s.kv_heads * s.head_dim + ab * s.kv_heads * s.head_dim]
    return max(sizes)


def model_states(P: int, largest: int, *, gpus_per_node: int, nodes: int, zero_stage: int, offload: bool,
                 precision: str, trainable: int | None = None) -> dict:
    """Per-GPU bytes of params, gradients and optimizer states (see the module docstring's table); gradients and
    optimizer states count the `trainable` parameters only (default all P)."""
    n = gpus_per_node * nodes
    w = _word_bytes(precision)
    Pt = P if trainable is None else trainable
    master_adam = (4 + ADAM_STATE_BYTES) * Pt          # fp32 master weights + Adam m and v
    if zero_stage == 0:
        if offload:
            raise UserError("optimizer offload needs ZeRO stage 1, 2 or 3 (train.zero_stage / --zero-stage)")
        if w == 4:   # plain fp32 optimizer: no master copy, no second gradient copy
            return {"params": 4 * P, "gradients": 4 * Pt, "optimizer": ADAM_STATE_BYTES * Pt}
        return {"params": 2 * P, "gradients": 2 * Pt + 4 * Pt, "optimizer": master_adam}
    optimizer = 0 if offload else master_adam // n
    if zero_stage == 3:
        gathered = 2 * largest      # DeepSpeed's 4L: the gathered layer's 16-bit params and gradients
        params = w * P // n + gathered
        if offload:                 # DeepSpeed: 4L + int(2P/N)
            return {"params": params, "gradients": gathered, "optimizer": 0}
        # the fp32 gradient partition the micro-steps accumulate into, and the flat fp32 copy the step reads
        return {"params": params, "gradients": 2 * (4 * Pt // n) + gathered, "optimizer": optimizer}
    if zero_stage == 1:
        # bf16: every bf16 gradient plus the whole model's fp32 accumulation buffer (BF16_Optimizer, or the
        # ZeRO optimizer's fp32 `grad_accum` with offload); fp32: the gradients and their fp32 partition copy
        whole = w * Pt + 4 * Pt if w == 2 else 4 * Pt + (0 if offload else 4 * Pt // n)
        return {"params": w * P, "gradients": whole, "optimizer": optimizer}
    if w == 2:  # stage 2: the fp32 partition each micro-step's reduced gradients go to (on the GPU with offload too)
        return {"params": w * P, "gradients": 4 * Pt // n, "optimizer": optimizer}
    # fp32 stage 2: the gradient partition and the flat copy the step reads (offload: both on the CPU)
    return {"params": w * P, "gradients": 0 if offload else 2 * (4 * Pt // n), "optimizer": optimizer}


def host_bytes_per_node(P: int, *, gpus_per_node: int, nodes: int, offload: bool) -> int:
    """CPU memory per node for the offloaded optimizer (fp32 gradient partition, master, Adam): 16P/N per rank,
    P the trainable parameters."""
    return 16 * P // (gpus_per_node * nodes) * gpus_per_node if offload else 0


def distill_activation_bytes(s: shapes.Shape, *, micro_batch: int, seq: int, precision: str) -> dict:
    """What distillation adds to the loss's forward and backward peaks (module docstring)."""
    w, bsv = _word_bytes(precision), micro_batch * seq * s.vocab
    chunk = KL_CHUNK_TEMPORARIES * 4 * min(micro_batch * seq, chunk_rows(s.vocab)) * s.vocab
    return {"teacher_logits": w * bsv, "kl_chunks": chunk, "loss_forward": w * bsv + chunk,
            "loss_backward": 3 * w * bsv + chunk}


def buffer_bytes(*, zero_stage: int, precision: str, overlap_comm: bool = True) -> int:
    """DeepSpeed's gradient-reduction (and ZeRO-3 prefetch) buckets, allocated in full."""
    w = _word_bytes(precision)
    if zero_stage in (1, 2):
        return REDUCE_BUCKET_ELEMENTS * w * (2 if overlap_comm else 1)
    if zero_stage == 3:
        return (REDUCE_BUCKET_ELEMENTS + PREFETCH_BUCKET_ELEMENTS) * w
    return 0


# ---------------------------------------------------------------- activations
def layer_saved_bytes(s: shapes.Shape, *, b: int, seq: int, w: int, latent: Latent | None = None,
                      attention: str = "sdpa") -> dict:
    """Bytes one decoder layer keeps for its backward, by part."""
    bs = b * seq
    qd, kvd = s.heads * s.head_dim, s.kv_heads * s.head_dim
    norms = 2 * ((4 + 2 * w) * bs * s.hidden + 4 * bs)      # + the fp32 rsqrt per token
    mlp = 4 * w * bs * s.intermediate
    if attention == "eager":
        probs = b * s.heads * seq * seq * (4 + (w if w < 4 else 0))
        kv_kept = 2 * qd if s.groups > 1 else 2 * kvd          # repeat_kv copies, or k and v themselves
        attn = w * bs * (qd + kv_kept + qd) + probs
    else:
        attn = w * bs * (qd + 2 * kvd + qd) + 4 * b * s.heads * seq
    if latent is not None:
        # the concatenated query is head-major, so the kernel's output is too and o_proj reads a copy;
        # c_kv is kept for k_up/v_up; cos/sin of the kept pairs are gathered per layer (q and k heads)
        attn += w * bs * (qd + s.kv_heads * latent.d_kv) + 2 * w * seq * 2 * latent.r * (s.heads + s.kv_heads)
    return {"norms": norms, "attention": attn, "mlp": mlp, "total": norms + attn + mlp}


def activation_plan(s: shapes.Shape, *, micro_batch: int, seq: int, precision: str, gradient_checkpointing: bool,
                    latent: Latent | None = None, attention: str = "sdpa", distill: bool = False) -> dict:
    """Peak activation bytes of one forward + backward of one micro-batch, with the terms it is built from."""
    b, w = micro_batch, _word_bytes(precision)
    bs, bsh, bsv, bsi = b * seq, b * seq * s.hidden, b * seq * s.vocab, b * seq * s.intermediate
    layer = layer_saved_bytes(s, b=b, seq=seq, w=w, latent=latent, attention=attention)
    # cos/sin [1, s, d]: kept by the RoPE multiplications of Llama, by the checkpointed layers' inputs; MLA keeps
    # only its per-layer gathers of the kept pairs (counted in the layer)
    rope = 2 * w * seq * s.head_dim if latent is None or gradient_checkpointing else 0
    final_norm = (4 + 2 * w) * bsh + 4 * bs
    log_softmax = 4 * bsv
    kept = s.layers * w * bsh if gradient_checkpointing else s.layers * layer["total"]
    # the loss backward: log-softmax output + its gradient + the fp32 logits' gradient
    loss_peak = kept + rope + final_norm + 3 * 4 * bsv
    # forward at the loss: logits (w) + their fp32 upcast (a copy in bf16) + the log-softmax output
    forward_peak = kept + rope + final_norm + (w + (4 if w < 4 else 0)) * bsv + log_softmax
    # the last layer's MLP backward: gradients of the product, SiLU output and up in flight, and of the layer
    layer_backward = 2 * w * bsi + w * bsh
    layer_peak = kept + rope + (layer["total"] if gradient_checkpointing else 0) + layer_backward
    extra = distill_activation_bytes(s, micro_batch=b, seq=seq, precision=precision) if distill else None
    if extra:
        loss_peak += extra["loss_backward"]
        forward_peak += extra["loss_forward"]
    candidates = {"loss_backward": loss_peak, "loss_forward": forward_peak, "layer_backward": layer_peak}
    where = max(candidates, key=candidates.get)
    return {
        "peak_bytes": candidates[where], "peak_at": where, "candidates": candidates,
        "per_layer_saved": layer, "layers_kept": kept,
        "kept_per_layer": w * bsh if gradient_checkpointing else layer["total"],
        "final_norm": final_norm, "rope_tables": rope, "log_softmax": log_softmax, "logits_fp32": 4 * bsv,
        "distillation": extra,
    }


# ---------------------------------------------------------------- the plan
def parse_memory(text: str | float | int) -> int:
    """'80GB', '80 GiB', '141e9', 80 (GB) -> bytes."""
    if isinstance(text, (int, float)):
        return int(text * GB)
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([KMGT]i?B|B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise UserError(f"--gpu-memory {text!r}: expected a size such as 80GB, 141GB or 80GiB")
    value, unit = float(m.group(1)), (m.group(2) or "GB").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(value * scale)


def _check(value, name: str, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise UserError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _check_choice(value, name: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UserError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


def plan_training(config_dict: dict, *, nproc: int, nodes: int = 1, micro_batch: int, seq: int, zero_stage: int,
                  gradient_checkpointing: bool, offload: bool = False, precision: str = "bf16",
                  d_kv: int | None = None, r: int | None = None, gpu_memory_bytes: int | None = None,
                  svd: str = DEFAULT_SVD, attention: str = "sdpa", overlap_comm: bool = True,
                  trainable: str = "all", teacher_params: int | None = None) -> dict:
    """Per-GPU memory of one training job of the model `config_dict` (a config.json), as a JSON-ready dict.

    `overlap_comm` (DeepSpeed's, on for GPUs in our config) doubles the ZeRO-1/2 reduction buckets.
    `trainable` "attention" counts gradients and optimizer states of the attention parameters only;
    `teacher_params` (distillation: the teacher's parameter count, `teacher_parameters`) adds the teacher's
    weights and the distillation's activations (module docstring)."""
    for value, name in ((nproc, "nproc"), (nodes, "nodes"), (micro_batch, "micro_batch"), (seq, "seq")):
        _check(value, name)
    if zero_stage not in (0, 1, 2, 3):
        raise UserError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    _check_choice(precision, "precision", PRECISIONS)
    _check_choice(attention, "attention", ATTENTIONS)
    _check_choice(trainable, "trainable", ("all", "attention"))
    if teacher_params is not None:
        _check(teacher_params, "teacher_params")
    s = shapes.shape_of(config_dict)
    tied = bool(config_dict.get("tie_word_embeddings", False))
    latent = None
    if d_kv is not None:
        r = shapes.default_r(s.head_dim) if r is None else r
        _check(d_kv, "d_kv")
        _check(r, "r")
        if 2 * r > s.head_dim:
            raise UserError(f"r={r} is out of range: at most d_h/2 = {s.head_dim // 2} frequency pairs per head")
        latent = Latent(d_kv, r, svd == "split")
    elif r is not None:
        raise UserError("--r needs --d-kv (it plans the converted model)")

    P = total_params(s, latent, tied)
    P_trainable = trainable_params(s, latent, tied, trainable)
    largest = largest_module_params(s, latent)
    states = model_states(P, largest, gpus_per_node=nproc, nodes=nodes, zero_stage=zero_stage, offload=offload,
                          precision=precision, trainable=P_trainable)
    acts = activation_plan(s, micro_batch=micro_batch, seq=seq, precision=precision,
                           gradient_checkpointing=gradient_checkpointing, latent=latent, attention=attention,
                           distill=teacher_params is not None)
    buffers = buffer_bytes(zero_stage=zero_stage, precision=precision, overlap_comm=overlap_comm)
    teacher = _word_bytes(precision) * teacher_params if teacher_params is not None else 0
    model_state_bytes = sum(states.values())
    total = model_state_bytes + teacher + acts["peak_bytes"] + buffers
    parts = {**states, "teacher": teacher, "activations": acts["peak_bytes"], "buffers": buffers, "total": total}
    usable = None if gpu_memory_bytes is None else int(gpu_memory_bytes * (1 - HEADROOM_FRACTION))
    return {
        **{f"{k}_bytes": v for k, v in parts.items()},
        "fits": None if usable is None else total <= usable,
        "gpu_memory_bytes": gpu_memory_bytes, "usable_bytes": usable,
        "gb": {k: round(v / GB, 2) for k, v in parts.items()},
        "model": {"parameters": P, "trainable_parameters": P_trainable, "teacher_parameters": teacher_params,
                  "largest_module_parameters": largest, "tied_embeddings": tied,
                  "layers": s.layers, "hidden": s.hidden, "intermediate": s.intermediate, "vocab": s.vocab,
                  "heads": s.heads, "kv_heads": s.kv_heads, "head_dim": s.head_dim,
                  "mla": None if latent is None else {"d_kv": latent.d_kv, "r": latent.r, "svd": svd,
                                                      "kv_lora_rank": s.kv_heads * latent.d_kv}},
        "settings": {"nproc": nproc, "nodes": nodes, "world_size": nproc * nodes, "micro_batch": micro_batch,
                     "seq": seq, "zero_stage": zero_stage, "offload": offload, "precision": precision,
                     "gradient_checkpointing": gradient_checkpointing, "attention": attention,
                     "overlap_comm": overlap_comm, "trainable": trainable, "teacher_params": teacher_params},
        "breakdown": {"model_states_bytes": model_state_bytes, "activations": acts,
                      "host_bytes_per_node": host_bytes_per_node(P_trainable, gpus_per_node=nproc, nodes=nodes,
                                                                 offload=offload)},
        "assumptions": ASSUMPTIONS,
    }


ASSUMPTIONS = [
    "DeepSpeed 0.19.8 ZeRO with AdamW: bf16 params, gradients accumulated in fp32 (data_types.grad_accum_dtype), "
    "fp32 master weights and Adam m, v; stage 1 = BF16_Optimizer (whole fp32 gradient buffer); stages 2/3 = "
    "estimate_zero{2,3}_model_states_mem_needs adjusted for the fp32 accumulation",
    "buffers: gradient-reduction buckets of 5e8 elements in the model dtype (x2 with overlap_comm on GPUs; "
    "ZeRO-3: one bucket + the 5e7 prefetch bucket)",
    "activations: transformers Llama / mla.modeling MLA with SDPA (flash or memory-efficient kernel, no s x s "
    "matrix; GQA via enable_gqa), RMSNorm in fp32, loss on fp32 logits; checkpointing keeps each layer's input",
    "fits: total <= 90 % of the GPU memory (CUDA context, NCCL buffers and fragmentation are not counted)",
]

