"""The token bitmask of constrained decoding (xgrammar's packed int32 words): allocated and applied to the
logits by the sampler; each request's grammar state (engine/grammar.py) fills its row."""

from __future__ import annotations

from typing import Any

import xgrammar as xgr


def allocate_bitmask(batch_size: int, vocab_size: int) -> Any:
    return xgr.allocate_token_bitmask(batch_size, vocab_size)


def apply_bitmask(logits: Any, bitmask: Any, indices: list[int] | None = None) -> None:
    """Mask disallowed tokens to -inf in place (rows in `indices`, or all)."""
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=indices)
