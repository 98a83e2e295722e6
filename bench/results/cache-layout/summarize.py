"""Medians of the alternating runs (alternate.sh) per side, and new / base."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

out = Path(sys.argv[1])


def warm(side: str) -> dict[str, float]:
    runs = [json.loads(p.read_text()) for p in sorted(out.glob(f"warm-{side}-*.json"))]
    keys = ("warm_ratio_longest_over_shortest", "warm_ratio_back_to_back", "warm_extra_ms_longest",
            "warm_extra_ms_longest_back_to_back")
    return {k: statistics.median(r[k] for r in runs) for k in keys} | {"runs": len(runs)}


def replay(side: str) -> dict[str, float]:
    stats = [r["stats"] for p in sorted([*out.glob(f"replay-{side}-*/replay.json"), *out.glob(f"replay-{side}-*.json")])
             for r in json.loads(p.read_text())["runs"]]
    res: dict[str, float] = {}
    for model in sorted({s["extra"]["model"] for s in stats}):
        mine = [s for s in stats if s["extra"]["model"] == model]
        for k in ("wall_s", "ttft_p50_s", "later_latency_p50_s", "recomputed_share"):
            res[f"{model} {k}"] = statistics.median(s[k] for s in mine)
    return res | {"runs": len(stats) // 2}


report = {}
for name, fn in (("warm", warm), ("replay", replay)):
    b, n = fn("base"), fn("new")
    report[name] = {k: {"base": round(b[k], 4), "new": round(n[k], 4),
                        "new_over_base": round(n[k] / b[k], 3) if b[k] else None} for k in b}
print(json.dumps(report, indent=1))
