"""The config dataclasses: the one place defaults live. CLI options read their defaults from here."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path


class CachePolicy(str, Enum):
    """What the prefix cache keeps between turns (the CLI's --cache-policy choices are these values)."""

    SESSION = "session"  # session leases, eviction by expected saving, host-RAM tier
    LRU = "lru"  # a plain prefix cache, least recently used first (what general engines do)
    NONE = "none"  # nothing: every prompt is computed in full (the cold baseline)


class Speculative(str, Enum):
    """Speculative decoding (engine/draft.py; the CLI's --speculative choices are these values)."""

    # suffix (every model family, hybrid and sliding-window ones included), and the checkpoint's own MTP head
    # beside it where it has one: the longer draft wins each step
    AUTO = "auto"
    SUFFIX = "suffix"  # longest match in the request's own tokens, then in recent outputs of every session
    NGRAM = "ngram"  # a fixed-length n-gram match in the request's own tokens only (llama.cpp's kind)
    MTP = "mtp"  # the checkpoint's multi-token-prediction head (Qwen3.5 / 3.6 / 3.8 `mtp.*`) drafts, alone
    OFF = "off"

    @property
    def uses_mtp(self) -> bool:
        """Whether the engine loads the checkpoint's MTP head to draft with (auto: where there is one)."""
        return self in (Speculative.AUTO, Speculative.MTP)


DTYPES = ("auto", "float32", "bfloat16", "float16")

# What the planner (hub/plan.py) counts as KV: this many sessions resident at this context (or the model's,
# when shorter). On CPU the engine sizes its pool by the same numbers, so the plan's memory is what the
# server takes (a share of free RAM instead took 4 GiB for SmolLM2, planned at 0.35 GiB of KV).
PLAN_CONTEXT = 32768
PLAN_SESSIONS = 1
# A MoE variant whose routed experts would live in host RAM is preferred over a lower-bit one that fits the
# GPU alone only while its decode-speed bound (hub/offload.py) stays at or above this many tokens/s.
PLAN_MIN_TOK_S = 8.0


# A name every agentbox server's model answers to, whatever it serves: what `agentbox setup` writes into a
# client's config, so the client keeps working when another model is served (`default` is taken: Claude Code
# reads a model named "default" as its own default model).
STABLE_MODEL_ALIAS = "agentbox"

STATE_ENV = "AGENTBOX_HOME"
DISK_CACHE_SHARE = 0.1  # of the free disk under the state directory, by default
DISK_CACHE_MAX_GB = 64.0
SERVE_DISK_CACHE_GB: float | None = None  # the server's default: a share of free disk
HOST_STATE_GB = 4.0  # hybrid models: host RAM the demoted state snapshots take at most, by default


def state_dir() -> Path:
    """Where the daemon keeps pid/port/log files and verdicts (AGENTBOX_HOME overrides, for tests)."""
    root = os.environ.get(STATE_ENV) or os.path.join(
        os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state"), "agentbox"
    )
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


GPU_PAGE_SIZE = 16
CPU_PAGE_SIZE = 4


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine core process needs to start. Frozen: one instance per engine."""

    model: str = ""
    dtype: str = "auto"  # auto: bf16 on GPU, fp32 on CPU
    device: str = "auto"  # auto: cuda when available, else cpu
    # None: GPU_PAGE_SIZE on a GPU; CPU_PAGE_SIZE on the CPU, where a turn resumes its history only up to the last
    # page boundary of what the cache holds (a hybrid's state snapshots and every model's radix pages are whole
    # pages), and a smaller page costs nothing measured (resolved_page_size).
    page_size: int | None = None
    num_pages: int | None = None  # None: sized from kv_cache_gb
    kv_cache_gb: float | None = None  # None: a share of free memory (see engine/exec/runner.py)
    max_num_seqs: int = 32  # cap on running requests
    max_num_batched_tokens: int = 1024  # per-step token budget (chunked prefill falls out of it)
    # Once a prompt finishes in a step, other prompts add at most this many tokens to it (the rest waits a step):
    # the first prompt's first token is not held back by the next one's chunk, which gets its first token no
    # later for it (the scheduler says why); prompts this short still share a step and its fixed cost.
    prefill_join_tokens: int = 256
    max_model_len: int | None = None  # None: the model's own context length
    attention: str = "auto"  # auto | a name in layers/backends' registry (auto: flashinfer, triton, torch)
    enforce_eager: bool = False  # True: no CUDA graphs for decode (engine/exec/graph_runner.py)
    # True: quantised layers dequantised on CPU (exact fp32 numbers; no int8-rounded activations, no fused
    # decode layers: kernels/cpu_gemv.c, cpu_decode.c), at 2-3x the decode time and the fp32 weight bytes.
    exact_cpu: bool = False
    # The paged KV cache's element type. auto: fp16 on CPU when the model runs in fp32 and not exact_cpu (a decode
    # step over a 2-5k-token agent history reads its whole KV: fp16 halves those bytes, llama.cpp's default f16
    # cache does the same), else the model's dtype. Models whose attention has not been checked on a narrower
    # cache keep the model's dtype (CausalLM.narrow_cpu_kv).
    kv_dtype: str = "auto"
    tensor_parallel_size: int = 1
    # MoE models: the routed experts of every MoE layer (cpu_moe) or of the first n_cpu_moe in host RAM, run by
    # the CPU expert kernels while the device runs the rest (layers/experts/placement.py; llama.cpp's flags).
    # The planner names the N that fits (hub/offload.py).
    cpu_moe: bool = False
    n_cpu_moe: int = 0
    seed: int = 0
    # None: every core while no other process keeps them busy, else all but one (engine/exec/cpu_threads.py);
    # `serve --threads N`: N for every step
    cpu_threads: int | None = None
    cache_policy: CachePolicy = CachePolicy.SESSION
    host_cache_gb: float | None = None  # None: a share of free RAM
    # The disk tier under the in-memory ones (engine/cache/disk_tier.py), under state_dir()/kvcache.
    # None: DISK_CACHE_SHARE of the free disk there, at most DISK_CACHE_MAX_GB; 0: off. `agentbox serve`
    # passes SERVE_DISK_CACHE_GB; an in-process engine (the offline `LLM`, tests) writes nothing unless asked.
    disk_cache_gb: float | None = 0.0
    disk_restore: bool = True  # False (`serve --no-restore`): the model's namespace is cleared at start
    disk_flush_s: float = 8.0  # a graceful stop writes the cache to disk for at most this long
    # Hybrid models (Gated DeltaNet): recurrent-state snapshots kept, two per session (engine/cache/
    # state_snapshots.py). None: one per running request; 0: none (a session recomputes its whole history).
    state_snapshots: int | None = None
    # Snapshots a full device store demotes to host RAM instead of dropping them. None: as many as the
    # device store keeps, within HOST_STATE_GB; 0: none (a full store drops).
    host_state_snapshots: int | None = None
    lease_default_ttl_s: float = 10.0  # TTL of a session lease before its gaps are measured
    lease_max_ttl_s: float = 120.0
    lease_max_share: float = 0.8  # leased pages may hold at most this share of the pool
    admission_queue_size: int = 256
    admission_timeout_s: float = 120.0  # a CPU turn can take tens of seconds; agents retry a 429 anyway
    # Loop guard (engine/loop_guard.py): a cycle of at most `loop_guard_max_period` tokens repeated
    # `loop_guard_min_repeats` times over at least `loop_guard_min_tokens` tokens ends the generation.
    loop_guard: bool = True
    loop_guard_max_period: int = 48
    loop_guard_min_repeats: int = 8
    loop_guard_min_tokens: int = 128
    # A grammar-bound output starts closing (the shortest completion its grammar accepts) once the tokens
    # left are within this window of what closing needs; see engine/grammar.py.
    grammar_close_window: int = 96
    # Engine restarts after a death (a CUDA error, OOM, a dead rank): at most `max_restarts` within any
    # `restart_window_s`; one more death in that window exits the server non-zero for its supervisor.
    max_restarts: int = 3
    restart_window_s: float = 600.0
    # The engine process's memory ceiling (engine/memory_ceiling.py): what it holds once loaded (weights, KV,
    # state, host tier) plus the disk tier's queues plus this margin for a step's work. None: no ceiling.
    memory_margin_gb: float | None = 4.0
    # The session table: an entry idle this long (no request) is forgotten, and past `max_sessions`
    # entries the longest idle goes first. Without them the table grew with every id a client made up.
    session_idle_s: float = 3600.0
    max_sessions: int = 1024
    # Speculative decoding (engine/draft.py): drafts of up to `spec_max_draft` tokens, proposed only after a
    # match of at least `spec_min_match` tokens; k is chosen from the request's acceptance and what each
    # verified row costs over a decode step (`spec_row_cost`; None: measured defaults per device, draft.py).
    speculative: Speculative = Speculative.AUTO
    spec_max_draft: int = 16
    spec_min_match: int = 3
    spec_row_cost: float | None = None
    spec_match_factor: float | None = None  # a draft is at most this many tokens per matched token (None: draft.py)
    spec_global_tokens: int = 65536  # recent outputs of every session searched when a request's own miss
    # Tokens an MTP head drafts a step: the head is trained to predict one token ahead; fed its own output it
    # still predicts the next ones often enough to pay on a GPU (peers draft 3 with Qwen3.6-27B's head: ~3.3 of 4)
    spec_mtp_tokens: int = 3

    def __post_init__(self) -> None:
        # Callers may name the policy ("lru"); an unknown name fails here, naming the field.
        try:
            policy = CachePolicy(self.cache_policy)
        except ValueError:
            choices = ", ".join(p.value for p in CachePolicy)
            raise ValueError(f"cache_policy must be one of {choices} (got {self.cache_policy!r})") from None
        object.__setattr__(self, "cache_policy", policy)
        try:
            spec = Speculative(self.speculative)
        except ValueError:
            choices = ", ".join(p.value for p in Speculative)
            raise ValueError(f"speculative must be one of {choices} (got {self.speculative!r})") from None
        object.__setattr__(self, "speculative", spec)
        if self.kv_dtype not in DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(DTYPES)} (got {self.kv_dtype!r})")
        if self.spec_mtp_tokens < 1:
            raise ValueError(f"spec_mtp_tokens must be at least 1 (got {self.spec_mtp_tokens})")

    @property
    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.resolved_device.startswith("cuda") else "float32"

    @property
    def resolved_page_size(self) -> int:
        """Tokens per KV page (see `page_size`). On the CPU the Qwen3.5 hybrid's agent replay (bench/results/
        llamacpp-agents) resumed at most 15 tokens short of each turn's history at 16 and 3 at 4 (history reused,
        min over 32 turns: 0.9935 -> 0.9987), its wall unchanged (24.5 / 25.1 s, 1 session 11.4-12.1 / 11.8 s);
        llama-server resumes within 4 tokens. SmolLM2's batched decode step at 3k tokens of context: the same at 4
        and 16. A hybrid's prompt snapshot stands before the tail of the prompt a next turn does not repeat
        (chat/generation_prompt.py); without that, a small page put it past the tail on a quarter of GLM's turns.
        GPUs keep 16, the size their kernels and CUDA graphs were measured at."""
        if self.page_size is not None:
            return self.page_size
        return GPU_PAGE_SIZE if self.resolved_device.startswith("cuda") else CPU_PAGE_SIZE

    @property
    def resolved_kv_dtype(self) -> str:
        """The KV cache's dtype name (see `kv_dtype`), before a model's own refusal of a narrower one."""
        if self.kv_dtype != "auto":
            return self.kv_dtype
        cpu_fp32 = self.resolved_device == "cpu" and self.resolved_dtype == "float32"
        return "float16" if cpu_fp32 and not self.exact_cpu else self.resolved_dtype


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # None: derived from the model path
    api_key: str | None = None  # None: no auth (AGENTBOX_API_KEY sets it without showing it in `ps`)
    # Beyond loopback a server without a key is anyone's on the network: serve refuses unless this is set.
    allow_unauthenticated: bool = False
    max_body_mb: float = 32.0  # request bodies past this are a 413 (an agent's 100k-token turn is ~0.5 MB)
    cors_origins: tuple[str, ...] = ()  # browser origins allowed to call the API; none by default
    # Output budget for a request with no max_tokens when the model's profile names none.
    default_max_tokens: int = 4096
    record_trace: str | None = None  # `serve --record-trace FILE`: live traffic saved as a replayable trace
    # Conversations whose text and ids the API keeps so a warm turn tokenizes only its new part
    # (chat/incremental.py): ~1 MB each at 128k tokens.
    tokenize_cache_texts: int = 64
    engine: EngineConfig = field(default_factory=EngineConfig)


@dataclass(frozen=True)
class FleetConfig:
    """`agentbox fleet`: vllm-router in front of agentbox servers. The health and retry numbers are the ones
    measured in docs/serving-a-team.md: with the router's defaults a SIGKILLed backend cost clients two 500s
    and stayed in rotation 173 s; with these no client saw an error and traffic moved in about 4 s."""

    host: str = "127.0.0.1"  # the router checks no API key: keep it on a private address
    port: int = 8100
    policy: str = "consistent_hash"  # hashes X-Session-Id / X-User-Id, body session_id, metadata.user_id
    health_check_interval_s: int = 5
    health_failure_threshold: int = 2
    health_success_threshold: int = 1
    retry_max_retries: int = 3
    cb_failure_threshold: int = 2
    cb_timeout_s: int = 15
    request_timeout_s: int = 1800  # a long CPU turn is still one request
    startup_timeout_s: int = 120  # how long the router waits for the backends to answer /health
