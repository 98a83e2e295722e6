"""The API process's state: what every route reads (`ServerState`, one per app: the engine client, the
tokenizer, the model profile's defaults and the checks on a request against them) and the request's own
context (the client's User-Agent and API-key namespace, set by app.py's middleware)."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from agentbox.chat.effort import ReasoningEffort
from agentbox.config import ServerConfig
from agentbox.engine.ipc.client import EngineClient
from agentbox.engine.ipc.messages import EngineReady
from agentbox.server.errors import APIError
from agentbox.server.grammar_gate import GrammarGate

T = TypeVar("T")
log = logging.getLogger("agentbox.server")


def max_token_chars(tokenizer: Any) -> int:
    """The longest token's text, in characters (at least 1): the bound `check_prompt_chars` divides by."""
    vocab = tokenizer.get_vocab()
    longest = max((len(t) for t in vocab), default=1)
    # A vocabulary entry is the token's byte-level spelling ('Ġ' for a space): never shorter than its text.
    return max(1, longest)


@dataclass
class ServerState:
    config: ServerConfig
    engine: EngineClient
    tokenizer: Any
    info: EngineReady
    model_name: str
    started: float = field(default_factory=time.time)
    clients: dict[str, str] = field(default_factory=dict)  # session id -> User-Agent of its last request
    # The model profile's sampling defaults (applied where the client sends none) and whether it thinks.
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    recorder: Any = None  # agentbox.server.trace_recorder.TraceRecorder under `serve --record-trace FILE`
    thinking_model: bool = False
    tool_parser: str | None = None  # the profile's call syntax; None: read from the template
    default_effort: ReasoningEffort | None = None  # the profile's effort for requests that name none
    default_max_tokens: int = 4096  # the profile's output budget for requests that send no max_tokens
    names: tuple[str, ...] = ()  # every name the model answers to, model_name first (server/model_names.py)
    context_note: str = ""  # the served context and why it is that (server/context.py)
    grammars: GrammarGate | None = None  # judges every grammar before the engine sees it (server/grammar_gate.py)
    _cpu: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="tokenize"))
    _max_token_chars: int | None = None

    def remember_client(self, session_id: str, agent: str) -> None:
        """The session's User-Agent for `top`; the oldest entries go past the engine's session cap."""
        self.clients.pop(session_id, None)
        self.clients[session_id] = agent
        while len(self.clients) > self.config.engine.max_sessions:
            self.clients.pop(next(iter(self.clients)))

    def pick(self, name: str, sent: float | int | None, fallback: float | int) -> float | int:
        """The client's value, else the model profile's default, else the API's."""
        if sent is not None:
            return sent
        return type(fallback)(self.sampling_defaults.get(name, fallback))

    def warn_if_greedy_thinking(self, temperature: float) -> None:
        if self.thinking_model and temperature == 0.0:
            log.warning("greedy decoding (temperature 0) on thinking model %s: it tends to loop inside its "
                        "reasoning; the model card recommends temperature %s", self.model_name,
                        self.sampling_defaults.get("temperature", "> 0"))

    def check_model(self, name: str) -> None:
        if name not in (self.model_name, self.info.model_name, *self.names):
            known = ", ".join(f"'{n}'" for n in (self.names or (self.model_name,)))
            raise APIError(
                404, f"model '{name}' is not served here; this server's model answers to {known}",
                param="model", code="model_not_found", type_="not_found_error",
            )

    async def off_loop(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """Runs `fn` (rendering, tokenizing) on the tokenizer's own thread: a 5 MB prompt took the event loop
        4.5 s, and /health with it. One thread: the tokenizer is not shared between threads."""
        return await asyncio.get_running_loop().run_in_executor(self._cpu, functools.partial(fn, *args, **kw))

    def check_prompt_chars(self, text: str, param: str) -> None:
        """Refuses a prompt before tokenizing it when its characters alone prove it too long: no token of
        this tokenizer is longer than `max_token_chars`, so a text needs at least len / that many tokens."""
        if self._max_token_chars is None:
            self._max_token_chars = max_token_chars(self.tokenizer)
        at_least = len(text) // self._max_token_chars
        if at_least >= self.info.max_model_len:
            raise APIError(
                400, f"the prompt is at least {at_least} tokens long ({len(text)} characters) but this server's "
                f"context is {self.info.max_model_len} tokens", param=param, code="context_length_exceeded",
            )

    def check_prompt(self, n: int, param: str) -> None:
        if n >= self.info.max_model_len:
            raise APIError(
                400,
                f"the prompt is {n} tokens long but this server's context is {self.info.max_model_len} tokens",
                param=param, code="context_length_exceeded",
            )

    def clamp_max_tokens(self, requested: int | None, prompt_len: int) -> int:
        """The client's max_tokens as sent, else the model's default output budget; capped only by the
        room the context leaves."""
        room = self.info.max_model_len - prompt_len
        return max(1, min(requested or self.default_max_tokens, room))


# The User-Agent of the request being served (set by app.py's middleware), shown per session by `top`.
CLIENT_AGENT: contextvars.ContextVar[str | None] = contextvars.ContextVar("client_agent", default=None)
# The API key's session namespace (set by app.py's auth when several keys are configured, else ""): engine
# session ids are namespace + the client's id, and a key sees, infers and deletes only its own.
CLIENT_NAMESPACE: contextvars.ContextVar[str] = contextvars.ContextVar("client_namespace", default="")
