"""What agentbox's engine runs (architectures, formats, the gaps it names) and what the plan says about the
kernels a variant would take: the tables and notes `agentbox plan` (hub/plan.py) reads, kept apart from its
arithmetic."""

from __future__ import annotations

from agentbox.hub.profiles import KnownBad, Profile, Variant
from agentbox.hw.probe import GIB
from agentbox.layers.quant.formats import (
    GGUF_MIXES,
    METHODS,
    KernelStatus,
    QuantMethod,
    QuantScheme,
    engine_formats,
    expert_info,
    has_fp4_tensor_cores,
    method_of_format,
    moe_expert_formats,
)

# What agentbox's engine runs today (models/ and layers/). Grow these as kernels land.
ENGINE_ARCHITECTURES = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "GptOssForCausalLM",
        "Gemma4ForCausalLM",
        "Gemma4ForConditionalGeneration",
        "Gemma4UnifiedForConditionalGeneration",
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForConditionalGeneration",
        "Qwen3NextForCausalLM",
        "Glm4MoeLiteForCausalLM",
        "DeepseekV4ForCausalLM",
        "Glm5NextForConditionalGeneration",
        "Qwen4ExpForConditionalGeneration",  # Qwen3.8-Flash-Next (issue 46)
        "Qwen4ExpForCausalLM",
        "LagunaForCausalLM",
        "NemotronHForCausalLM",
    }
)
QUANTISED_METHODS = frozenset(m for m in METHODS if m is not QuantMethod.UNQUANTIZED)
ENGINE_FORMATS = engine_formats()  # the linear-method registry's formats (layers/quant/formats.py)
# Formats one architecture runs beyond those: gpt-oss's MXFP4 experts stay resident (layers/experts/mxfp4.py).
ARCHITECTURE_FORMATS: dict[str, frozenset[str]] = {"GptOssForCausalLM": frozenset({"mxfp4"})}
# Formats the MoE layer's experts load (layers/experts/__init__.py): the expert methods' registry.
MOE_EXPERT_FORMATS = moe_expert_formats()
# Architectures known and deliberately not run, with the missing piece named.
ARCHITECTURE_GAPS: dict[str, str] = {}
# Formats an architecture cannot load yet although the engine has their kernels.
FORMAT_GAPS: dict[tuple[str, str], str] = {
    # Its experts' intermediate size (1,856) is not a multiple of the 128-wide FP8 blocks the expert method holds,
    # and the release's own FP8 scale layout is not verified here.
    ("NemotronHForCausalLM", "fp8"): "Nemotron-H's experts (1,856 wide) do not fall on FP8 block-128 boundaries: "
                                     "serve a GGUF or bf16",
}


def engine_rejection(profile: Profile, variant: Variant) -> str | None:
    """Why our engine cannot run this variant today, or None when it can."""
    arch = profile.architecture
    if arch in ARCHITECTURE_GAPS:
        return f"engine: {arch}: {ARCHITECTURE_GAPS[arch]}"
    if arch not in ENGINE_ARCHITECTURES:
        return f"engine: architecture {arch} not implemented yet"
    if (gap := FORMAT_GAPS.get((arch, variant.format))) is not None:
        return f"engine: {gap}"
    if variant.format not in ENGINE_FORMATS | ARCHITECTURE_FORMATS.get(arch, frozenset()):
        return f"engine: no {variant.format} kernels yet"
    experts = variant.expert_format
    if profile.moe and experts not in MOE_EXPERT_FORMATS | ARCHITECTURE_FORMATS.get(arch, frozenset()):
        # The linear-method registry quantises dense linears; the MoE layer's experts have their own formats.
        runs = "/".join(sorted(MOE_EXPERT_FORMATS))
        return f"engine: no {experts} MoE expert kernels yet (experts run {runs})"
    return None


def engine_runs(profile: Profile) -> bool:
    return any(engine_rejection(profile, v) is None for v in profile.variants)


def gguf_note(variant: Variant, mix: str, weights: int, device: str = "cuda") -> str:
    types = " + ".join(f"{int(share * 100)} % {t.upper()}" for t, share in GGUF_MIXES[mix])
    return (
        f"{variant.format} {mix.upper()} on {'GPU' if device == 'cuda' else 'CPU'}: stays quantised ({types}, by the name): "
        f"{_gb(variant.size)} on disk, {_gb(weights)} resident"
    )


