"""Routed experts in host RAM on a GPU (agentbox/bench/gpu_cpu_moe.py): a tiny Qwen3-MoE with every layer's
experts on the CPU equals the same model with them on the GPU (greedy tokens identical in fp32, logits within
tolerance in fp32 and bf16); CUDA graphs are off with host experts and on without. Skipped without CUDA;
scripts/gpu_check.sh runs it with `pytest -m gpu` and prints decode tok/s and each side's share of a step of a
Qwen3-30B-A3B-shaped model in its `cpu_moe` block."""

from __future__ import annotations

import pytest
import torch

from agentbox.bench.gpu_cpu_moe import parity

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_fp32_cpu_moe_equals_experts_on_the_gpu() -> None:
    got = parity("cuda", torch.float32)
    assert got["host_layers"] == got["moe_layers"] == 3
    assert got["identical_tokens"], got["first_difference"]
    assert got["max_abs_diff"] < 1e-3 * got["max_abs_logit"] and got["top1_match"]
    assert got["cuda_graphs"] == {"device": True, "host": False}


def test_bf16_cpu_moe_is_within_bf16_of_experts_on_the_gpu() -> None:
    got = parity("cuda", torch.bfloat16)
    # the GPU's fused kernel and the CPU's torch loop round bf16 products differently: bf16's few digits
    assert got["max_abs_diff"] < 0.05 * got["max_abs_logit"] and got["top1_match"]
