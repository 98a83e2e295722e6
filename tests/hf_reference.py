"""What the per-model parity tests share: transformers' causal computation fed through its cache (the reference
for models whose full forward and decode may break score ties differently), the paged runner stepped in chunks,
and an engine's interleaved session turns."""

from __future__ import annotations

import torch
from model_harness import PagedRunner
from transformers import DynamicCache

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
    page, asked = llm.core.config.page_size, []
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
