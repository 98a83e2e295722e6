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
    NVFP4 = "nvfp4"  # e2m1 + e4m3 scale per 16 + fp32 global (ModelOpt or compressed-tensors nvfp4-pack-quantized)
    # e2m1 + an E8M0 exponent per 32: MoE experts only (layers/experts/mxfp4.py), no linear method; DeepSeek-V4's
    # release names it for its experts (`expert_dtype: fp4`) beside FP8 linears
    MXFP4 = "mxfp4"


class NvFp4Layout(Enum):
    """The two on-disk layouts of the same NVFP4 numbers (layers/quant/nvfp4.py reads both)."""

    MODELOPT = "modelopt"  # `weight`, `weight_scale`, `weight_scale_2` (a multiplier), `input_scale`
    COMPRESSED_TENSORS = "compressed-tensors"  # `weight_packed`, `weight_scale`, `weight_global_scale` (a divisor)


# Compute capabilities with FP4 (e2m1) tensor cores: datacenter Blackwell (sm_100, B300 sm_103) and consumer
# Blackwell (sm_120: RTX 5090 / 5080; sm_121: GB10). Hopper and Ada have FP8 tensor cores but no FP4.
FP4_TENSOR_CORE_CAPABILITIES: frozenset[tuple[int, int]] = frozenset({(10, 0), (10, 3), (12, 0), (12, 1)})


def has_fp4_tensor_cores(capability: tuple[int, int] | None) -> bool:
    return capability is not None and capability in FP4_TENSOR_CORE_CAPABILITIES


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
    moe_gpu: KernelStatus | None = None  # the MoE experts' GPU path (layers/experts/: int4.py, fp8.py, bits.py); None: not loaded
    moe_cpu_bytes_per_weight: float = 0.0  # experts stay quantised on CPU too (fp32 scales there); 0: not
    cpu_bytes_per_weight: float = 0.0  # dense linears on a CPU whose kernels build (cpu_gemv); 0: dequantised
    scheme: QuantScheme = QuantScheme.WEIGHT_ONLY


FP8_BYTES = 1 + 4 / (128 * 128)
INT4_FILE_BYTES = 0.5 + (2 + 0.5) / 128
INT4_RESIDENT_BYTES = 0.5 + (2 + 2) / 128
INT4_CPU_BYTES = 0.5 + (4 + 4) / 128  # fp32 scale and offset
# NVFP4: a 4-bit e2m1 code and one e4m3 byte per 16 weights (4.5 bits); the fp32 global scale per tensor is
# nothing per weight. Resident on GPU as stored (the W4A16 kernel and the FP4 GEMM both read that form).
NVFP4_BYTES = 0.5 + 1 / 16

