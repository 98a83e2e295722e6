"""One sampled token's log-probability and its top alternatives: made by the sampler (engine/exec), carried
over the pipe inside RequestOutput (engine/ipc) and rendered by the server. Torch-free, so the API process
imports it without the execution side."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
