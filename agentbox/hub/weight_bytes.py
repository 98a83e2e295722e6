"""Weight bytes a model variant occupies once loaded, and what one decoded token reads: the planner's
weights term (hub/plan.py), by format, device and whether the CPU kernels build."""

from __future__ import annotations

from agentbox.hub.gguf_moe import ExpertBytes, cpu_only_types, expert_bytes
from agentbox.hub.profiles import QUANTISED_FORMATS, Profile, Variant
from agentbox.layers.quant.formats import (
    METHODS,
    MXFP4_BYTES,
    expert_info,
    gguf_mix,
    gguf_resident_ratio,
    method_of_format,
)


def active_weight_bytes(profile: Profile, variant: Variant, device: str, cpu_kernels: bool = True) -> int:
    """Weight bytes one decoded token reads: the active parameters at the variant's resident width."""
    return trunk_weight_bytes(profile, variant, device, cpu_kernels) * profile.active_params // profile.params


def resident_weight_bytes(profile: Profile, variant: Variant, device: str, cpu_kernels: bool = True) -> int:
    """Bytes the weights occupy once loaded: the model's, plus its MTP head's (mtp_weight_bytes)."""
    return trunk_weight_bytes(profile, variant, device, cpu_kernels) + mtp_weight_bytes(profile, variant, device)


def mtp_weight_bytes(profile: Profile, variant: Variant, device: str) -> int:
    """The MTP head in the compute dtype (bf16 on GPU, fp32 on CPU), loaded from an unquantised checkpoint's `mtp.*`
    tensors; 0 for a variant agentbox loads no head from (GGUF, quantised checkpoints: Variant.carries_mtp)."""
    return profile.mtp_params * (2 if device == "cuda" else 4) if variant.carries_mtp else 0


def trunk_weight_bytes(profile: Profile, variant: Variant, device: str, cpu_kernels: bool = True) -> int:
    """Bytes the model's weights (its MTP head aside) occupy once loaded. A method that keeps its weights quantised holds the file's
    bytes plus what its resident form adds per weight (int4: a bf16 scale and offset per group where the
    file has an fp16 scale and a 4-bit zero; MoE experts included, layers/experts/int4.py), counted over every
    parameter (an upper bound: embeddings and norms stay as stored). A dense GGUF file is its size times its
    mix's resident / file bytes (formats.GGUF_MIXES, the types its name tells) on GPU, and on a CPU whose
    kernels build (kernels/cpu_gemv, cpu_bits; `cpu_kernels`, from the probe). The rest become the compute
    dtype (bf16 on GPU, fp32 on CPU; EngineConfig.resolved_dtype): on CPU that is the bound for a CPU where
    the kernels cannot build and for --exact-cpu; where they build, AWQ / GPTQ / W4A16 linears stay 4-bit
    (fp32 scale and offset). MoE experts stay quantised on CPU either way. A bf16 / fp16 checkpoint's weights stay
    16-bit on such a CPU (layers/quant/unquantized.py) but are counted at fp32 here: counted at their size, a
    32 GiB box would plan Qwen3-8B's bf16 over its q8_0, which decodes at half the speed."""
    method = method_of_format(variant.format)
    size = files_on_device(profile, variant)
    if method is None and variant.format in QUANTISED_FORMATS:
        return size  # not runnable here anyway: planned as an engine that keeps it quantised
    if (experts := gguf_experts(profile, variant, device)) is not None:
        if device != "cuda":
            return experts.resident + (profile.params - profile.expert_params) * 4
        if cpu_only_types(variant.name):
            # a llama.cpp Q2_K / Q3_K_* file's other linears are mostly Q2_K / Q3_K too, which a GPU dequantises:
            # bf16 (an upper bound by a few %: its Q4_K attn_v and Q6_K output stay quantised)
            return experts.resident + (profile.params - profile.expert_params) * 2
        mix = gguf_mix(variant.name, *variant.files)
        rest = size - experts.file  # attention, router, norms, tables: the file's mix (experts' aside)
        return experts.resident + int(rest * (gguf_resident_ratio(mix) if mix is not None else 1.0))
    if (mix := gguf_gpu_mix(profile, variant, device, cpu_kernels)) is not None:
        return int(size * gguf_resident_ratio(mix, device))
    # Other GGUF files (types the name does not tell or the linears do not keep: IQ*, dense Q2_K / Q3_K) are
    # planned dequantised, below.
    if method is not None and METHODS[method].stays_quantised and device == "cuda" and not variant.is_gguf:
        info = METHODS[method]
        extra = max(0.0, info.resident_bytes_per_weight - info.file_bytes_per_weight)
        return size + int(profile.params * extra)
    if device == "cpu" and (experts := cpu_quantised_experts(profile, variant)) is not None:
        info = expert_info(variant.expert_format)
        assert info is not None  # cpu_quantised_experts found it
        return int(experts * info.moe_cpu_bytes_per_weight) + (profile.params - experts) * 4
    if device == "cpu" and cpu_kernels and method is not None and (cpu := METHODS[method].cpu_bytes_per_weight):
        return size + int(profile.params * max(0.0, cpu - METHODS[method].file_bytes_per_weight))
    return profile.params * (2 if device == "cuda" else 4)


