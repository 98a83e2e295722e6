"""The sampler's greedy fast path (plain greedy rows: one argmax, no logits copy) picks what the full path
picks, and a batch with any row that needs more (logprobs here) still takes the full path."""

from __future__ import annotations

import torch

from agentbox.engine.exec.sampler import sample
from agentbox.engine.request import Request
from agentbox.engine.sampling import SamplingParams


def test_greedy_fast_path_equals_full_path() -> None:
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(0))
    plain = [Request(f"r{i}", [1, 2, 3], SamplingParams(temperature=0.0)) for i in range(5)]
    fast, fast_lps = sample(logits, plain)
    assert fast == logits.argmax(-1).tolist() and fast_lps == [None] * 5
    mixed = [*plain[:4], Request("lp", [1, 2, 3], SamplingParams(temperature=0.0, logprobs=2))]
    full, full_lps = sample(logits, mixed)
    assert full == fast
    assert full_lps[4] is not None and full_lps[4].token_id == fast[4] and full_lps[:4] == [None] * 4
