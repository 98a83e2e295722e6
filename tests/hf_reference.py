"""What the per-model parity tests share: transformers' causal computation fed through its cache (the reference
for models whose full forward and decode may break score ties differently), the paged runner stepped in chunks,
and an engine's interleaved session turns, and the tensor-parallel greedy and session check."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from model_harness import PagedRunner
from transformers import DynamicCache

from agentbox.config import EngineConfig
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams


def hf_causal_logits(hf: torch.nn.Module, tokens: list[int], chunk: int = 1) -> torch.Tensor:
    """[len(tokens), vocab] fp32 from transformers fed `chunk` tokens at a time through its cache (1: the decode
    path generate() takes after its first token)."""
    cache, out = DynamicCache(config=hf.config), []
    with torch.no_grad():
        for lo in range(0, len(tokens), chunk):
            ids = torch.tensor([tokens[lo : lo + chunk]])
            out.append(hf(ids, cache=cache, use_cache=True).logits[0].float())
    return torch.cat(out)


def hf_full_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def hf_causal_greedy(hf: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens on the causal computation: the prompt token by token, then each new token."""
    cache, out = DynamicCache(config=hf.config), []
    with torch.no_grad():
        logits = None
        for t in prompt:
            logits = hf(torch.tensor([[t]]), cache=cache, use_cache=True).logits[0, -1]
        for _ in range(n):
            assert logits is not None
            nxt = int(logits.argmax())
            out.append(nxt)
            logits = hf(torch.tensor([[nxt]]), cache=cache, use_cache=True).logits[0, -1]
    return out


def chunked_steps(runner: PagedRunner, seq: int, tokens: list[int], chunks: list[int]) -> torch.Tensor:
    """The logits of `tokens` stepped through `runner` in chunks of the given sizes, concatenated."""
    out, pos = [], 0
    for n in chunks:
        out.append(runner.step({seq: tokens[pos : pos + n]})[seq])
        pos += n
    return torch.cat(out)


def session_turns(llm: LLM, history: dict[str, list[int]], sp: SamplingParams, first_id: int,
                  turns: int = 3) -> list[tuple[list[int], list[int]]]:
    """The sessions' turns, interleaved: each later turn re-sends its history, its answer and 2 + turn new ids
    (from `first_id` up, under 250 + first_id) and must resume from what the last turn left (at most a page and
    the new ids recomputed). Every (prompt, answer), in order; the cache is checked after each turn."""
    page, asked = llm.core.runner.page_size, []
    for turn in range(turns):
        sids = list(history)
        outs = llm.generate(list(history.values()), sp, session_ids=sids)
        for sid, out in zip(sids, outs, strict=True):
            prompt = history[sid]
            asked.append((list(prompt), out.token_ids))
            if turn:
                assert out.num_cached_tokens >= len(prompt) - page - (3 + turn), (sid, turn, out.num_cached_tokens)
            new = [(turn * 3 + len(prompt) + j) % 250 + first_id for j in range(2 + turn)]
            history[sid] = prompt + out.token_ids + new
        llm.core.check_integrity()
    return asked


def tp2_greedy_and_turns(path: Path, prompts: list[list[int]], reference: Callable[[list[int], int], list[int]],
                         max_tokens: int, batched: int, first_id: int) -> None:
    """The engine at tensor parallel 2 (two gloo ranks on CPU): the greedy tokens of `prompts`, prefilled in chunks
    of `batched` beside decodes, equal `reference`'s; then the last prompt as a session of 3 turns, each later turn
    resumed from what the last one left on both ranks (at most a page and the 3 new ids recomputed)."""
    engine = EngineConfig(model=str(path), device="cpu", dtype="float32", num_pages=256, page_size=8,
                          tensor_parallel_size=2, cpu_threads=1, max_num_batched_tokens=batched, speculative="off",
                          kv_dtype="float32")  # transformers' greedy tokens: not the default fp16 CPU pool
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with LLM(engine) as llm:
        outs = llm.generate(prompts, greedy)
        history, cached, answers = list(prompts[-1]), [], []
        for turn in range(3):
            out = llm.generate([history], greedy, session_ids=["agent"])[0]
            answers.append((list(history), out.token_ids))
            cached.append(out.num_cached_tokens)
            history += out.token_ids + [(turn * 7 + k) % 250 + first_id for k in range(3)]
    assert [o.token_ids for o in outs] == [reference(p, max_tokens) for p in prompts]
    assert all(got == reference(prompt, max_tokens) for prompt, got in answers)
    assert all(c >= len(p) - 8 - 3 for c, (p, _) in zip(cached[1:], answers[1:], strict=True)), cached
