"""A small synchronous HTTP client over the server's read API (stats, sessions, metrics) and the one write
`top` makes (closing a session). `tui/` reads the server only through here.

Synchronous on purpose: the dashboard polls from a worker thread and `--once` / `agentbox status` are plain
functions, so one code path serves all three."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import httpx

# Short: a dashboard that waits long on a wedged server looks frozen; the next poll retries anyway. Not too
# short: a CPU-bound server in the middle of a big prefill answers slowly, and slow is not down.
TIMEOUT_S = 5.0


class ServerDown(Exception):
    """Nothing answers at the URL (refused, unreachable, or not an agentbox)."""


class ServerSlow(Exception):
    """The server accepted the connection but did not answer within the timeout: busy, not gone."""


class Api:
    def __init__(self, url: str, timeout: float = TIMEOUT_S, api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        headers = {"user-agent": "agentbox-top"}
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        self._http = httpx.Client(base_url=self.url, timeout=timeout, headers=headers)

    def close(self) -> None:
        self._http.close()

    def _get(self, path: str) -> httpx.Response:
        try:
            return self._http.get(path)
        except (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout) as exc:
            raise ServerSlow(f"GET {path} took over {self._http.timeout.read:g} s") from exc
        except httpx.HTTPError as exc:
            raise ServerDown(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__) from exc

    def stats(self) -> dict[str, Any]:
        r = self._get("/v1/stats")
        if r.status_code != 200:
            raise ServerDown(f"GET /v1/stats answered {r.status_code}")
        try:
            return r.json()
        except ValueError as exc:
            raise ServerDown("GET /v1/stats did not answer JSON") from exc

    def sessions(self) -> list[dict[str, Any]] | None:
        """The session list; None when this server has no sessions endpoint (an older build)."""
        r = self._get("/v1/sessions")
        if r.status_code in (404, 405):
            return None
        r.raise_for_status()
        return list(r.json().get("data", []))

    def session(self, sid: str) -> dict[str, Any] | None:
        """One session with its turn history; None when it is gone (or the endpoint is missing)."""
        r = self._get(f"/v1/sessions/{quote(sid, safe='')}")
        if r.status_code in (404, 405):
            return None
        r.raise_for_status()
        return r.json()

    def delete_session(self, sid: str) -> dict[str, Any]:
        try:
            r = self._http.delete(f"/v1/sessions/{quote(sid, safe='')}")
        except httpx.HTTPError as exc:
            raise ServerDown(str(exc) or type(exc).__name__) from exc
        r.raise_for_status()
        return r.json()

    def metrics(self) -> str | None:
        r = self._get("/metrics")
        return r.text if r.status_code == 200 else None
