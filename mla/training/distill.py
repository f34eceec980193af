"""Distillation from the source model while fine-tuning (docs/distillation.md).

The loss per run is

    CE + weight · T² · KL(p_teacher,T ‖ p_student,T)

where p_·,T is the softmax of the logits divided by the temperature T, and the KL is taken per predicted token
over exactly the tokens (and with exactly the normalisation) of the causal-LM cross-entropy of transformers'
`ForCausalLMLoss`: position t predicts labels[t + 1], labels -100 are skipped, the sum is divided by the
Trainer's `num_items_in_batch` (every predicted token of the global batch) or else by this micro-batch's count.
T² keeps the gradient's scale independent of T (the KL's gradient carries a 1/T² factor).

The KL over a large vocabulary is computed by `chunked_kl_sum`, an autograd function that walks the tokens in
chunks of at most `kl_chunks.KL_CHUNK_ELEMENTS` logits, in fp32, and in its backward writes (q − p)/T chunk by
chunk into one gradient tensor: besides the teacher's logits, memory grows by a few fp32 chunks, never by a full
fp32 copy of the (tokens × vocabulary) logits (mla/training/memory.py counts it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from mla.checkpoint import load_model
from mla.training import kl_chunks

IGNORE_INDEX = -100            # transformers' label for "no target here"


def _rows(vocab: int) -> int:
    return kl_chunks.chunk_rows(vocab, kl_chunks.KL_CHUNK_ELEMENTS)


class _ChunkedKL(torch.autograd.Function):
    """sum_i weights[i] · KL(softmax(teacher[i]/T) ‖ softmax(student[i]/T)) over rows i of [N, V] logits."""

    @staticmethod
    def forward(ctx, student: torch.Tensor, teacher: torch.Tensor, weights: torch.Tensor, temperature: float):
        total = torch.zeros((), dtype=torch.float32, device=student.device)
        step = _rows(student.shape[-1])
        for i in range(0, student.shape[0], step):
            log_q = torch.log_softmax(student[i:i + step].float() / temperature, dim=-1)
            log_p = torch.log_softmax(teacher[i:i + step].float() / temperature, dim=-1)
            total += ((log_p.exp() * (log_p - log_q)).sum(-1) * weights[i:i + step]).sum()
        ctx.save_for_backward(student, teacher, weights)
        ctx.temperature = temperature
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        student, teacher, weights = ctx.saved_tensors
        t = ctx.temperature
        grad = torch.empty_like(student)
        step = _rows(student.shape[-1])
        scale = grad_total.float() / t
        for i in range(0, student.shape[0], step):
            q = torch.softmax(student[i:i + step].float() / t, dim=-1)
            p = torch.softmax(teacher[i:i + step].float() / t, dim=-1)
            grad[i:i + step] = ((q - p) * (weights[i:i + step, None] * scale)).to(grad.dtype)
        return grad, None, None, None


def chunked_kl_sum(student: torch.Tensor, teacher: torch.Tensor, weights: torch.Tensor,
                   temperature: float) -> torch.Tensor:
    """Σ_i weights[i] · KL(p_teacher,T ‖ p_student,T) over the rows of [N, V] logits, in fp32 (differentiable in
    `student` only; the teacher is a constant)."""
    return _ChunkedKL.apply(student, teacher.detach(), weights.detach().float(), float(temperature))


def predicted_token_weights(labels: torch.Tensor) -> torch.Tensor:
    """[b·s] 1.0 where position t has a target (labels[t + 1] != -100), else 0 (the last position of each row):
    the tokens of transformers' causal-LM cross-entropy, without copying the logits to shift them."""
    weights = torch.zeros(labels.shape, dtype=torch.float32, device=labels.device)
    weights[..., :-1] = (labels[..., 1:] != IGNORE_INDEX).float()
    return weights.reshape(-1)


def token_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor, temperature: float,
             num_items_in_batch=None) -> torch.Tensor:
    """KL per predicted token, normalised as the cross-entropy is: Σ KL / num_items_in_batch (the Trainer's count
    over the accumulated global batch), else the mean over this micro-batch's predicted tokens."""
    vocab = student_logits.shape[-1]
    weights = predicted_token_weights(labels)
    total = chunked_kl_sum(student_logits.reshape(-1, vocab), teacher_logits.reshape(-1, vocab), weights,
                           temperature)
    if num_items_in_batch is None:
        return total / weights.sum().clamp(min=1)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


@dataclass
class Distillation:
    """The teacher (a plain module: eval mode, no gradients, never given to DeepSpeed) and the loss weights."""

    teacher: nn.Module
    weight: float
    temperature: float

    def teacher_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.teacher(input_ids=input_ids, use_cache=False).logits

    def combined(self, ce: torch.Tensor, kl: torch.Tensor) -> torch.Tensor:
        return ce + self.weight * self.temperature**2 * kl


def load_teacher(path: str | Path, bf16: bool) -> nn.Module:
    """The teacher, whole, in the training dtype, in eval mode without gradients (on the CPU; the trainer moves it
    to the training device). Call it before the Trainer's DeepSpeed config exists: with ZeRO-3 active,
    transformers' `from_pretrained` would build the model inside `deepspeed.zero.Init` and partition it."""
    from transformers.integrations import is_deepspeed_zero3_enabled


    if is_deepspeed_zero3_enabled():
        raise RuntimeError("load_teacher called with the ZeRO-3 config active: the teacher would be partitioned")
    teacher = load_model(path, dtype=torch.bfloat16 if bf16 else torch.float32)
    teacher.config.use_cache = False
    teacher.eval().requires_grad_(False)
    return teacher


def whole_parameter_elements(model: nn.Module) -> tuple[int, int]:
    """(elements in local tensors, parameters that are DeepSpeed partitions): a whole model gives (all, 0)."""
    local = sum(p.numel() for p in model.parameters())
    partitioned = sum(1 for p in model.parameters() if hasattr(p, "ds_numel"))
    return local, partitioned
