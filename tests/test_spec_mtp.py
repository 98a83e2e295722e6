"""Drafts from the checkpoint's own MTP head (models/mtp.py, engine/exec/mtp.py) on a tiny Qwen3.5 whose head is in
the released layout and trained on the model's own greedy outputs (tests/mtp_models.py): the head in the engine
predicts what its plain-torch twin predicts, its first draft and the ones it chains on its own output; greedy
output is the same token for token with `--speculative mtp`, `suffix`, `auto` (both) and `off` over two turns of
two sessions whose second turns resume from the state snapshots the first left; /v1/stats counts each source."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mtp_models import BASE, PROMPTS, TRAIN, engine_greedy, trained_checkpoint, trunk
from safetensors.torch import load_file

from agentbox.bench.mtp_head import mtp_twin
from agentbox.config import EngineConfig, Speculative
from agentbox.engine.draft_state import DraftSource
from agentbox.engine.llm import LLM
from agentbox.engine.reports import engine_stats
from agentbox.engine.sampling import SamplingParams
from agentbox.models.loader import load_model

SP = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """The tiny model with its head trained for 300 steps on its own greedy continuations (mtp_models.py)."""
    path = tmp_path_factory.mktemp("qwen3_5_mtp")
    hf, _, (first, last), seconds = trained_checkpoint(path)
    assert seconds < 60 and last < 0.25 * first, (seconds, first, last)
    return path, hf


def _engine(path: Path, spec: Speculative, **kw: object) -> LLM:
    config = EngineConfig(model=str(path), page_size=4, num_pages=400, attention="torch", speculative=spec,
                          spec_row_cost=0.0, host_cache_gb=0.0, **kw)  # type: ignore[arg-type]
    return LLM(config, loaded=load_model(str(path), torch.float32, "cpu", with_mtp=spec.uses_mtp))


def test_the_head_drafts_what_its_twin_predicts(checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    path, hf = checkpoint
    text = hf.config.get_text_config()
    w = load_file(str(path / "mtp.safetensors"))
    embed = hf.model.language_model.embed_tokens.weight.float()
    prompt = TRAIN[0]
    offers: list[tuple[int, list[int]]] = []
    with _engine(path, Speculative.MTP, spec_mtp_tokens=2) as llm:
        real = llm.core.drafter.offer
        monkeypatch.setattr(llm.core.drafter, "offer", lambda req, tokens, after: (offers.append((after, tokens)),
                                                                                 real(req, tokens, after)))
        out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0].token_ids
    seq = prompt + out
    assert seq == engine_greedy(path, [prompt], 16)[0]
    hidden, head = trunk(hf, [seq])
    n = len(seq)
    for after, (first, second) in offers:
        if after >= n:
            continue
        # rows (hidden_p, token_{p+1}) for p < after - 1, then the head's own output with its first draft
        rows = torch.arange(after - 1)
        twin = mtp_twin(w, text, embed, hidden[0, rows], torch.tensor(seq[1:after]), rows)
        assert int((twin[-1] @ head.T).argmax()) == first
        g = mtp_twin(w, text, embed, torch.cat([hidden[0, rows], twin[-1:]]), torch.tensor(seq[1:after] + [first]),
                     torch.arange(after))
        assert int((g[-1] @ head.T).argmax()) == second
    assert len(offers) >= 5  # 16 tokens in fewer steps: drafts were kept


def _two_turns(path: Path, spec: Speculative) -> tuple[list[list[int]], int, dict]:
    """Both turns' outputs of two sessions, the second turn's cached prompt tokens, and the drafters' stats."""
    outs: list[list[int]] = []
    prompts, sessions = list(PROMPTS), ["a", "b"]
    with _engine(path, spec) as llm:
        for _ in range(2):
            got = llm.generate(prompts, SP, session_ids=sessions)
            outs += [o.token_ids for o in got]
            cached = sum(o.num_cached_tokens for o in got)
            prompts = [p + o + BASE[:6] for p, o in zip(prompts, outs[-2:], strict=True)]
        llm.core.check_integrity()
        spec_stats = engine_stats(llm.core).speculative
    return outs, cached, {"mode": spec_stats.mode, **spec_stats.drafters}


