"""Speculative decoding on a GPU (agentbox/bench/gpu_spec.py): greedy output with drafts equals greedy output
without, token for token, in bf16 with CUDA graphs on (decode steps replay graphs, verify steps run eagerly),
with drafts both kept and refused. Skipped without CUDA; scripts/gpu_check.sh runs it with `pytest -m gpu` and
prints the verify-step cost in its `gpu_spec` block."""

from __future__ import annotations

import pytest
import torch

from agentbox.bench.gpu_spec import TINY, exactness

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_bf16_greedy_with_drafts_and_graphs_equals_plain() -> None:
    got = exactness(TINY, "cuda", torch.bfloat16)
    assert got["cuda_graphs"]
    assert got["identical"], got["first_difference"]
    assert 0 < got["accepted_tokens"] < got["drafted_tokens"]
