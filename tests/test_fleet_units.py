"""Fast checks of the fleet's pieces that need no router: the routing header clients are given, the
router's command line, and `agentbox fleet`'s refusals (a real closed port, real HTTP)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from agentbox import fleet
from agentbox.clients.names import Client
from agentbox.clients.routing import ROUTING_HEADER
from agentbox.clients.targets import Endpoint, launch_command, plan
from agentbox.config import FleetConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

EP = Endpoint(url="http://127.0.0.1:8100", model="m", context=65536)


def test_codex_and_opencode_send_a_routing_key_the_router_hashes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("AGENTBOX_HOME", str(tmp_path / "state"))
    written = tomllib.loads(plan(Client.CODEX, EP).new)["model_providers"]["agentbox"]["http_headers"]
    assert set(written) == {ROUTING_HEADER} and "@" in written[ROUTING_HEADER]
    # launch: a `-c` inline table Codex parses as TOML, a key per run (runs spread over the boxes)
    keys = []
    for _ in range(2):
        argv, _env, _note = launch_command(Client.CODEX, EP, [])
        value = argv[argv.index("-c") + 1].split("=", 1)[1]
        keys.append(tomllib.loads("p=" + value)["p"]["http_headers"][ROUTING_HEADER])
    assert keys[0] != keys[1] and all(k.startswith(written[ROUTING_HEADER] + "/") for k in keys)
    oc = json.loads(plan(Client.OPENCODE, EP).new)["provider"]["agentbox"]["options"]["headers"]
    assert oc == written
    argv, _env, _note = launch_command(Client.AIDER, EP, [])
    settings = json.loads(Path(argv[argv.index("--model-settings-file") + 1]).read_text())
    assert settings[0]["name"] == "openai/m" and ROUTING_HEADER in settings[0]["extra_params"]["extra_headers"]


def test_router_command_line_carries_the_measured_flags() -> None:
    if fleet.shutil.which(fleet.ROUTER_EXE) is None and not (Path(sys.executable).parent / fleet.ROUTER_EXE).exists():
        pytest.skip(f"vllm-router not installed: {fleet.INSTALL_HINT}")
    cfg = FleetConfig()
    argv = fleet.router_argv(["http://a:1", "http://b:2"], cfg, metrics_port=9999, api_key="k")
    def flag(name: str) -> str:
        return argv[argv.index(name) + 1]

    assert flag("--policy") == "consistent_hash" and flag("--prometheus-port") == "9999"
    assert flag("--cb-failure-threshold") == str(cfg.cb_failure_threshold) and flag("--api-key") == "k"
    assert argv[argv.index("--worker-urls") + 1 : argv.index("--worker-urls") + 3] == ["http://a:1", "http://b:2"]


def test_fleet_refuses_a_backend_that_does_not_answer() -> None:
    dead = f"http://127.0.0.1:{fleet.free_port()}"
    with pytest.raises(fleet.FleetError, match=dead.replace(".", r"\.") + ": not reachable"):
        fleet.check_backends([dead])
    with pytest.raises(fleet.FleetError, match="given twice"):
        fleet.check_backends([dead, dead])
    assert fleet.root_url(dead + "/v1/") == dead
    assert fleet.workers(dead) is None  # not a router (nothing there at all)
