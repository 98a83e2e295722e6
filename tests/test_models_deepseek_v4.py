"""DeepSeek-V4 (models/deepseek_v4.py) against transformers: a tiny random checkpoint saved with save_pretrained and
loaded like a download. fp32 logits equal transformers' full forward for a prefill, for the same tokens prefilled
in chunks that end anywhere (inside CSA windows, inside HCA entries, on and off pages) and for a step-by-step
decode, alone and beside other sequences; the engine's greedy tokens equal transformers' and a session's later
turns resume from their snapshots with the same answers. Pages are 8 tokens and an HCA entry 32, so every HCA entry
spans pages (kept in the page of its last token: layers/paged_entries.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from deepseek_v4_gguf import write_release
from deepseek_v4_models import hf_greedy, hf_logits, save_deepseek_v4
from hf_reference import chunked_steps, session_turns
from model_harness import PagedRunner
from safetensors import safe_open

from agentbox.config import EngineConfig
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams
from agentbox.layers import compressor, window_entry_attention
from agentbox.layers.paged_entries import entry_slot_mapping
from agentbox.models.loader import LoadedModel, load_model

PROMPT = [(7 * i + 3) % 251 + 1 for i in range(101)]
OTHER = [(11 * i + 5) % 253 + 2 for i in range(77)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module, LoadedModel]:
    path = tmp_path_factory.mktemp("deepseek-v4")
    hf = save_deepseek_v4(path)
    return path, hf, load_model(str(path), torch.float32, "cpu")


def test_prefill_chunks_and_decode_match_transformers(tiny: tuple[Path, torch.nn.Module, LoadedModel]) -> None:
    _, hf, loaded = tiny
    ref = hf_logits(hf, PROMPT)
    assert (ref - hf_logits(hf, PROMPT[:60])[-1]).abs().max() > 0.1  # the positions differ: a test that can fail
    prefill = PagedRunner(loaded, page_size=8).step({0: PROMPT})[0]
    torch.testing.assert_close(prefill, ref, atol=2e-5, rtol=2e-5)
    for chunks in ([5, 8, 3, 13, 31, 41], [33, 30, 38], [1] * 40 + [61]):
        got = chunked_steps(PagedRunner(loaded, page_size=8), 0, PROMPT, chunks)
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5, msg=lambda m, c=chunks: f"chunks {c}: {m}")
    decode = chunked_steps(PagedRunner(loaded, page_size=16), 0, PROMPT, [20] + [1] * 81)
    torch.testing.assert_close(decode, ref, atol=2e-5, rtol=2e-5)


def test_query_blocks_equal_one_block(tiny: tuple[Path, torch.nn.Module, LoadedModel],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Long chunks run in blocks of queries (the attention's band of raw keys and entries, the indexer's scores):
    blocks of 7 queries and of 500 scores give the same logits."""
    _, hf, loaded = tiny
    monkeypatch.setattr(window_entry_attention, "QUERY_BLOCK", 7)
    monkeypatch.setattr(compressor, "SCORE_BUDGET", 500)
    got = chunked_steps(PagedRunner(loaded, page_size=8), 0, PROMPT, [45, 56])
    torch.testing.assert_close(got, hf_logits(hf, PROMPT), atol=2e-5, rtol=2e-5)


def test_sequences_stepped_together_equal_each_alone(tiny: tuple[Path, torch.nn.Module, LoadedModel]) -> None:
    _, hf, loaded = tiny
    runner = PagedRunner(loaded, page_size=8)
    a, b = [], []
    for n, m in ((9, 30), (40, 1), (1, 46), (51, 0)):
        start_a, start_b = sum(x.shape[0] for x in a), sum(x.shape[0] for x in b)
        chunks = {0: PROMPT[start_a : start_a + n]} | ({1: OTHER[start_b : start_b + m]} if m else {})
        got = runner.step(chunks)
        a.append(got[0])
        if m:
            b.append(got[1])
    torch.testing.assert_close(torch.cat(a), hf_logits(hf, PROMPT), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(torch.cat(b), hf_logits(hf, OTHER), atol=2e-5, rtol=2e-5)


def test_the_release_layout_loads_alike(tiny: tuple[Path, torch.nn.Module, LoadedModel], tmp_path: Path) -> None:
    """DeepSeek's own names (`layers.0.attn.wq_a.weight`, `embed.weight`, `hc_head_fn`, `attn.kv_norm`, config keys
    `compress_ratios` and `num_hash_layers`) load into the same model (checkpoint_renames)."""
    path, hf, _ = tiny
    release = write_release(hf, path, tmp_path / "release", fp4=False)
    assert "layers.0.attn.kv_norm.weight" in safe_open(str(release / "model.safetensors"), "pt").keys()
    got = PagedRunner(load_model(str(release), torch.float32, "cpu"), page_size=8).step({0: PROMPT})[0]
    torch.testing.assert_close(got, hf_logits(hf, PROMPT), atol=2e-5, rtol=2e-5)


def test_an_entry_lives_in_the_page_of_its_last_token() -> None:
    # 32-token entries over 8-token pages (one slot a page): the entry of tokens 0..31 completes at token 31,
    # which is in page id 13 (the sequence's fourth page); a 4-token entry sits in its page's slot by offset
    pages = [10, 11, 12, 13, 14]
    assert entry_slot_mapping(32, 1, 8, [30, 31, 32], pages) == [-1, 13, -1]
    assert entry_slot_mapping(4, 2, 8, [3, 7, 11], pages) == [20, 21, 22]


def test_engine_greedy_and_session_turns(tiny: tuple[Path, torch.nn.Module, LoadedModel]) -> None:
    path, hf, loaded = tiny
    config = EngineConfig(model=str(path), page_size=8, attention="torch", num_pages=300, max_num_seqs=4,
                          max_num_batched_tokens=40, host_cache_gb=0.0, disk_cache_gb=0.0, cpu_threads=1,
                          speculative="off")
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    history = {f"s{k}": [(k * 7 + i * 5 + 1) % 250 + 1 for i in range(57 + 11 * k)] for k in range(3)}
    with LLM(config, loaded=loaded) as llm:
        for prompt, answer in session_turns(llm, history, sp, first_id=1):  # later turns at their last page boundary
            assert answer == hf_greedy(hf, prompt, 6), len(prompt)
        stats = llm.core.cache.snapshot_stats()
    assert stats is not None and stats.hits >= 6


def test_an_fp16_checkpoint_runs_its_fp16_weights_on_the_default_path(tmp_path: Path) -> None:
    """The default CPU path keeps an fp16 checkpoint's linears fp16 (quant/unquantized.py); the grouped output
    projection widens its own for the batched matmul (it raised a dtype error at the first step). Its logits are
    the fp32 model's on the same fp16 values up to summation order."""
    hf = save_deepseek_v4(tmp_path / "fp32")
    hf.half().save_pretrained(tmp_path / "fp16")
    ours = PagedRunner(load_model(str(tmp_path / "fp16"), torch.float32, "cpu"), page_size=8).step({0: PROMPT[:20]})[0]
    ref = hf_logits(hf.float(), PROMPT[:20])  # the same fp16-rounded weights, widened
    assert (ours - ref).abs().max().item() < 1e-3
