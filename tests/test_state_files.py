"""The state directory as untrusted input (agentbox/state_files.py): paths read from it stay inside it, sealed
derived files that do not verify are not trusted, the canary's verdicts that do not verify are measured again,
and a model marker cannot send a load outside its directory."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from agentbox.hub.pull import list_local
from agentbox.hub.verify import Verdict, VerdictStore
from agentbox.state_files import check_seal, inside, read_sealed_json, seal, sealed_json


def test_inside_refuses_what_leads_out(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", root / "link")
    assert inside(root, "a/b.gguf") == root / "a" / "b.gguf"
    assert inside(root, ".") == root / "."
    for bad in ("../outside", "a/../../outside", "/etc/passwd", "link/x"):
        assert inside(root, bad) is None
    assert caplog.text.count("leads outside") == 4


def test_a_sealed_directory_verifies_until_a_file_changes(tmp_path: Path) -> None:
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_text('{"a": 1}')
    (d / "chat_template.jinja").write_text("{{ messages }}")
    assert check_seal(d) == "has no checksums"
    seal(d)
    assert check_seal(d) is None
    (d / "tokenizer.json").write_text('{"a": ')  # truncated
    (d / "chat_template.jinja").write_text("{% broken")
    why = check_seal(d)
    assert why is not None and "tokenizer.json" in why and "chat_template.jinja" in why
    seal(d)
    (d / "extra.json").write_text("{}")
    assert "other files" in (check_seal(d) or "")
    (d / ".sha256.json").write_text("[1, 2")
    assert check_seal(d) == "has unreadable checksums"


def test_sealed_json_reads_back_only_what_it_wrote(tmp_path: Path) -> None:
    p = tmp_path / "v.json"
    assert read_sealed_json(p) is None
    p.write_text(sealed_json({"k": {"ok": True}}))
    assert read_sealed_json(p) == {"k": {"ok": True}}
    p.write_text(p.read_text().replace("true", "false"))  # an edit: the checksum no longer matches
    assert read_sealed_json(p) is None
    for garbage in ("{", "[]", '{"body": 3}', "\x00"):
        p.write_text(garbage)
        assert read_sealed_json(p) is None


def test_verdicts_that_do_not_verify_are_measured_again(tmp_path: Path) -> None:
    store = VerdictStore(tmp_path / "verdicts.json")
    key = store.key("m", "q4", "cpu", "none", "1")
    store.put(key, Verdict(True, "ok", "m", "q4", "cpu", "none", "1"))
    got = store.get(key)
    assert got is not None and got.ok and got.cached
    raw = json.loads(store.path.read_text())
    raw["body"] = raw["body"].replace('"ok": true', '"ok": false')  # flipped by hand
    store.path.write_text(json.dumps(raw))
    assert store.get(key) is None  # not trusted: the canary runs again
    store.path.write_text(sealed_json({key: {"ok": "yes", "bogus": 1}}))  # verifies, but not a verdict
    assert store.get(key) is None


def test_a_marker_cannot_send_a_load_outside_its_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTBOX_HOME", str(tmp_path / "state"))
    d = tmp_path / "state" / "models" / "owner" / "name"
    d.mkdir(parents=True)
    (tmp_path / "secret.gguf").write_bytes(b"x")
    (d / ".agentbox.json").write_text(json.dumps({"files": {"../../../../secret.gguf": {}}}))
    found = [m for m in list_local() if not m.embedded]
    assert [m.path for m in found] == [d]  # the directory itself, never the file outside
    (d / ".agentbox.json").write_text("{garbage")
    assert [m.path for m in list_local() if not m.embedded] == [d]
