"""What `agentbox logs` shows a user: no access line per dashboard poll, and every 4xx with its reason."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import httpx

from agentbox.server.access_log import PollingAccessFilter, error_reason


def _log_after(path: Path, start: int, needle: str, timeout: float = 10.0) -> str:
    """The log written since byte `start`, once it holds `needle` (the server writes asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        text = path.read_bytes()[start:].decode("utf-8", "replace")
        if needle in text or time.monotonic() > deadline:
            return text
        time.sleep(0.1)


def test_polls_stay_out_of_the_log_and_a_400_names_its_field(live_server: str, agentbox_home: Path) -> None:
    log = agentbox_home / "server.log"
    start = log.stat().st_size
    with httpx.Client(base_url=live_server, timeout=30) as http:
        for _ in range(3):  # what `agentbox top` sends every second
            assert http.get("/v1/stats").status_code == 200
            assert http.get("/v1/sessions").status_code == 200
        bad = http.post("/v1/chat/completions", json={"model": "x", "messages": [{"role": "user"}], "max_tokens": -3})
        assert bad.status_code == 400
        reason = bad.json()["error"]["message"]
        missing = http.post("/v1/messages", json={"model": "x", "max_tokens": 5})  # Anthropic shape, no messages
        assert missing.status_code == 400
        assert http.get("/v1/sessions/no-such-session").status_code == 404
    text = _log_after(log, start, "POST /v1/messages")
    assert "/v1/stats" not in text and "GET /v1/sessions HTTP" not in text, text
    lines = text.splitlines()
    # One WARNING line per 4xx, naming the request and the reason the client got (the field's name in it).
    chat = [ln for ln in lines if "WARNING" in ln and "400 POST /v1/chat/completions" in ln]
    assert len(chat) == 1 and chat[0].endswith(reason), text
    assert "max_tokens" in chat[0] or "messages" in chat[0]
    anthropic = [ln for ln in lines if "WARNING" in ln and "400 POST /v1/messages:" in ln]
    assert len(anthropic) == 1 and "messages" in anthropic[0], text
    # a failed poll still logs: a 404 on a session is not routine
    assert any("404 GET /v1/sessions/no-such-session" in ln for ln in lines), text
    # the requests that are not polls keep their access lines at info
    assert any('"POST /v1/chat/completions HTTP/1.1" 400' in ln for ln in lines), text


def test_the_filter_demotes_only_successful_polls() -> None:
    f = PollingAccessFilter()
    logger = logging.getLogger("uvicorn.access")

    def rec(method: str, path: str, status: int) -> logging.LogRecord:
        return logger.makeRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                                 ("127.0.0.1:5", method, path, "1.1", status), None)

    old = logger.level
    try:
        logger.setLevel(logging.INFO)
        assert not f.filter(rec("GET", "/v1/stats", 200))
        assert not f.filter(rec("GET", "/v1/sessions?limit=5", 200))
        assert f.filter(rec("GET", "/v1/stats", 503))  # an error is news
        assert f.filter(rec("POST", "/v1/chat/completions", 200))
        assert f.filter(rec("DELETE", "/v1/sessions/abc", 200))  # a user's action, not a poll
        logger.setLevel(logging.DEBUG)
        r = rec("GET", "/v1/stats", 200)
        assert f.filter(r) and r.levelname == "DEBUG"
    finally:
        logger.setLevel(old)


def test_error_reason_reads_every_error_shape() -> None:
    assert error_reason(b'{"error": {"message": "\'messages\': Field required", "type": "x"}}') == \
        "'messages': Field required"
    assert error_reason(b'{"type": "error", "error": {"type": "invalid_request_error", "message": "m"}}') == "m"
    assert error_reason(b'{"detail": "Not Found"}') == "Not Found"
    assert error_reason(b"plain text") == "plain text"
