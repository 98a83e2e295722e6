"""The quantisation methods the engine runs, as plain data (no torch): the key of the linear-method
registry (`layers/quant/base.py`), and what the planner reads (`hub/plan.py`) without importing torch.

A method is chosen by the checkpoint: `quantization_config.quant_method` in config.json, or the tensor
types of a GGUF file. Each method names the variant formats of hub profiles it serves and whether its
weights stay quantised once loaded (so the planner counts the file's bytes, not the parameter count's).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class QuantMethod(Enum):
    UNQUANTIZED = "unquantized"
    GGUF = "gguf"
    FP8_BLOCK = "fp8"
    AWQ = "awq"
    GPTQ = "gptq"
    COMPRESSED_TENSORS = "compressed-tensors"  # W4A16 pack-quantized


class KernelStatus(Enum):
    """How far a method's GPU path is verified (the planner caveats what is not)."""

    VERIFIED = "verified"  # ran on that GPU family and matched its torch reference
    INTERPRETER_ONLY = "interpreter-only"  # the Triton kernel matched its twin under TRITON_INTERPRET=1 only
    DEQUANT_FALLBACK = "dequant-fallback"  # no fused kernel: weights dequantised per call / at load


class QuantScheme(Enum):
    """What a kernel computes in: the known-bad matrix names a scheme when only that one failed."""

    WEIGHT_ONLY = "weight-only"  # w4a16 / w8a16: weights dequantised inside the GEMM, 16-bit activations
    W8A8 = "w8a8"  # 8-bit activations too (per-token-group scales)


@dataclass(frozen=True)
class MethodInfo:
    formats: tuple[str, ...]  # hub profile variant formats this method loads
    stays_quantised: bool  # resident bytes ~ the file's bytes (else params x compute dtype)
    gpu: KernelStatus  # the CUDA path's verification status (no GPU was lent while writing it)
    # Bytes per weight of the quantised tensors in a typical release (group 128 / block 128) on disk and
    # resident on GPU (bf16 compute); the planner adds the difference to the file's size. 0: not counted.
    file_bytes_per_weight: float = 0.0
    resident_bytes_per_weight: float = 0.0
    moe_gpu: KernelStatus | None = None  # the MoE experts' GPU path (layers/moe_quant.py); None: not loaded
    moe_cpu_bytes_per_weight: float = 0.0  # experts stay quantised on CPU too (fp32 scales there); 0: not
    scheme: QuantScheme = QuantScheme.WEIGHT_ONLY


FP8_BYTES = 1 + 4 / (128 * 128)
INT4_FILE_BYTES = 0.5 + (2 + 0.5) / 128
INT4_RESIDENT_BYTES = 0.5 + (2 + 2) / 128
INT4_CPU_BYTES = 0.5 + (4 + 4) / 128  # fp32 scale and offset

# Only methods with a registered implementation appear here (tests/test_quant_registry.py checks it).
METHODS: dict[QuantMethod, MethodInfo] = {
    QuantMethod.UNQUANTIZED: MethodInfo(("bf16", "fp16", "fp32"), False, KernelStatus.VERIFIED),
    # Q4_0/Q4_1/Q4_K layers stay 4-bit on GPU (w4a16; experts: fused_moe_int4) and on CPU (cpu_gemv); other
    # types, and merged layers mixing them (Q4_K_M puts attn_v and half the ffn_down in Q6_K), are
    # dequantised: planned dense, the file's mix unknown.
    QuantMethod.GGUF: MethodInfo(("gguf",), False, KernelStatus.INTERPRETER_ONLY, moe_gpu=KernelStatus.INTERPRETER_ONLY),
    # w8a16; w8a8 on sm_89+ (kernels/w8a8_block.py). e4m3 + one float32 scale per 128 x 128 block, on disk and resident.
    QuantMethod.FP8_BLOCK: MethodInfo(
        ("fp8",), True, KernelStatus.INTERPRETER_ONLY, FP8_BYTES, FP8_BYTES, KernelStatus.INTERPRETER_ONLY, FP8_BYTES
    ),
    # 4-bit codes + fp16 scale + 4-bit zero per group of 128 on disk; resident in the canonical int4 form:
    # codes + a scale and an offset in the compute dtype (bf16) per group.
    QuantMethod.AWQ: MethodInfo(
        ("awq",), True, KernelStatus.INTERPRETER_ONLY, INT4_FILE_BYTES, INT4_RESIDENT_BYTES,
        KernelStatus.INTERPRETER_ONLY, INT4_CPU_BYTES,
    ),
    QuantMethod.GPTQ: MethodInfo(
        ("gptq",), True, KernelStatus.INTERPRETER_ONLY, INT4_FILE_BYTES, INT4_RESIDENT_BYTES,
        KernelStatus.INTERPRETER_ONLY, INT4_CPU_BYTES,
    ),
    # compressed-tensors W4A16: GPTQ's method under other tensor names, the same canonical int4 form.
    QuantMethod.COMPRESSED_TENSORS: MethodInfo(
        ("w4a16",), True, KernelStatus.INTERPRETER_ONLY, INT4_FILE_BYTES, INT4_RESIDENT_BYTES
    ),
}


def engine_formats() -> frozenset[str]:
    return frozenset(f for info in METHODS.values() for f in info.formats)


def moe_expert_formats() -> frozenset[str]:
    """Formats whose MoE experts load (layers/moe_quant.py); bf16 / fp16 / fp32 always do."""
    quantised = (f for info in METHODS.values() if info.moe_gpu is not None for f in info.formats)
    return frozenset({"bf16", "fp16", "fp32", *quantised})


def method_of_format(fmt: str) -> QuantMethod | None:
    return next((m for m, info in METHODS.items() if fmt in info.formats), None)
