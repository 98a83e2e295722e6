"""Speculative decoding on models with per-sequence state (layers/recurrent_state.py, engine/exec/verify_state.py):
a tiny hybrid (Gated DeltaNet + gated attention), a tiny Gemma 4 and a tiny Laguna (sliding-window rings of 8), a
tiny Nemotron-H (Mamba-2 conv and SSM state, replayed by the commit) and a tiny DeepSeek-V4 (position rings of its window and of the tokens its compressed entries still pool; entries a refused
draft completed are rewritten when the kept tokens complete them) decode greedily with drafts exactly as without, token for token, over two turns of two sessions. Drafts are accepted in part
(the state must end at the accepted position, not past the rejected tail), pages of 4 tokens put page
boundaries inside verifies (the state copied there is what the second turn resumes from)."""

from __future__ import annotations

import pytest
import torch
from deepseek_v4_models import save_deepseek_v4
from gemma4_models import configs as gemma4_configs
from gemma4_models import save_gemma4
from hybrid_models import configs as hybrid_configs
from hybrid_models import save_hybrid
from laguna_models import save_laguna
from nemotron_h_models import save_nemotron_h

from agentbox.config import EngineConfig, Speculative
from agentbox.engine.exec.step_inputs import StepInputs
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams
from agentbox.models.loader import load_model

SP = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _near_copy(tokens: list[int]) -> list[int]:
    """The answer with every 7th token changed: drafts from it are kept up to a change, refused from there."""
    return [(t + 1) % 256 if i % 7 == 6 else t for i, t in enumerate(tokens)]


def _two_turns(path, loaded, spec: Speculative, ref: list[list[int]] | None, **kw: object) -> tuple[list[list[int]], int, int, int]:  # noqa: ANN001
    """Both turns' outputs, drafted and accepted tokens, and the second turn's cached prompt tokens. With `ref`
    (the outputs without drafts), near copies of each turn's answers sit in the recent outputs drafts come from:
    a random model repeats nothing itself."""
    config = EngineConfig(model=str(path), page_size=4, num_pages=400, attention="torch", speculative=spec,
                          spec_row_cost=0.0, spec_match_factor=2.0, host_cache_gb=0.0, **kw)  # type: ignore[arg-type]
    base = [(7 * i + 3) % 250 + 1 for i in range(12)]
    prompts = [base * 3, base[:5] * 4 + [9, 8, 7]]
    sessions = ["a", "b"]
    outs: list[list[int]] = []
    cached = 0
    with LLM(config, loaded=loaded) as llm:
        for turn in range(2):
            for answer in ref[2 * turn : 2 * turn + 2] if ref else []:
                llm.core.drafter.recent.add(_near_copy(answer))
            got = llm.generate(prompts, SP, session_ids=sessions)
            outs += [o.token_ids for o in got]
            cached = sum(o.num_cached_tokens for o in got)  # the second turn's counts last
            prompts = [p + o + base[:6] for p, o in zip(prompts, outs[-2:], strict=True)]
        llm.core.check_integrity()
        c = llm.core.counters
        return outs, c.drafted_tokens, c.accepted_tokens, cached


@pytest.mark.parametrize("family", ["hybrid", "gemma4", "deepseek_v4", "laguna", "nemotron_h"])
def test_stateful_models_greedy_with_drafts_equals_plain(family: str, tmp_path) -> None:  # noqa: ANN001
    if family == "hybrid":
        save_hybrid(hybrid_configs()["qwen3_5"], tmp_path)
    elif family == "deepseek_v4":
        save_deepseek_v4(tmp_path)
    elif family == "laguna":
        save_laguna(tmp_path)
    elif family == "nemotron_h":
        save_nemotron_h(tmp_path)
    else:
        save_gemma4(gemma4_configs()["dense"], tmp_path)
    loaded = load_model(str(tmp_path), torch.float32, "cpu")
    plain, _, _, cached_plain = _two_turns(tmp_path, loaded, Speculative.OFF, None)
    spec, drafted, accepted, cached = _two_turns(tmp_path, loaded, Speculative.SUFFIX, plain)
    assert spec == plain
    assert 0 < accepted < drafted  # some drafts kept, some refused: the state stepped back past refused ones
    assert cached == cached_plain > 0  # the second turns resumed from states the verifies left


@pytest.mark.slow
def test_hybrid_tp2_with_drafts_equals_tp1_plain(tmp_path) -> None:  # noqa: ANN001
    # Each rank stashes its own heads' inputs; the commit travels in StepInputs.state_commits.
    save_hybrid(hybrid_configs()["qwen3_5"], tmp_path)
    loaded = load_model(str(tmp_path), torch.float32, "cpu")
    plain, _, _, _ = _two_turns(tmp_path, loaded, Speculative.OFF, None)
    spec, drafted, accepted, _ = _two_turns(tmp_path, None, Speculative.SUFFIX, plain, tensor_parallel_size=2,
                                            cpu_threads=1)
    assert spec == plain and 0 < accepted < drafted


def test_step_inputs_carry_state_commits_and_verifies() -> None:
    # What tensor-parallel ranks receive: which sequences verify, and the last step's commits.
    step = StepInputs(torch.tensor([5, 6, 7]), torch.tensor([0, 8, 9]), torch.tensor([16, 40, 41]), [1, 2], [1, 10],
                      torch.tensor([3, 0]), torch.tensor([[3, 0, 1]]), torch.tensor([0, 1, 2]), 1,
                      state_commits=torch.tensor([[0, 3, 2], [3, 0, 0]]), state_verifies=torch.tensor([1]))
    back = StepInputs.unpack(step.pack())
    assert torch.equal(back.state_commits, step.state_commits) and back.state_commits.shape == (2, 3)
    assert back.state_verifies.tolist() == [1] and back.sample_rows.tolist() == [0, 1, 2]
    assert StepInputs.unpack(StepInputs(*list(vars(step).values())[:9]).pack()).state_commits.shape == (0, 3)
