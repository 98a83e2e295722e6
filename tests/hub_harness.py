"""A fake Hugging Face hub: a local HTTP server in the hub's layout (HF_ENDPOINT), serving one tiny model
repo and one gated repo, with a profile for them. It can hang up mid-file to test resumed downloads."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO = "test-org/Tiny-Test"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
FILES = {
    "config.json": b'{"architectures": ["LlamaForCausalLM"]}',
    "model.safetensors": bytes(range(256)) * 800,  # 204,800 bytes: several chunks
}
TINY_PROFILE = f"""
name = "Tiny-Test"
family = "llama"
architecture = "LlamaForCausalLM"
params = 100_000
layers = 2
kv_heads = 2
head_dim = 16
context_length = 2048
tool_parser = ""
reasoning_parser = ""
common_files = ["config.json"]

[[variants]]
name = "bf16"
format = "bf16"
bits = 16
repo = "{REPO}"
files = ["model.safetensors"]
size = 204_840

[[variants]]
name = "gated"
format = "bf16"
bits = 16
repo = "test-org/Gated"
files = ["model.safetensors"]
size = 204_840
"""


class HubState:
    def __init__(self) -> None:
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.truncate_next_get: dict[str, int] = {}  # file -> bytes to send before dropping the connection


def _handler(state: HubState) -> type[BaseHTTPRequestHandler]:
    class Hub(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # keep pytest output clean
            pass

        def _resolve(self) -> tuple[str, bytes] | None:
            m = re.fullmatch(r"/(.+?/.+?)/resolve/([^/]+)/(.+)", self.path)
            if not m:
                return None
            repo, _rev, name = m.groups()
            if repo == "test-org/Gated" and "Bearer " not in (self.headers.get("Authorization") or ""):
                return ("gated", b"")
            if repo != REPO or name not in FILES:
                return ("missing", b"")
            return name, FILES[name]

        def _head_common(self, name: str, body: bytes) -> None:
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", '"' + hashlib.sha256(body).hexdigest() + '"')
            self.send_header("Accept-Ranges", "bytes")

        def _error(self, code: int, error_code: str | None = None) -> None:
            self.send_response(code)
            if error_code:
                self.send_header("X-Error-Code", error_code)
                self.send_header("X-Error-Message", "Access to this repo is restricted")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_HEAD(self) -> None:
            state.requests.append(("HEAD", self.path, None))
            found = self._resolve()
            if found is None or found[0] == "missing":
                return self._error(404, "EntryNotFound")
            if found[0] == "gated":
                return self._error(401, "GatedRepo")
            name, body = found
            self.send_response(200)
            self._head_common(name, body)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()

        def do_GET(self) -> None:
            rng = self.headers.get("Range")
            state.requests.append(("GET", self.path, rng))
            if self.path.startswith("/api/models/"):
                payload = json.dumps(
                    {"id": REPO, "sha": COMMIT, "siblings": [{"rfilename": n} for n in FILES]}
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                return
            found = self._resolve()
            if found is None or found[0] in ("missing", "gated"):
                return self._error(404 if found is None or found[0] == "missing" else 401)
            name, body = found
            start = int(re.fullmatch(r"bytes=(\d+)-", rng).group(1)) if rng else 0  # type: ignore[union-attr]
            part = body[start:]
            self.send_response(206 if rng else 200)
            self._head_common(name, body)
            if rng:
                self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
            self.send_header("Content-Length", str(len(part)))
            self.end_headers()
            cut = state.truncate_next_get.pop(name, None)
            if cut is not None:  # an interrupted transfer: promise everything, send some, hang up
                self.wfile.write(part[:cut])
                self.wfile.flush()
                self.close_connection = True
                return
            self.wfile.write(part)

    return Hub


def serve_fake_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubState]:
    """The body of each test file's `hub` fixture: the profile and the environment set, the server up until
    the generator is closed."""
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "tiny-test.toml").write_text(TINY_PROFILE)
    monkeypatch.setenv("AGENTBOX_PROFILES", str(profiles))
    monkeypatch.setenv("AGENTBOX_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
    state = HubState()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    yield state
    server.shutdown()
    server.server_close()
