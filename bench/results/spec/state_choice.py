"""How a hybrid model's verify leaves its state at the accepted position: the three ways, measured on CPU.

(a) stash each position's inputs and the final state, recompute the kept positions' state update at the next
    step unless the draft was kept whole (what the engine does, layers/recurrent_state.py); (b) keep every position's state during the verify (k + 1 copies per layer);
(c) restore a copy and recompute the kept tokens through the whole model (one more forward of m + 1 tokens).
Run: .venv/bin/python bench/results/spec/state_choice.py (prints JSON)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from hybrid_models import configs, save_hybrid  # noqa: E402

from agentbox.config import EngineConfig, Speculative  # noqa: E402
from agentbox.engine.llm import LLM  # noqa: E402
from agentbox.engine.sampling import SamplingParams  # noqa: E402
from agentbox.kernels.cpu_gemv import cpu_model  # noqa: E402
from agentbox.layers import delta_rule  # noqa: E402
from agentbox.layers.recurrent_state import StateCache  # noqa: E402


def _bench(fn, reps: int = 200) -> float:  # noqa: ANN001
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e3


def layer_costs(h: int, dk: int, dv: int, n: int, kept: int) -> dict:
    """ms per layer for a verify of n positions: the recurrent pass alone, with each position's state kept
    (b), and the commit's recompute of `kept` positions (a)."""
    q, k = (torch.randn(1, h, n, dk) for _ in range(2))
    v, g, beta, s = torch.randn(1, h, n, dv), -torch.rand(1, h, n), torch.rand(1, h, n), torch.randn(1, h, dk, dv)

    def keep_all() -> None:
        st, kept_states = s, []
        for t in range(n):
            _, st = delta_rule.recurrent(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1],
                                         g[:, :, t : t + 1], beta[:, :, t : t + 1], st)
            kept_states.append(st.clone())

    return {
        "verify_pass_ms": round(_bench(lambda: delta_rule.recurrent(q, k, v, g, beta, s)), 4),
        "b_keep_every_state_ms": round(_bench(keep_all), 4),
        "a_commit_recompute_ms": round(_bench(lambda: delta_rule.recurrent(
            k[:, :, :kept], k[:, :, :kept], v[:, :, :kept], g[:, :, :kept], beta[:, :, :kept], s)), 4),
        "b_extra_bytes_per_layer": (n - 1) * h * dk * dv * 4,
        "a_extra_bytes_per_layer": n * h * (2 * dk + dv + 2) * 4 + h * dk * dv * 4,  # inputs + the final state
    }


def engine_steps(path: Path) -> dict:
    """The tiny hybrid in the engine: mean decode step, verify step and commit (ms)."""
    times: dict[str, list[float]] = {"decode": [], "verify": [], "commit": []}
    commit = StateCache.commit

    def timed_commit(self, commits, offset):  # noqa: ANN001, ANN202
        t = time.perf_counter()
        commit(self, commits, offset)
        times["commit"].append(time.perf_counter() - t)

    StateCache.commit = timed_commit  # type: ignore[method-assign]
    base = [(7 * i + 3) % 250 + 1 for i in range(12)]
    with LLM(EngineConfig(model=str(path), page_size=16, num_pages=400, attention="torch",
                          speculative=Speculative.SUFFIX, spec_row_cost=0.0, spec_match_factor=2.0)) as llm:
        run = llm.core.runner.execute

        def timed(step):  # noqa: ANN001, ANN202
            t = time.perf_counter()
            out = run(step)
            (times["verify"] if step.state_verifies.numel() else times["decode"]).append(time.perf_counter() - t)
            return out

        llm.core.runner.execute = timed  # type: ignore[method-assign]
        sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        for _ in range(3):  # the same prompt again: the last answer is the draft (accepted whole)
            llm.generate([base * 3], sp)
    StateCache.commit = commit  # type: ignore[method-assign]
    return {k: round(1e3 * sorted(v)[len(v) // 2], 3) if v else None for k, v in times.items()}


if __name__ == "__main__":
    torch.set_num_threads(1)
    d = Path(tempfile.mkdtemp())
    save_hybrid(configs()["qwen3_5"], d)
    print(json.dumps({
        "cpu": cpu_model(), "load_average": os.getloadavg(),
        "tiny_hybrid_engine_median_ms": engine_steps(d),
        "tiny_layer_k16": layer_costs(4, 8, 8, 17, 9),
        "qwen3_6_27b_layer_k16": layer_costs(48, 128, 128, 17, 9),  # 48 value heads of 128 x 128 per layer
    }, indent=1))
