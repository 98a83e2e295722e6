"""The top-token comparison the numeric tests use: it tolerates summation-order ties, and still fails."""

from __future__ import annotations

import pytest
import torch
from top_tokens import assert_top_tokens_agree


def _logits() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 100, generator=gen)
    x[::2, 7] += 5.0  # every other position has a clear winner; the rest are random near-ties
    return x


def test_summation_noise_that_flips_a_near_tie_passes() -> None:
    expected = _logits()
    expected[1, :2] = torch.tensor([9.0, 9.0 - 1e-3])  # a near tie, as random inputs make
    got = expected + 1e-2 * torch.randn(expected.shape, generator=torch.Generator().manual_seed(1))
    got[1, :2] = torch.tensor([9.0, 9.0 + 1e-3])  # ... flipped by summation order
    assert got[1].argmax() != expected[1].argmax()
    assert_top_tokens_agree(got, expected, max_err=0.1, min_decided=0.5)


def test_a_flipped_decided_position_fails() -> None:
    expected = _logits()
    expected[0] = 0.0
    expected[0, 7], expected[0, 3] = 5.0, 1.0  # a margin of 4
    got = expected.clone()
    got[0, 7], got[0, 3] = 2.4, 3.6  # each off by 2.6, under the margin, in opposite directions: a flip
    with pytest.raises(AssertionError, match="1 of them flipped"):
        assert_top_tokens_agree(got, expected, max_err=10.0, min_decided=0.0)


def test_a_difference_past_the_bound_fails() -> None:
    expected = _logits()
    with pytest.raises(AssertionError, match="bound"):
        assert_top_tokens_agree(expected + 0.5, expected, max_err=0.1, min_decided=0.0)


def test_too_few_decided_positions_fail() -> None:
    """A path whose logits are all far off leaves nothing decided: that is a failure, not a pass."""
    expected = _logits()
    got = expected + 3.0 * torch.randn(expected.shape, generator=torch.Generator().manual_seed(2))
    with pytest.raises(AssertionError, match="decided"):
        assert_top_tokens_agree(got, expected, max_err=100.0, min_decided=0.3)
