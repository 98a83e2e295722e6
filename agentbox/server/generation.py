"""One generation as the HTTP routes see it: token ids in, text deltas out, with stop strings applied and
usage counted from the engine's real counters. Shared by every API dialect."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from agentbox.chat.harmony import hidden_special_ids, keeps_special_tokens
from agentbox.engine.exec.logprob import TokenLogprob
from agentbox.engine.sampling import SamplingParams
from agentbox.server.detok import Detokenizer, StopChecker
from agentbox.server.errors import RETRY_AFTER_S, APIError
from agentbox.server.state import CLIENT_AGENT, CLIENT_NAMESPACE, ServerState


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    host_cached_tokens: int = 0
    drafted_tokens: int = 0  # speculative decoding (engine/draft.py)
    accepted_tokens: int = 0
    session_id: str | None = None

    def openai(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            # OpenAI's names for a prediction's tokens the model kept and refused: here, the drafts'
            "completion_tokens_details": {"accepted_prediction_tokens": self.accepted_tokens,
                                          "rejected_prediction_tokens": self.drafted_tokens - self.accepted_tokens},
        }


@dataclass
class GenEvent:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finished: bool = False
    finish_reason: str | None = None
    usage: Usage = field(default_factory=Usage)



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
    state: ServerState, prompt_ids: Sequence[int], sampling: SamplingParams, session_id: str | None,
    request_id: str | None = None, record: tuple[list[dict], list[dict] | None] | None = None, history_end: int = 0,
) -> AsyncIterator[GenEvent]:
    """Yields text deltas; the last event has finished=True. Abandoning the iterator aborts the request.
    `record` (messages, tools): the conversation as the client sent it, for `serve --record-trace`. `history_end`:
    PreparedChat.history_end."""
    rid = request_id or new_id("req")
    state.warn_if_greedy_thinking(sampling.temperature)
    hidden = hidden_special_ids(state.tokenizer)  # Gemma 4: special tokens kept but its end of turn
    keep = hidden is not None or keeps_special_tokens(state.tokenizer)
    detok = Detokenizer(state.tokenizer, prompt_ids, skip_special_tokens=not keep, hidden_ids=hidden)
    stops = StopChecker(sampling.stop)
    usage = Usage(prompt_tokens=len(prompt_ids))
    started, produced = time.monotonic(), []
    ns = CLIENT_NAMESPACE.get()
    stream = state.engine.generate(rid, prompt_ids, sampling, ns + session_id if session_id else None, ns,
                                   history_end=history_end)
    async with contextlib.aclosing(stream):
        async for o in stream:
            if o.error and o.finish_reason == "error":
                raise engine_error(o.error, o.error_code)
            usage.completion_tokens += len(o.new_token_ids)
            usage.cached_tokens = o.num_cached_tokens
            usage.host_cached_tokens = o.num_host_cached_tokens
            usage.drafted_tokens, usage.accepted_tokens = o.num_drafted_tokens, o.num_accepted_tokens
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
