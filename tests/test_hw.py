"""The probe and `doctor` on this GPU-less machine (CPU mode), and doctor's checks on described machines."""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentbox.cli.doctor import disk_problem, doctor, port_problems, server_health, software_problems
from agentbox.config import ServerConfig
from agentbox.hw.probe import Probe, probe

HW = Path(__file__).parents[1] / "profiles" / "hardware"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("AGENTBOX_HOME", str(tmp_path))
    return tmp_path


@pytest.fixture(scope="module")
def here() -> Probe:
    return probe()


def test_probe_in_cpu_mode_is_a_first_class_answer(here: Probe) -> None:
    if not here.cpu_only:
        pytest.skip("this machine has a GPU")
    assert here.gpus == [] and here.links == [] and here.min_sm is None
    assert here.host.cores >= 1 and 0 < here.host.ram_free <= here.host.ram_total
    assert here.host.python.count(".") == 2 and here.host.cpu_model
    assert here.software.torch_version and here.software.torch_kernels_ok is None
    assert not here.described


def test_probe_round_trips_through_json(here: Probe, tmp_path: Path) -> None:
    path = tmp_path / "me.json"
    path.write_text(here.to_json())
    back = Probe.load(path)
    assert back.described and back.host == here.host and back.software == here.software
    five = Probe.load(HW / "2x-rtx5090.json")
    assert [g.arch for g in five.gpus] == ["sm_120", "sm_120"] and five.links[0].nvlink is False
    assert Probe.from_dict(json.loads(five.to_json())).gpus == five.gpus


def _with(name: str, **software: object) -> Probe:
    p = Probe.load(HW / f"{name}.json")
    for k, v in software.items():
        setattr(p.software, k, v)
    return p


def test_doctor_names_driver_wheel_and_flashinfer_problems_with_fixes() -> None:
    healthy = software_problems(_with("2x-rtx5090"))  # a healthy described machine: the NVFP4 path, for information
    assert [(p.severity, p.what) for p in healthy] == [
        ("info", "NVFP4 checkpoints on sm_120: W4A4 on the FP4 tensor cores (flashinfer-fp4)")
    ]
    old = software_problems(_with("2x-rtx5090", driver_cuda="11.8", driver_version="520.61.05"))
    assert old[0].severity == "error" and "older than the CUDA 12.8" in old[0].what and "cu118" in old[0].fix
    minor = software_problems(_with("2x-rtx5090", driver_cuda="12.4"))
    assert minor[0].severity == "warning"
    no_sm120 = software_problems(_with("2x-rtx5090", torch_arch_list=["sm_80", "sm_86", "sm_90"]))
    assert "no kernels for sm_120" in no_sm120[0].what and "cu128" in no_sm120[0].fix
    failing = software_problems(
        _with("1x-rtx4090", torch_kernels_ok=False, torch_error="no kernel image is available")
    )
    assert any("no kernel image" in p.what for p in failing)
    missing = software_problems(_with("1x-rtx4090"))
    assert [p.severity for p in missing] == ["warning", "info"] and "flashinfer-python" in missing[0].fix
    assert missing[1].what == "NVFP4 checkpoints on sm_89: the Triton W4A16 path (triton-w4a16; no FP4 tensor cores)"
    no_fi = software_problems(_with("1x-rtx5090", flashinfer_version=None, flashinfer_ok=None))
    assert no_fi[-1].severity == "warning" and "FP4 tensor cores that flashinfer would use" in no_fi[-1].what
    broken = software_problems(
        _with("2x-rtx5090", flashinfer_ok=False, flashinfer_error="libcuda.so not found")
    )
    assert "fails to load: libcuda.so not found" in broken[0].what
    cpu_wheel = software_problems(_with("1x-h100", torch_cuda=None, torch_version="2.6.0+cpu"))
    assert "CPU build" in cpu_wheel[0].what


def test_doctor_disk_and_port_checks(tmp_path: Path) -> None:
    assert disk_problem("X:bf16", 1, tmp_path) is None
    problem = disk_problem("X:bf16", 10**18, tmp_path)
    assert problem is not None and "not enough disk for X:bf16" in problem.what
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        taken = port_problems(ServerConfig(host="127.0.0.1", port=port), None)
        assert taken and f"port {port}" in taken[0].what and "--port" in taken[0].fix
    assert port_problems(ServerConfig(host="127.0.0.1", port=port), None) == []