def test_the_head_runs_on_the_steps_cores(checkpoint, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:  # noqa: ANN001
    """The head's layer and LM head after each step take the step's cores (every core while they are spare),
    not the engine's own count (all but one): on two cores they ran on one."""
    import os

    from agentbox.engine.exec.cpu_threads import Spare

    path, _ = checkpoint
    with _engine(path, Speculative.MTP, spec_mtp_tokens=2) as llm:
        runner = llm.core.runner
        runner.spare = Spare(tmp_path / "missing")  # no /proc/stat: every core counts as spare
        seen: list[int] = []
        real = runner.mtp.execute
        monkeypatch.setattr(runner.mtp, "execute", lambda plan, hidden: (seen.append(torch.get_num_threads()),
                                                                        real(plan, hidden))[1])
        llm.generate([TRAIN[0]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        cores = os.cpu_count() or 1
        assert seen and set(seen) == {max(cores, torch.get_num_threads())}, (seen, cores)


def test_greedy_is_the_same_with_mtp_suffix_both_and_off(checkpoint) -> None:  # noqa: ANN001
    path, _ = checkpoint
    plain, cached_plain, off = _two_turns(path, Speculative.OFF)
    assert off == {"mode": "off"} and cached_plain > 0  # second turns resumed from their snapshots
    for spec in (Speculative.MTP, Speculative.SUFFIX, Speculative.AUTO):
        outs, cached, stats = _two_turns(path, spec)
        assert outs == plain, spec
        assert cached == cached_plain, spec
        if spec.uses_mtp:
            mtp = stats["mtp"]
            assert mtp.steps > 0 and 0 < mtp.accepted_tokens < mtp.drafted_tokens, (spec, stats)
            assert mtp.accepted_per_step == round(mtp.accepted_tokens / mtp.steps, 4)
        assert stats["mode"] == {Speculative.MTP: "mtp", Speculative.SUFFIX: "suffix",
                                 Speculative.AUTO: "suffix+mtp"}[spec]
        assert ("suffix" in stats) == (spec is not Speculative.MTP)


def test_a_moe_head_loads_and_drafts_exactly(tmp_path: Path) -> None:
    """Qwen3.5-MoE: the head's layer has routed experts and a shared expert (untrained: its drafts are refused)."""
    from mtp_models import save_with_mtp

    save_with_mtp(tmp_path, family="qwen3_5_moe")
    outs = {}
    for spec in (Speculative.OFF, Speculative.MTP):
        with _engine(tmp_path, spec) as llm:
            outs[spec] = [o.token_ids for o in llm.generate(PROMPTS, SP, session_ids=["a", "b"])]
            if spec is Speculative.MTP:
                assert llm.core.runner.mtp is not None and llm.core.drafter.by_source[DraftSource.MTP][1] > 0
                head, own = llm.loaded.model.mtp.layers[0].mlp, llm.loaded.model.language_model.layers[3].mlp
                for name, p in head.state_dict().items():  # the same tensors, loaded under mtp.layers.0.
                    assert torch.equal(p, own.state_dict()[name]), name
    assert outs[Speculative.MTP] == outs[Speculative.OFF]


@pytest.mark.slow
def test_tp2_with_mtp_drafts_equals_tp1_plain(checkpoint) -> None:  # noqa: ANN001
    """At tp 2 the head's layers are split like the model's; every rank runs the step's MtpStep and drafts the
    same chain (the logits are gathered on every rank)."""
    path, _ = checkpoint
    plain, _, _ = _two_turns(path, Speculative.OFF)
    outs: list[list[int]] = []
    prompts = list(PROMPTS)
    config = EngineConfig(model=str(path), page_size=4, num_pages=400, attention="torch", speculative=Speculative.MTP,
                          spec_row_cost=0.0, host_cache_gb=0.0, tensor_parallel_size=2, cpu_threads=1)
    with LLM(config) as llm:
        for _ in range(2):
            got = llm.generate(prompts, SP, session_ids=["a", "b"])
            outs += [o.token_ids for o in got]
            prompts = [p + o + BASE[:6] for p, o in zip(prompts, outs[-2:], strict=True)]
        mtp = llm.core.drafter.by_source[DraftSource.MTP]
    assert outs == plain
    assert 0 < mtp[2] < mtp[1]  # drafts kept and refused, across ranks


def test_the_head_is_read_from_unquantised_checkpoints_only() -> None:
    from agentbox.layers.quant import QuantConfig, QuantMethod
    from agentbox.models.mtp import mtp_loadable

    assert mtp_loadable(QuantConfig())
    assert not any(mtp_loadable(QuantConfig(method=m)) for m in QuantMethod if m is not QuantMethod.UNQUANTIZED)


def test_mtp_needs_a_head(tmp_path: Path) -> None:
    from hybrid_models import configs, save_hybrid

    save_hybrid(configs()["qwen3_5"], tmp_path)
    with pytest.raises(ValueError, match="no multi-token-prediction head"):
        LLM(EngineConfig(model=str(tmp_path), attention="torch", speculative=Speculative.MTP, num_pages=64))
    # auto on a checkpoint without a head drafts from the text alone
    with LLM(EngineConfig(model=str(tmp_path), attention="torch", num_pages=64, host_cache_gb=0.0)) as llm:
        assert llm.core.runner.mtp is None and llm.core.drafter.describe() == "suffix"


def test_stats_json_and_top_show_accepted_tokens_per_step_per_drafter(checkpoint) -> None:  # noqa: ANN001
    from agentbox.engine.stats import to_json
    from agentbox.tui import panels

    path, _ = checkpoint
    with _engine(path, Speculative.AUTO) as llm:
        llm.generate(PROMPTS[:1], SP)
        stats = to_json(engine_stats(llm.core))
    drafters = stats["speculative"]["drafters"]
    assert set(drafters) == {"suffix", "mtp"} and drafters["mtp"]["steps"] > 0
    snap = {"stats": stats, "local": None}
    text = "\n".join(t.plain for t in panels.machine_panel(snap).renderables)  # type: ignore[union-attr]
    mtp = drafters["mtp"]
    assert f"drafts mtp {mtp['accepted_per_step']:.2f} accepted/step ({mtp['steps']} steps)" in text
    assert panels.drafters_line({"speculative": {"drafters": {"suffix": {"steps": 0}}}}) is None
