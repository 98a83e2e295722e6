"""Qwen3.8-Flash-Next (models/qwen4_exp.py) against transformers: a tiny random checkpoint in the released
image-text layout (tests/qwen4_exp_models.py) loaded like a download. Prompts of 29 to 40 tokens, past the QSA
budget (8 tokens, 2 blocks of 4), so the indexer drops blocks; an end-of-text token inside the prompt, so the
n-gram context resets. fp32 logits equal transformers' causal computation (fed token by token through its cache, as
generate() continues) for a prefill, for chunked prefills that end anywhere (inside blocks, on and off pages,
inside the n-gram context and the PLE conv's reach) and for a decode, alone and beside another sequence; the
engine's greedy tokens equal transformers' and a session's later turns resume from their snapshots (delta-net
state, the PLE rings) with the answers of a cold run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from hf_reference import chunked_steps, hf_causal_greedy, hf_causal_logits, hf_full_logits, session_turns
from model_harness import PagedRunner
from qwen4_exp_models import (
    EOS,
    randomize,
    save_qwen4_exp,
    text_only_config,
    tiny_config,
)

from agentbox.config import EngineConfig
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams
from agentbox.layers.host_table import HostTable
from agentbox.models.loader import LoadedModel, load_model
from agentbox.models.qwen4_exp import Qwen4ExpForConditionalGeneration

PROMPT = [(7 * i + 3) % 251 + 3 for i in range(40)]
PROMPT[17] = EOS
OTHER = [(11 * i + 5) % 250 + 3 for i in range(29)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module, LoadedModel]:
    path = tmp_path_factory.mktemp("qwen4-exp")
    hf = save_qwen4_exp(path)
    return path, hf, load_model(str(path), torch.float32, "cpu")


@pytest.fixture(scope="module")
def ref(tiny: tuple[Path, torch.nn.Module, LoadedModel]) -> torch.Tensor:
    return hf_causal_logits(tiny[1], PROMPT)


def test_the_release_layout_loads(tiny: tuple[Path, torch.nn.Module, LoadedModel]) -> None:
    _, hf, loaded = tiny
    model = loaded.model
    assert isinstance(model, Qwen4ExpForConditionalGeneration)
    layout = model.cache_layout()
    # 2 QSA layers' K and V (2 heads of 16), then their indexers' raw keys (1 x 16, tied)
    assert [(s.num_kv_heads, s.head_dim, s.tied) for s in layout.kv_specs] == [(2, 16, False)] * 2 + [(1, 16, True)] * 2
    # layers 0 and 3 have PLE (an id ring and a conv ring each), every delta-net layer its conv and matrix
    assert layout.state is not None and len(layout.state.specs) == 3 + 1 + 3
    # the n-gram tables are mapped from the file, not parameters; their rows equal transformers' tables
    tables = model.host_tables()
    assert len(tables) == 2 and all(isinstance(t, HostTable) for t in tables)
    assert not any("ngram" in n for n, _ in model.named_parameters())
    text = hf.model.language_model
    for table, i in zip(tables, (0, 3), strict=True):
        weight = text.layers[i].ple.ple_embedding.ngram_embedding.weight
        rows = torch.tensor([0, 1, 1365, 1366, weight.shape[0] - 1])  # across the 3 shards' seams
        assert torch.equal(table.gather(rows, "cpu", torch.float32), weight[rows])


def test_the_indexer_drops_blocks(tiny: tuple[Path, torch.nn.Module, LoadedModel], ref: torch.Tensor) -> None:
    """The same weights with a budget that keeps every block give other logits: the prompt is long enough that
    the sparse selection matters (a test of it that can fail)."""
    _, hf, _ = tiny
    dense = transformers.Qwen4ExpForConditionalGeneration(tiny_config(indexer_budget=256)).float().eval()
    dense.load_state_dict(hf.state_dict())
    assert (hf_full_logits(dense, PROMPT) - ref)[12:].abs().max() > 1e-2


def test_prefill_chunks_and_decode_match_transformers(tiny: tuple[Path, torch.nn.Module, LoadedModel],
                                                      ref: torch.Tensor) -> None:
    _, hf, loaded = tiny
    # on this checkpoint (no exact score ties) transformers' full forward agrees with its causal decode
    torch.testing.assert_close(hf_full_logits(hf, PROMPT), ref, atol=2e-5, rtol=2e-5)
    prefill = PagedRunner(loaded, page_size=8).step({0: PROMPT})[0]
    torch.testing.assert_close(prefill, ref, atol=2e-5, rtol=2e-5)
    for chunks in ([5, 8, 3, 1, 13, 10], [18, 22], [1] * 11 + [29]):
        got = chunked_steps(PagedRunner(loaded, page_size=8), 0, PROMPT, chunks)
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5, msg=lambda m, c=chunks: f"chunks {c}: {m}")
    decode = chunked_steps(PagedRunner(loaded, page_size=16), 0, PROMPT, [10] + [1] * 30)
    torch.testing.assert_close(decode, ref, atol=2e-5, rtol=2e-5)


def test_sequences_stepped_together_equal_each_alone(tiny: tuple[Path, torch.nn.Module, LoadedModel],
                                                     ref: torch.Tensor) -> None:
    _, hf, loaded = tiny
    runner = PagedRunner(loaded, page_size=8)
    a, b = [], []
    for n, m in ((9, 20), (20, 1), (1, 8), (10, 0)):
        start_a, start_b = sum(x.shape[0] for x in a), sum(x.shape[0] for x in b)
        chunks = {0: PROMPT[start_a : start_a + n]} | ({1: OTHER[start_b : start_b + m]} if m else {})
        got = runner.step(chunks)
        a.append(got[0])
        if m:
            b.append(got[1])
    torch.testing.assert_close(torch.cat(a), ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(torch.cat(b), hf_full_logits(hf, OTHER), atol=2e-5, rtol=2e-5)


def test_engine_greedy_and_session_turns(tiny: tuple[Path, torch.nn.Module, LoadedModel]) -> None:
    """Greedy tokens equal transformers'; then 3 sessions of 3 turns, each later turn resumed from its snapshot
    (only the new tokens recomputed) with the tokens of the same prompt run cold on a fresh engine."""
    path, hf, loaded = tiny
    config = EngineConfig(model=str(path), page_size=8, attention="torch", num_pages=300, max_num_seqs=4,
                          max_num_batched_tokens=24, host_cache_gb=0.0, disk_cache_gb=0.0, cpu_threads=1,
                          speculative="off")
    sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    with LLM(config, loaded=loaded) as llm:
        outs = llm.generate([PROMPT, OTHER], sp)
    assert [o.token_ids for o in outs] == [hf_causal_greedy(hf, p, 5) for p in (PROMPT, OTHER)]
    history = {f"s{k}": [(k * 7 + i * 5 + 1) % 250 + 3 for i in range(21 + 6 * k)] for k in range(3)}
    history["s1"][9] = EOS
    with LLM(config, loaded=loaded) as llm:
        asked = session_turns(llm, history, sp, first_id=3)  # later turns from their snapshots
        stats = llm.core.cache.snapshot_stats()
    assert stats is not None and stats.hits >= 6
    with LLM(config, loaded=loaded) as cold:
        assert [o.token_ids for o in cold.generate([p for p, _ in asked], sp)] == [t for _, t in asked]


def test_the_text_only_layout_loads(tmp_path: Path) -> None:
    """`Qwen4ExpForCausalLM`: the same text model under `model.` (no vision tower), n-gram tables included."""
    torch.manual_seed(1)
    hf = randomize(transformers.Qwen4ExpForCausalLM(text_only_config()).float().eval(), seed=1)
    hf.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), torch.float32, "cpu")
    assert len(loaded.model.host_tables()) == 2
    got = chunked_steps(PagedRunner(loaded, page_size=8), 0, OTHER, [17, 1, 11])
    torch.testing.assert_close(got, hf_full_logits(hf, OTHER), atol=2e-5, rtol=2e-5)


def test_drafts_verified_through_the_states_equal_plain_greedy(tiny: tuple[Path, torch.nn.Module, LoadedModel]) -> None:
    """Suffix drafts on repetitive prompts: a verify reads the delta-net slot and the PLE rings, stashes each
    position's inputs, and the commit keeps only the accepted ones (the rings write the kept positions' ids and
    conv inputs). Tokens equal the engine's without drafts."""
    path, _, loaded = tiny
    base = [(7 * i + 3) % 250 + 3 for i in range(12)]
    prompts = [base * 4, base[:5] * 7, base[:5] * 3 + [EOS] + base[:5] * 3]
    sp = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    got, counts = {}, {}
    for spec in ("off", "suffix"):
        config = EngineConfig(model=str(path), page_size=8, attention="torch", num_pages=300, max_num_seqs=4,
                              max_num_batched_tokens=64, host_cache_gb=0.0, disk_cache_gb=0.0, cpu_threads=1,
                              speculative=spec, spec_row_cost=0.0)
        with LLM(config, loaded=loaded) as llm:
            got[spec] = [o.token_ids for o in llm.generate(prompts, sp)]
            counts[spec] = (llm.core.counters.drafted_tokens, llm.core.counters.accepted_tokens)
    drafted, accepted = counts["suffix"]
    assert drafted > accepted >= 0  # drafts ran, and some were rejected: the partial commit ran
    assert got["suffix"] == got["off"]


def test_hash_constants_unlike_the_config_are_refused(tiny: tuple[Path, torch.nn.Module, LoadedModel],
                                                      tmp_path: Path) -> None:
    """The checkpoint's saved multipliers are checked against the config's: another seed is an error at load, not
    a model that reads the wrong rows."""
    path, _, _ = tiny
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["text_config"]["seed"] = 4321
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="layer_multipliers"):
        load_model(str(tmp_path), torch.float32, "cpu")