# Only methods with a registered implementation appear here (tests/test_quant_registry.py checks it).
METHODS: dict[QuantMethod, MethodInfo] = {
    QuantMethod.UNQUANTIZED: MethodInfo(("bf16", "fp16", "fp32"), False, KernelStatus.VERIFIED),
    # Dense linears stay quantised on GPU: Q4_0/Q4_1/Q4_K in int4's form (w4a16), Q5_0/Q5_1/Q8_0/Q5_K/Q6_K in
    # the k-bit form (wbits), merged layers mixing them per run of rows; planned per GGUF type of the
    # variant's mix (GGUF_MIXES). On CPU the 4-bit layers stay 4-bit (cpu_gemv), the others are dequantised.
    # Experts: Q4_* stay 4-bit (fused_moe_int4), Q5_* / Q6_K / Q8_0 k-bit (fused_moe_bits; hub/gguf_moe.py).
    QuantMethod.GGUF: MethodInfo(("gguf",), True, KernelStatus.INTERPRETER_ONLY, moe_gpu=KernelStatus.INTERPRETER_ONLY),
    # w8a16; w8a8 on sm_89+ (kernels/w8a8_block.py). e4m3 + one float32 scale per 128 x 128 block, on disk and resident.
    QuantMethod.FP8_BLOCK: MethodInfo(
        ("fp8",), True, KernelStatus.INTERPRETER_ONLY, FP8_BYTES, FP8_BYTES, KernelStatus.INTERPRETER_ONLY, FP8_BYTES
    ),
    # 4-bit codes + fp16 scale + 4-bit zero per group of 128 on disk; resident in the canonical int4 form:
    # codes + a scale and an offset in the compute dtype (bf16) per group.
    QuantMethod.AWQ: MethodInfo(
        ("awq",), True, KernelStatus.INTERPRETER_ONLY, INT4_FILE_BYTES, INT4_RESIDENT_BYTES,
        KernelStatus.INTERPRETER_ONLY, INT4_CPU_BYTES, cpu_bytes_per_weight=INT4_CPU_BYTES,
    ),
    QuantMethod.GPTQ: MethodInfo(
        ("gptq",), True, KernelStatus.INTERPRETER_ONLY, INT4_FILE_BYTES, INT4_RESIDENT_BYTES,
        KernelStatus.INTERPRETER_ONLY, INT4_CPU_BYTES, cpu_bytes_per_weight=INT4_CPU_BYTES,
    ),
    # compressed-tensors W4A16: GPTQ's method under other tensor names, the same canonical int4 form.
    QuantMethod.COMPRESSED_TENSORS: MethodInfo(
        ("w4a16",), True, KernelStatus.INTERPRETER_ONLY, INT4_FILE_BYTES, INT4_RESIDENT_BYTES,
        cpu_bytes_per_weight=INT4_CPU_BYTES,
    ),
    # NVFP4: W4A4 FP4 GEMM on sm_100 / sm_120 where flashinfer imports, the Triton W4A16 kernel on other GPUs
    # (kernels/nvfp4.py), dequantised at load on CPU (cpu_bytes 0). Experts stay 4.5-bit on every device, through
    # the fused-MoE kernel on GPU (kernels/fused_moe_quant.py fused_moe_nvfp4, weight-only).
    QuantMethod.NVFP4: MethodInfo(
        ("nvfp4",), True, KernelStatus.INTERPRETER_ONLY, NVFP4_BYTES, NVFP4_BYTES, KernelStatus.INTERPRETER_ONLY,
        NVFP4_BYTES,
    ),
}

# MXFP4: an e2m1 code and an E8M0 exponent per 32 weights (4.25 bits), resident as stored on every device.
MXFP4_BYTES = 0.5 + 1 / 32
# Methods of MoE experts alone (no linear method: kept out of METHODS, which is the linear registry's), keyed
# as the expert registry is (layers/experts/__init__.py). DeepSeek-V4's release names MXFP4 for its experts
# beside FP8 linears (a profile variant's `experts_format`); the CPU runs the torch reference on them.
EXPERT_METHODS: dict[QuantMethod, MethodInfo] = {
    QuantMethod.MXFP4: MethodInfo(
        ("mxfp4",), True, KernelStatus.INTERPRETER_ONLY, MXFP4_BYTES, MXFP4_BYTES, KernelStatus.INTERPRETER_ONLY,
        MXFP4_BYTES,
    ),
}


