"""Schemathesis against a live server, from its own /openapi.json: every documented request shape and limit,
valid and invalid data, counted as 5xx answers and crashes (the engine process replaced, or the server gone).

The document is used as the server publishes it, with two pins so the run tests the server and not 404s and
long generations: `model` is the served name, and an output budget field is required and at most
PIN_MAX_TOKENS (a negative-mode case still sends any value, or none: then the model's default budget runs, see
/v1/models default_max_tokens). Bounded by `max_time_s` (schemathesis's own time budget).

    python -m agentbox.bench.fuzz_api --model PATH            # starts `agentbox serve`, runs 10 minutes
    python -m agentbox.bench.fuzz_api --url http://127.0.0.1:8000 --max-time 60

schemathesis is a dev extra (pyproject.toml); tests/test_fuzz_schemathesis.py runs this briefly on every suite.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

PIN_MAX_TOKENS = 8
MAX_TOKENS_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


@dataclass
class FuzzResult:
    requests: int  # answers schemathesis received
    server_errors: int  # of those, 5xx
    crashes: int  # the engine process was replaced, or the server stopped answering
    failures: list[str]  # schemathesis's failure titles (5xx and transport errors), at most 50
    seconds: float
    exit_code: int


def pinned(spec: dict[str, Any], model: str) -> dict[str, Any]:
    """The document with `model` pinned to the served name and the output budget small, in every request body."""
    for schema in spec.get("components", {}).get("schemas", {}).values():
        props = schema.get("properties") if isinstance(schema, dict) else None
        if not isinstance(props, dict):
            continue
        if "model" in props:
            props["model"] = {"type": "string", "enum": [model]}
        budget = [f for f in MAX_TOKENS_FIELDS if f in props]
        for field in budget:
            props[field] = {"type": "integer", "minimum": 1, "maximum": PIN_MAX_TOKENS}
        if budget:  # the first of them (max_tokens where there are two), so a positive case never runs long
            schema["required"] = sorted({*schema.get("required", []), budget[0]})
    return spec


def _engine_pid(client: httpx.Client) -> int | None:
    for _ in range(30):
        try:
            r = client.get("/v1/stats")
            if r.status_code == 200:
                return int(r.json()["engine_pid"])
        except httpx.HTTPError:
            pass
        time.sleep(1)
    return None


def _count(report: Path) -> tuple[int, int, list[str]]:
    """(answers, 5xx answers, failure titles) from schemathesis's NDJSON event stream."""
    answers = errors = 0
    titles: list[str] = []
    for line in report.read_text().splitlines() if report.is_file() else []:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        for interaction in _find(event, "response"):
            if isinstance(interaction, dict) and isinstance(interaction.get("status_code"), int):
                answers += 1
                errors += interaction["status_code"] >= 500
        for failure in _find(event, "title"):
            if isinstance(failure, str) and len(titles) < 50:
                titles.append(failure)
    return answers, errors, titles


def _find(obj: Any, key: str) -> list[Any]:
    """Every value under `key` anywhere in obj."""
    out, stack = [], [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            if key in x:
                out.append(x[key])
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return out


def fuzz(url: str, max_time_s: int = 600, workers: int = 2, seed: int | None = None,
         out: Path | None = None) -> FuzzResult:
    """Run schemathesis (its CLI, from this interpreter's environment) against the server at url."""
    exe = shutil.which("schemathesis", path=str(Path(sys.executable).parent)) or shutil.which("schemathesis")
    if exe is None:
        raise RuntimeError("schemathesis is not installed: pip install -e '.[dev]'")
    with httpx.Client(base_url=url, timeout=60) as client:
        spec = client.get("/openapi.json").json()
        model = client.get("/v1/models").json()["data"][0]["id"]
        pid = _engine_pid(client)
        work = Path(tempfile.mkdtemp(prefix="agentbox-fuzz-")) if out is None else out
        work.mkdir(parents=True, exist_ok=True)
        (work / "openapi.json").write_text(json.dumps(pinned(spec, model)))
        events = work / "events.ndjson"
        cmd = [exe, "run", str(work / "openapi.json"), "--url", url, "--checks", "not_a_server_error",
               "--max-time", str(max_time_s), "--workers", str(workers), "--request-timeout", "120",
               "--report", "ndjson", "--report-ndjson-path", str(events), "--suppress-health-check", "all",
               "--continue-on-failure", "--no-shrink", *(["--seed", str(seed)] if seed is not None else [])]
        t0 = time.monotonic()
        with open(work / "schemathesis.log", "wb") as log:
            code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=max_time_s + 300).returncode
        seconds = time.monotonic() - t0
        after = _engine_pid(client)
    answers, errors, titles = _count(events)
    crashes = int(after is None or after != pid)
    return FuzzResult(answers, errors, crashes, titles, round(seconds, 1), code)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running server (else one is started over --model)")
    ap.add_argument("--model", help="the model to serve when no --url is given")
    ap.add_argument("--max-time", type=int, default=600, help="seconds (default 600)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--out", type=Path, help="where the pinned document, the events and the log go")
    args = ap.parse_args()
    if args.url:
        result = fuzz(args.url, args.max_time, args.workers, args.seed, args.out)
    else:
        from agentbox.bench.spawn import agentbox_command, spawned

        if not args.model:
            ap.error("give --url or --model")
        out = args.out or Path(tempfile.mkdtemp(prefix="agentbox-fuzz-"))
        with spawned(agentbox_command(args.model), out / "server.log") as (url, _):
            result = fuzz(url, args.max_time, args.workers, args.seed, out)
    print(json.dumps(asdict(result), indent=1))
    sys.exit(0 if result.server_errors == 0 and result.crashes == 0 else 1)


if __name__ == "__main__":
    main()
