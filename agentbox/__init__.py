"""agentbox: serve a language model to coding agents, keeping each agent session's KV cache resident."""

__version__ = "0.1.0"
