"""The served model answers to the name the CLI prints (`PROFILE:VARIANT`), its file name, its profile name,
`agentbox` (what setup writes into clients) and `default`; `/v1/models` lists the main name with the aliases beside it; an unknown name is a 404 naming them."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

MAIN = "SmolLM2-135M-Instruct.Q4_1"
ALIASES = ["SmolLM2-135M-Instruct:embedded", "SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct.Q4_1.gguf", "agentbox", "default"]


def test_every_name_the_user_meets_is_served(live_server: str) -> None:
    models = httpx.get(live_server + "/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == [MAIN]
    assert set(ALIASES) <= set(models[0]["aliases"])
    client = openai.OpenAI(base_url=live_server + "/v1", api_key="unused", max_retries=0)
    for name in [MAIN, *ALIASES]:
        r = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
        assert r.model == MAIN and r.choices[0].finish_reason in ("length", "stop")
        assert httpx.get(f"{live_server}/v1/models/{name}", timeout=10).json()["id"] == MAIN


def test_an_unknown_name_is_a_404_that_lists_the_names(live_server: str) -> None:
    client = openai.OpenAI(base_url=live_server + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    msg = e.value.body["message"]  # type: ignore[index]
    assert msg.startswith("model 'gpt-4o' is not served here; this server's model answers to 'SmolLM2-135M-Instruct.Q4_1'")
    assert "'SmolLM2-135M-Instruct:embedded'" in msg and "'default'" in msg and e.value.body["param"] == "model"  # type: ignore[index]
    claude = anthropic.Anthropic(base_url=live_server, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.NotFoundError, match="answers to"):
        claude.messages.create(model="claude-sonnet-4-5", max_tokens=1, messages=[{"role": "user", "content": "hi"}])
    assert httpx.get(live_server + "/v1/models/gpt-4o", timeout=10).status_code == 404
