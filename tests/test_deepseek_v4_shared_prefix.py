"""A 1,000-token prompt shared by two DeepSeek-V4 sessions (HCA entries of 128 tokens as the release, pages of 16):
the second session resumes at the first one's prompt snapshot (992 tokens, the prompt's last page boundary: at
least the 896 of its last whole HCA entry), with the answer transformers gives. The second continues the prompt
differently and completes the HCA entry of tokens 896..1023 with its own tokens; the first session's next turn still
reads its own entry (an entry lives in the page of its last token, which only the sequence that computed that whole
page writes: kept in the page of its first token, the shared page 56, the second session would overwrite it)."""

from __future__ import annotations

from pathlib import Path

import torch
from deepseek_v4_models import CSA, HCA, hf_greedy, save_deepseek_v4, tiny_config

from agentbox.config import EngineConfig
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams

PROMPT = [(13 * i + 7) % 250 + 1 for i in range(1000)]


def test_second_session_reuses_a_shared_prompt(tmp_path: Path) -> None:
    hf = save_deepseek_v4(tmp_path, tiny_config(compress_rates={CSA: 4, HCA: 128}, max_position_embeddings=4096))
    config = EngineConfig(model=str(tmp_path), page_size=16, attention="torch", num_pages=400, max_num_seqs=2,
                          host_cache_gb=0.0, disk_cache_gb=0.0, cpu_threads=1, speculative="off")
    sp = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    with LLM(config) as llm:
        a = llm.generate([PROMPT], sp, session_ids=["a"])[0]
        b_prompt = [*PROMPT, 3, 1, 4]  # the same 1,000 tokens, then the second session's own
        b = llm.generate([b_prompt], sp, session_ids=["b"])[0]
        a2_prompt = [*PROMPT, *a.token_ids, 9, 9, 9]
        a2 = llm.generate([a2_prompt], sp, session_ids=["a"])[0]
        llm.core.check_integrity()
    assert a.num_cached_tokens == 0 and b.num_cached_tokens >= 896, b.num_cached_tokens
    assert a2.num_cached_tokens >= 1024  # its own turn's snapshot, past the entry b completed differently
    assert a.token_ids == hf_greedy(hf, PROMPT, 30)
    assert b.token_ids == hf_greedy(hf, b_prompt, 30)
    assert a2.token_ids == hf_greedy(hf, a2_prompt, 30)
    assert torch.tensor(b.token_ids).ne(torch.tensor(a.token_ids)).any()  # b's tokens past 1,000 are its own
