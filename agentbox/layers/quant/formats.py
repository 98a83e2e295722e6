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


@dataclass(frozen=True)
class MethodInfo:
    formats: tuple[str, ...]  # hub profile variant formats this method loads
    stays_quantised: bool  # resident bytes ~ the file's bytes (else params x compute dtype)
    gpu: KernelStatus  # the CUDA path's verification status (no GPU was lent while writing it)


# Only methods with a registered implementation appear here (tests/test_quant_registry.py checks it).
METHODS: dict[QuantMethod, MethodInfo] = {
    QuantMethod.UNQUANTIZED: MethodInfo(("bf16", "fp16", "fp32"), False, KernelStatus.VERIFIED),
    # Q4_0/Q4_1/Q4_K layers stay 4-bit on GPU (w4a16); other types, and merged layers mixing them (Q4_K_M
    # puts attn_v and half the ffn_down in Q6_K), are dequantised: planned dense, the file's mix unknown.
    QuantMethod.GGUF: MethodInfo(("gguf",), False, KernelStatus.INTERPRETER_ONLY),
    QuantMethod.FP8_BLOCK: MethodInfo(("fp8",), True, KernelStatus.INTERPRETER_ONLY),  # w8a16; w8a8 on sm_89+
    QuantMethod.AWQ: MethodInfo(("awq",), True, KernelStatus.INTERPRETER_ONLY),
    QuantMethod.GPTQ: MethodInfo(("gptq",), True, KernelStatus.INTERPRETER_ONLY),
    QuantMethod.COMPRESSED_TENSORS: MethodInfo(("w4a16",), True, KernelStatus.INTERPRETER_ONLY),  # GPTQ's kernels
}


def engine_formats() -> frozenset[str]:
    return frozenset(f for info in METHODS.values() for f in info.formats)


def method_of_format(fmt: str) -> QuantMethod | None:
    return next((m for m, info in METHODS.items() if fmt in info.formats), None)
