"""The loop guard: ends a generation that has fallen into a cycle.

A weak or greedy model can repeat the same few tokens until the context is full (seen: ten minutes of a
looping answer, after which the agent's own "continue" request is a guaranteed 400). A cycle of period p
shows as a run of positions i with out[i] == out[i - p]; the guard keeps that run length for every period
up to `max_period`, O(max_period) integer compares per token, and trips when one run covers
`min_repeats` cycles and at least `min_tokens` tokens. Legitimate output rarely repeats one exact span
of up to a few dozen tokens eight times and over a hundred tokens in a row; a model stuck in a loop does
nothing else.
"""

from __future__ import annotations

from collections import deque

from agentbox.config import EngineConfig


class LoopGuard:
    def __init__(self, max_period: int, min_repeats: int, min_tokens: int) -> None:
        self.max_period = max_period
        self.min_repeats = min_repeats
        self.min_tokens = min_tokens
        self._tail: deque[int] = deque(maxlen=max_period + 1)  # the newest token last
        self._runs = [0] * (max_period + 1)  # _runs[p]: how many latest tokens equal the one p before
        self.period: int | None = None  # the cycle's period once the guard tripped

    @classmethod
    def from_config(cls, config: EngineConfig) -> LoopGuard | None:
        if not config.loop_guard:
            return None
        return cls(config.loop_guard_max_period, config.loop_guard_min_repeats, config.loop_guard_min_tokens)

    def feed(self, token: int) -> bool:
        """Take the next output token; True once the output ends in a cycle (and from then on)."""
        if self.period is not None:
            return True
        tail, runs = self._tail, self._runs
        n = len(tail)
        for p in range(1, self.max_period + 1):
            if p <= n and tail[n - p] == token:
                runs[p] += 1
                if self.period is None and runs[p] >= max(self.min_tokens, p * (self.min_repeats - 1)):
                    self.period = p  # the shortest period that trips names the cycle
            else:
                runs[p] = 0
        tail.append(token)
        return self.period is not None
