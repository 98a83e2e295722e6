"""`serve --model X`: a path, a profile name (planned and pulled by the chain, from a fake hub on loopback)
or a hub repo id; and each way X can name nothing, as the user sees it. Nothing is downloaded from a hub."""

from __future__ import annotations

import io
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from hub_harness import HubState, serve_fake_hub
from rich.console import Console
from test_cli_errors import agentbox, assert_user_error

from agentbox.hub.model_arg import ModelArgError, resolve_model_arg
from agentbox.hub.pull import variant_dir
from agentbox.hub.verify import Verdict, VerdictStore, engine_version, machine_key
from agentbox.hw.hardware import load_hardware


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubState]:
    yield from serve_fake_hub(tmp_path, monkeypatch)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_path_is_served_as_it_is(tmp_path: Path) -> None:
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert resolve_model_arg(str(f)).path == f
    assert resolve_model_arg(str(tmp_path)).tp is None


def test_a_profile_name_is_planned_and_pulled_even_on_a_cpu(hub: HubState, tmp_path: Path) -> None:
    cpu = load_hardware("cpu")
    store = VerdictStore(tmp_path / "verdicts.json")
    gpu, driver = machine_key(cpu)
    # The canary's verdict for this machine, as an earlier serve left it (the canary itself: test_hub_chain.py).
    store.put(store.key("Tiny-Test", "bf16", gpu, driver, engine_version()),
              Verdict(True, "ok", "Tiny-Test", "bf16", gpu, driver, engine_version(), "", 0.0))
    out = io.StringIO()
    choice = resolve_model_arg("tiny-test", Console(file=out, width=200), probe=cpu, store=store)
    from agentbox.hub.profiles import find_profile

    profile = find_profile("Tiny-Test")
    assert choice.path == variant_dir(profile, profile.variant("bf16")) and choice.tp == 1
    assert (choice.path / "model.safetensors").stat().st_size == 204_800
    text = out.getvalue()
    assert "pull Tiny-Test:bf16" in text and "pulling Tiny-Test:bf16 from test-org/Tiny-Test" in text
    assert "does not pull on its own" not in text  # named: a CPU-only machine pulls it too
    assert any(m == "GET" for m, *_ in hub.requests)
    # MODEL:VARIANT pulls that variant (already here: no request), and an unknown variant names those that exist
    before = len(hub.requests)
    assert resolve_model_arg("Tiny-Test:bf16", Console(file=io.StringIO())).path == choice.path
    assert len(hub.requests) == before
    with pytest.raises(ModelArgError, match=r"Tiny-Test has no variant 'q9' \(it has: bf16, gated\)"):
        resolve_model_arg("Tiny-Test:q9")


def test_a_name_that_matches_nothing_lists_close_matches(tmp_path: Path) -> None:
    r = agentbox("serve", "--model", "qwen3-8", "--port", str(_free_port()), home=tmp_path)
    err = assert_user_error(r, "--model qwen3-8: not a file or directory, not a known model, not a hub repo id",
                            "close matches: Qwen3-8B")
    assert len(err) == 2 and "models --known" in err[1]
    assert "probe:" not in r.stderr


def test_a_missing_path_and_an_unknown_variant(tmp_path: Path) -> None:
    r = agentbox("serve", "--model", "./no/such/model.gguf", "--port", str(_free_port()), home=tmp_path)
    assert_user_error(r, "--model ./no/such/model.gguf: no such file or directory")
    v = agentbox("serve", "--model", "Qwen3-8B:q9", "--port", str(_free_port()), home=tmp_path)
    assert_user_error(v, "Qwen3-8B has no variant 'q9' (it has: bf16, ")


def test_a_hub_repo_id_names_what_was_tried(tmp_path: Path) -> None:
    offline = agentbox("serve", "--model", "someone/Some-Model-7B", "--port", str(_free_port()), home=tmp_path,
                       HF_HUB_OFFLINE="1")
    assert_user_error(offline, "--model someone/Some-Model-7B: not a file or directory, not a known model; "
                      "as a hub repo id: HF_HUB_OFFLINE is set", "serve --model PATH")
