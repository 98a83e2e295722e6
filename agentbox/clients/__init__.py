"""Setup of Claude Code / Codex / opencode / Aider for the local server, and launching them."""

from agentbox.clients.names import Client, ClientError, parse_client
from agentbox.clients.setup import launch_client, setup_client
from agentbox.clients.targets import Endpoint, resolve_endpoint

__all__ = ["Client", "ClientError", "Endpoint", "launch_client", "parse_client", "resolve_endpoint", "setup_client"]
