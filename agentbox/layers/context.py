"""One forward context per step: the attention backend and the step's batch layout.

The runner enters it around the model call; attention layers read it. Nesting is refused so a step's
layout can never leak into another step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from agentbox.layers.backends.base import AttentionBackend, AttentionMetadata
from agentbox.layers.paged_entries import EntryStep
from agentbox.layers.recurrent_state import StateStep


@dataclass
class ForwardContext:
    backend: AttentionBackend
    meta: AttentionMetadata
    state: StateStep | None = None  # a model with a state group: each sequence's state slot
    # A model with paged groups of more than one token an entry: each size's slots this step (paged_entries.py)
    entries: dict[int, EntryStep] = field(default_factory=dict)


_current: ForwardContext | None = None


@contextmanager
def forward_context(
    backend: AttentionBackend, meta: AttentionMetadata, *, capture: bool = False, state: StateStep | None = None,
    entries: dict[int, EntryStep] | None = None,
) -> Iterator[ForwardContext]:
    """capture: the step is being captured into a CUDA graph (the backend's begin_capture hook runs)."""
    global _current
    if _current is not None:
        raise RuntimeError("forward contexts do not nest: a step is already running")
    if capture:
        backend.begin_capture(meta)
    else:
        backend.begin(meta)
    _current = ForwardContext(backend, meta, state, entries or {})
    try:
        yield _current
    finally:
        _current = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention called outside a forward context (the runner sets one per step)")
    return _current
