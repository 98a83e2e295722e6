"""`--hardware X`: a machine we do not have, as a JSON file (a saved probe) or a bundled name such as
`2x-rtx5090` (profiles/hardware/2x-rtx5090.json). Every way it can go wrong is a `HardwareError` whose
one-line message names the cause and the valid names."""

from __future__ import annotations

import json
import os
from pathlib import Path

from agentbox.hw.probe import Probe


class HardwareError(ValueError):
    """A --hardware value that names no machine: a missing or malformed file, or an unknown name."""


def hardware_dirs() -> list[Path]:
    """profiles/hardware/ under $AGENTBOX_PROFILES' directories, then the source tree's (first match wins)."""
    roots = [Path(p) for p in os.environ.get("AGENTBOX_PROFILES", "").split(os.pathsep) if p]
    roots.append(Path(__file__).resolve().parents[2] / "profiles")
    return [d for d in (r / "hardware" for r in roots) if d.is_dir()]


def bundled_names() -> list[str]:
    return sorted({p.stem for d in hardware_dirs() for p in d.glob("*.json")})


def load_hardware(spec: str | Path) -> Probe:
    """The machine `spec` describes: an existing file (a probe, or `agentbox doctor --json` output), else a
    bundled name (with or without .json)."""
    path = Path(spec).expanduser()
    if not path.is_file():
        bare = str(spec).removesuffix(".json")
        found = None if os.sep in bare else next(
            (d / f"{bare}.json" for d in hardware_dirs() if (d / f"{bare}.json").is_file()), None
        )
        if found is None:
            raise HardwareError(
                f"--hardware {spec}: no such file, and not a bundled name (bundled: {', '.join(bundled_names())})"
            )
        path = found
    try:
        data = json.loads(path.read_text())
        if isinstance(data, dict) and isinstance(data.get("probe"), dict):
            data = data["probe"]  # a saved `agentbox doctor --json`
        _check_shape(data)
        probe = Probe.from_dict(data)
        _check_numbers(probe)
    except OSError as exc:
        raise HardwareError(f"--hardware {spec}: cannot read {path} ({exc.strerror})") from exc
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        cause = f"no {exc} field" if isinstance(exc, KeyError) else str(exc).splitlines()[0]
        raise HardwareError(
            f"--hardware {spec}: {path} is not a machine description ({cause}); save one with "
            f"`agentbox doctor --json > machine.json`, or use a bundled name: {', '.join(bundled_names())}"
        ) from exc
    probe.described = True
    return probe


def _check_shape(data: object) -> None:
    """The JSON's outline, so that a wrong type is named by its field rather than by a Python error."""
    if not isinstance(data, dict):
        raise ValueError("the file must hold a JSON object with host, gpus, links and software")
    if "host" not in data:
        raise KeyError("host")
    for key, kind in (("host", dict), ("gpus", list), ("links", list), ("software", dict)):
        if key in data and not isinstance(data[key], kind):
            raise ValueError(f"{key} must be a JSON {'object' if kind is dict else 'list'}")
    for i, g in enumerate(data.get("gpus", [])):
        if not isinstance(g, dict):
            raise ValueError(f"gpus[{i}] must be a JSON object")


def _check_numbers(probe: Probe) -> None:
    """The fields the planner does arithmetic on are integers (a string here would fail far from the file)."""
    fields = {"host.ram_total": probe.host.ram_total, "host.ram_free": probe.host.ram_free}
    if probe.host.ram_bandwidth is not None:
        fields["host.ram_bandwidth"] = probe.host.ram_bandwidth
    for g in probe.gpus:
        fields |= {f"gpus[{g.index}].sm": g.sm, f"gpus[{g.index}].memory_total": g.memory_total,
                   f"gpus[{g.index}].memory_free": g.memory_free}
        if g.memory_bandwidth is not None:
            fields[f"gpus[{g.index}].memory_bandwidth"] = g.memory_bandwidth
    bad = [name for name, v in fields.items() if not isinstance(v, int) or isinstance(v, bool)]
    if bad:
        raise ValueError(f"{', '.join(bad)} must be whole numbers (bytes, bandwidths in bytes/s; sm as 89 for 8.9)")
