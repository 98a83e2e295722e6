"""Sampling parameters: validated once at the API boundary, carried by the request."""

from __future__ import annotations

from dataclasses import dataclass, field

from agentbox.engine.grammar_spec import GrammarSpec


class InvalidParam(ValueError):
    """A sampling value out of range; `field` names the offending request field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # checked on detokenized text by the API process
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None: off; n >= 0: the chosen token's logprob plus the top n
    grammar: GrammarSpec | None = None  # built by chat/grammar.py, compiled by engine/grammar.py

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> SamplingParams:
        checks = [
            ("max_tokens", self.max_tokens >= 1, "must be at least 1"),
            ("temperature", 0.0 <= self.temperature <= 2.0, "must be between 0 and 2"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= -1, "must be -1, 0 (off) or positive"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be between 0 and 1"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be between -2 and 2"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be between -2 and 2"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 10.0, "must be in (0, 10]"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be between 0 and 20"),
            ("stop", len(self.stop) <= 16, "at most 16 stop strings"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise InvalidParam(name, f"'{name}' {why} (got {getattr(self, name)!r})")
        return self
