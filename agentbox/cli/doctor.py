"""`agentbox doctor`: everything the probe knows, the local models, the plan for the default model and a
running server's health — and each problem found, with the command or setting that fixes it. It checks the
whole install, so it lives in cli/, above both hw/ (the machine) and hub/ (models and plans) that it reads."""

from __future__ import annotations

import json
import os
import shutil
import socket
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agentbox.config import ServerConfig, state_dir
from agentbox.hw.probe import GIB, Probe
from agentbox.invocation import pip_cmd

SEVERITIES = ("error", "warning", "info")


@dataclass
class Problem:
    severity: str  # error | warning | info
    what: str
    fix: str


@dataclass
class ServerHealth:
    host: str
    port: int
    pid: int | None
    model: str | None
    pid_alive: bool
    healthy: bool
    detail: str  # the /health body, or why it could not be read


@dataclass
class Report:
    probe: Probe
    local_models: list[dict[str, Any]]
    plan: dict[str, Any] | None
    server: ServerHealth | None
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(p.severity == "error" for p in self.problems)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "probe": self.probe.to_dict(),
            "local_models": self.local_models,
            "plan": self.plan,
            "server": asdict(self.server) if self.server else None,
            "problems": [asdict(p) for p in self.problems],
        }


def doctor(
    probe: Probe | None = None, server: ServerConfig | None = None, model: str | None = None
) -> Report:
    from agentbox.hub.chain import default_profiles, suggest_model
    from agentbox.hub.plan import SHORT_OF_FREE_RAM, plan
    from agentbox.hub.profiles import ProfileError, find_profile
    from agentbox.hub.pull import list_local, local_path, models_dir

    if probe is None:
        from agentbox.hw.probe import probe as measure

        probe = measure()
    server = server or ServerConfig()
    problems = software_problems(probe)
    local = [
        {"model": m.model, "variant": m.variant, "path": str(m.path), "size": m.size, "complete": m.complete}
        for m in list_local()
    ]
    if model is None:
        problems += serve_problems(probe, local)

    plan_dict: dict[str, Any] | None = None
    try:
        if model:
            profile = find_profile(model)
        else:  # the model agentbox suggests for agent work here: the one plan, serve and the clients name
            found = suggest_model(probe)
            profile = find_profile(found.model) if found else next(iter(default_profiles()), None)
    except ProfileError as exc:
        problems.append(Problem("error", str(exc), "agentbox plan lists the known models"))
        profile = None
    if profile is not None:
        p = plan(profile, probe)
        plan_dict = p.to_dict()
        chosen = p.chosen
        if chosen is None:
            # A variant that fits the machine's RAM and only not what is free now is the one to talk about.
            short = [c for c in p.candidates if c.reasons and all(r.startswith(SHORT_OF_FREE_RAM) for r in c.reasons)]
            best = short[0] if short else p.candidates[0] if p.candidates else None
            why = best.reasons[-1] if best and best.reasons else "no variants"
            problems.append(
                Problem(
                    "warning" if short else "info" if probe.cpu_only else "error",
                    f"{profile.name} does not run on this machine{' now' if short else ''}: {why}",
                    "free memory (close what uses it)" if short else
                    "pick a smaller model (`agentbox plan MODEL`), or lower --context / --sessions",
                )
            )
        else:
            problems += tp_problems(chosen.tp)
        if chosen is not None and local_path(profile, chosen.variant) is None:
            if (
                disk := disk_problem(
                    f"{profile.name}:{chosen.variant.name}", chosen.variant.size, models_dir()
                )
            ) is not None:
                problems.append(disk)
    health = server_health()
    problems += port_problems(server, health)
    return Report(probe, local, plan_dict, health, problems)


def serve_problems(probe: Probe, local: list[dict[str, Any]]) -> list[Problem]:
    """Whether `agentbox serve` (no --model) finds a model to start with, and what it will be."""
    from agentbox.hub.chain import agent_work_hint, first_servable, no_model_message
    from agentbox.hub.embedded import EMBEDDED_NAME, INSTALL_HINT
    from agentbox.invocation import agentbox_cmd

    first = first_servable(probe)
    if first is None:
        cause, _, fix = no_model_message(probe).partition("\n")
        return [Problem("error", f"`agentbox serve` cannot start: {cause}", fix.strip().removeprefix("fix: "))]
    out = [Problem("info", f"`agentbox serve` starts with {first}", "nothing to do")]
    if first.startswith(f"{EMBEDDED_NAME}:embedded"):
        hint = agent_work_hint(probe).removeprefix("note: ")
        what, _, fix = hint.partition("; for them: ")
        out.append(Problem("info", what, fix or f"{agentbox_cmd()} plan MODEL shows the arithmetic"))
    if not any(m["variant"] == "embedded" for m in local):
        out.append(Problem("warning", "the embedded fallback model (SmolLM2) is not installed", INSTALL_HINT))
    return out


