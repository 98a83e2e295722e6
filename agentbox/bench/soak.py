"""`agentbox bench soak`: N agent-like sessions against one server for T minutes, with clients that leave
mid-stream or mid-request and malformed requests mixed in. It reports what a server that must never go
down has to show: every request answered (by status), failures by kind, pages still held once idle, the
server's memory growth, the slowest /health answer, and whether the engine process is the one it started
with.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from typing import Any

import httpx
import psutil

# Requests a careless or hostile client sends; each must be a 4xx, never a 5xx or a dead engine.
MALFORMED: list[tuple[str, bytes, str]] = [
    ("/v1/chat/completions", b'{"model": "M", "messages": [', "application/json"),
    ("/v1/chat/completions", b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "seed": 18446744073709551616}',
     "application/json"),
    ("/v1/completions", b'{"model": "M", "prompt": "hi", "repetition_penalty": 5e-324}', "application/json"),
    ("/v1/chat/completions", b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "top_k": 9223372036854775808}',
     "application/json"),
    ("/v1/messages", b'{"model": "M", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}', "text/plain"),
    ("/v1/messages", b'{"model": "M", "max_tokens": 4, "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",
     "application/json"),
    ("/v1/chat/completions", b'{"model": "M", "messages": [{"role": "user", "content": "\\ud800 x"}]}', "application/json"),
    ("/v1/chat/completions", b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": '
     b'"function", "function": {}}]}', "application/json"),
]
TOPICS = ["fix the failing test in utils.py", "add a --verbose flag to the CLI", "explain the retry loop",
          "rename the config class", "write a docstring for parse()", "why does the build fail on CI"]


class Soak:
    def __init__(self, url: str, model: str, max_tokens: int, seed: int) -> None:
        self.url, self.model, self.max_tokens = url, model, max_tokens
        self.rng = random.Random(seed)
        self.status: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()
        self.actions: Counter[str] = Counter()
        self.health_max_s = 0.0

    def _chat(self, messages: list[dict], stream: bool) -> dict:
        return {"model": self.model, "messages": messages, "max_tokens": self.max_tokens, "temperature": 0.7,
                "stream": stream}

    async def turn(self, c: httpx.AsyncClient, sid: str, messages: list[dict]) -> None:
        stream = self.rng.random() < 0.5
        self.actions["turn_stream" if stream else "turn"] += 1
        headers = {"x-session-id": sid}
        if not stream:
            r = await c.post("/v1/chat/completions", json=self._chat(messages, False), headers=headers)
            self._count(r.status_code, valid=True)
            if r.status_code == 200:
                messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"] or ""})
            return
        text, done = "", False
        async with c.stream("POST", "/v1/chat/completions", json=self._chat(messages, True), headers=headers) as r:
            self._count(r.status_code, valid=True)
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        self.failures[f"stream_error:{ev['error'].get('code')}"] += 1
                    for ch in ev.get("choices", []):
                        text += ch.get("delta", {}).get("content") or ""
        if r.status_code == 200 and not done:
            self.failures["stream_without_done"] += 1
        messages.append({"role": "assistant", "content": text})

    async def leave(self, c: httpx.AsyncClient, sid: str, messages: list[dict]) -> None:
        """A client that goes away: mid-stream after a few events, or before a non-streaming answer."""
        if self.rng.random() < 0.5:
            self.actions["disconnect_stream"] += 1
            async with c.stream("POST", "/v1/chat/completions", json=self._chat(messages, True),
                                headers={"x-session-id": sid}) as r:
                n = 0
                async for _ in r.aiter_lines():
                    n += 1
                    if n >= 3:
                        break
            return
        self.actions["disconnect_request"] += 1
        task = asyncio.ensure_future(c.post("/v1/chat/completions", json=self._chat(messages, False)))
        await asyncio.sleep(self.rng.uniform(0.05, 0.5))
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, httpx.HTTPError):
            pass
        else:
            self._count(task.result().status_code, valid=True)

    async def malformed(self, c: httpx.AsyncClient) -> None:
        path, raw, ctype = self.rng.choice(MALFORMED)
        self.actions["malformed"] += 1
        r = await c.post(path, content=raw.replace(b'"M"', json.dumps(self.model).encode()),
                         headers={"content-type": ctype})
        self._count(r.status_code, valid=False)

    def _count(self, status: int, valid: bool) -> None:
        self.status[str(status)] += 1
        if status >= 500:
            self.failures[f"http_{status}"] += 1
        elif status >= 400 and valid:
            self.failures[f"valid_request_{status}"] += 1
        elif status < 400 and not valid:
            self.failures["malformed_accepted"] += 1

    async def session(self, i: int, deadline: float) -> None:
        sid = f"soak-{i}-{self.rng.randrange(1 << 30)}"
        messages: list[dict] = []
        async with httpx.AsyncClient(base_url=self.url, timeout=300) as c:
            while time.monotonic() < deadline:
                if not messages or messages[-1]["role"] == "assistant":
                    messages.append({"role": "user", "content": self.rng.choice(TOPICS)})
                roll = self.rng.random()
                try:
                    if roll < 0.15:
                        await self.malformed(c)
                    elif roll < 0.30:
                        await self.leave(c, sid, messages)
                    else:
                        await self.turn(c, sid, messages)
                except httpx.HTTPError as e:
                    self.failures[f"transport:{type(e).__name__}"] += 1
                if len(messages) > 12:  # a new task: the conversation starts over
                    messages.clear()

    async def watch_health(self, deadline: float) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=30) as c:
            while time.monotonic() < deadline:
                t0 = time.monotonic()
                try:
                    r = await c.get("/health")
                    if r.status_code != 200:
                        self.failures[f"health_{r.status_code}"] += 1
                except httpx.HTTPError as e:
                    self.failures[f"health:{type(e).__name__}"] += 1
                self.health_max_s = max(self.health_max_s, time.monotonic() - t0)
                await asyncio.sleep(0.25)


def _tree_rss(pid: int) -> int:
    root = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])


def _idle_stats(url: str, timeout: float = 120.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        s = httpx.get(url + "/v1/stats", timeout=60).json()
        if s.get("running") == 0 and s.get("waiting") == 0 or time.monotonic() > deadline:
            return s
        time.sleep(0.5)


def run_soak(url: str, sessions: int, minutes: float, max_tokens: int = 16, seed: int = 0) -> dict[str, Any]:
    model = httpx.get(url + "/v1/models", timeout=60).json()["data"][0]["id"]
    before = _idle_stats(url)
    rss0 = _tree_rss(before["pid"])
    soak = Soak(url, model, max_tokens, seed)
    t0 = time.monotonic()
    deadline = t0 + 60.0 * minutes

    async def main() -> None:
        await asyncio.gather(soak.watch_health(deadline), *(soak.session(i, deadline) for i in range(sessions)))

    asyncio.run(main())
    after = _idle_stats(url)
    pool, cache = after["pool"], after["cache"]
    return {
        "sessions": sessions, "minutes": minutes, "seconds": round(time.monotonic() - t0, 1), "model": model,
        "requests": sum(soak.status.values()), "actions": dict(soak.actions), "answered_by_status": dict(soak.status),
        "failures_by_type": dict(soak.failures), "failures": sum(soak.failures.values()),
        # Idle: every page in use belongs to the prefix cache; any other is held by no one (leaked).
        "pages_leaked": pool["used_pages"] - cache["gpu_pages"],
        "rss_growth_mb": round((_tree_rss(after["pid"]) - rss0) / 2**20, 1),
        "health_max_latency_s": round(soak.health_max_s, 3),
        "engine_pid_unchanged": after["engine_pid"] == before["engine_pid"],
        "engine_request_failures": after["counters"].get("request_failures", 0),
        "generated_tokens": after["counters"]["generated_tokens"] - before["counters"]["generated_tokens"],
    }