# GGUF types the linears keep quantised on GPU: (bytes per weight in the file, resident with bf16 scales).
# Q4_*: int4's form (4-bit codes, a scale and an offset per 32); the rest the k-bit form of
# layers/quant/bits.py (codes, a scale per 32 (Q6_K: 16), an offset for Q5_1 / Q5_K).
GGUF_TYPE_BYTES: dict[str, tuple[float, float]] = {
    "q4_0": (18 / 32, 0.5 + 4 / 32),
    "q4_1": (20 / 32, 0.5 + 4 / 32),
    "q4_k": (144 / 256, 0.5 + 4 / 32),
    "q5_0": (22 / 32, 5 / 8 + 2 / 32),
    "q5_1": (24 / 32, 5 / 8 + 4 / 32),
    "q5_k": (176 / 256, 5 / 8 + 4 / 32),
    "q6_k": (210 / 256, 6 / 8 + 2 / 16),
    "q8_0": (34 / 32, 1 + 2 / 32),
}
# Dense linears of a GGUF type held in a form of their own on GPU: Q4_K keeps its 6-bit scale and min per 32 and
# fp16 d and dmin per 256 (int4.install_k, kernels/w4a16.py w4k_matmul). MoE experts and vocabulary tables keep
# GGUF_TYPE_BYTES' form (the tables are planned at the linears' ratio all the same).
GGUF_LINEAR_GPU_BYTES: dict[str, float] = {"q4_k": 0.5 + 2 / 32 + 4 / 256}
# On CPU, where kernels/cpu_gemv builds: the 4-bit kernel's tiles (Q4_0 / Q4_1 keep their fp16 scale and
# offset, Q4_K's products of two scales need fp32) and kernels/cpu_bits' rows (fp16 scales for Q5_0 / Q5_1 /
# Q8_0: the file's bytes; an fp32 per 256 times int8 sub-scales for Q5_K 5.75 bits, Q6_K 6.625, Q3_K 3.625 (file
# 3.4375), times Q2_K's own 4-bit scales and mins 2.75 (file 2.625)). Q2_K / Q3_K run only there:
# on a GPU they are dequantised (hub/gguf_moe.py counts their GPU experts at bf16).
GGUF_CPU_BYTES: dict[str, float] = {
    "q4_0": 20 / 32, "q4_1": 20 / 32, "q4_k": 24 / 32, "q5_0": 22 / 32, "q5_1": 24 / 32, "q5_k": 5.75 / 8,
    "q6_k": 6.625 / 8, "q8_0": 34 / 32, "q2_k": 2.75 / 8, "q3_k": 3.625 / 8,
}
# GGUF types only the CPU kernels keep quantised: (bytes per weight in the file, on a GPU: dequantised to bf16).
GGUF_CPU_ONLY_TYPE_BYTES: dict[str, tuple[float, float]] = {"q2_k": (84 / 256, 2.0), "q3_k": (110 / 256, 2.0)}
# A GGUF file's weights by GGUF type, from the llama.cpp type name its variant or file carries
# (llama_tensor_get_type): the single-type files hold every linear in that type; Q4_K_M / Q5_K_M put attn_v
# and ffn_down of half the layers (use_more_bits) in Q6_K, which is 14-15 % of a GQA transformer's linear
# weights (Qwen3-8B 14.1 %, Qwen2.5-32B 15.1 %): 15 % here. The _S mixes bump a few early layers one type
# up (under 3 % of weights): planned as single-type. The vocabulary tables (token_embd, output) take the
# same forms, assumed to grow by the linears' ratio.
GGUF_MIXES: dict[str, tuple[tuple[str, float], ...]] = {
    **{t: ((t, 1.0),) for t in ("q4_0", "q4_1", "q5_0", "q5_1", "q6_k", "q8_0")},
    "q4_k_s": (("q4_k", 1.0),),
    "q5_k_s": (("q5_k", 1.0),),
    "q4_k_m": (("q4_k", 0.85), ("q6_k", 0.15)),
    "q5_k_m": (("q5_k", 0.85), ("q6_k", 0.15)),
    # unsloth's dynamic mix (UD-Q4_K_XL): mostly Q4_K, sensitive tensors kept wider; approx as Q4_K_M plus
    "q4_k_xl": (("q4_k", 0.8), ("q6_k", 0.2)),
}


def gguf_mix(*names: str) -> str | None:
    """The llama.cpp type name (a GGUF_MIXES key) in a variant's name or file names, or None."""
    text = " ".join(names).lower().replace("-", "_")
    return next((m for m in sorted(GGUF_MIXES, key=len, reverse=True) if m in text), None)


def gguf_resident_ratio(mix: str, device: str = "cuda") -> float:
    """Resident bytes on GPU (or on a CPU with its kernels) over the file's bytes, for a GGUF mix's weights."""
    shares = GGUF_MIXES[mix]
    file = sum(s * GGUF_TYPE_BYTES[t][0] for t, s in shares)
    if device == "cuda":
        return sum(s * GGUF_LINEAR_GPU_BYTES.get(t, GGUF_TYPE_BYTES[t][1]) for t, s in shares) / file
    return sum(s * GGUF_CPU_BYTES[t] for t, s in shares) / file


def engine_formats() -> frozenset[str]:
    return frozenset(f for info in METHODS.values() for f in info.formats)


def moe_expert_formats() -> frozenset[str]:
    """Formats whose MoE experts load (the registry in layers/experts/__init__.py); bf16 / fp16 / fp32 always do."""
    methods = [*METHODS.values(), *EXPERT_METHODS.values()]
    quantised = (f for info in methods if info.moe_gpu is not None for f in info.formats)
    return frozenset({"bf16", "fp16", "fp32", *quantised})


def method_of_format(fmt: str) -> QuantMethod | None:
    return next((m for m, info in METHODS.items() if fmt in info.formats), None)


def expert_info(fmt: str) -> MethodInfo | None:
    """What the planner reads of a format's MoE experts (a linear method's, or an expert-only method's)."""
    return next((info for info in (*METHODS.values(), *EXPERT_METHODS.values()) if fmt in info.formats), None)
