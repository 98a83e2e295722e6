"""The request guard's pieces and `serve`'s refusal to expose an unauthenticated server (no model loads)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentbox.server.guard import BadInput, check_json, host_name, is_json_type, is_loopback


@pytest.mark.parametrize(("host", "name"), [("127.0.0.1:8000", "127.0.0.1"), ("[::1]:8000", "::1"),
                                            ("LOCALHOST", "localhost"), ("evil.example:80", "evil.example"),
                                            ("[::1]", "::1"),
                                            # not a host[:port]: refused, never read as the name before them
                                            ("localhost:8000@evil.example", None), ("localhost:evil", None),
                                            ("localhost:99999", None), ("::1", None), ("localhost:80:80", None),
                                            ("user@localhost", None), ("", None)])
def test_host_name(host: str, name: str | None) -> None:
    assert host_name(host) == name


def test_json_types_and_loopback() -> None:
    assert is_json_type("application/json; charset=utf-8") and is_json_type("application/vnd.api+json")
    assert not is_json_type("text/plain") and not is_json_type("") and not is_json_type("multipart/form-data")
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.2")


def test_check_json_depth_and_surrogates() -> None:
    check_json(b'{"a": [[[{"b": "caf\\u00e9"}]]]}')
    check_json(b"not json")  # left to the route, which names the parse error in its API's shape
    # the bound is exact on the fast path (orjson's decode, a type test per value) as on the full walk
    assert check_json(b'{"a": ' + b"[" * 63 + b"]" * 63 + b"}") is not None
    with pytest.raises(BadInput, match="nested"):
        check_json(b'{"a": ' + b"[" * 64 + b"]" * 64 + b"}")
    with pytest.raises(BadInput, match="nested"):
        check_json(b"[" * 100 + b"]" * 100)
    with pytest.raises(BadInput, match="nested"):
        check_json(b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(BadInput, match="surrogate") as e:
        check_json(b'{"messages": [{"content": "\\ud800 x"}]}')
    assert "messages" in str(e.value)


def test_serve_beyond_loopback_without_a_key_is_refused(tmp_path: Path) -> None:
    env = {**os.environ, "AGENTBOX_HOME": str(tmp_path)}
    env.pop("AGENTBOX_API_KEY", None)
    model = tmp_path / "model.gguf"
    model.write_bytes(b"")
    r = subprocess.run([sys.executable, "-m", "agentbox.cli.main", "serve", "--host", "0.0.0.0", "--model", str(model)],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "--allow-unauthenticated" in r.stderr and "AGENTBOX_API_KEY" in r.stderr
