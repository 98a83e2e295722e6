"""The guard's body memo: a body decoded from a remembered prefix equals orjson's decode of the whole, and
everything the whole decode refuses (depth, lone surrogates, bad JSON) is refused in the same words."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentbox.config import ServerConfig
from agentbox.server import guard
from agentbox.server.body_memo import BodyMemo
from agentbox.server.guard import BadInput, check_json

TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False,
                   allow_infinity=False), TEXT)
NESTED = st.recursive(SCALAR, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                      max_leaves=8)
CALL = st.fixed_dictionaries({"id": TEXT, "type": st.just("function"),
                              "function": st.fixed_dictionaries({"name": TEXT, "arguments": TEXT})})
PART = st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}, optional={"extra": NESTED})
MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "tool"]), "content": TEXT | st.lists(PART, max_size=3)}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": TEXT}, optional={"tool_calls": st.lists(CALL, max_size=2)}),
    NESTED,  # the guard takes any JSON; the route's model refuses what is no message
)
# json.dumps' layouts: compact, spaced, indented; escaped or raw UTF-8
LAYOUT = st.fixed_dictionaries({"separators": st.sampled_from([(",", ":"), (", ", ": "), (" , ", " : ")]),
                                "indent": st.sampled_from([None, 1, "\t"]), "ensure_ascii": st.booleans()})
OTHER = st.dictionaries(st.sampled_from(["model", "tools", "stream", "max_tokens", "méta"]), NESTED, max_size=3)
OP = st.one_of(st.tuples(st.just("append"), st.lists(MESSAGE, min_size=0, max_size=3)),
               st.tuples(st.just("edit"), st.integers(0, 50), MESSAGE),
               st.tuples(st.just("truncate"), st.integers(1, 50)),
               st.tuples(st.just("fields"), OTHER),
               st.tuples(st.just("bytes"), st.integers(0, 10**6), st.binary(min_size=1, max_size=3)))


@contextmanager
def memo() -> Iterator[BodyMemo]:
    before, guard.BODY_MEMO = guard.BODY_MEMO, BodyMemo()
    try:
        yield guard.BODY_MEMO
    finally:
        guard.BODY_MEMO = before


def outcome(raw: bytes) -> tuple[str, Any]:
    try:
        return "ok", check_json(raw)
    except BadInput as e:
        return "refused", str(e)


def reference(raw: bytes) -> tuple[str, Any]:
    """What check_json does with nothing remembered: today's whole decode."""
    with memo():
        return outcome(raw)


def encode(other: dict[str, Any], messages: list[Any], first: bool, layout: dict[str, Any]) -> bytes:
    body = {"messages": messages, **other} if first else {**other, "messages": messages}
    return json.dumps(body, **layout).encode()


@settings(max_examples=150, deadline=None)
@given(messages=st.lists(MESSAGE, min_size=1, max_size=4), other=OTHER, first=st.booleans(), layout=LAYOUT,
       ops=st.lists(OP, min_size=1, max_size=6))
def test_memo_decodes_as_the_whole_body(messages: list[Any], other: dict[str, Any], first: bool,
                                        layout: dict[str, Any], ops: list[tuple[Any, ...]]) -> None:
    with memo() as m:
        raw = encode(other, messages, first, layout)
        assert outcome(raw) == ("ok", orjson.loads(raw))
        for op in ops:
            hits = m.hits
            if op[0] == "append":
                messages = messages + op[1]
            elif op[0] == "edit":
                messages = [*messages[: op[1] % len(messages)], op[2], *messages[op[1] % len(messages) + 1 :]]
            elif op[0] == "truncate":
                messages = messages[: max(1, len(messages) - op[1] % len(messages))]
            elif op[0] == "fields":
                other = op[1]
            raw = encode(other, messages, first, layout)
            if op[0] == "bytes":  # anywhere, often past the remembered prefix: bad JSON, a surrogate, a digit
                at = op[1] % (len(raw) + 1)
                raw = raw[:at] + op[2] + raw[at:]
            got = outcome(raw)
            assert got == reference(raw)
            if got[0] == "ok" and op[0] != "bytes":
                assert got[1] == orjson.loads(raw)
            if op[0] == "append":
                assert m.hits == hits + 1  # a turn that only appended reads its history from the memo


@contextmanager
def remembered(raw: bytes) -> Iterator[BodyMemo]:
    with memo() as m:
        assert check_json(raw) is not None and m.indexed == 1
        yield m


def test_appending_reuses_the_history_and_only_the_new_messages_are_decoded() -> None:
    first = b'{"model": "m", "messages": [{"role": "user", "content": "caf\\u00e9"}], "tools": []}'
    second = b'{"model": "m", "messages": [{"role": "user", "content": "caf\\u00e9"}, {"role": "assistant", ' \
             b'"content": "ok \xc3\xa9"}], "tools": [{"x": 1}], "stream": true}'
    with remembered(first) as m:
        got = check_json(second)
        assert m.hits == 1 and got == orjson.loads(second)
        again = check_json(second)  # the same body again: nothing appended, still from the memo
        assert m.hits == 2 and again == got and again["messages"] is not got["messages"]


