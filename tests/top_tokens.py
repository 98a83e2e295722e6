"""Top-token agreement between two sets of logits that holds on any x86 CPU.

A fraction of agreeing argmaxes fails on random inputs, whose reference top two logits are often nearly
tied: the BLAS library's summation order (AVX2 here, AVX-512 on a Xeon) flips such ties. So a position
counts only when it is decided: the reference's top-2 margin exceeds the measured max abs difference
between the two sets of logits at that position. A flip there needs both top logits to move by most of that difference,
in opposite directions, which summation order does not do and a wrong kernel does; and the difference
itself is held under a bound stated from the reference's scale, so a broken path cannot pass by making
every position undecided (too few decided positions fail too)."""

from __future__ import annotations

import os

import torch


def assert_top_tokens_agree(got: torch.Tensor, expected: torch.Tensor, max_err: float,
                            min_decided: float) -> None:
    """`got` and `expected`: [positions, vocab] logits. `max_err`: the bound on max |got - expected|;
    `min_decided`: the share of positions that must be decided (set well under the measured share)."""
    got, expected = got.float().reshape(-1, got.shape[-1]), expected.float().reshape(-1, expected.shape[-1])
    row_err = (got - expected).abs().amax(-1)  # each position's own measured difference
    err = row_err.max().item()
    top2 = expected.topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1]) > row_err
    flipped = decided & (got.argmax(-1) != expected.argmax(-1))
    summary = (f"max |difference| {err:.4g} (bound {max_err:.4g}); {int(decided.sum())} of {len(decided)} "
               f"positions decided (top-2 margin > that position's max |difference|), "
               f"{int(flipped.sum())} of them flipped")
    if os.environ.get("AGENTBOX_TEST_VERBOSE"):
        print(summary)
    assert err <= max_err, summary
    assert decided.float().mean().item() >= min_decided, summary
    assert not flipped.any(), summary
