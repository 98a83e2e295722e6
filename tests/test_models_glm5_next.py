"""GLM-5.3-Flash (models/glm5_next.py) against transformers: a tiny random checkpoint in the released image-text
layout (tests/glm5_next_models.py) loaded like a download. Prompts of 45 to 101 tokens, past index_topk (8 tokens,
2 pools of 4) x index_kpool, so the indexer drops keys. fp32 logits equal transformers' causal computation (fed
token by token through its cache, as generate() continues) for a prefill, for chunked prefills that end anywhere
(inside pools, on and off pages) and for a decode, alone and beside another sequence; the engine's greedy tokens
equal transformers' and a session's later turns resume from their KDA snapshots with the same answers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from glm5_next_models import (
    INDEXED,
    KDA,
    TEXT,
    save_glm5_next,
    tiny_config,
)
from hf_reference import chunked_steps, hf_causal_greedy, hf_causal_logits, hf_full_logits, session_turns
from model_harness import PagedRunner

from agentbox.config import EngineConfig
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams
from agentbox.models.glm5_next import Glm5NextForConditionalGeneration
from agentbox.models.loader import LoadedModel, load_model

PROMPT = [(7 * i + 3) % 251 + 1 for i in range(61)]
OTHER = [(11 * i + 5) % 253 + 2 for i in range(45)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module, LoadedModel]:
    path = tmp_path_factory.mktemp("glm5-next")
    hf = save_glm5_next(path)
    return path, hf, load_model(str(path), torch.float32, "cpu")


@pytest.fixture(scope="module")
def ref(tiny: tuple[Path, torch.nn.Module, LoadedModel]) -> torch.Tensor:
    return hf_causal_logits(tiny[1], PROMPT)


def test_the_release_layout_loads(tiny: tuple[Path, torch.nn.Module, LoadedModel]) -> None:
    _, _, loaded = tiny
    assert isinstance(loaded.model, Glm5NextForConditionalGeneration)
    layout = loaded.model.cache_layout()
    # 3 indexed layers' latents + 2 indexers' entries (layer 2 shares layer 1's top-k); 2 KDA states
    assert [s.head_dim for s in layout.kv_specs] == [32, 32, 32, 32, 32]
    assert layout.state is not None and len(layout.state.specs) == 2


def test_the_indexer_drops_keys(tiny: tuple[Path, torch.nn.Module, LoadedModel], ref: torch.Tensor) -> None:
    """The same weights with a top-k that keeps every pool give other logits: the prompt is long enough that
    the sparse selection matters (a test of it that can fail)."""
    _, hf, _ = tiny
    dense = transformers.Glm5NextForConditionalGeneration(tiny_config(index_topk=256)).float().eval()
    dense.load_state_dict(hf.state_dict())
    assert (hf_causal_logits(dense, PROMPT) - ref)[20:].abs().max() > 1e-2


def test_prefill_chunks_and_decode_match_transformers(tiny: tuple[Path, torch.nn.Module, LoadedModel],
                                                      ref: torch.Tensor) -> None:
    _, hf, loaded = tiny
    assert (ref - hf_causal_logits(hf, PROMPT[:30])[-1]).abs().max() > 0.1  # the positions differ
    # on this checkpoint (no exact score ties) transformers' full forward agrees with its causal decode
    torch.testing.assert_close(hf_full_logits(hf, PROMPT), ref, atol=2e-5, rtol=2e-5)
    prefill = PagedRunner(loaded, page_size=8).step({0: PROMPT})[0]
    torch.testing.assert_close(prefill, ref, atol=2e-5, rtol=2e-5)
    for chunks in ([5, 8, 3, 13, 31, 1], [33, 28], [1] * 20 + [41]):
        got = chunked_steps(PagedRunner(loaded, page_size=8), 0, PROMPT, chunks)
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5, msg=lambda m, c=chunks: f"chunks {c}: {m}")
    decode = chunked_steps(PagedRunner(loaded, page_size=16), 0, PROMPT, [10] + [1] * 51)
    torch.testing.assert_close(decode, ref, atol=2e-5, rtol=2e-5)
    # transformers fed in chunks of 7 through its cache agrees too
    torch.testing.assert_close(hf_causal_logits(hf, PROMPT, chunk=7), ref, atol=2e-5, rtol=2e-5)


def test_sequences_stepped_together_equal_each_alone(tiny: tuple[Path, torch.nn.Module, LoadedModel],
                                                     ref: torch.Tensor) -> None:
    _, hf, loaded = tiny
    runner = PagedRunner(loaded, page_size=8)
    a, b = [], []
    for n, m in ((9, 30), (40, 1), (1, 14), (11, 0)):
        start_a, start_b = sum(x.shape[0] for x in a), sum(x.shape[0] for x in b)
        chunks = {0: PROMPT[start_a : start_a + n]} | ({1: OTHER[start_b : start_b + m]} if m else {})
        got = runner.step(chunks)
        a.append(got[0])
        if m:
            b.append(got[1])
    torch.testing.assert_close(torch.cat(a), ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(torch.cat(b), hf_causal_logits(hf, OTHER), atol=2e-5, rtol=2e-5)


def test_tied_scores_pick_the_same_pools_however_the_prompt_is_chunked(tmp_path: Path) -> None:
    """transformers' own initialisation (pooling logits all equal) and two indexer heads: the ReLU'd pool scores
    tie exactly. The same prompt prefilled whole and decoded token by token gives the same logits (ties go to the
    earlier pool; with topk, which breaks them by the row's width, our prefill and decode differed by 0.24 here,
    as transformers' own full forward and decode do: neither of its paths is the reference on ties)."""
    text = dict(vocab_size=128, num_hidden_layers=6, index_n_heads=2, n_group=1, swiglu_limit=10.0,
                layer_types=[KDA, INDEXED, INDEXED, KDA, KDA, INDEXED],
                indexer_types=["full", "full", "shared", "full", "full", "full"],
                mlp_layer_types=["dense"] + ["sparse"] * 5)
    vision = dict(depth=1, hidden_size=32, num_heads=2, out_hidden_size=64, intermediate_size=32,
                  projection_intermediate_size=32, patch_size=14, image_size=28)
    config = transformers.Glm5NextConfig(text_config={**TEXT, **text}, vision_config=vision,
                                         architectures=["Glm5NextForConditionalGeneration"])
    torch.manual_seed(0)
    hf = transformers.Glm5NextForConditionalGeneration(config).float().eval()
    hf.save_pretrained(tmp_path)
    torch.manual_seed(1)
    prompt = torch.randint(1, 128, (40,)).tolist()
    full, causal = hf_full_logits(hf, prompt), hf_causal_logits(hf, prompt)
    assert (full - causal)[21:].abs().max() > 0.1  # transformers' two paths break the ties differently
    loaded = load_model(str(tmp_path), torch.float32, "cpu")
    whole = PagedRunner(loaded, page_size=8).step({0: prompt})[0]
    decoded = chunked_steps(PagedRunner(loaded, page_size=8), 0, prompt, [1] * 40)
    torch.testing.assert_close(decoded, whole, atol=2e-5, rtol=2e-5)


def test_engine_greedy_and_session_turns(tiny: tuple[Path, torch.nn.Module, LoadedModel]) -> None:
    path, hf, loaded = tiny
    config = EngineConfig(model=str(path), page_size=8, attention="torch", num_pages=300, max_num_seqs=4,
                          max_num_batched_tokens=40, host_cache_gb=0.0, disk_cache_gb=0.0, cpu_threads=1,
                          speculative="off")
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    history = {f"s{k}": [(k * 7 + i * 5 + 1) % 250 + 1 for i in range(37 + 11 * k)] for k in range(3)}
    with LLM(config, loaded=loaded) as llm:
        for prompt, answer in session_turns(llm, history, sp, first_id=1):  # later turns from their KDA snapshots
            assert answer == hf_causal_greedy(hf, prompt, 6), len(prompt)
        stats = llm.core.cache.snapshot_stats()
    assert stats is not None and stats.hits >= 6


def test_drafts_verified_through_kda_equal_plain_greedy(tiny: tuple[Path, torch.nn.Module, LoadedModel]) -> None:
    """Suffix drafts on repetitive prompts: a verify reads the KDA slot, stashes each position's inputs, and the
    commit keeps only the accepted ones (KDAStateSpec.commit replays the per-channel decay). Tokens equal the
    engine's without drafts. (Not transformers' here: on text this periodic the pools' scores come within float
    rounding of each other, and transformers' full forward, its decode and ours each pick differently.)"""
    path, _, loaded = tiny
    base = [(7 * i + 3) % 250 + 1 for i in range(12)]
    prompts = [base * 4, base[:5] * 7]
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    got, counts = {}, {}
    for spec in ("off", "suffix"):
        config = EngineConfig(model=str(path), page_size=8, attention="torch", num_pages=300, max_num_seqs=4,
                              max_num_batched_tokens=64, host_cache_gb=0.0, disk_cache_gb=0.0, cpu_threads=1,
                              speculative=spec, spec_row_cost=0.0,
                              # the fp32 pool: on it these prompts' greedy text repeats, so suffix drafts run (over
                              # the default fp16 pool this tiny model's text parts from it and nothing is drafted)
                              kv_dtype="float32")
        with LLM(config, loaded=loaded) as llm:
            got[spec] = [o.token_ids for o in llm.generate(prompts, sp)]
            counts[spec] = (llm.core.counters.drafted_tokens, llm.core.counters.accepted_tokens)
    drafted, accepted = counts["suffix"]
    assert drafted > accepted >= 0  # drafts ran, and some were rejected: the partial commit ran
    assert got["suffix"] == got["off"]


def test_earliest_top_k_is_a_stable_sorts_first_k() -> None:
    """The indexers' selection (layers/kpool_indexer.earliest_top_k) against the stable descending sort it replaced:
    rows full of exact ties (scores on a coarse grid, -inf where a pool is incomplete), every k up to the width."""
    from agentbox.layers.kpool_indexer import earliest_top_k

    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 4, (3, 17, 40), generator=g).float()
    scores[torch.rand(scores.shape, generator=g) < 0.2] = float("-inf")
    for k in range(scores.shape[-1] + 1):
        want = torch.zeros_like(scores, dtype=torch.bool)
        want.scatter_(-1, scores.sort(dim=-1, descending=True, stable=True).indices[..., :k], True)
        assert torch.equal(earliest_top_k(scores, k), want), k
