"""Whether a client's own prompt fits the served context, and what `setup` and `launch` tell the client so that
it does: the usual limits, adapted ones (smaller output limit, auto-compaction off), or a refusal that says why.

A client compacts its conversation when it passes (context - output limit). A client whose own first prompt is
already past that point compacts at once, and its summary plus its prompt is past it again: it loops, sending
request after request and never answering (opencode on an 8k context did exactly that).
"""

from __future__ import annotations

from dataclasses import dataclass

from agentbox.clients.names import Client, ClientError

# Each client's own first prompt (system prompt + tool definitions) in tokens, measured by the real-client tests
# (tests/test_real_clients.py, SmolLM2's tokenizer, a one-line task) with the pinned versions: Claude Code
# 2.1.332 about 24.8k, Codex 0.171.0 about 6.5k, aider 0.86.2 about 0.7k; opencode 1.18.33 7,699 (its 10
# tools; `opencode run "say hi"`, replayed from a recorded trace), plus a separate 586-token title request.
CLIENT_PROMPT_TOKENS = {Client.CLAUDE: 24_800, Client.CODEX: 6_500, Client.OPENCODE: 7_700, Client.AIDER: 700}
MIN_ANSWER_TOKENS = 256  # below this much room after its own prompt a client cannot answer anything useful
COMPACTION_OFF = (Client.CODEX, Client.OPENCODE)  # clients whose auto-compaction agentbox can turn off


@dataclass(frozen=True)
class Fit:
    context: int
    output: int  # the output limit told to the client
    compact: bool = True  # False: agentbox turns the client's auto-compaction off
    note: str = ""  # what was adapted and why, for the user


def _longer_context_hint(need: int) -> str:
    from agentbox.hub.profiles import load_profiles

    fits = sorted((p for p in load_profiles() if p.context_length >= 2 * need), key=lambda p: p.params)
    return (f"serve a model with a longer context, e.g. agentbox serve --model {fits[0].name} "
            f"({fits[0].context_length} tokens)") if fits else "serve a model with a longer context"


def fit(client: Client, context: int, output: int) -> Fit:
    """The limits to tell `client` for a server with this context and output limit; ClientError when the
    client's own prompt leaves no room for an answer."""
    need = CLIENT_PROMPT_TOKENS.get(client)
    if need is None:
        return Fit(context, output)
    if context < need + MIN_ANSWER_TOKENS:
        raise ClientError(
            f"{client.value}'s own prompt (system prompt and tools) is about {need} tokens, but this server's "
            f"context is {context} tokens (at least {need + MIN_ANSWER_TOKENS} needed); "
            f"{_longer_context_hint(need)}; --force goes ahead anyway")
    if context - output >= need + output or client not in COMPACTION_OFF:
        return Fit(context, output)  # room for its prompt and a full answer before it would compact
    small = min(output, context - need)
    # Codex has no output-limit setting (the server's budget, capped by the room left, applies).
    told = "auto-compaction off" if client is Client.CODEX else \
        f"an output limit of {small} tokens and auto-compaction off"
    return Fit(context, small, compact=False, note=(
        f"note: {client.value}'s own prompt is about {need} of this server's {context} tokens: it gets {told} "
        f"(with an output limit of {output} it would compact at once and loop); a long session will hit the "
        f"context limit; for real work {_longer_context_hint(need)}"))
