"""One generation as the HTTP routes see it: token ids in, text deltas out, with stop strings applied and
usage counted from the engine's real counters. Shared by every API dialect."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from agentbox.chat.harmony import keeps_special_tokens
from agentbox.config import ServerConfig
from agentbox.engine.ipc.client import EngineClient
from agentbox.engine.ipc.messages import EngineReady, TokenLogprob
from agentbox.engine.sampling import SamplingParams
from agentbox.server.detok import Detokenizer, StopChecker
from agentbox.server.errors import RETRY_AFTER_S, APIError


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    host_cached_tokens: int = 0
    session_id: str | None = None

    def openai(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass
class GenEvent:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finished: bool = False
    finish_reason: str | None = None
    usage: Usage = field(default_factory=Usage)


T = TypeVar("T")


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
    recorder: Any = None  # agentbox.bench.record.TraceRecorder under `serve --record-trace FILE`
    thinking_model: bool = False
    tool_parser: str | None = None  # the profile's call syntax; None: read from the template
    default_max_tokens: int = 4096  # the profile's output budget for requests that send no max_tokens
    names: tuple[str, ...] = ()  # every name the model answers to, model_name first (server/model_names.py)
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


log = logging.getLogger("agentbox.server")
# The User-Agent of the request being served (set by app.py's middleware), shown per session by `top`.
CLIENT_AGENT: contextvars.ContextVar[str | None] = contextvars.ContextVar("client_agent", default=None)
# The API key's session namespace (set by app.py's auth when several keys are configured, else ""): engine
# session ids are namespace + the client's id, and a key sees, infers and deletes only its own.
CLIENT_NAMESPACE: contextvars.ContextVar[str] = contextvars.ContextVar("client_namespace", default="")


def engine_error(message: str, code: str | None) -> APIError:
    """An engine-side failure as the HTTP error a client can act on."""
    if code in ("queue_full", "admission_timeout"):
        # 429, not 503: behind vllm-router a 503 counts as a circuit-breaker failure (two in a row took a
        # healthy box out of rotation, moving its sessions to a cold cache), while a 429 is handed back to
        # the client with Retry-After and leaves the box in rotation (docs/serving-a-team.md has the numbers).
        return APIError(429, message, code=code, type_="rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_S)})
    if code in ("engine_dead", "shutting_down"):  # a restart (or a stop) is under way: come back shortly
        return APIError(503, f"the engine is unavailable ({message}); retry in {RETRY_AFTER_S} s",
                        code="engine_unavailable", type_="overloaded_error", headers={"Retry-After": str(RETRY_AFTER_S)})
    if code in ("prompt_too_long", "bad_grammar"):
        return APIError(400, message, param="messages" if code == "prompt_too_long" else "tools", code=code)
    return APIError(500, message, code=code or "engine_error", type_="server_error")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


async def generate(
    state: ServerState, prompt_ids: list[int], sampling: SamplingParams, session_id: str | None,
    request_id: str | None = None, record: tuple[list[dict], list[dict] | None] | None = None,
) -> AsyncIterator[GenEvent]:
    """Yields text deltas; the last event has finished=True. Abandoning the iterator aborts the request.
    `record` (messages, tools): the conversation as the client sent it, for `serve --record-trace`."""
    rid = request_id or new_id("req")
    state.warn_if_greedy_thinking(sampling.temperature)
    detok = Detokenizer(state.tokenizer, prompt_ids, skip_special_tokens=not keeps_special_tokens(state.tokenizer))
    stops = StopChecker(sampling.stop)
    usage = Usage(prompt_tokens=len(prompt_ids))
    started, produced = time.monotonic(), []
    ns = CLIENT_NAMESPACE.get()
    stream = state.engine.generate(rid, prompt_ids, sampling, ns + session_id if session_id else None, ns)
    async with contextlib.aclosing(stream):
        async for o in stream:
            if o.error and o.finish_reason == "error":
                raise engine_error(o.error, o.error_code)
            usage.completion_tokens += len(o.new_token_ids)
            usage.cached_tokens = o.num_cached_tokens
            usage.host_cached_tokens = o.num_host_cached_tokens
            if o.session_id:
                usage.session_id = o.session_id.removeprefix(ns)
                if agent := CLIENT_AGENT.get():
                    state.remember_client(o.session_id, agent)
            text = stops.feed(detok.add(o.new_token_ids))
            finished, reason = o.finished, o.finish_reason
            if stops.stopped and not finished:
                finished, reason = True, "stop"  # closing the stream below aborts the engine request
            if finished:
                if not stops.stopped:
                    text += stops.feed(detok.flush()) + stops.flush()
                if state.recorder is not None and record is not None:
                    state.recorder.record(usage.session_id or session_id or rid, record[0], record[1],
                                          "".join(produced) + text, None, usage.completion_tokens, started,
                                          time.monotonic())
                    state.recorder.save()
                yield GenEvent(text, o.new_token_ids, o.logprobs, True, reason, usage)
                return
            produced.append(text)
            yield GenEvent(text, o.new_token_ids, o.logprobs, usage=usage)
