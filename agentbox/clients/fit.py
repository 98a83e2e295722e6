"""Whether a client's own prompt fits the served context, and what `setup` and `launch` tell the client so that
it does: the usual limits, a smaller output limit, or a refusal with the numbers and the fix.

A client compacts its conversation when it passes (context - output limit). A client whose own first prompt is
already past that point compacts at once, and its summary plus its prompt is past it again: it loops, sending
request after request and never answering (opencode on an 8k context did exactly that). One whose prompt leaves
a few hundred tokens before that point answers once and then fails or rambles at the limit (Codex on the 8k
embedded model). So a client needs its prompt plus room to work (an answer and a tool result or two) below
its compaction point; the output limit it is told shrinks to make that room, and below a useful answer's worth
it is refused, every client alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentbox.clients.names import Client, ClientError

# Each client's own first prompt (system prompt + tool definitions) in tokens, as the server counted it (SmolLM2's
# tokenizer, a one-line task in an empty directory, `agentbox launch CLIENT`; tests/test_real_clients.py runs
# them): Claude Code 20,257 with 2.1.197 and 12,360 with 2.1.332 (the larger counts: npm may hand out either),
# Codex 0.171.0 6,495, aider 0.86.2 about 0.7k; opencode 1.18.33 7,699 (its 10 tools; `opencode run "say hi"`,
# replayed from a recorded trace), plus a separate 586-token title request.
CLIENT_PROMPT_TOKENS = {Client.CLAUDE: 20_300, Client.CODEX: 6_500, Client.OPENCODE: 7_700, Client.AIDER: 700}
WORK_TOKENS = 4096  # after its own prompt and before it compacts: an answer and a tool result or two
MIN_ANSWER_TOKENS = 256  # an output limit below this answers nothing useful


@dataclass(frozen=True)
class Fit:
    context: int
    output: int  # the output limit told to the client (it compacts past context - output)
    note: str = ""  # what was adapted and why, for the user


def needed_context(client: Client) -> int:
    """The least context `client` is set up for: its own prompt, room to work, a useful answer's limit."""
    return CLIENT_PROMPT_TOKENS.get(client, 0) + WORK_TOKENS + MIN_ANSWER_TOKENS


def longer_context_hint(need: int) -> str:
    """What to serve instead: the one model agentbox suggests for agent work on this machine (hub.chain), the
    one `serve`, `plan` and `doctor` name too."""
    from agentbox.hub.chain import suggest_model
    from agentbox.hw.probe import probe

    found = suggest_model(probe(try_kernels=False), need)
    if found is None:
        return "serve a model with a longer context (no known model fits this machine at that context)"
    return f"serve a model with a longer context: {found.describe()}"


def fit(client: Client, context: int, output: int) -> Fit:
    """The limits to tell `client` for a server with this context and output limit; ClientError when the
    client's own prompt leaves no room to work."""
    need = CLIENT_PROMPT_TOKENS.get(client)
    if need is None:
        return Fit(context, output)
    room = context - need - WORK_TOKENS  # the largest output limit that leaves its prompt room to work
    if room < MIN_ANSWER_TOKENS:
        raise ClientError(
            f"{client.value}'s own prompt (system prompt and tools) is about {need:,} tokens; with {WORK_TOKENS:,} "
            f"to work in and a {MIN_ANSWER_TOKENS}-token answer it needs a context of {needed_context(client):,}, "
            f"and this server's is {context:,}; {longer_context_hint(needed_context(client))}; "
            f"--force goes ahead anyway")
    if output <= room:
        return Fit(context, output)
    # Codex has no output-limit setting: its compaction point is set directly (targets.codex_settings).
    told = "it compacts" if client is Client.CODEX else \
        f"it is told an output limit of {room:,} (not {output:,}) so that it compacts"
    return Fit(context, room, note=(
        f"note: {client.value}'s own prompt is about {need:,} of this server's {context:,} tokens: {told} past "
        f"{context - room:,} tokens, with {WORK_TOKENS:,} to work in; a long session compacts often: for real "
        "work serve a longer context"))


def forced(client: Client, context: int, output: int) -> Fit:
    """`--force` past a refusal: the client goes ahead, its output limit cut so that its own prompt is at least
    below its compaction point (else it compacts at once and loops), where that leaves a useful answer."""
    need = CLIENT_PROMPT_TOKENS.get(client, 0)
    below = context - need - 1
    out = min(output, below) if below >= MIN_ANSWER_TOKENS else output
    return Fit(context, out, note=f"note: --force: {client.value} is told an output limit of {out:,} on a context "
                                  f"of {context:,}, of which its own prompt takes about {need:,}")