def software_problems(probe: Probe) -> list[Problem]:
    """Driver, torch wheel and flashinfer against the GPUs that are actually there."""
    sw = probe.software
    out: list[Problem] = []
    if probe.cpu_only:
        out.append(
            Problem(
                "info",
                "no NVIDIA GPU found (or no driver): CPU mode, for small models (larger ones are slow)",
                "on a GPU machine: install the NVIDIA driver (nvidia-smi must work)",
            )
        )
        if sw.cpu_kernels_isa:
            out.append(Problem("info", f"CPU kernels: {sw.cpu_kernels_line}", "nothing to do"))
        if sw.cpu_kernels_ok is False:
            out.append(
                Problem(
                    "warning",
                    f"the CPU 4-bit kernels are unavailable ({sw.cpu_kernels_error}): quantised layers are "
                    "dequantised to fp32 at load, about 4-8x the memory and a third of the decode speed",
                    "install a C compiler (e.g. `apt install gcc`) on an x86-64 CPU with AVX2/FMA/F16C; "
                    "agentbox builds the kernels on first use",
                )
            )
        return out
    if sw.torch_version is None:
        out.append(
            Problem("error", f"torch is not usable: {sw.torch_error}", "./install.sh (picks the CUDA build)")
        )
        return out
    if sw.torch_cuda is None:
        out.append(
            Problem(
                "error",
                f"torch {sw.torch_version} is a CPU build on a machine with {len(probe.gpus)} GPU(s)",
                f"{pip_cmd()} install torch --index-url https://download.pytorch.org/whl/cu128",
            )
        )
    elif sw.driver_cuda and _version(sw.driver_cuda) < _version(sw.torch_cuda):
        major_gap = _version(sw.driver_cuda)[0] < _version(sw.torch_cuda)[0]
        out.append(
            Problem(
                "error" if major_gap else "warning",
                f"driver {sw.driver_version} supports CUDA {sw.driver_cuda}, older than the CUDA {sw.torch_cuda} "
                f"the torch wheel was built for"
                + ("" if major_gap else " (minor-version compatibility may work; JIT kernels may not)"),
                f"upgrade the NVIDIA driver, or install torch built for CUDA {sw.driver_cuda}: "
                f"{pip_cmd()} install torch --index-url https://download.pytorch.org/whl/cu{sw.driver_cuda.replace('.', '')}",
            )
        )
    missing = [
        g.arch for g in probe.gpus if sw.torch_arch_list and not wheel_runs_on(sw.torch_arch_list, g.sm)
    ]
    if missing:
        out.append(
            Problem(
                "error",
                f"the torch wheel has no kernels for {', '.join(sorted(set(missing)))} (it has {', '.join(sw.torch_arch_list)})",
                f"install a newer torch wheel (sm_120 needs CUDA 12.8+): {pip_cmd()} install torch --index-url https://download.pytorch.org/whl/cu128",
            )
        )
    if sw.torch_kernels_ok is False:
        out.append(
            Problem(
                "error",
                f"a CUDA kernel failed to run: {sw.torch_error}",
                "reinstall torch for this GPU: ./install.sh",
            )
        )
    if sw.flashinfer_version is None:
        out.append(
            Problem(
                "warning",
                "flashinfer is not installed: attention runs on the triton / torch backends",
                f"{pip_cmd()} install flashinfer-python (matching your torch and CUDA versions)",
            )
        )
    elif sw.flashinfer_ok is False:
        out.append(
            Problem(
                "warning",
                f"flashinfer {sw.flashinfer_version} fails to load: {sw.flashinfer_error}",
                "reinstall flashinfer-python built for your torch/CUDA, or run with --attention triton",
            )
        )
    out.append(nvfp4_path(probe))
    return out


