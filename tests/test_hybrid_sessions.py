"""Session reuse on a hybrid model, the agent pattern: 4 conversations at once, 8 turns each, every turn the
whole history plus the last answer plus new tokens, in a KV pool that cannot hold every history's pages with
room to spare (eviction runs). With snapshots each later turn resumes at its last cached page; without, every
turn recomputes its history. A finished conversation's pages are evicted meanwhile. Either way each answer
equals transformers' cold greedy run."""

from __future__ import annotations

import pytest
import torch
from hybrid_models import configs, hf_greedy, save_hybrid

from agentbox.config import EngineConfig
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams

SESSIONS, TURNS, NEW, ANSWER = 4, 8, 5, 6


def _conversation(llm: LLM, hf: torch.nn.Module) -> list[float]:
    """Cached share of each later turn's prompt, all sessions."""
    sp = SamplingParams(max_tokens=ANSWER, temperature=0.0, ignore_eos=True)
    # a finished conversation first: its pages fill the pool and must be evicted as the agents' grow
    llm.generate([[(i * 7 + 1) % 256 for i in range(480)]], sp, session_ids=["finished"])
    history = [[(s * 31 + i * 17 + 3) % 256 for i in range(200)] for s in range(SESSIONS)]
    shares: list[float] = []
    for t in range(TURNS):
        outs = llm.generate(history, sp, session_ids=[f"agent-{s}" for s in range(SESSIONS)])
        for s, out in enumerate(outs):
            assert out.token_ids == hf_greedy(hf, history[s], ANSWER), (s, t)
            if t:
                shares.append(out.num_cached_tokens / len(history[s]))
            history[s] = history[s] + out.token_ids + [(t * 7 + s * 3 + k) % 256 for k in range(NEW)]
    return shares


@pytest.mark.slow
def test_snapshots_resume_every_later_turn(tmp_path) -> None:  # noqa: ANN001
    hf = save_hybrid(configs()["qwen3_5"], tmp_path)
    end_pages = -(-(200 + TURNS * (ANSWER + NEW)) // 16)
    # Room for the four live histories and little more: the finished conversation's pages are pushed out.
    common = dict(model=str(tmp_path), page_size=16, attention="torch", num_pages=SESSIONS * end_pages + 4,
                  host_cache_gb=0.0)
    with LLM(EngineConfig(**common)) as llm:  # type: ignore[arg-type]
        on = _conversation(llm, hf)
        stats = llm.core.cache.stats()
        evicted = stats.evictions + stats.demotions
    with LLM(EngineConfig(**common, state_snapshots=0)) as llm:  # type: ignore[arg-type]
        off = _conversation(llm, hf)
    print(f"\ncached share of later turns: snapshots on min {min(on):.3f} mean {sum(on) / len(on):.3f}; "
          f"off max {max(off):.3f}; evicted {evicted}")
    assert min(on) >= 0.9 and evicted > 0
    assert max(off) == 0.0