def files_on_device(profile: Profile, variant: Variant) -> int:
    """The variant's bytes on disk less its n-gram table, which stays memory-mapped in host RAM (hub/ngram_table.py)."""
    return variant.size - profile.ngram_table_bytes


def gguf_experts(profile: Profile, variant: Variant, device: str) -> ExpertBytes | None:
    """A GGUF MoE variant's experts, kept quantised (layers/experts/gguf.py), by the file type its name tells."""
    if not variant.is_gguf or not profile.moe:
        return None
    return expert_bytes(variant.name, profile.expert_params, device)


def gguf_gpu_mix(profile: Profile, variant: Variant, device: str, cpu_kernels: bool = True) -> str | None:
    """The GGUF_MIXES key of a dense GGUF variant planned at its types' resident bytes (on GPU, or on a CPU
    whose kernels build), or None. The type comes from the variant's name or file name (e.g. "q8_0",
    "Qwen3-8B-Q4_K_M.gguf")."""
    if not variant.is_gguf or profile.moe or (device == "cpu" and not cpu_kernels):
        return None
    return gguf_mix(variant.name, *variant.files)


def cpu_quantised_experts(profile: Profile, variant: Variant) -> int | None:
    """The expert parameters that stay quantised on CPU (layers/experts/int4.py keeps them so), or None."""
    info = expert_info(variant.expert_format)
    if not profile.moe or not profile.expert_params or info is None or not info.moe_cpu_bytes_per_weight:
        return None
    return profile.expert_params


def expert_resident_bytes(profile: Profile, variant: Variant, device: str) -> int:
    """Bytes the routed experts hold once loaded on `device` of a GPU machine ("cuda", or "cpu" for experts
    kept in host RAM beside it: hub/offload.py). GGUF experts by their type's form there (hub/gguf_moe.py);
    fp8 / awq / gptq in their resident form (the CPU kernels' on "cpu"); MXFP4 as stored; anything else at
    the model's compute dtype on a GPU machine, bf16 (GGUF types no expert kernel keeps: IQ*; Q2_K and Q3_K on
    the GPU, hub/gguf_moe.py)."""
    if (experts := gguf_experts(profile, variant, device)) is not None:
        return experts.resident
    if variant.expert_format == "mxfp4":  # E2M1 codes and an E8M0 exponent per 32, kept as stored
        return round(profile.expert_params * MXFP4_BYTES)
    method = method_of_format(variant.format)
    if method is not None and not variant.is_gguf and METHODS[method].moe_cpu_bytes_per_weight:
        info = METHODS[method]
        per = info.moe_cpu_bytes_per_weight if device == "cpu" else max(info.resident_bytes_per_weight,
                                                                         info.file_bytes_per_weight)
        return round(profile.expert_params * per)
    return profile.expert_params * 2


def cpu_expert_kernel(profile: Profile, variant: Variant) -> bool:
    """Whether the CPU expert kernels run this variant's experts in host RAM (layers/experts/cpu.py: the int4
    and k-bit forms, i.e. GGUF Q4_0 to Q8_0 and the K-quants between, AWQ, GPTQ, W4A16; layers/experts/nvfp4_cpu.py:
    NVFP4 at 4.5 bits as loaded); the others (bf16, FP8, MXFP4, GGUF types without a form) run the torch
    reference, which dequantises each routed expert per step."""
    if variant.is_gguf:
        return gguf_experts(profile, variant, "cpu") is not None
    return variant.format in ("awq", "gptq", "w4a16", "nvfp4")


def experts_kept_quantised(profile: Profile, variant: Variant) -> bool:
    """Whether a kernel keeps this variant's experts in their quantised form (else bf16, expert_resident_bytes)."""
    if gguf_experts(profile, variant, "cuda") is not None or variant.expert_format == "mxfp4":
        return True
    method = method_of_format(variant.format)
    return method is not None and not variant.is_gguf and bool(METHODS[method].moe_cpu_bytes_per_weight)