@pytest.mark.parametrize("second", [
    b'{"messages": [{"a": 1}, {"b": 2}], "messages": [{"c": 3}]}',  # orjson keeps the last
    b'{"messages": [{"a": 1}, {"b": 2}], "messages": 5}',
    b'{"messages": [{"a": 1}, {"b": 2}], "messages": ' + b"[" * 70 + b"]" * 70 + b"}",  # the depth of the last
    b'{"messages": [{"a": 1}, {"b": 2}],}',  # a trailing comma after the array
    b'{"messages": [{"a": 1}, {"b": 2},]}',
    b'{"messages": [{"a": 1}, {"b": 2}]',
    b'{"messages": [{"a": 1}, {"b": 2}]} x',
    b'{"messages": [{"a": 1}, {"b": 2}]}  \n',
    b'{"messages": [{"a": 1}]]}',
    b'{"messages": [{"a": 1}, {"b": NaN}]}',  # the stdlib scanner reads NaN, orjson refuses it
    b'{"messages": [{"a": 1}, {"b": "\xff"}]}',
])
def test_odd_bodies_after_a_remembered_one(second: bytes) -> None:
    with remembered(b'{"messages": [{"a": 1}]}'):
        assert outcome(second) == reference(second)


def test_a_number_is_not_taken_for_a_shorter_one() -> None:
    with remembered(b'{"messages": [1]}'):
        assert check_json(b'{"messages": [12]}') == {"messages": [12]}
        assert check_json(b'{"messages": [1, 2]}') == {"messages": [1, 2]}


@pytest.mark.parametrize("body", [b'{"messages": []}', b'{"messages": {"a": 1}}', b'[{"messages": [1]}]',
                                  b'{"messages": [1], "messages": [1, 2]}', b'{"m\\u0065ssages": [1], "messages": [2]}'])
def test_bodies_that_are_not_remembered(body: bytes) -> None:
    with memo() as m:
        assert check_json(body) == orjson.loads(body)
        assert m.indexed == 0
        longer = body[:-1] + b', "x": 1}' if body.startswith(b"{") else body
        assert check_json(longer) == orjson.loads(longer) and m.hits == 0


@pytest.mark.parametrize("levels", [60, 61, 62, 63])
def test_depth_inside_a_new_message(levels: int) -> None:
    # body 1, messages 2, the message 3, its lists 4..: the innermost list is at depth 3 + levels
    deep = b'{"messages": [{"a": 1}, {"c": ' + b"[" * levels + b"]" * levels + b"}]}"
    with remembered(b'{"messages": [{"a": 1}]}') as m:
        assert outcome(deep) == reference(deep)
        if 3 + levels <= guard.MAX_JSON_DEPTH:
            assert check_json(deep) == orjson.loads(deep) and m.hits >= 1
        else:
            with pytest.raises(BadInput, match=f"more than {guard.MAX_JSON_DEPTH} levels"):
                check_json(deep)


def test_depth_in_the_other_fields() -> None:
    for levels, ok in ((63, True), (64, False)):
        body = b'{"messages": [{"a": 1}, {"b": 2}], "x": ' + b"[" * levels + b"]" * levels + b"}"
        with remembered(b'{"messages": [{"a": 1}]}'):
            assert outcome(body) == reference(body)
            assert (outcome(body)[0] == "ok") == ok


def test_a_lone_surrogate_in_a_new_message() -> None:
    with remembered(b'{"messages": [{"content": "a"}]}'):
        bad = b'{"messages": [{"content": "a"}, {"content": "\\ud800 x"}]}'
        assert outcome(bad) == reference(bad)
        with pytest.raises(BadInput, match="surrogate") as e:
            check_json(bad)
        assert "body.messages[1].content" in str(e.value)


def test_concurrent_turns_of_several_sessions() -> None:
    errors: list[str] = []

    def session(n: int) -> None:
        messages: list[Any] = [{"role": "system", "content": f"session {n} ü"}]
        for k in range(40):
            messages = messages + [{"role": "user", "content": f"{n}.{k} \u2603"}, {"role": "assistant", "content": [k]}]
            raw = json.dumps({"model": "m", "messages": messages, "n": n}, ensure_ascii=n % 2 == 0).encode()
            if check_json(raw) != orjson.loads(raw):
                errors.append(f"{n}.{k}")

    with memo() as m:
        threads = [threading.Thread(target=session, args=(n,)) for n in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and m.hits > 0


def test_the_memo_is_bounded_in_bodies_and_bytes() -> None:
    m = BodyMemo(size=3, max_bytes=1000)
    raws = [json.dumps({"messages": [{"n": n, "pad": "x" * 40}]}).encode() for n in range(5)]
    for raw in raws:
        seen = m.index(raw, orjson.loads(raw))
        assert seen is not None
        m.keep(seen)
    assert [s.raw for s in m._seen] == raws[2:]
    big = json.dumps({"messages": [{"pad": "x" * 1000}]}).encode()
    seen = m.index(big, orjson.loads(big))
    assert seen is not None
    m.keep(seen)
    assert m._seen == []  # a body past the byte bound is not kept, and it pushed the others out


def test_the_guard_hands_the_route_the_memo_decode() -> None:
    """Through the ASGI guard, as the server runs it: the second turn's body comes from the memo."""
    parsed: list[Any] = []

    async def route(scope: dict, receive: Any, send: Any) -> None:
        parsed.append(scope.get(guard.PARSED_BODY))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def post(app: guard.RequestGuard, body: bytes) -> None:
        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
                 "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json")]}

        async def receive() -> dict:
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict) -> None:
            pass

        await app(scope, receive, send)

    turns = [[{"role": "user", "content": "hi"}]]
    turns.append([*turns[0], {"role": "assistant", "content": "hello"}, {"role": "user", "content": "next"}])
    bodies = [json.dumps({"model": "m", "messages": t, "stream": True}).encode() for t in turns]
    with memo() as m:
        app = guard.RequestGuard(route, ServerConfig())
        for body in bodies:
            asyncio.run(post(app, body))
        assert parsed == [orjson.loads(b) for b in bodies] and (m.indexed, m.hits) == (1, 1)
