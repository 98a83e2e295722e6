"""Memory bandwidth of a machine's two sides, for the planner's decode-speed estimate of a model whose routed
experts live in host RAM (hub/offload.py): a decoded token reads its active experts from RAM and the rest of
the active weights from the GPU, so each side's bytes over its bandwidth bound the step.

A GPU's is its data sheet's number, looked up by the name NVML reports unless the machine description carries
`memory_bandwidth`. Host RAM has no data sheet the probe can read (channels, DIMM speed and what a read stream
reaches vary by board): a machine description carries `host.ram_bandwidth`, else the planner assumes a number
and says so on the row.
"""

from __future__ import annotations

from agentbox.hw.probe import GpuInfo, HostInfo

GB = 10**9

# Data-sheet memory bandwidth by a substring of the NVML name, the longest match first (so "H100 PCIe" wins
# over "H100"). Bytes per second.
GPU_BANDWIDTH: dict[str, int] = {
    "RTX 5090": 1792 * GB,
    "RTX PRO 6000": 1792 * GB,
    "RTX 5080": 960 * GB,
    "RTX 4090": 1008 * GB,
    "RTX 4080 SUPER": 736 * GB,
    "RTX 4080": 717 * GB,
    "RTX 3090": 936 * GB,
    "RTX 6000 Ada": 960 * GB,
    "L40S": 864 * GB,
    "A100-SXM4-80GB": 2039 * GB,
    "A100 80GB PCIe": 1935 * GB,
    "A100": 1555 * GB,
    "H100 PCIe": 2039 * GB,
    "H100 NVL": 3900 * GB,
    "H100": 3350 * GB,
    "H200": 4800 * GB,
}


def gpu_bandwidth(gpu: GpuInfo) -> int | None:
    """The card's memory bandwidth in bytes/s: the description's, else the data sheet's by name; None: unknown."""
    if gpu.memory_bandwidth:
        return gpu.memory_bandwidth
    name = gpu.name.lower()
    return next((bw for key, bw in sorted(GPU_BANDWIDTH.items(), key=lambda kv: -len(kv[0])) if key.lower() in name),
                None)


def ram_bandwidth(host: HostInfo) -> int | None:
    """Host RAM's read bandwidth in bytes/s as the machine description gives it; None: not described."""
    return host.ram_bandwidth or None
