"""What a GGUF MoE file's experts occupy once loaded, for the planner (plain data, no torch).

Every quantised GGUF expert type stays quantised (layers/experts/gguf.py): 4-bit types in the int4 expert
form (4-bit codes, a scale and an offset per 32 weights), Q5_0 / Q5_1 / Q8_0 / Q5_K / Q6_K in the k-bit form
(layers/experts/bits.py: codes at their width, a scale and, for Q5_1 / Q5_K, an offset per group of 32, 16 for
Q6_K), the scales in bf16 on GPU; on CPU the CPU kernels' forms (layers/experts/cpu.py, formats.GGUF_CPU_BYTES).
Q2_K / Q3_K experts stay quantised on CPU alone (the k-bit form at 2 / 3 bits, 2.75 / 3.625 bits a weight): on
a GPU they are dequantised to bf16, so a plan for them keeps their experts in host RAM. tests/test_plan_gguf_moe.py measures
each number below on loaded layers. A profile does not list its file's tensor types, so a variant named
after a llama.cpp file type gets that type's expert mix.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentbox.layers.quant.formats import GGUF_CPU_BYTES, GGUF_CPU_ONLY_TYPE_BYTES, GGUF_TYPE_BYTES


@dataclass(frozen=True)
class ExpertTypeBytes:
    """Bytes per expert weight of one GGUF type: in the file, resident on GPU (bf16), on CPU (its kernels)."""

    file: float
    cuda: float
    cpu: float

    def resident(self, device: str) -> float:
        return self.cuda if device == "cuda" else self.cpu


# Experts take the linear layers' forms on every device (layers/experts/cpu.py repacks them for the CPU kernels)
EXPERT_TYPE_BYTES: dict[str, ExpertTypeBytes] = {
    t.upper(): ExpertTypeBytes(*(GGUF_TYPE_BYTES | GGUF_CPU_ONLY_TYPE_BYTES)[t], cpu) for t, cpu in GGUF_CPU_BYTES.items()
}
CPU_ONLY_TYPES = frozenset(t.upper() for t in GGUF_CPU_ONLY_TYPE_BYTES)  # quantised in host RAM only

# Shares of the expert weights in each type, per llama.cpp file type (its llama_tensor_get_type): the _M
# mixes keep ffn_gate/up_exps at the base type and put ffn_down_exps in Q6_K in half the layers
# (use_more_bits: the first and last eighth and every third between; 24 of Qwen3-30B-A3B's 48), so a
# sixth of the expert weights are Q6_K; Q4_K_S puts the first eighth's ffn_down_exps in Q5_K. (Q4_0 /
# Q5_0 quantised with an imatrix move that eighth to Q4_1 / Q5_1: the same bytes within 1 %.) Q2_K puts every
# ffn_down_exps in Q3_K; Q3_K_M puts the first sixteenth's in Q5_K and the rest in Q4_K (a Q4_K down beside
# Q3_K gate/up runs 4-bit on the CPU kernel), Q3_K_S keeps all in Q3_K.
EXPERT_MIX: dict[str, dict[str, float]] = {
    "q2_k": {"Q2_K": 2 / 3, "Q3_K": 1 / 3},
    "q3_k_s": {"Q3_K": 1.0},
    "q3_k_m": {"Q3_K": 2 / 3, "Q4_K": 15 / 48, "Q5_K": 1 / 48},
    "q4_0": {"Q4_0": 1.0},
    "q4_1": {"Q4_1": 1.0},
    "q4_k_s": {"Q4_K": 23 / 24, "Q5_K": 1 / 24},
    "q4_k_m": {"Q4_K": 5 / 6, "Q6_K": 1 / 6},
    "ud-q4_k_xl": {"Q4_K": 5 / 6, "Q6_K": 1 / 6},  # Unsloth's dynamic mix: planned as Q4_K_M's experts (approx)
    "q5_0": {"Q5_0": 1.0},
    "q5_1": {"Q5_1": 1.0},
    "q5_k_s": {"Q5_K": 1.0},
    "q5_k_m": {"Q5_K": 5 / 6, "Q6_K": 1 / 6},
    "q6_k": {"Q6_K": 1.0},
    "q8_0": {"Q8_0": 1.0},
}


def cpu_only_types(variant_name: str) -> list[str]:
    """The expert types of a variant's mix that only the CPU kernels keep quantised (Q2_K, Q3_K)."""
    return sorted(t for t in EXPERT_MIX.get(variant_name.lower(), {}) if t in CPU_ONLY_TYPES)


@dataclass(frozen=True)
class ExpertBytes:
    file: int  # the experts' share of the file
    resident: int  # what they hold once loaded on that device


def expert_bytes(variant_name: str, expert_params: int, device: str) -> ExpertBytes | None:
    """The experts of a GGUF variant named after a llama.cpp file type; None for any other name."""
    mix = EXPERT_MIX.get(variant_name.lower())
    if mix is None or not expert_params:
        return None
    file = sum(share * EXPERT_TYPE_BYTES[t].file for t, share in mix.items())
    resident = sum(share * EXPERT_TYPE_BYTES[t].resident(device) for t, share in mix.items())
    return ExpertBytes(round(expert_params * file), round(expert_params * resident))