@pytest.fixture
def health_server() -> Iterator[int]:
    class Health(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            body = b'{"status": "ok"}' if self.path == "/health" else b""
            self.send_response(200 if body else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_server_health_from_the_state_file(home: Path, health_server: int) -> None:
    assert server_health() is None
    state = {"host": "127.0.0.1", "port": health_server, "pid": os.getpid(), "model": "m"}
    (home / "server.json").write_text(json.dumps(state))
    h = server_health()
    assert h is not None and h.healthy and h.pid_alive and '"ok"' in h.detail
    assert port_problems(ServerConfig(host="127.0.0.1", port=health_server), h) == []  # that port is ours
    with socket.socket() as s:  # a stale file: dead pid, nothing listening
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    (home / "server.json").write_text(json.dumps({**state, "port": free_port, "pid": 2**22 + 1}))
    stale = server_health()
    assert stale is not None and not stale.healthy and not stale.pid_alive
    assert "stale state file" in port_problems(ServerConfig(port=free_port + 0), stale)[0].what


def test_doctor_in_cpu_mode(home: Path, here: Probe) -> None:
    if not here.cpu_only:
        pytest.skip("this machine has a GPU")
    report = doctor(probe=here, server=ServerConfig(port=_free_port()))
    whats = " ".join(p.what for p in report.problems)
    assert "CPU mode" in whats
    from agentbox.kernels import cpu_gemv

    assert here.software.cpu_kernels_ok is cpu_gemv.available()  # measured by building them
    assert ("CPU 4-bit kernels are unavailable" in whats) is not cpu_gemv.available()
    if cpu_gemv.available():  # the variant picked from this CPU's flags is named
        assert here.software.cpu_kernels_isa == cpu_gemv.pick_isa(cpu_gemv.cpu_flags()).value
        assert f"CPU kernels: {here.software.cpu_kernels_isa} ({cpu_gemv.cpu_model()}; avx2 fma f16c" in whats
    no_cc = Probe.from_dict({**here.to_dict(), "software": {"cpu_kernels_ok": False,
                                                            "cpu_kernels_error": "no C compiler (cc / gcc) on PATH"}})
    warned = [p for p in software_problems(no_cc) if "CPU 4-bit kernels" in p.what]
    assert warned and "no C compiler" in warned[0].what and "apt install gcc" in warned[0].fix
    assert report.plan is not None and report.plan["model"] == "Qwen3-8B"
    assert report.server is None and report.ok
    data = json.loads(json.dumps(report.to_dict()))
    assert data["probe"]["gpus"] == [] and data["ok"] is True


def test_doctor_on_a_described_machine_flags_a_model_too_large(home: Path) -> None:
    report = doctor(
        probe=Probe.load(HW / "1x-rtx4090.json"),
        server=ServerConfig(port=_free_port()),
        model="Qwen2.5-Coder-32B-Instruct",
    )
    too_large = [p for p in report.problems if "does not run on this machine" in p.what]
    assert too_large and too_large[0].severity == "error" and not report.ok


def test_doctor_command_json(home: Path) -> None:
    from agentbox.cli.main import app

    out = CliRunner().invoke(app, ["doctor", "--json"])
    data = json.loads(out.output)
    assert out.exit_code == (0 if data["ok"] else 1)
    assert {"probe", "local_models", "plan", "server", "problems"} <= data.keys()
    assert all(p["fix"] for p in data["problems"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_wheel_arch_compatibility() -> None:
    from agentbox.cli.doctor import wheel_runs_on

    cu124 = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]
    assert wheel_runs_on(cu124, 89)  # sm_86 cubins run on an RTX 4090
    assert wheel_runs_on(cu124, 90)
    assert not wheel_runs_on(cu124, 120)  # an RTX 5090 needs a cu128 wheel
    assert wheel_runs_on([*cu124, "compute_90"], 120)  # PTX can be JIT-compiled forward
    assert wheel_runs_on(["sm_90a", "sm_100", "sm_120"], 120)


def test_plan_doctor_and_serve_tell_one_story_on_a_cpu_box(home: Path) -> None:
    """On a CPU machine without downloads: `plan` (no model) plans the model agentbox suggests for agent work and
    says serve starts with the embedded one; doctor says the same, in GiB; a client refused for its context
    names the same model; the suggestion does not move with what RAM is free this minute."""
    import dataclasses

    from rich.console import Console

    from agentbox.cli.doctor import render
    from agentbox.clients.fit import longer_context_hint
    from agentbox.hub.chain import suggest_model
    from agentbox.hub.embedded import embedded_model_path

    if embedded_model_path() is None:
        pytest.skip("the embedded SmolLM2 is not installed")
    cpu = Probe.load(HW / "cpu.json")
    box = dataclasses.replace(cpu, host=dataclasses.replace(cpu.host, ram_total=32 * 2**30, ram_free=6 * 2**30))
    found = suggest_model(box)
    assert found is not None and (found.model, found.variant) == ("Qwen3-8B", "q8_0")  # 6 GiB free: still q8_0
    report = doctor(probe=box, server=ServerConfig(port=_free_port()))
    says = [(p.what, p.fix) for p in report.problems]
    assert ("`agentbox serve` starts with SmolLM2-135M-Instruct:embedded (on this machine)", "nothing to do") in says
    hint = next(fix for what, fix in says if what.startswith("the embedded SmolLM2 (8k context) is for trying"))
    assert "serve --model Qwen3-8B   (q8_0 at a 32,768-token context takes 14.6 of 32.0 GiB" in hint
    assert report.plan is not None and report.plan["model"] == "Qwen3-8B"
    console = Console(record=True, width=200)
    render(report, console)
    text = console.export_text()
    assert "GiB" in text and " GB" not in text
    # a client refused for its context: the same model (where this machine's own probe plans it too)
    here_found = suggest_model(probe(try_kernels=False), 29_000)
    hint = longer_context_hint(29_000)
    assert (f"--model {here_found.model}" in hint) if here_found else "no known model fits" in hint
