"""Verifying drafts (speculative decoding, engine/draft.py): a drafted sequence brings logits after its last
real token and after each draft token; the sampler keeps the longest draft prefix the model agrees with, plus
one token of the model's own. Sequences without a draft are sampled as ever (exec/sampler.py).
Under a grammar (greedy only), each row is masked with the grammar's state after the draft tokens before it.

Greedy: draft token j is kept while it is the argmax of the row before it, so the output is token for token
plain greedy decoding's. Sampled: the standard rejection rule (Leviathan et al. 2023; Chen et al. 2023) with a
deterministic draft: keep draft token t with probability p(t) under the request's filtered distribution p,
else draw from p with t removed and renormalised; a draft kept whole earns a draw from the last row. Each
output token is then distributed exactly as plain sampling's (tests/test_spec_decode.py checks it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from agentbox.engine.exec.logprob import TokenLogprob
from agentbox.engine.exec.sampler import filter_logits, greedy_ids, sample_isolated

if TYPE_CHECKING:  # the core's types, for hints only: exec must not import the core at run time
    from agentbox.engine.request import Request


def greedy_prefix(best: list[int], draft: list[int]) -> list[int]:
    """The argmax tokens up to and including the first that differs from the draft (all of them when none)."""
    for j, t in enumerate(draft):
        if best[j] != t:
            return best[: j + 1]
    return best[: len(draft) + 1]


def grammar_prefix(logits: torch.Tensor, req: Request, draft: list[int]) -> list[int]:
    """Greedy under a grammar: row j masked by the grammar after draft[:j]; the matcher looks ahead through
    the accepted draft tokens and is rolled back (the core accepts the kept tokens as ever)."""
    from agentbox.engine.exec.bitmask import allocate_bitmask, apply_bitmask

    gs = req.grammar_state
    assert gs is not None
    bitmask = allocate_bitmask(1, logits.shape[-1])
    out: list[int] = []
    ahead = 0
    try:
        for j in range(len(draft) + 1):
            row = logits[j : j + 1].clone()
            gs.fill_bitmask(bitmask, 0)
            apply_bitmask(row, bitmask)
            out.append(greedy_ids(row)[0])
            if j == len(draft) or out[-1] != draft[j] or not gs.advance(out[-1]):
                break
            ahead += 1
            if gs.is_terminated():  # the draft's token ended the grammar: no row after it has a mask
                break
    finally:
        gs.rollback(ahead)
    return out


def sampled_prefix(logits: torch.Tensor, req: Request, draft: list[int]) -> list[int]:
    """Rejection sampling of a deterministic draft over rows [k + 1, V] of one request."""
    probs = filter_logits(logits, [req] * logits.shape[0]).softmax(dim=-1).cpu()
    g = req.generator()
    out: list[int] = []
    for j, t in enumerate(draft):
        p = probs[j]
        if float(torch.rand(1, generator=g)) < float(p[t]):
            out.append(t)
            continue
        p = p.clone()
        p[t] = 0.0
        out.append(int(torch.multinomial(p / p.sum(), 1, generator=g)))
        return out
    out.append(int(torch.multinomial(probs[len(draft)], 1, generator=g)))
    return out


def sample_verified(
    logits: torch.Tensor, reqs: list[Request], drafts: list[list[int]]
) -> tuple[list[list[int]], list[TokenLogprob | None], dict[int, str]]:
    """logits: float32 [sum(1 + len(draft)), V], each request's rows in order. Returns each request's new
    tokens, its logprobs entry (requests without a draft only) and the requests whose sampling failed."""
    starts, row = [], 0
    for d in drafts:
        starts.append(row)
        row += 1 + len(d)
    plain = [i for i, d in enumerate(drafts) if not d]
    tokens: list[list[int]] = [[] for _ in reqs]
    lps: list[TokenLogprob | None] = [None] * len(reqs)
    failed: dict[int, str] = {}
    if plain:
        idx = torch.tensor([starts[i] for i in plain], device=logits.device)
        toks, plps, pfailed = sample_isolated(logits.index_select(0, idx), [reqs[i] for i in plain])
        for j, i in enumerate(plain):
            tokens[i], lps[i] = [toks[j]], plps[j]
            if j in pfailed:
                failed[i] = pfailed[j]
    drafted = [i for i, d in enumerate(drafts) if d]
    greedy = [i for i in drafted if reqs[i].sampling.greedy and reqs[i].grammar_state is None]
    if greedy:  # one argmax and one host sync for every greedy draft of the step
        if len(greedy) == len(reqs):  # every row is a greedy draft's (one sequence's verify): no gather
            best = greedy_ids(logits)
        else:
            rows = torch.cat([torch.arange(starts[i], starts[i] + 1 + len(drafts[i])) for i in greedy])
            best = greedy_ids(logits.index_select(0, rows.to(logits.device)))
        at = 0
        for i in greedy:
            n = 1 + len(drafts[i])
            tokens[i], at = greedy_prefix(best[at : at + n], drafts[i]), at + n
    for i in drafted:
        if i in greedy:
            continue
        rows = logits[starts[i] : starts[i] + 1 + len(drafts[i])]
        try:
            if reqs[i].grammar_state is not None:
                tokens[i] = grammar_prefix(rows, reqs[i], drafts[i])
            else:
                tokens[i] = sampled_prefix(rows, reqs[i], drafts[i])
        except Exception as e:  # noqa: BLE001 - one request's failure is that request's error
            failed[i] = f"{type(e).__name__}: {e}"
    return tokens, lps, failed
