"""The planner's GGUF expert bytes (agentbox/hub/gguf_moe.py) are what the loader holds: a tiny qwen3moe
GGUF with one expert type per layer, loaded in bf16 (the GPU's compute dtype) and fp32 (the CPU's), holds
exactly the table's bytes per expert weight for every type; and Qwen3-Coder-30B-A3B's Q4_K_M experts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGML_QUANT_SIZES
from test_gguf_moe import FFN, E, H, Q, write_qwen3moe

from agentbox.hub.gguf_moe import EXPERT_TYPE_BYTES, ExpertBytes, expert_bytes
from agentbox.hub.profiles import find_profile
from agentbox.layers.experts import FusedMoE
from agentbox.layers.quant import resident_weight_bytes
from agentbox.models.loader import load_model

TYPES = [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K, Q.Q8_0]


def test_the_table_is_what_the_loader_holds(tmp_path: Path) -> None:
    path = tmp_path / "types.gguf"
    write_qwen3moe(path, layer_types=[(t,) * 3 for t in TYPES])
    weights = 3 * E * FFN * H
    for dtype, device in ((torch.bfloat16, "cuda"), (torch.float32, "cpu")):
        moes = [m for m in load_model(str(path), dtype, "cpu").model.modules() if isinstance(m, FusedMoE)]
        held = {t.name: resident_weight_bytes(m) / weights for t, m in zip(TYPES, moes, strict=True)}
        assert held == {t.name: pytest.approx(EXPERT_TYPE_BYTES[t.name].resident(device), rel=1e-12) for t in TYPES}
    for t in TYPES:  # and the file's bytes are gguf's block sizes
        block, size = GGML_QUANT_SIZES[t]
        assert EXPERT_TYPE_BYTES[t.name].file == size / block


def test_qwen3_coder_q4_k_m_experts() -> None:
    """128 experts x 48 layers: gate/up and half the downs Q4_K, the other downs Q6_K. 16.3 GiB of the
    18.6 GB file; resident 18.0 GiB on GPU (x 1.101), 20.6 GiB on CPU (Q4_K in fp32 scales: x 1.260)."""
    profile = find_profile("Qwen3-Coder-30B-A3B-Instruct")
    variant = next(v for v in profile.variants if v.name == "q4_k_m")
    cuda = expert_bytes(variant.name, profile.expert_params, "cuda")
    cpu = expert_bytes(variant.name, profile.expert_params, "cpu")
    assert cuda == ExpertBytes(17_553_162_240, 19_327_352_832)
    assert cpu == ExpertBytes(17_553_162_240, 22_120_759_296)
    assert cuda.file < variant.size
    assert expert_bytes("iq2_xxs", profile.expert_params, "cuda") is None


def test_q2_k_q3_k_experts_are_planned_at_the_cpu_kernels_form(tmp_path: Path) -> None:
    """Q2_K / Q3_K experts stay quantised on CPU only (2.75 / 3.625 bits a weight in kernels/cpu_bits' form, what
    an fp32 load holds); a GPU dequantises them, so the table plans them at bf16 there."""
    types = [Q.Q2_K, Q.Q3_K]
    path = tmp_path / "low.gguf"
    write_qwen3moe(path, layer_types=[(t,) * 3 for t in types])
    moes = [m for m in load_model(str(path), torch.float32, "cpu").model.modules() if isinstance(m, FusedMoE)]
    held = {t.name: resident_weight_bytes(m) / (3 * E * FFN * H) for t, m in zip(types, moes, strict=True)}
    assert held == {"Q2_K": 2.75 / 8, "Q3_K": 3.625 / 8} == {t.name: EXPERT_TYPE_BYTES[t.name].cpu for t in types}
    for t in types:
        block, size = GGML_QUANT_SIZES[t]
        assert EXPERT_TYPE_BYTES[t.name].file == size / block and EXPERT_TYPE_BYTES[t.name].cuda == 2.0