def other_scheme(bad: KnownBad, variant: Variant) -> str | None:
    """Why a known-bad entry does not apply: it names a compute scheme that our kernel for this format is
    not (the fp8 w8a8 MoE kernel vs our weight-only one). None: it applies."""
    method = method_of_format(variant.format)
    if not bad.scheme or method is None:
        return None
    ours = METHODS[method].scheme
    if QuantScheme(bad.scheme) is ours:
        return None
    return (
        f"agentbox runs {variant.format} {ours.value} (16-bit activations, the weights dequantised for the "
        f"matmul), not {bad.scheme}: a different kernel, itself not verified on this GPU family"
    )


def kernel_caveat(variant: Variant, device: str) -> str | None:
    """What is not verified about the kernel this variant would run on (the canary checks it first)."""
    method = method_of_format(variant.format)
    if method is None or device != "cuda":
        return None
    status = METHODS[method].gpu
    if status is KernelStatus.INTERPRETER_ONLY:
        return (
            f"{variant.format}: our Triton kernel is verified only under Triton's CPU interpreter, not on this "
            f"GPU family; the canary runs before the first serve"
        )
    if status is KernelStatus.DEQUANT_FALLBACK:
        return f"{variant.format}: no fused GPU kernel yet; weights dequantised per matmul (slow decode)"
    return None


def nvfp4_path(
    variant: Variant, sm: int | None, weights: int, decode: int, split: bool = False, flashinfer: bool | None = None
) -> str:
    """Which NVFP4 path a GPU takes (layers/quant/nvfp4.py nvfp4_kernel_for, as `agentbox doctor` says) and what
    it costs. split: some experts are in host RAM, so `weights` is what the GPU and the RAM hold together.
    flashinfer: the probe's flashinfer_ok (None: not installed), which the FP4 GEMM needs."""
    capability = None if sm is None else (sm // 10, sm % 10)
    where = " on the GPU and in host RAM" if split else ""
    cost = f"weights stay 4.5 bits: {_gb(weights)} resident{where}, {_gb(decode)} read per decode step"
    w4a16 = "each tile's e2m1 codes and e4m3 scales decoded in registers and multiplied in bf16"
    if has_fp4_tensor_cores(capability) and flashinfer:
        return (
            f"{variant.format} on sm_{sm} (FP4 tensor cores): W4A4 through flashinfer's FP4 GEMM (activations "
            f"quantised per 16 with the checkpoint's input scales; a release without them takes the Triton W4A16 "
            f"kernel); {cost}"
        )
    if has_fp4_tensor_cores(capability):
        why = "does not import" if flashinfer is False else "is not installed"
        return (
            f"{variant.format} on sm_{sm} (FP4 tensor cores): the Triton W4A16 path here, {w4a16}, because "
            f"flashinfer {why} (16-bit tensor-core speed; with flashinfer, W4A4 on the FP4 tensor cores); {cost}"
        )
    return (
        f"{variant.format} on sm_{sm} (no FP4 tensor cores): the Triton W4A16 path, {w4a16} (16-bit tensor-core "
        f"speed, no FP4 speed-up); {cost}"
    )


def moe_kernel_caveat(variant: Variant, device: str) -> str | None:
    """What is not verified about the MoE experts' GPU path of this variant's experts' format."""
    fmt = variant.expert_format
    info = expert_info(fmt)
    if info is None or device != "cuda" or (status := info.moe_gpu) is None:
        return None
    if status is KernelStatus.INTERPRETER_ONLY:
        return (
            f"{fmt} MoE experts: our fused Triton kernel is verified only under Triton's CPU "
            f"interpreter, not on this GPU family; the canary runs before the first serve"
        )
    if status is KernelStatus.DEQUANT_FALLBACK:
        return (
            f"{fmt} MoE experts: no fused GPU kernel in this build; the routed experts are "
            f"dequantised per step (torch reference, slower decode); the canary runs before the first serve"
        )
    return None


def _gb(n: int) -> str:
    return f"{n / GIB:.1f} GiB"
