"""Sampling defaults come from the model's profile where the client sends none; greedy on a thinking
model is logged as a warning."""

from __future__ import annotations

import logging

import pytest

from agentbox.config import ServerConfig
from agentbox.server.app import profile_sampling
from agentbox.server.generation import ServerState


def state_for(path: str, name: str) -> ServerState:
    defaults, thinking = profile_sampling(path, name)
    return ServerState(ServerConfig(), None, None, None, name, sampling_defaults=defaults, thinking_model=thinking)  # type: ignore[arg-type]


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
