"""Schemathesis against the shared live server (SmolLM2) from its own /openapi.json, model pinned, briefly (the
10-minute run is `python -m agentbox.bench.fuzz_api`): no 5xx, no crash; and the document declares the limits
a request meets (exact integer bounds, the schema limits, the default output budget)."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

from agentbox.bench.fuzz_api import fuzz
from agentbox.chat.schema_check import MAX_ENUM_MEMBERS
from agentbox.engine.sampling import MAX_TOKENS_MAX, SEED_MAX

pytestmark = pytest.mark.slow


def test_the_document_declares_the_limits(live_server: str) -> None:
    spec = httpx.get(live_server + "/openapi.json").json()
    comps = spec["components"]["schemas"]
    seed = next(a for a in comps["ChatCompletionRequest"]["properties"]["seed"]["anyOf"] if a.get("type") == "integer")
    assert seed["maximum"] == SEED_MAX and isinstance(seed["maximum"], int)  # exact: was 2**63 as a float
    budget = next(a for a in comps["Thinking"]["properties"]["budget_tokens"]["anyOf"] if a.get("type") == "integer")
    assert (budget["minimum"], budget["maximum"]) == (1, MAX_TOKENS_MAX)
    limits = spec["x-limits"]
    default = httpx.get(live_server + "/v1/models").json()["data"][0]["default_max_tokens"]
    assert limits["default_max_tokens"] == default and str(default) in comps["CreateBody"]["properties"][
        "max_tokens"]["description"]
    assert limits["schema"]["max_enum_members"] == MAX_ENUM_MEMBERS and limits["max_json_depth"] == 64
    assert f"{MAX_ENUM_MEMBERS:,} members an enum" in comps["FunctionDef"]["properties"]["parameters"]["description"]
    assert "405" not in spec["paths"]["/v1/chat/completions"]["post"]["responses"]  # a POST route answers POST
    assert httpx.get(live_server + "/v1/chat/completions").status_code == 405
    assert httpx.post(live_server + "/v1/models", content=b"x", headers={"content-type": "text/plain"}).status_code == 405


@pytest.mark.skipif(shutil.which("schemathesis") is None and not (Path(__file__).parents[1] / ".venv/bin/schemathesis")
                    .exists(), reason="schemathesis (a dev extra) is not installed")
def test_schemathesis_finds_no_5xx_and_no_crash(live_server: str, tmp_path: Path) -> None:
    result = fuzz(live_server, max_time_s=40, workers=2, seed=51, out=tmp_path)
    print(f"\nschemathesis: {result.requests} requests in {result.seconds} s, {result.server_errors} 5xx, "
          f"{result.crashes} crashes")
    assert result.requests > 100, (tmp_path / "schemathesis.log").read_text()[-3000:]
    assert result.server_errors == 0 and result.crashes == 0, result.failures
