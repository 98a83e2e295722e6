"""Setup of Claude Code / Codex / opencode / Aider for the local server, and launching them."""

from agentbox.clients.setup import launch_client, setup_client
from agentbox.clients.targets import LAUNCH_CLIENTS, SETUP_CLIENTS, ClientError, Endpoint, resolve_endpoint

__all__ = ["LAUNCH_CLIENTS", "SETUP_CLIENTS", "ClientError", "Endpoint", "launch_client", "resolve_endpoint",
           "setup_client"]
