"""Tensor parallel 2 over gloo for the MoE families: two processes, each rank holding half of every
expert's intermediate dimension (and half the heads, sinks included), one all-reduce per MoE layer; the
logits of prefill and step-by-step decode match transformers on every rank. One spawn for every family
(GGUF Qwen3-MoE included): starting the processes costs more than the models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from moe_harness import DECODE, PROMPT, hf_logits, save_random, tp_logits
from test_gguf_moe import twin as gguf_twin
from test_gguf_moe import write_qwen3moe
from test_models_gpt_oss import CONFIG as GPT_OSS
from test_models_gpt_oss import write_mxfp4
from test_models_qwen3_moe import CONFIGS as QWEN3_MOE


@pytest.mark.slow
def test_tensor_parallel_2_matches_transformers(tmp_path: Path) -> None:
    models = {
        "qwen3-moe": lambda p: save_random(QWEN3_MOE["norm-topk"], p),
        "gpt-oss-bf16": lambda p: save_random(GPT_OSS, p),
        "gpt-oss-mxfp4": write_mxfp4,
        # Q4_0/Q4_1/Q4_K experts in the int4 form (the Q4_K down shard cuts a block), the Q6_K-down and Q8_0
        # layers in the k-bit form (the Q6_K down shard: 128 of 256 columns, cut at a 16-column group)
        "qwen3-moe.gguf": lambda p: gguf_twin(write_qwen3moe(p)),
    }
    expected = {name: hf_logits(build(tmp_path / name)) for name, build in models.items()}
    results = tp_logits([tmp_path / name for name in models], world=2)
    for name, ranks in zip(models, results, strict=True):
        for got in ranks:
            assert got.shape[0] == len(PROMPT) + len(DECODE)
            torch.testing.assert_close(got, expected[name], atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
