"""What this machine is: host, GPUs, links between them, and whether the GPU software stack really loads.

A probe is plain data (JSON round-trip), so `--hardware FILE.json` can describe a machine we do not have.
A machine without libnvidia-ml or CUDA is a first-class CPU mode: every GPU query degrades to "none",
never to a traceback.
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

GIB = 1024**3


@dataclass
class GpuProcess:
    pid: int
    used_bytes: int | None  # None: the driver does not say (e.g. inside containers)


@dataclass
class GpuInfo:
    index: int
    name: str
    sm: int  # compute capability as an integer: 8.9 -> 89, 12.0 -> 120
    memory_total: int  # bytes
    memory_free: int  # bytes
    pcie_gen: int | None = None
    pcie_width: int | None = None
    processes: list[GpuProcess] = field(default_factory=list)
    # bytes/s of the card's memory (its data sheet); None: looked up by name (hw/bandwidth.py) where known
    memory_bandwidth: int | None = None

    @property
    def arch(self) -> str:
        return f"sm_{self.sm}"


@dataclass
class GpuLink:
    a: int
    b: int
    p2p: bool
    nvlink: bool


@dataclass
class HostInfo:
    cpu_model: str
    cores: int
    ram_total: int  # bytes
    ram_free: int  # bytes (available, not merely unused)
    os: str
    python: str
    # bytes/s a read stream over host RAM reaches (the planner's speed estimate for experts kept there);
    # None: not measured, the planner assumes PlanConfig.ram_bandwidth and says so
    ram_bandwidth: int | None = None


@dataclass
class SoftwareInfo:
    driver_version: str | None = None  # e.g. "570.86.15"
    driver_cuda: str | None = None  # highest CUDA the driver supports, e.g. "12.8"
    torch_version: str | None = None
    torch_cuda: str | None = None  # CUDA the torch wheel was built for; None for a CPU wheel
    torch_arch_list: list[str] = field(default_factory=list)  # sm_XX the wheel carries kernels for
    torch_kernels_ok: bool | None = None  # None: not tried (no GPU)
    torch_error: str | None = None
    flashinfer_version: str | None = None
    flashinfer_ok: bool | None = None  # None: not installed
    flashinfer_error: str | None = None
    triton_version: str | None = None
    cpu_kernels_ok: bool | None = None  # the AVX2 4-bit kernels (kernels/cpu_gemv) built; None: not tried
    cpu_kernels_error: str | None = None
    cpu_kernels_isa: str | None = None  # the variant picked from the CPU's flags (cpu_gemv.Isa value)
    cpu_kernels_line: str | None = None  # the variant, the CPU, its flags, why no better variant (cpu_gemv.describe)


@dataclass
class Probe:
    host: HostInfo
    gpus: list[GpuInfo] = field(default_factory=list)
    links: list[GpuLink] = field(default_factory=list)
    software: SoftwareInfo = field(default_factory=SoftwareInfo)
    described: bool = False  # True when loaded from a file rather than measured here

    @property
    def cpu_only(self) -> bool:
        return not self.gpus

    @property
    def min_sm(self) -> int | None:
        return min(g.sm for g in self.gpus) if self.gpus else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Probe:
        gpus = [
            GpuInfo(**{**g, "processes": [GpuProcess(**p) for p in g.get("processes", [])]})
            for g in data.get("gpus", [])
        ]
        return cls(
            host=HostInfo(**data["host"]),
            gpus=gpus,
            links=[GpuLink(**link) for link in data.get("links", [])],
            software=SoftwareInfo(**data.get("software", {})),
            described=bool(data.get("described", False)),
        )

    @classmethod
    def load(cls, path: str | Path) -> Probe:
        probe = cls.from_dict(json.loads(Path(path).read_text()))
        probe.described = True
        return probe


def probe(try_kernels: bool = True) -> Probe:
    """Measure this machine. `try_kernels` runs a tiny CUDA op and imports flashinfer (slow-ish: seconds)."""
    gpus, links, software = _nvml_probe()
    _torch_probe(software, gpus, try_kernels)
    return Probe(host=_host_probe(), gpus=gpus, links=links, software=software)


def _host_probe() -> HostInfo:
    import psutil

    mem = psutil.virtual_memory()
    return HostInfo(
        cpu_model=_cpu_model(),
        cores=psutil.cpu_count(logical=True) or os.cpu_count() or 1,
        ram_total=int(mem.total),
        ram_free=int(mem.available),
        os=f"{platform.system()} {platform.release()}",
        python=platform.python_version(),
    )


def _cpu_model() -> str:
    try:  # platform.processor() is empty on most Linux systems; /proc/cpuinfo has the marketing name
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _nvml_probe() -> tuple[list[GpuInfo], list[GpuLink], SoftwareInfo]:
    software = SoftwareInfo()
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no library, no driver, no device: CPU mode
        return [], [], software
    try:
        software.driver_version = _text(pynvml.nvmlSystemGetDriverVersion())
        cuda = pynvml.nvmlSystemGetCudaDriverVersion()  # e.g. 12080
        software.driver_cuda = f"{cuda // 1000}.{(cuda % 1000) // 10}"
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        gpus = [_nvml_gpu(pynvml, i, h) for i, h in enumerate(handles)]
        links = [
            _nvml_link(pynvml, i, j, handles) for i in range(len(handles)) for j in range(i + 1, len(handles))
        ]
        return gpus, links, software
    finally:
        pynvml.nvmlShutdown()


def _nvml_gpu(pynvml: Any, index: int, handle: Any) -> GpuInfo:
    major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
    mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
    procs: list[GpuProcess] = []
    try:
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            procs.append(GpuProcess(pid=int(p.pid), used_bytes=_int_or_none(p.usedGpuMemory)))
    except pynvml.NVMLError:
        pass
    return GpuInfo(
        index=index,
        name=_text(pynvml.nvmlDeviceGetName(handle)),
        sm=major * 10 + minor,
        memory_total=int(mem.total),
        memory_free=int(mem.free),
        pcie_gen=_safe(lambda: int(pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle))),
        pcie_width=_safe(lambda: int(pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle))),
        processes=procs,
    )


def _nvml_link(pynvml: Any, i: int, j: int, handles: list[Any]) -> GpuLink:
    p2p = _safe(
        lambda: (
            pynvml.nvmlDeviceGetP2PStatus(handles[i], handles[j], pynvml.NVML_P2P_CAPS_INDEX_READ)
            == pynvml.NVML_P2P_STATUS_OK
        )
    )
    other_bus = _safe(lambda: _text(pynvml.nvmlDeviceGetPciInfo(handles[j]).busId))
    nvlink = False
    for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
        try:  # an active link whose far end is the other GPU's PCI bus id
            if pynvml.nvmlDeviceGetNvLinkState(handles[i], link) != pynvml.NVML_FEATURE_ENABLED:
                continue
            remote = _text(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handles[i], link).busId)
        except pynvml.NVMLError:
            break  # consumer cards answer "not supported" for link 0: no NVLink at all
        if other_bus and remote.lower() == other_bus.lower():
            nvlink = True
            break
    return GpuLink(a=i, b=j, p2p=bool(p2p), nvlink=nvlink)


def _torch_probe(software: SoftwareInfo, gpus: list[GpuInfo], try_kernels: bool) -> None:
    try:
        import torch
    except Exception as exc:  # a broken torch install is something doctor reports, not a crash
        software.torch_error = f"torch does not import: {exc}"
        return
    software.torch_version = torch.__version__
    software.torch_cuda = torch.version.cuda
    software.triton_version = _dist_version("triton")
    if torch.cuda.is_available():
        software.torch_arch_list = list(torch.cuda.get_arch_list())
        if not gpus:  # NVML missing but CUDA works (rare): describe the devices from torch
            for i in range(torch.cuda.device_count()):
                props = torch.cuda.get_device_properties(i)
                free, total = torch.cuda.mem_get_info(i)
                gpus.append(GpuInfo(i, props.name, props.major * 10 + props.minor, int(total), int(free)))
    if not try_kernels:
        return
    if not gpus:  # CPU mode: the quantised layers' speed and memory depend on this kernel building
        from agentbox.kernels import cpu_gemv

        software.cpu_kernels_ok = cpu_gemv.available()
        software.cpu_kernels_error = None if software.cpu_kernels_ok else cpu_gemv.unavailable_reason()
        software.cpu_kernels_isa = isa.value if (isa := cpu_gemv.isa()) else None
        software.cpu_kernels_line = cpu_gemv.describe()
        return
    try:  # "no kernel image is available" shows up here, on the first real launch, not at import
        x = torch.arange(8, device="cuda", dtype=torch.float32)
        software.torch_kernels_ok = bool((x * 2).sum().item() == 56.0)
    except Exception as exc:
        software.torch_kernels_ok = False
        software.torch_error = str(exc).splitlines()[0]
    software.flashinfer_version = _dist_version("flashinfer-python") or _dist_version("flashinfer")
    if software.flashinfer_version is not None:
        try:
            import flashinfer  # noqa: F401

            software.flashinfer_ok = True
        except Exception as exc:
            software.flashinfer_ok = False
            software.flashinfer_error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _dist_version(name: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and value >= 0 else None


def _safe(fn: Any) -> Any:
    try:
        return fn()
    except Exception:
        return None
