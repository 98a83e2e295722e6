"""Attention backends. Importing this package registers the built-in ones in ATTENTION_BACKENDS."""

from agentbox.layers.backends.base import ATTENTION_BACKENDS, AttentionBackend, AttentionMetadata, KVCache
from agentbox.layers.backends.torch_backend import TorchAttention

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionMetadata", "KVCache", "TorchAttention"]
