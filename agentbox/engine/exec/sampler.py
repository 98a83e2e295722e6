"""Turns one logits row per sampling request into a token: penalties, temperature, top-k/top-p/min-p,
then a draw from the request's own generator when it has a seed (so a seeded output does not depend on
what else is in the batch), plus logprobs of the raw distribution when asked."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from agentbox.engine.exec.logprob import TokenLogprob

if TYPE_CHECKING:  # the core's types, for hints only: exec must not import the core at run time
    from agentbox.engine.request import Request


def _apply_penalties(logits: torch.Tensor, reqs: list[Request]) -> None:
    vocab = logits.shape[-1]
    for i, r in enumerate(reqs):
        s = r.sampling
        if s.repetition_penalty != 1.0:
            # HF semantics: over prompt and output; shrink positive logits, grow negative ones.
            seen = torch.tensor(sorted({t for t in r.all_token_ids if t < vocab}), dtype=torch.long, device=logits.device)
            if seen.numel():
                vals = logits[i, seen]
                logits[i, seen] = torch.where(vals > 0, vals / s.repetition_penalty, vals * s.repetition_penalty)
        if (s.presence_penalty or s.frequency_penalty) and r.num_output_tokens:
            # OpenAI semantics: over generated tokens only.
            out = torch.tensor(r.output_token_ids, dtype=torch.long, device=logits.device)
            counts = torch.zeros(vocab, dtype=logits.dtype, device=logits.device).scatter_add_(
                0, out.clamp(max=vocab - 1), torch.ones_like(out, dtype=logits.dtype)
            )
            logits[i] -= s.frequency_penalty * counts + s.presence_penalty * (counts > 0).to(logits.dtype)


def filter_logits(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks, vectorised over the batch."""
    dev = logits.device
    temps = torch.tensor([max(r.sampling.temperature, 1e-5) for r in reqs], device=dev).unsqueeze(1)
    logits = logits / temps
    top_k = [r.sampling.top_k for r in reqs]
    top_p = [r.sampling.top_p for r in reqs]
    min_p = [r.sampling.min_p for r in reqs]
    vocab = logits.shape[-1]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        ks = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_k], device=dev).unsqueeze(1)
        ranks = torch.arange(vocab, device=dev).unsqueeze(0)
        drop = ranks >= ks
        probs = sorted_logits.softmax(dim=-1)
        # Keep the smallest set whose mass reaches top_p: drop a token when the mass before it already does.
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= mass_before >= torch.tensor(top_p, device=dev).unsqueeze(1)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, idx, sorted_logits)
    if any(p > 0 for p in min_p):
        probs = logits.softmax(dim=-1)
        thresh = torch.tensor(min_p, device=dev).unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < thresh, float("-inf"))
    return logits


def _apply_grammar(logits: torch.Tensor, reqs: list[Request], rows: list[int]) -> None:
    """Mask every token the request's grammar does not allow next (xgrammar bitmask, in place); a state
    that is closing leaves exactly one token, the next of its shortest completion."""
    from agentbox.engine.exec.bitmask import allocate_bitmask, apply_bitmask

    bitmask = allocate_bitmask(len(reqs), logits.shape[-1])
    for i in rows:
        reqs[i].grammar_state.fill_bitmask(bitmask, i)  # type: ignore[union-attr]
    apply_bitmask(logits, bitmask, indices=rows)
    for i in rows:
        forced = reqs[i].grammar_state.forced_token()  # type: ignore[union-attr]
        if forced is not None:
            logits[i] = float("-inf")
            logits[i, forced] = 0.0


def _plain_greedy(r: Request) -> bool:
    s = r.sampling
    return (
        s.greedy and r.grammar_state is None and s.logprobs is None and s.repetition_penalty == 1.0
        and not s.presence_penalty and not s.frequency_penalty
    )


def sample_isolated(
    logits: torch.Tensor, reqs: list[Request]
) -> tuple[list[int], list[TokenLogprob | None], dict[int, str]]:
    """`sample`, with a failure kept to the request that caused it: when the batched draw raises (a seed
    torch cannot take, a penalty that turns a row into inf or nan), each row is drawn alone and the rows that
    still fail come back in the third item (row -> why); the other requests of the batch carry on."""
    try:
        tokens, lps = sample(logits, reqs)
        return tokens, lps, {}
    except Exception:  # noqa: BLE001 - retried row by row below, where the cause is found
        pass
    tokens, lps, failed = [0] * len(reqs), [None] * len(reqs), {}
    for i, r in enumerate(reqs):
        try:
            (tokens[i],), (lps[i],) = sample(logits[i : i + 1], [r])
        except Exception as e:  # noqa: BLE001 - one request's failure is that request's error
            failed[i] = f"{type(e).__name__}: {e}"
    return tokens, lps, failed


def greedy_ids(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (the first index of its maximum, as argmax). `max(dim).indices`, not `argmax`: torch's CPU
    argmax took 88 us a row of SmolLM2's 49,152 logits against 35 us (a speculative verify argmaxes every row of
    its draft); the plain sampler and the verify both use this, so their choices are the same on every device.
    fp32 rows on a CPU with the C kernels take kernels/cpu_decode.c's argmax, the same index (170 us a row of a
    151,936-token vocabulary in torch, ~20 there)."""
    from agentbox.kernels import cpu_gemv

    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 and cpu_gemv.available():
        ids = cpu_gemv.argmax_rows(logits)
        if ids is not None:  # else a NaN: torch's max propagates it
            return ids
    return logits.max(dim=-1).indices.tolist()


def sample(logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits: float32 [B, V], one row per request in `reqs`. Returns token ids and logprobs entries."""
    if all(_plain_greedy(r) for r in reqs):
        # The common agent case (greedy, no grammar, penalties or logprobs): one argmax on the device and one
        # host sync for the ids, no copy of the [B, vocab] logits (19 MB at batch 32 of a 152k vocabulary).
        return greedy_ids(logits), [None] * len(reqs)
    raw = logits
    logits = logits.clone()
    constrained = [i for i, r in enumerate(reqs) if r.grammar_state is not None]
    if constrained:
        _apply_grammar(logits, reqs, constrained)
    if any(
        r.sampling.repetition_penalty != 1.0 or r.sampling.presence_penalty or r.sampling.frequency_penalty
        for r in reqs
    ):
        _apply_penalties(logits, reqs)
    greedy_rows = [i for i, r in enumerate(reqs) if r.sampling.greedy]
    tokens = [0] * len(reqs)
    if greedy_rows:
        best = greedy_ids(logits[greedy_rows])
        for i, t in zip(greedy_rows, best, strict=True):
            tokens[i] = t
    random_rows = [i for i, r in enumerate(reqs) if not r.sampling.greedy]
    if random_rows:
        sub = [reqs[i] for i in random_rows]
        probs = filter_logits(logits[random_rows], sub).softmax(dim=-1).cpu()
        for j, i in enumerate(random_rows):
            tokens[i] = int(torch.multinomial(probs[j], 1, generator=reqs[i].generator()).item())
    lps: list[TokenLogprob | None] = [None] * len(reqs)
    want = [i for i, r in enumerate(reqs) if r.sampling.logprobs is not None]
    if want:
        logp = raw[want].float().log_softmax(dim=-1)
        for j, i in enumerate(want):
            n = reqs[i].sampling.logprobs or 0
            top: list[tuple[int, float]] = []
            if n:
                v, ix = logp[j].topk(n)
                top = list(zip(ix.tolist(), v.tolist(), strict=True))
            lps[i] = TokenLogprob(tokens[i], float(logp[j, tokens[i]]), top)
    return tokens, lps
