"""The serve log says which attention backend `auto` picked and why it passed over the others."""

from __future__ import annotations

from pathlib import Path


def test_serve_log_names_the_attention_backend(live_server: str, agentbox_home: Path) -> None:
    text = (agentbox_home / "server.log").read_text()
    assert "attention backend: auto picked torch on cpu (flashinfer: not installed; triton: " in text
