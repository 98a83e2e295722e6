"""`agentbox top` as a user sees it: the real command in a real terminal (tmux, 80x24 and 120x40) against a real
server with agent sessions on it, photographed with `tmux capture-pane`. The photographs are the ones in
docs/clients.md: where the docs' copy no longer shows what `top` shows (its column titles, its panels, its
footer), this test writes the new one there and fails, so a changed layout reaches the docs in the same
commit."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "clients.md"
SIZES = ((80, 24), (120, 40))
# What the sessions show: three agent clients and a plain chat, three turns each
CLIENTS = {"claude-0f9c2d1e": "claude-cli/2.1.332 (external, cli)", "codex-5b6c7d8e": "codex_exec/0.171.0",
           "opencode-3a4b": "opencode/1.18.33", "chat": "curl/8.5.0"}

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")]


@pytest.fixture(scope="module")
def server(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    home = tmp_path_factory.mktemp("top-tmux")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "AGENTBOX_HOME": str(home)}
    cli = [sys.executable, "-m", "agentbox.cli.main"]
    r = subprocess.run([*cli, "serve", "--model", str(smollm2_path), "--port", str(port), "--num-pages", "256",
                        "--max-model-len", "2048", "--disk-cache-gb", "0"], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    url = f"http://127.0.0.1:{port}"
    for _ in range(2):
        turns(url)
    try:
        yield url, env
    finally:
        subprocess.run([*cli, "stop"], env=env, capture_output=True, timeout=120)


CONVERSATIONS: dict[str, list[dict[str, str]]] = {}


def turns(url: str) -> None:
    """One more turn of every session (the whole transcript again, as agents send it)."""
    for sid, agent in CLIENTS.items():
        messages = CONVERSATIONS.setdefault(sid, [{"role": "system", "content": "You are a terse coding assistant. " * 20}])
        messages.append({"role": "user", "content": f"turn {len(messages) // 2}: name a file"})
        out = httpx.post(f"{url}/v1/chat/completions", timeout=300, headers={"X-Session-Id": sid, "User-Agent": agent},
                         json={"model": "agentbox", "messages": messages, "max_tokens": 6, "temperature": 0})
        out.raise_for_status()
        messages.append({"role": "assistant", "content": out.json()["choices"][0]["message"]["content"]})


def capture(url: str, env: dict[str, str], cols: int, rows: int, sock: str) -> str:
    """`agentbox top` in a tmux terminal of that size once it shows every session, then Ctrl-C: the screen."""
    tmux = ["tmux", "-L", sock, "-f", "/dev/null"]  # a server of its own: the user's tmux is never touched
    top = (f"env -u COLUMNS -u LINES HOME={env['HOME']} AGENTBOX_HOME={env['AGENTBOX_HOME']} {sys.executable} "
           f"-m agentbox.cli.main top --url {url}")  # its size from the terminal, as a user's
    subprocess.run([*tmux, "new-session", "-d", "-s", "top", "-x", str(cols), "-y", str(rows), top], check=True,
                   env={**env, "TERM": "xterm-256color"}, timeout=30)
    try:
        screen, deadline, nudged = "", time.monotonic() + 60, False
        while not all(sid[:5] in screen for sid in CLIENTS) or "q quit" not in screen:
            assert time.monotonic() < deadline, f"top did not show the sessions:\n{screen}"
            time.sleep(0.5)
            screen = subprocess.run([*tmux, "capture-pane", "-p", "-t", "top"], capture_output=True, text=True,
                                    timeout=30).stdout
            if "agentbox top" in screen and not nudged:
                # tmux may size the window after the app asked for its size (a busy machine drew 80x24 in a
                # 120x40 window): a resize there and back is the SIGWINCH that settles it, as a user's drag does
                for w in (cols - 1, cols):
                    subprocess.run([*tmux, "resize-window", "-t", "top", "-x", str(w), "-y", str(rows)], timeout=30)
                    time.sleep(0.3)
                nudged, screen = True, ""
        time.sleep(1.5)  # a second poll: the rates
        screen = subprocess.run([*tmux, "capture-pane", "-p", "-t", "top"], capture_output=True, text=True,
                                timeout=30).stdout
        subprocess.run([*tmux, "send-keys", "-t", "top", "C-c"], check=True, timeout=30)
        deadline = time.monotonic() + 10
        while subprocess.run([*tmux, "has-session", "-t", "top"], capture_output=True, timeout=30).returncode == 0:
            assert time.monotonic() < deadline, "Ctrl-C did not quit top"
            time.sleep(0.2)
        return screen.rstrip("\n")
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True, timeout=30)


def shape(screen: str) -> list[str]:
    """What the docs' copy must agree on: the table's column titles, the panels' titles and the footer."""
    lines = screen.splitlines()
    titles = [line.split() for line in lines if line.lstrip().startswith("session ")]
    panels = [m for line in lines for m in re.findall(r"KV pool \(pages|host tier|hit rate|decode tok/s|server CPU", line)]
    return [repr(titles), repr(panels), lines[-1].strip()]


def doc_block(cols: int, rows: int) -> tuple[str, str]:
    return f"<!-- agentbox top {cols}x{rows}: tests/test_top_tmux.py -->\n```text\n", "\n```\n"


def test_top_in_tmux_at_80x24_and_120x40_matches_the_docs(server: tuple[str, dict[str, str]]) -> None:
    url, env = server
    stale = []
    for cols, rows in SIZES:
        turns(url)  # leases live: the sessions show as waiting for their next turn
        screen = capture(url, env, cols, rows, f"agentbox-test-{os.getpid()}-{cols}")
        lines = screen.splitlines()
        assert all(len(line) <= cols for line in lines), screen
        assert "agentbox top" in lines[0] and lines[1].lstrip().startswith("session"), screen  # one-line header
        assert "q quit" in lines[-1], screen
        header = lines[1].split()
        for title in ("turns", "state", "KV", "tok", "lease", "recomp", "TTFT"):
            assert title in header, (cols, header)
        assert "KV pool (pages" in screen
        if rows >= 40:  # every panel under the table, and the client column
            assert "client" in header and "decode tok/s" in screen and "server CPU" in screen, screen
        else:
            assert "v panel" in lines[-1], screen
        chat = next(line for line in lines if line.startswith(" chat "))
        # a plain chat waits on no tool: "waiting" while its lease lives (about a second, from its short gaps)
        assert {"waiting", "idle"} & set(chat.split()) and "tool wait" not in screen, screen
        text = DOC.read_text()
        start, end = doc_block(cols, rows)
        i = text.find(start)
        if i < 0:
            new = text.rstrip("\n") + f"\n\n{start}{screen}{end}"
        else:
            j = text.index(end, i + len(start))
            new = text if shape(text[i + len(start):j]) == shape(screen) else text[:i + len(start)] + screen + text[j:]
        if new != text:
            stale.append(f"{cols}x{rows}")
            DOC.write_text(new)
    assert not stale, f"docs/clients.md's captures of `agentbox top` ({', '.join(stale)}) were out of date; " \
                      "the test wrote the new ones there: review and commit them"
