"""Session and cache observability: /v1/sessions (JSON) and /metrics (Prometheus text), from the engine's
real counters. `agentbox top` reads only these.

With several API keys, each key lists, reads and deletes only its own sessions (their engine ids carry the
key's namespace, see state.CLIENT_NAMESPACE). What stays shared: /metrics and /v1/stats (totals of all
keys), and the prefix cache itself, whose speed still tells a key that a prefix was computed before."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from agentbox.engine.stats import to_json
from agentbox.server.errors import APIError
from agentbox.server.state import CLIENT_NAMESPACE, ServerState

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.agentbox


def _not_found(session_id: str) -> APIError:
    return APIError(404, f"no session '{session_id}'", param="session_id", code="session_not_found",
                    type_="not_found_error")


def _shown(state: ServerState, s: dict, ns: str) -> dict:
    """A session as its key sees it: its own id, without the namespace."""
    return {**s, "id": s["id"].removeprefix(ns), "client": state.clients.get(s["id"])}


@router.get("/v1/sessions")
async def list_sessions(request: Request) -> dict:
    state, ns = _state(request), CLIENT_NAMESPACE.get()
    res = await state.engine.sessions()
    return {"object": "list", "data": [_shown(state, to_json(s), ns) for s in res.data if s.id.startswith(ns)]}


@router.get("/v1/sessions/{session_id}")
async def get_session(session_id: str, request: Request) -> dict:
    state, ns = _state(request), CLIENT_NAMESPACE.get()
    res = await state.engine.session(ns + session_id)
    if res is None:
        raise _not_found(session_id)
    return _shown(state, to_json(res), ns)


@router.delete("/v1/sessions/{session_id}")
async def delete_session(session_id: str, request: Request) -> dict:
    state, ns = _state(request), CLIENT_NAMESPACE.get()
    res = await state.engine.drop_session(ns + session_id)
    if res is None:
        raise _not_found(session_id)
    state.clients.pop(ns + session_id, None)
    return {**to_json(res), "id": session_id}


def _metric(lines: list[str], name: str, kind: str, help_: str, value: float, labels: str = "") -> None:
    if not any(line.startswith(f"# TYPE {name} ") for line in lines):
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
    lines.append(f"{name}{{{labels}}} {value}" if labels else f"{name} {value}")


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> PlainTextResponse:
    s = to_json(await _state(request).engine.stats())
    c, pool, cache, adm = s["counters"], s["pool"], s["cache"], s["admission"]
    out: list[str] = []
    m = lambda *a: _metric(out, *a)  # noqa: E731
    m("agentbox_prompt_tokens_total", "counter", "Prompt tokens of finished prefills.", c["prompt_tokens"])
    m("agentbox_cached_tokens_total", "counter", "Prompt tokens served from the cache (all tiers).", c["cached_tokens"])
    m("agentbox_host_cached_tokens_total", "counter", "Prompt tokens copied back from the host tier.", c["host_cached_tokens"])
    m("agentbox_recomputed_history_tokens_total", "counter", "Session history the cache had dropped and was computed again.",
      c["recomputed_history_tokens"])
    m("agentbox_generated_tokens_total", "counter", "Generated tokens.", c["generated_tokens"])
    m("agentbox_prefill_tokens_total", "counter", "Prompt tokens computed.", c["prefill_tokens"])
    m("agentbox_spec_drafted_tokens_total", "counter", "Draft tokens verified (speculative decoding).", c["drafted_tokens"])
    m("agentbox_spec_accepted_tokens_total", "counter", "Draft tokens accepted (each a decode step saved).", c["accepted_tokens"])
    m("agentbox_preemptions_total", "counter", "Requests preempted for lack of pages.", c["preemptions"])
    m("agentbox_cache_hit_rate", "gauge", "cached / prompt tokens since start.",
      c["cached_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0)
    hist = sum(x.history_tokens for x in (await _state(request).engine.sessions()).data)
    m("agentbox_recompute_ratio", "gauge", "recomputed / re-sent history tokens since start.",
      c["recomputed_history_tokens"] / hist if hist else 0.0)
    m("agentbox_pool_pages", "gauge", "KV pool pages by use.", pool["used_pages"], 'tier="gpu",use="used"')
    m("agentbox_pool_pages", "gauge", "KV pool pages by use.", pool["free_pages"], 'tier="gpu",use="free"')
    m("agentbox_pool_pages", "gauge", "KV pool pages by use.", cache.get("gpu_pages", 0), 'tier="gpu",use="cached"')
    m("agentbox_pool_pages", "gauge", "KV pool pages by use.", cache.get("leased_pages", 0), 'tier="gpu",use="leased"')
    m("agentbox_pool_pages", "gauge", "KV pool pages by use.", cache.get("host_pages", 0), 'tier="host",use="cached"')
    m("agentbox_pool_capacity_pages", "gauge", "Pages per tier.", pool["total_pages"], 'tier="gpu"')
    m("agentbox_pool_capacity_pages", "gauge", "Pages per tier.", cache.get("host_total_pages", 0), 'tier="host"')
    m("agentbox_leases_live", "gauge", "Sessions with a live lease.", s["sessions"]["live_leases"])
    m("agentbox_sessions", "gauge", "Known sessions.", s["sessions"]["count"])
    m("agentbox_requests_running", "gauge", "Running requests.", s["running"])
    m("agentbox_requests_waiting", "gauge", "Waiting requests.", s["waiting"])
    m("agentbox_admission_queue", "gauge", "New sessions waiting for room.", adm["queued_new_sessions"])
    m("agentbox_admission_timeouts_total", "counter", "New sessions refused after the admission timeout.", adm["timeouts"])
    for k in ("evictions", "demotions", "promotions"):
        m(f"agentbox_cache_{k}_total", "counter", f"Pages {k}.", cache.get(k, 0))
    return PlainTextResponse("\n".join(out) + "\n", media_type="text/plain; version=0.0.4")
