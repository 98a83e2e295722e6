"""A session's next turn that arrives while its last turn is still in its flush step (the client has the answer;
the step that computes the last token's KV, then caches the turn's pages and its state snapshot, has not run):
it is admitted after that step, so it resumes the whole last turn. Matched in the same schedule as the flush, a
model with state would find no snapshot of that turn (its first turn: nothing to resume at all). A tiny Laguna
(sliding rings) and a tiny Nemotron-H (Mamba-2 state), in-process, stepped by hand."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from laguna_models import save_laguna
from nemotron_h_models import save_nemotron_h

from agentbox.config import EngineConfig, Speculative
from agentbox.engine.ipc.messages import AddRequest
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams
from agentbox.models.loader import load_model

PAGE = 4
PROMPT = [(i * 37 + 11) % 250 + 1 for i in range(23)]
SP = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("family", ["laguna", "nemotron_h"])
def test_next_turn_waits_for_the_flush(family: str, tmp_path: Path) -> None:
    (save_laguna if family == "laguna" else save_nemotron_h)(tmp_path)
    config = EngineConfig(model=str(tmp_path), num_pages=64, page_size=PAGE, attention="torch",
                          speculative=Speculative.OFF)
    llm = LLM(config, loaded=load_model(str(tmp_path), torch.float32, "cpu"))
    core = llm.core
    core.add(AddRequest("a", PROMPT, SP, "s"))
    answer: list[int] = []
    finished = False
    while not finished:  # up to the step whose output tells the client the turn is over
        for o in core.step():
            answer += o.new_token_ids
            finished = finished or o.finished
    assert core.has_work()  # the flush step is still to run
    turn = PROMPT + answer
    core.add(AddRequest("b", turn + [7, 9, 11], SP, "s"))
    cached = None
    while core.has_work():
        for o in core.step():
            if o.request_id == "b":
                cached = o.num_cached_tokens
    assert cached == len(turn) // PAGE * PAGE, (cached, len(turn))