def nvfp4_path(probe: Probe) -> Problem:
    """The kernel NVFP4 checkpoints take on the slowest GPU here (layers/quant/nvfp4.py nvfp4_kernel_for)."""
    from agentbox.layers.quant.formats import has_fp4_tensor_cores
    from agentbox.layers.quant.nvfp4 import NvFp4Kernel, nvfp4_kernel_for

    sm = probe.min_sm or 0
    kernel = nvfp4_kernel_for("cuda", (sm // 10, sm % 10), probe.software.flashinfer_ok is True)
    if kernel is NvFp4Kernel.FP4_GEMM:
        return Problem("info", f"NVFP4 checkpoints on sm_{sm}: W4A4 on the FP4 tensor cores ({kernel.value})", "nothing to do")
    if has_fp4_tensor_cores((sm // 10, sm % 10)):  # the cores are there, flashinfer is not
        return Problem(
            "warning",
            f"NVFP4 checkpoints on sm_{sm}: the Triton W4A16 path ({kernel.value}); this GPU has FP4 tensor cores "
            "that flashinfer would use",
            f"{pip_cmd()} install flashinfer-python (matching your torch and CUDA versions)",
        )
    return Problem(
        "info", f"NVFP4 checkpoints on sm_{sm}: the Triton W4A16 path ({kernel.value}; no FP4 tensor cores)", "nothing to do"
    )


def tp_problems(tp: int, peer: Callable[[int, int], bool] | None = None, count: int | None = None) -> list[Problem]:
    """Whether the first `tp` GPUs can talk for tensor parallel. Without peer-to-peer access (consumer
    cards) NCCL's P2P transport is known to hang (multi-RTX-4090 boxes); NCCL_P2P_DISABLE=1 routes the
    all-reduces through host memory instead. `peer`/`count` default to torch's answers."""
    if tp <= 1:
        return []
    if peer is None or count is None:
        try:
            import torch
        except ImportError:
            return []  # software_problems already says torch is missing
        if not torch.cuda.is_available():
            return []
        peer, count = peer or torch.cuda.can_device_access_peer, torch.cuda.device_count() if count is None else count
    if count < tp:
        return [Problem("error", f"the plan runs tensor parallel over {tp} GPUs but {count} are visible",
                        "check CUDA_VISIBLE_DEVICES, or serve a smaller model with --tp 1")]
    missing = [f"{i}->{j}" for i in range(tp) for j in range(tp) if i != j and not peer(i, j)]
    if not missing:
        return [Problem("info", f"GPUs 0..{tp - 1} have peer-to-peer access (NCCL for --tp {tp})", "nothing to do")]
    if os.environ.get("NCCL_P2P_DISABLE") == "1":
        return [Problem("info", f"no GPU peer access ({', '.join(missing)}); NCCL_P2P_DISABLE=1 is set, so "
                        "tensor-parallel traffic goes through host memory", "nothing to do")]
    return [Problem(
        "warning",
        f"GPUs {', '.join(missing)} have no peer-to-peer access: NCCL can hang at --tp {tp} on such cards",
        "export NCCL_P2P_DISABLE=1 before `agentbox serve` (the engine also sets it itself when it sees this)",
    )]


def wheel_runs_on(arch_list: list[str], sm: int) -> bool:
    """Whether a wheel built for `arch_list` has code for compute capability `sm`: a cubin of the same major
    and a lower-or-equal minor (sm_86 runs on sm_89), or PTX (compute_XX) of a lower-or-equal version to JIT."""
    for arch in arch_list:
        kind, _, num = arch.partition("_")
        digits = int("".join(ch for ch in num if ch.isdigit()) or 0)
        if kind == "sm" and digits // 10 == sm // 10 and digits <= sm:
            return True
        if kind == "compute" and digits <= sm:
            return True
    return False


def disk_problem(label: str, size: int, target: Path) -> Problem | None:
    """A download of `size` bytes into `target` that the disk cannot hold."""
    target.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(target).free
    if free >= size:
        return None
    return Problem(
        "error",
        f"not enough disk for {label}: {size / GIB:.1f} GiB needed, {free / GIB:.1f} GiB free at {target}",
        "free disk space, or set AGENTBOX_HOME to a larger disk",
    )


def server_health(timeout_s: float = 2.0) -> ServerHealth | None:
    """Health of the daemon named by state_dir()/server.json (keys host, port, pid, model), or None."""
    path = state_dir() / "server.json"
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    import httpx
    import psutil

    host, port = str(info.get("host", "127.0.0.1")), int(info.get("port", ServerConfig().port))
    pid = info.get("pid")
    alive = bool(pid) and psutil.pid_exists(int(pid))
    try:
        r = httpx.get(f"http://{_connect_host(host)}:{port}/health", timeout=timeout_s)
        healthy, detail = r.status_code == 200, f"HTTP {r.status_code}: {r.text[:200]}"
    except httpx.HTTPError as exc:
        healthy, detail = False, f"{type(exc).__name__}: {exc}"
    return ServerHealth(host, port, pid, info.get("model"), alive, healthy, detail)


def port_problems(server: ServerConfig, health: ServerHealth | None) -> list[Problem]:
    out: list[Problem] = []
    if health is not None and not health.healthy:
        if health.pid_alive:
            out.append(
                Problem(
                    "error",
                    f"the server (pid {health.pid}) on {health.host}:{health.port} does not answer /health: {health.detail}",
                    "agentbox logs, then agentbox stop && agentbox serve",
                )
            )
        else:
            out.append(
                Problem(
                    "warning",
                    f"server.json names pid {health.pid}, which is not running (a stale state file)",
                    "agentbox stop (clears the state), then agentbox serve",
                )
            )
    ours = health is not None and health.healthy and health.port == server.port
    if not ours and port_in_use(server.host, server.port):
        out.append(
            Problem(
                "error",
                f"port {server.port} on {server.host} is taken by another process",
                f"agentbox serve --port <free port>, or stop what listens on {server.port} (ss -ltnp | grep {server.port})",
            )
        )
    return out


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else host


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split(".")[:2] if x.isdigit())


def render(report: Report, console: object) -> None:
    """Print the report for a person: machine, models, plan, server, then the problems with their fixes."""
    from rich.console import Console
    from rich.table import Table

    assert isinstance(console, Console)
    pr = report.probe
    h = pr.host
    console.print(
        f"[bold]host[/]: {h.cpu_model}, {h.cores} cores, RAM {h.ram_free / GIB:.1f} / {h.ram_total / GIB:.1f} GiB free, {h.os}, Python {h.python}"
    )
    sw = pr.software
    console.print(
        f"[bold]software[/]: torch {sw.torch_version or '-'} (CUDA {sw.torch_cuda or 'none'}), "
        f"driver {sw.driver_version or '-'} (CUDA {sw.driver_cuda or '-'}), triton {sw.triton_version or '-'}, "
        f"flashinfer {sw.flashinfer_version or 'not installed'}"
    )
    if pr.gpus:
        gpus = Table(title="GPUs")
        for col in ("#", "name", "arch", "memory free / total", "PCIe", "processes"):
            gpus.add_column(col)
        for g in pr.gpus:
            pcie = f"gen{g.pcie_gen} x{g.pcie_width}" if g.pcie_gen else "-"
            gpus.add_row(
                str(g.index),
                g.name,
                g.arch,
                f"{g.memory_free / GIB:.1f} / {g.memory_total / GIB:.1f} GiB",
                pcie,
                str(len(g.processes)),
            )
        console.print(gpus)
        for link in pr.links:
            console.print(
                f"  GPU{link.a} <-> GPU{link.b}: p2p {'yes' if link.p2p else 'no'}, NVLink {'yes' if link.nvlink else 'no'}"
            )
    else:
        console.print("[bold]GPUs[/]: none (CPU mode)")
    console.print(f"[bold]local models[/]: {len(report.local_models)}")
    for m in report.local_models:
        console.print(f"  {m['model']}:{m['variant']}  {m['size'] / GIB:.2f} GiB  {m['path']}")
    if report.plan:
        console.print(f"[bold]plan[/] for {report.plan['model']}: {report.plan['chosen'] or 'nothing fits'}")
    if report.server:
        s = report.server
        console.print(
            f"[bold]server[/]: {s.host}:{s.port} pid {s.pid} model {s.model}: {'healthy' if s.healthy else 'unhealthy'} ({s.detail})"
        )
    else:
        console.print("[bold]server[/]: not running (no server.json)")
    styles = {"error": "red", "warning": "yellow", "info": "cyan"}
    for p in sorted(report.problems, key=lambda p: SEVERITIES.index(p.severity)):
        console.print(f"[{styles[p.severity]}]{p.severity}[/]: {p.what}\n    fix: {p.fix}")
    console.print(
        "[bold green]no problems found[/]"
        if not report.problems
        else ("[bold]ok[/] (no errors)" if report.ok else "[bold red]errors found[/]")
    )
