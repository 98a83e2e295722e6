"""Sampling defaults come from the model's profile where the client sends none; greedy on a thinking
model is logged as a warning."""

from __future__ import annotations

import logging

import pytest

from agentbox.config import ServerConfig
from agentbox.server.app import model_defaults
from agentbox.server.state import ServerState


def state_for(path: str, name: str) -> ServerState:
    d = model_defaults(path, name)
    return ServerState(ServerConfig(), None, None, None, name, sampling_defaults=d.sampling,  # type: ignore[arg-type]
                       thinking_model=d.thinking, tool_parser=d.tool_parser,
                       default_max_tokens=d.max_output_tokens or ServerConfig().default_max_tokens)


def test_profile_defaults_apply_only_where_the_client_sent_none() -> None:
    st = state_for("/models/Qwen3-8B", "Qwen3-8B")
    assert st.thinking_model
    assert st.pick("temperature", None, 1.0) == 0.6 and st.pick("top_k", None, 0) == 20
    assert st.pick("temperature", 0.3, 1.0) == 0.3  # the client's value wins
    unknown = state_for("/models/my-own-model", "my-own-model")
    assert unknown.pick("temperature", None, 1.0) == 1.0 and not unknown.thinking_model


def test_greedy_on_a_thinking_model_warns(caplog: pytest.LogCaptureFixture) -> None:
    st = state_for("/models/Qwen3-8B", "Qwen3-8B")
    with caplog.at_level(logging.WARNING, logger="agentbox.server"):
        st.warn_if_greedy_thinking(0.0)
        st.warn_if_greedy_thinking(0.6)
    assert len([r for r in caplog.records if "greedy" in r.getMessage()]) == 1


def test_default_output_budget_applies_only_when_the_client_sends_none() -> None:
    from agentbox.engine.ipc.messages import EngineReady

    st = state_for("/models/Qwen3-8B", "Qwen3-8B")
    st.info = EngineReady("m", 40960, 100, [0], 10, 16, "torch", "cpu", "float32")
    assert st.default_max_tokens == 16384  # profiles/qwen3-8b.toml
    assert st.clamp_max_tokens(None, 1000) == 16384
    assert st.clamp_max_tokens(32000, 1000) == 32000  # the client's own value, as sent
    assert st.clamp_max_tokens(32000, 30000) == 40960 - 30000  # capped only by the context
    assert st.clamp_max_tokens(None, 40000) == 960
    assert state_for("/models/mine", "mine").default_max_tokens == ServerConfig().default_max_tokens
