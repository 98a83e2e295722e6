"""Sampling parameters: validated once at the API boundary, carried by the request."""

from __future__ import annotations

from dataclasses import dataclass, field

from agentbox.engine.grammar_spec import GrammarSpec

# Bounds of the values a request may send: past them torch overflows (a seed or top_k beyond int64) or the
# distribution turns into inf / nan (a repetition penalty of 5e-324 divides logits by almost zero).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
TOP_K_MAX = 1 << 20
MAX_TOKENS_MAX = 1 << 31
REPETITION_PENALTY_MIN, REPETITION_PENALTY_MAX = 0.01, 10.0
TOKEN_ID_MAX = 1 << 31
MAX_STOP = 16
MAX_STOP_TOKEN_IDS = 64
MAX_STOP_CHARS = 1000


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
        # Written so that nan fails every check (a comparison with nan is False).
        checks = [
            ("max_tokens", 1 <= self.max_tokens <= MAX_TOKENS_MAX, f"must be between 1 and {MAX_TOKENS_MAX}"),
            ("temperature", 0.0 <= self.temperature <= 2.0, "must be between 0 and 2"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", -1 <= self.top_k <= TOP_K_MAX, f"must be -1 or 0 (off), or between 1 and {TOP_K_MAX}"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be between 0 and 1"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be between -2 and 2"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be between -2 and 2"),
            ("repetition_penalty", REPETITION_PENALTY_MIN <= self.repetition_penalty <= REPETITION_PENALTY_MAX,
             f"must be between {REPETITION_PENALTY_MIN} and {REPETITION_PENALTY_MAX}"),
            ("seed", self.seed is None or SEED_MIN <= self.seed <= SEED_MAX,
             f"must be between {SEED_MIN} and {SEED_MAX}"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be between 0 and 20"),
            ("stop", len(self.stop) <= MAX_STOP and all(len(x) <= MAX_STOP_CHARS for x in self.stop),
             f"at most {MAX_STOP} stop strings of at most {MAX_STOP_CHARS} characters"),
            ("stop_token_ids", len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS
             and all(0 <= t < TOKEN_ID_MAX for t in self.stop_token_ids),
             f"at most {MAX_STOP_TOKEN_IDS} token ids, each in [0, {TOKEN_ID_MAX})"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise InvalidParam(name, f"'{name}' {why} (got {getattr(self, name)!r})")
        return self
