"""Several agentbox servers behind one URL: vllm-router (a Rust load balancer from PyPI, the optional
`fleet` extra) in front of them with a consistent hash on the session key, so every session's turns land on
the server that holds its cache. Not a router of our own: this module only checks the backends, builds the
router's command line from FleetConfig and reads the router's worker list back (for `top` and `doctor`).

Why vllm-router and not smg, and why these flags: measured in docs/serving-a-team.md. In short, vllm-router
passes /v1/messages and /v1/responses bodies through untouched and hashes `metadata.user_id` (Claude Code),
X-Session-Id / X-User-Id headers and a body `session_id`; smg 1.13 rejected body fields it does not know on
/v1/responses (`session_id`, `client_metadata`: 400) and hashes only headers it is told about.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from agentbox.config import FleetConfig

ROUTER_EXE = "vllm-router"
INSTALL_HINT = "pip install 'agentbox[fleet]'   (in a checkout: .venv/bin/pip install -e '.[fleet]')"


class FleetError(Exception):
    """A user-facing failure: no router installed, a backend down, backends serving different models."""


@dataclass(frozen=True)
class Backend:
    url: str
    model: str | None  # what /v1/models says; None when the server did not answer
    problem: str | None = None


def root_url(url: str) -> str:
    """The server root a user may have written with a trailing slash or /v1."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def router_exe() -> str:
    here = Path(sys.executable).parent / ROUTER_EXE  # the venv's own, also when it is not on PATH
    if here.exists():
        return str(here)
    found = shutil.which(ROUTER_EXE)
    if found is None:
        raise FleetError(f"`{ROUTER_EXE}` is not installed; install it with: {INSTALL_HINT}")
    return found


def check_backend(url: str, api_key: str | None = None, timeout: float = 5.0) -> Backend:
    """One agentbox server's health and model, with the reason when it cannot serve."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        health = httpx.get(url + "/health", timeout=timeout)
        models = httpx.get(url + "/v1/models", headers=headers, timeout=timeout)
    except httpx.HTTPError as e:
        return Backend(url, None, f"not reachable ({type(e).__name__}); start it there: agentbox serve --host 0.0.0.0")
    if models.status_code == 401:
        return Backend(url, None, "requires an API key: pass --api-key (the same key on every backend)")
    if health.status_code != 200:
        return Backend(url, None, f"/health answers {health.status_code}: {health.text[:200]}")
    try:
        model = models.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        return Backend(url, None, f"/v1/models answered {models.status_code} without a model: is this agentbox?")
    return Backend(url, str(model))


def check_backends(urls: list[str], api_key: str | None = None) -> list[Backend]:
    """Every backend checked; FleetError when one cannot serve or they serve different models (a session
    moved to a survivor must find the same model there)."""
    if len(set(urls)) != len(urls):
        raise FleetError("a backend URL is given twice: " + ", ".join(urls))
    backends = [check_backend(u, api_key) for u in urls]
    bad = [b for b in backends if b.problem]
    if bad:
        raise FleetError("; ".join(f"{b.url}: {b.problem}" for b in bad))
    models = {b.model for b in backends}
    if len(models) > 1:
        raise FleetError("the backends serve different models (" + ", ".join(f"{b.url}: {b.model}" for b in backends)
                         + "); serve the same model on each (agentbox serve --model ... --served-model-name ...)")
    return backends


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def router_argv(backends: list[str], cfg: FleetConfig, *, metrics_port: int, api_key: str | None = None) -> list[str]:
    """The vllm-router command line. Its own --api-key checks nothing: it is the Authorization the router
    sends backends on /v1/messages and /v1/responses, where it drops every client header (on chat and
    completions it forwards the client's own)."""
    argv = [router_exe(), "--host", cfg.host, "--port", str(cfg.port), "--worker-urls", *backends,
            "--policy", cfg.policy,
            "--health-check-interval-secs", str(cfg.health_check_interval_s),
            "--health-failure-threshold", str(cfg.health_failure_threshold),
            "--health-success-threshold", str(cfg.health_success_threshold),
            "--retry-max-retries", str(cfg.retry_max_retries),
            "--cb-failure-threshold", str(cfg.cb_failure_threshold),
            "--cb-timeout-duration-secs", str(cfg.cb_timeout_s),
            "--request-timeout-secs", str(cfg.request_timeout_s),
            "--worker-startup-timeout-secs", str(cfg.startup_timeout_s),
            # the default (29000) collides with a second router on the same machine
            "--prometheus-port", str(metrics_port), "--log-level", "warning"]
    if api_key:
        argv += ["--api-key", api_key]
    return argv


def router_url(cfg: FleetConfig) -> str:
    host = "127.0.0.1" if cfg.host in ("0.0.0.0", "::") else cfg.host
    return f"http://{host}:{cfg.port}"


def workers(url: str, timeout: float = 3.0) -> list[dict] | None:
    """The router's backends ({url, is_healthy, load}) from vllm-router's GET /workers, or None when `url`
    is not a router (an agentbox server answers 404 there)."""
    try:
        r = httpx.get(root_url(url) + "/workers", timeout=timeout)
        data = r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    found = data.get("workers") if isinstance(data, dict) else None
    return [w for w in found if isinstance(w, dict) and "url" in w] if isinstance(found, list) else None


def start(backends: list[str], cfg: FleetConfig, *, api_key: str | None = None, log: Path | None = None,
          metrics_port: int | None = None) -> subprocess.Popen:
    """Start the router and wait until it lists every backend; FleetError (with its log) when it does not."""
    argv = router_argv(backends, cfg, metrics_port=metrics_port or free_port(), api_key=api_key)
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 - the child keeps it open
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + cfg.startup_timeout_s + 10
    url = router_url(cfg)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log else ""
            raise FleetError(f"{ROUTER_EXE} exited with status {proc.returncode} (port {cfg.port} in use? "
                             f"try --port):\n{tail}")
        listed = workers(url, timeout=1.0)
        if listed is not None and len(listed) >= len(backends):
            return proc
        time.sleep(0.2)
    proc.terminate()
    raise FleetError(f"{ROUTER_EXE} did not list the backends within {cfg.startup_timeout_s} s")


@dataclass(frozen=True)
class Finding:
    ok: bool
    what: str
    fix: str = ""


def diagnose(urls: list[str], api_key: str | None = None) -> list[Finding]:
    """`agentbox doctor --url`: each router (listening, its verdict on each backend) and each backend (health,
    model, key); the backends must serve one model."""
    found: list[Finding] = []
    backends: list[str] = []
    for url in map(root_url, urls):
        listed = workers(url)
        if listed is None:
            backends.append(url)
            continue
        found.append(Finding(True, f"router {url}: vllm-router with {len(listed)} backends"))
        for w in listed:
            b = root_url(str(w["url"]))
            backends.append(b)
            if not w.get("is_healthy"):
                found.append(Finding(False, f"router {url} holds {b} out of rotation (health checks failing)",
                                     f"check it: agentbox doctor --url {b}"))
    models = {}
    for b in dict.fromkeys(backends):
        r = check_backend(b, api_key)
        if r.problem:
            found.append(Finding(False, f"backend {b}: {r.problem}", "on that machine: agentbox status; agentbox logs"))
        else:
            models[b] = r.model
            found.append(Finding(True, f"backend {b}: healthy, serves {r.model}"))
    if len(set(models.values())) > 1:
        found.append(Finding(False, "backends serve different models: " + ", ".join(f"{b}: {m}" for b, m in models.items()),
                             "serve one model everywhere (agentbox serve --model ...) so a moved session finds it"))
    return found
