"""Attention backends. Importing this package registers the built-in ones in ATTENTION_BACKENDS.

`torch` and `triton` are always registered (triton says itself whether it can run); `flashinfer` only where
the package is installed, so the CLI's choices (read from the registry) offer only what this machine has.
"""

from __future__ import annotations

import importlib.util
import logging

from agentbox.layers.backends.base import ATTENTION_BACKENDS, AttentionBackend, AttentionMetadata, KVCache
from agentbox.layers.backends.torch_backend import TorchAttention
from agentbox.layers.backends.triton_backend import TritonAttention

if importlib.util.find_spec("flashinfer") is not None:  # find_spec does not import it (slow, pulls CUDA JIT)
    from agentbox.layers.backends.flashinfer_backend import FlashInferAttention  # noqa: F401

log = logging.getLogger(__name__)

AUTO = "auto"
# What `auto` tries, fastest first.
AUTO_ORDER = ("flashinfer", "triton", "torch")


def backend_choices() -> list[str]:
    return [AUTO, *ATTENTION_BACKENDS]


def select_backend(name: str, device: str) -> type[AttentionBackend]:
    """The backend class for --attention `name` on `device` (a device type). `auto` takes the first of
    AUTO_ORDER that can run and logs the choice with why each earlier one could not."""
    if name == AUTO:
        skipped = []
        for candidate in AUTO_ORDER:
            cls = ATTENTION_BACKENDS.get(candidate)
            reason = "not installed" if cls is None else cls.unavailable_reason(device, auto=True)
            if reason is None and cls is not None:
                why = "; ".join(skipped) if skipped else "the first choice"
                log.info("attention backend: auto picked %s on %s (%s)", candidate, device, why)
                return cls
            skipped.append(f"{candidate}: {reason}")
        raise ValueError(f"no attention backend runs on {device}: {'; '.join(skipped)}")
    cls = ATTENTION_BACKENDS.get(name)
    if cls is None:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(backend_choices())}")
    reason = cls.unavailable_reason(device)
    if reason is not None:
        raise ValueError(f"attention backend {name!r} cannot run on {device}: {reason}")
    log.info("attention backend: %s on %s (asked for by name)", name, device)
    return cls


__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttentionMetadata",
    "KVCache",
    "TorchAttention",
    "TritonAttention",
    "backend_choices",
    "select_backend",
]
