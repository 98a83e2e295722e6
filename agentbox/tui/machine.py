"""What `top` reads from this machine when the server runs here: per-GPU figures (nvidia-ml-py) and the
server's process tree CPU and memory (psutil). Neither touches the server; both degrade to "absent"."""

from __future__ import annotations

import ipaddress
import socket
from typing import Any
from urllib.parse import urlparse

import psutil


def is_local(url: str) -> bool:
    """The URL names this machine (loopback, or one of its own names / addresses)."""
    host = urlparse(url).hostname or ""
    if host in ("localhost", socket.gethostname()):
        return True
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return False
    if addr.is_loopback or addr.is_unspecified:
        return True
    for addrs in psutil.net_if_addrs().values():
        if any(a.address.split("%")[0] == host for a in addrs):
            return True
    return False


def local_server_pid(url: str, stats: dict[str, Any] | None) -> int | None:
    """The server's pid when it runs on this machine: the pid it reports (its /v1/stats) if that process
    exists here, else the daemon's server.json when its port matches the URL's."""
    if not is_local(url):
        return None
    pid = (stats or {}).get("pid")
    if isinstance(pid, int) and psutil.pid_exists(pid):
        return pid
    from agentbox.cli.daemon import read_state

    st = read_state()
    if st and st.get("port") == urlparse(url).port:
        return int(st["pid"])
    return None


class ProcessProbe:
    """CPU % (of one core, summed over the tree) and resident memory of a process and its children.
    psutil's cpu_percent measures since the previous call on the same Process object, so they are kept."""

    def __init__(self) -> None:
        self._procs: dict[int, psutil.Process] = {}

    def sample(self, pid: int) -> dict[str, Any] | None:
        try:
            root = psutil.Process(pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            self._procs.clear()
            return None
        cpu = 0.0
        rss = 0
        seen: dict[int, psutil.Process] = {}
        for p in tree:
            # Reuse the Process we measured last time (same pid and start time) so the interval is real.
            kept = self._procs.get(p.pid)
            proc = kept if kept is not None and kept.is_running() else p
            try:
                cpu += proc.cpu_percent(interval=None)
                rss += proc.memory_info().rss
            except psutil.Error:
                continue
            seen[p.pid] = proc
        self._procs = seen
        return {"pid": pid, "processes": len(seen), "cpu_percent": cpu, "rss_bytes": rss}


class GpuProbe:
    """Utilisation, memory, power and temperature of every GPU; `available` is False without a driver."""

    def __init__(self) -> None:
        self.error: str | None = None
        self._nvml: Any = None
        self._handles: list[Any] = []
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self._nvml = pynvml
            if not self._handles:
                self.error = "no device"
        except Exception as exc:  # no driver, no library, no device: all mean "no GPU" here
            name = type(exc).__name__
            self.error = "no NVIDIA driver" if "LibraryNotFound" in name or "DriverNotLoaded" in name else name

    @property
    def available(self) -> bool:
        return bool(self._handles)

    def sample(self) -> list[dict[str, Any]]:
        nv = self._nvml
        out: list[dict[str, Any]] = []
        for i, h in enumerate(self._handles):
            gpu: dict[str, Any] = {"index": i}
            # Each field on its own: some boards (or MIG slices) refuse one query and answer the rest.
            for key, read in (
                ("name", lambda h=h: nv.nvmlDeviceGetName(h)),
                ("util_percent", lambda h=h: nv.nvmlDeviceGetUtilizationRates(h).gpu),
                ("memory_used_bytes", lambda h=h: nv.nvmlDeviceGetMemoryInfo(h).used),
                ("memory_total_bytes", lambda h=h: nv.nvmlDeviceGetMemoryInfo(h).total),
                ("power_w", lambda h=h: nv.nvmlDeviceGetPowerUsage(h) / 1000.0),
                ("temperature_c", lambda h=h: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
            ):
                try:
                    value = read()
                    gpu[key] = value.decode() if isinstance(value, bytes) else value
                except Exception:
                    gpu[key] = None
            out.append(gpu)
        return out

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self._nvml = None
            self._handles = []
