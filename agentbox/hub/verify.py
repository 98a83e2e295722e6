"""The canary: load a variant, run one fixed prompt greedily, and reject what is visibly broken.

Broken means: the load fails, a logit is NaN or infinite, or the output is degenerate (one token repeated,
or one character repeated, e.g. '!!!!' — what AWQ Qwen2.5-Coder-32B produced on two kernels). A verdict is
remembered per (model, variant, GPU, driver, engine version) in state_dir()/verdicts.json (with its checksum:
a file that does not verify is measured again), so the next start skips a known-bad variant without loading it,
and a driver or engine upgrade earns a fresh check.

The model run itself is a `Runner` callable so the contract is testable without the engine: the default
imports agentbox.engine.llm lazily; `transformers_runner` is the reference implementation.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from agentbox.config import state_dir
from agentbox.hw.probe import Probe
from agentbox.state_files import read_sealed_json, sealed_json

CANARY_PROMPT = "Write a Python function that returns the sum of a list of numbers."
CANARY_TOKENS = 16
MIN_REPEAT = 4  # this many identical tokens (or characters) and nothing else is degenerate


@dataclass
class CanaryOutput:
    token_ids: list[int]  # generated greedily
    text: str
    logits_finite: bool  # every logit the run looked at was finite


Runner = Callable[
    [Path, str, int], CanaryOutput
]  # (model path, prompt, max new tokens); raises on a failed load


@dataclass
class Verdict:
    ok: bool
    reason: str  # "ok", or what was wrong
    model: str
    variant: str
    gpu: str
    driver: str
    engine_version: str
    text: str = ""
    checked_at: float = 0.0
    cached: bool = False  # True when read back from verdicts.json instead of run now


def judge(out: CanaryOutput) -> str | None:
    """Why this output is broken, or None when it looks like a working model."""
    if not out.logits_finite:
        return "NaN or infinite logits"
    if not out.token_ids:
        return "no tokens generated"
    if len(out.token_ids) >= MIN_REPEAT and len(set(out.token_ids)) == 1:
        return f"degenerate output: token {out.token_ids[0]} repeated {len(out.token_ids)} times ({out.text[:20]!r})"
    chars = "".join(out.text.split())
    if len(chars) >= MIN_REPEAT and len(set(chars)) == 1:
        return f"degenerate output: {chars[:20]!r}"
    return None


def engine_version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("agentbox")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def machine_key(probe: Probe) -> tuple[str, str]:
    if probe.cpu_only:
        return "cpu", "none"
    names = sorted({g.name for g in probe.gpus})
    return " + ".join(names), probe.software.driver_version or "unknown"


class VerdictStore:
    """verdicts.json: one entry per (model, variant, GPU, driver, engine version)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or state_dir() / "verdicts.json"

    @staticmethod
    def key(model: str, variant: str, gpu: str, driver: str, version: str) -> str:
        return "|".join((model, variant, gpu, driver, version))

    def _read(self) -> dict[str, dict[str, object]]:
        """The verdicts, when the file verifies (state_files.py): one that is missing, half-written or edited reads
        as empty, so the canary runs again (a verdict is only ever what a canary measured)."""
        data = read_sealed_json(self.path)
        return data if isinstance(data, dict) else {}

    def get(self, key: str) -> Verdict | None:
        entry = self._read().get(key)
        if not isinstance(entry, dict):
            return None
        try:
            return Verdict(**{**entry, "cached": True})
        except TypeError:  # a field this version does not know: measured again
            return None

    def put(self, key: str, verdict: Verdict) -> None:
        data = self._read()
        data[key] = {**asdict(verdict), "cached": False}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(sealed_json(data))
        tmp.replace(self.path)  # atomic: a crash mid-write keeps the old file


def verify(
    model_path: Path | str,
    variant: str,
    probe: Probe,
    *,
    model: str | None = None,
    runner: Runner | None = None,
    store: VerdictStore | None = None,
    force: bool = False,
) -> Verdict:
    """Run the canary on `model_path` (or reuse the remembered verdict unless `force`)."""
    path = Path(model_path)
    model = model or path.name
    gpu, driver = machine_key(probe)
    version = engine_version()
    store = store or VerdictStore()
    key = store.key(model, variant, gpu, driver, version)
    if not force and (known := store.get(key)) is not None:
        return known
    runner = runner or engine_runner
    text = ""
    try:
        out = runner(path, CANARY_PROMPT, CANARY_TOKENS)
        text = out.text
        reason = judge(out)
    except ImportError as exc:
        if (exc.name or "").startswith("agentbox"):
            raise  # our engine is missing from this install: that says nothing about the model
        reason = f"failed to load or run: {type(exc).__name__}: {exc}"
    except Exception as exc:  # a failed load is a verdict, not a crash: the chain tries the next candidate
        reason = f"failed to load or run: {type(exc).__name__}: {exc}"
    verdict = Verdict(reason is None, reason or "ok", model, variant, gpu, driver, version, text, time.time())
    store.put(key, verdict)
    return verdict


def engine_runner(path: Path, prompt: str, max_tokens: int, tp: int = 1, n_cpu_moe: int = 0) -> CanaryOutput:
    """The canary through agentbox's own engine (what `serve` will run, at the tp and with the MoE layers'
    experts in host RAM it will run)."""
    import torch

    from agentbox.config import EngineConfig
    from agentbox.engine.llm import LLM
    from agentbox.engine.sampling import SamplingParams

    tokenizer = _tokenizer(path)
    ids = _prompt_ids(tokenizer, prompt)
    llm = LLM(EngineConfig(model=str(path), tensor_parallel_size=tp, n_cpu_moe=n_cpu_moe))
    try:
        logits = llm.logits(ids)
        finite = bool(torch.isfinite(logits).all())
        (completion,) = llm.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0.0))
        if completion.error:
            raise RuntimeError(completion.error)
        out_ids = list(completion.token_ids)
    finally:
        close = getattr(llm, "close", None) or getattr(llm, "shutdown", None)
        if close is not None:
            close()
    return CanaryOutput(out_ids, tokenizer.decode(out_ids, skip_special_tokens=True), finite)


def transformers_runner(path: Path, prompt: str, max_tokens: int) -> CanaryOutput:
    """The same canary through transformers: the reference, and a check for checkpoints the engine lacks."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = _tokenizer(path)
    ids = _prompt_ids(tokenizer, prompt)
    kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    model = AutoModelForCausalLM.from_pretrained(path.parent if path.suffix == ".gguf" else path, **kwargs)
    model.eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_tokens,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0,
        )
    new = out.sequences[0, len(ids) :].tolist()
    finite = all(bool(torch.isfinite(step).all()) for step in out.logits)
    return CanaryOutput(new, tokenizer.decode(new, skip_special_tokens=True), finite)


def _tokenizer(path: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return AutoTokenizer.from_pretrained(path)


def _prompt_ids(tokenizer, prompt: str) -> list[int]:  # type: ignore[no-untyped-def]
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer.encode(prompt)]
