"""The original model's quantized KV cache: transformers' `QuantizedCache(backend="quanto")` in plain torch.

transformers' quanto layer hands its keys and values to optimum-quanto 0.2.7, whose dequantization calls
`PackedTensor.unpack` -> `torch.ops.quanto.unpack`. That op is implemented by an extension which
`torch.utils.cpp_extension.load` compiles the first time a process calls it (`quanto_cpp` on the CPU,
`quanto_cuda` on GPUs: a C++ compiler, ninja, nvcc matching torch's CUDA, a writable site-packages and
minutes), so every quantized-cache evaluation of an original model would stop on a compute node
without nvcc. Quantizing alone compiles nothing; the first decode step after the prefill dequantizes.

This module keeps transformers' own `QuantizedLayer` (the KIVI window: the prompt returned in full
precision and quantized on the way out, new tokens kept in full precision until `residual_length` of
them are there, then everything re-quantized) and does optimum-quanto's arithmetic with torch operations
only, in the cache's dtype as quanto does. For a cached tensor x [B, n_kv, T, d_h] at axis 0 (the
default of transformers and of the paper):

    groups   x flattened row-major into N rows of `q_group_size` consecutive values
             (group(x, axis=0, group_size) in optimum/quanto/tensor/grouped.py)
    scale    (max - min) / (2^bits - 1) per group, shift = -min (MaxOptimizer)
    q        round((x + shift) / scale), clamped to [0, 2^bits - 1], as uint8 (quantize_affine)
    packed   R = ceil(N / (8/bits)) rows of bytes; byte row r holds q rows r, r + R, r + 2R, ...
             in bit fields 0, bits, 2·bits, ... (pack_weights in optimum/quanto/tensor/packed.py)
    x̂        scale·q - shift, reshaped back (QBitsDequantizer)

tests/test_kv_quant.py checks on the CPU that the dequantized states, the bytes held and the decoded
logits equal transformers + optimum-quanto's bit for bit, in fp32 and bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, QuantizedLayer, get_layer_types_and_kwargs

QUANTO_BITS = (2, 4)


@dataclass
class QuantoGroups:
    """One tensor quantized as optimum-quanto does: packed uint8 [R, g], scale and shift [N, 1]."""

    packed: torch.Tensor
    scale: torch.Tensor
    shift: torch.Tensor
    bits: int
    shape: torch.Size

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.shift))


def quantize(x: torch.Tensor, bits: int, group_size: int) -> QuantoGroups:
    """x quantized per group of `group_size` consecutive values (quanto's axis-0 grouping)."""
    per_row = x.numel() // x.shape[0]
    if group_size > per_row or per_row % group_size:
        raise ValueError(f"Group size ({group_size}) must be a divisor of ({per_row})")   # quanto's own check
    groups = x.reshape(-1, group_size)
    rmin, rmax = groups.amin(dim=1, keepdim=True), groups.amax(dim=1, keepdim=True)
    scale, shift = (rmax - rmin) / (2 ** bits - 1), -rmin
    q = torch.clamp(torch.round((groups + shift) / scale), min=0, max=2 ** bits - 1).to(torch.uint8)
    return QuantoGroups(_pack(q, bits), scale, shift, bits, x.shape)


def dequantize(q: QuantoGroups) -> torch.Tensor:
    values = q.scale * _unpack(q.packed, q.bits)[: q.scale.shape[0]]
    values -= q.shift
    return values.reshape(q.shape)


def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    per_byte = 8 // bits
    rows = q.shape[0]
    stride = (rows + per_byte - 1) // per_byte
    packed = torch.zeros((stride, *q.shape[1:]), dtype=torch.uint8, device=q.device)
    for i in range(min(per_byte, rows // stride + 1)):
        part = q[i * stride:(i + 1) * stride]
        packed[: part.shape[0]] |= part << (bits * i)
    return packed


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    fields = [(packed & (2 ** (bits * (i + 1)) - 1)) >> (bits * i) for i in range(8 // bits)]
    return torch.cat(fields).to(torch.uint8)


class QuantoTorchLayer(QuantizedLayer):
    """transformers' `QuantoQuantizedLayer` with optimum-quanto's arithmetic in torch (module docstring)."""

    def __init__(self, nbits: int = 4, axis_key: int = 0, axis_value: int = 0, q_group_size: int = 64,
                 residual_length: int = 128):
        super().__init__(nbits=nbits, axis_key=axis_key, axis_value=axis_value, q_group_size=q_group_size,
                         residual_length=residual_length)
        if nbits not in QUANTO_BITS:
            raise ValueError(f"optimum-quanto quantizes a cache to 2 or 4 bits, not {nbits}")
        if (axis_key, axis_value) != (0, 0):
            raise ValueError("only axis 0 (transformers' default for keys and values) is implemented")

    def _quantize(self, tensor: torch.Tensor, axis: int) -> QuantoGroups:
        return quantize(tensor, self.nbits, self.q_group_size)

    def _dequantize(self, q: QuantoGroups) -> torch.Tensor:
        return dequantize(q)

    def nbytes(self) -> int:
        """Bytes held: the quantized keys and values (packed, scales, shifts) and the full-precision window."""
        total = sum(q.nbytes for q in (self._quantized_keys, self._quantized_values) if q is not None)
        return total + sum(t.numel() * t.element_size() for t in (self.keys, self.values) if t is not None)


class QuantoTorchCache(Cache):
    """One `QuantoTorchLayer` per layer: what `QuantizedCache(backend="quanto", ...)` builds, without the
    compiled extension."""

    def __init__(self, config, nbits: int = 4, q_group_size: int = 64, residual_length: int = 128):
        config = config.get_text_config(decoder=True)
        other = set(get_layer_types_and_kwargs(config)[0]) - {"full_attention"}
        if other:   # transformers' QuantizedCache refuses these too (a sliding window is not a KIVI window)
            raise ValueError(f"a quantized cache supports full-attention layers only, not {sorted(other)}")
        self.nbits, self.q_group_size, self.residual_length = nbits, q_group_size, residual_length
        super().__init__(layers=[QuantoTorchLayer(nbits=nbits, q_group_size=q_group_size,
                                                  residual_length=residual_length)
                                 for _ in range(config.num_hidden_layers)])
