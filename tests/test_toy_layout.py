"""A model the engine has never seen, declaring a cache layout of three kinds (issue 42's test of the layout): a
paged group of ordinary KV (one entry a token), a paged group of compressed entries (one per 4 tokens: the mean of
4 tokens' projections, as DeepSeek-V4's compressed attention keeps) and a state group (the partial entry's raw
values, and an exponential moving average resumable only where it was saved). It is defined here and nowhere
else: everything it needs from the engine (the pool's tensors for each group, each group's slots per step, state
slots, snapshots at turn ends, resuming a session on all three) comes from the declared layout alone.

Its reference is the same arithmetic over a whole sequence at once (`reference_logits`), with no cache: the engine
must give the same greedy tokens cold, and the same again on a session's later turns while reporting at least
90 % of each later prompt cached.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from agentbox.config import EngineConfig
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams
from agentbox.layers.attention import Attention
from agentbox.layers.backends.base import KVLayerSpec
from agentbox.layers.cache_layout import CacheLayout, PagedGroup, StateGroup
from agentbox.layers.context import get_forward_context
from agentbox.models.base import AttentionShape, CausalLM
from agentbox.models.loader import LoadedModel, ModelSource

VOCAB, HIDDEN, HEADS, HEAD = 48, 32, 2, 8
ENTRY = 4  # tokens a compressed entry covers
LATENT = 16  # a compressed entry's size
DECAY = 0.75
PS = 8  # the engine's page size in this test


@dataclass(frozen=True)
class Rows:
    """A state spec of one tensor [rows, dim] a slot (the partial entry's values; the running average)."""

    rows: int
    dim: int

    def bytes(self, dtype: torch.dtype) -> int:
        return self.rows * self.dim * torch.empty(0, dtype=dtype).element_size()

    def allocate(self, num_slots: int, dtype: torch.dtype, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        return (torch.zeros(num_slots, self.rows, self.dim, dtype=dtype, device=device),)

    def commit(self, tensors: tuple[torch.Tensor, ...], slot: int, stash: tuple, lo: int, hi: int) -> None:
        raise NotImplementedError("the toy model is not drafted")


class ToyModel(CausalLM):
    def __init__(self) -> None:
        super().__init__(PretrainedConfig(vocab_size=VOCAB))
        g = torch.Generator().manual_seed(7)

        def w(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape, generator=g) / shape[-1] ** 0.5, requires_grad=False)

        self.embed = w(VOCAB, HIDDEN)
        self.qkv = w(3 * HEADS * HEAD, HIDDEN)
        self.o = w(HIDDEN, HEADS * HEAD)
        self.attn = Attention(HEADS, HEADS, HEAD, HEAD**-0.5, layer_id=0)  # the first group's layer
        self.c_proj = w(LATENT, HIDDEN)  # what a token adds to its entry
        self.c_query = w(LATENT, HIDDEN)
        self.c_out = w(HIDDEN, LATENT)
        self.ema_in = w(HIDDEN, HIDDEN)
        self.head = w(VOCAB, HIDDEN)

    def attention_shape(self) -> AttentionShape:
        return AttentionShape(HEADS, HEADS, HEAD)

    def cache_layout(self) -> CacheLayout:
        return CacheLayout(
            (PagedGroup((KVLayerSpec(HEADS, HEAD),)),
             PagedGroup((KVLayerSpec(1, LATENT, tied=True),), tokens_per_entry=ENTRY)),
            StateGroup((Rows(ENTRY - 1, LATENT), Rows(1, HIDDEN))),
        )

    # ---- the engine's path: one step of a batch, through the forward context ----

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        h = self.embed[input_ids]
        q, k, v = (h @ self.qkv.T).split(HEADS * HEAD, dim=-1)
        h = h + self.attn(q, k, v) @ self.o.T
        h = h + self._compressed(ctx, h, positions)
        return h + self._average(ctx, h)

    def _compressed(self, ctx, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        """Each token's query over the complete entries at or before it."""
        entries, state = ctx.entries[ENTRY], ctx.state
        partial = state.cache.layers[0][0]  # [slots, ENTRY - 1, LATENT]
        cache = ctx.backend.kv_cache.k[1]  # the second group's only layer: [entry slots, 1, LATENT]
        c = h @ self.c_proj.T
        done = torch.zeros_like(c)
        lo, out = 0, []
        for i, (slot, n, start) in enumerate(zip(state.slots, state.query_lens, state.starts, strict=True)):
            if state.fresh[i]:
                partial[slot].zero_()
            for j in range(n):  # the partial entry's values carry over from step to step in the state slot
                p = start + j
                if (p + 1) % ENTRY:
                    partial[slot, p % ENTRY] = c[lo + j]
                else:
                    done[lo + j] = (partial[slot].sum(0) + c[lo + j]) / ENTRY
            lo += n
        entries.write(cache, done[:, None, :])
        lo = 0
        for i, n in enumerate(state.query_lens):
            have = entries.gather(cache, i)[:, 0]  # [E, LATENT]: every complete entry, this step's included
            pos = positions[lo : lo + n]
            out.append(self._attend(h[lo : lo + n] @ self.c_query.T, have, pos))
            lo += n
        return torch.cat(out) @ self.c_out.T

    @staticmethod
    def _attend(q: torch.Tensor, entries: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """q [n, L] over entries [E, L], entry e visible at positions >= 4e + 3; a zero logit (a sink) joins."""
        scores = q @ entries.T / LATENT**0.5  # [n, E]
        visible = (torch.arange(entries.shape[0]) * ENTRY + ENTRY - 1)[None, :] <= pos[:, None]
        scores = torch.cat([torch.zeros(q.shape[0], 1), scores.masked_fill(~visible, float("-inf"))], dim=1)
        return F.softmax(scores, dim=-1)[:, 1:] @ entries

    def _average(self, ctx, h: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        """s_p = DECAY s_{p-1} + W h_p: a state that describes one position only."""
        state = ctx.state
        avg = state.cache.layers[1][0]  # [slots, 1, HIDDEN]
        x, lo, out = h @ self.ema_in.T, 0, []
        for i, (slot, n) in enumerate(zip(state.slots, state.query_lens, strict=True)):
            if state.fresh[i]:
                avg[slot].zero_()
            for j in range(n):
                avg[slot, 0] = DECAY * avg[slot, 0] + x[lo + j]
                out.append(avg[slot, 0].clone())
            lo += n
        return torch.stack(out)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.head.T).float()

    # ---- the reference: one whole sequence, no cache ----

    @torch.inference_mode()
    def reference_logits(self, ids: list[int]) -> torch.Tensor:
        t = len(ids)
        pos = torch.arange(t)
        h = self.embed[torch.tensor(ids)]
        q, k, v = (h @ self.qkv.T).split(HEADS * HEAD, dim=-1)
        att = F.scaled_dot_product_attention(q.view(t, HEADS, HEAD).transpose(0, 1), k.view(t, HEADS, HEAD).transpose(0, 1),
                                             v.view(t, HEADS, HEAD).transpose(0, 1), is_causal=True)
        h = h + att.transpose(0, 1).reshape(t, -1) @ self.o.T
        c = h @ self.c_proj.T
        entries = c[: t // ENTRY * ENTRY].view(-1, ENTRY, LATENT).mean(1)
        h = h + self._attend(h @ self.c_query.T, entries, pos) @ self.c_out.T
        x, s, out = h @ self.ema_in.T, torch.zeros(HIDDEN), []
        for p in range(t):
            s = DECAY * s + x[p]
            out.append(s)
        return self.compute_logits(h + torch.stack(out))


def greedy_reference(model: ToyModel, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model.reference_logits(ids)[-1].argmax()))
    return ids[len(prompt) :]


def toy_llm(tmp_path: Path, model: ToyModel) -> LLM:
    loaded = LoadedModel.of(model, model.config, ModelSource("hf", tmp_path, "toy"), torch.float32, [], 4096)
    config = EngineConfig(model=str(tmp_path), page_size=PS, attention="torch", num_pages=160, max_num_seqs=4,
                          max_num_batched_tokens=64, host_cache_gb=0.0, disk_cache_gb=0.0, cpu_threads=1,
                          speculative="off")
    return LLM(config, loaded)


def test_a_new_cache_layout_gets_session_reuse_from_its_declaration_alone(tmp_path: Path) -> None:
    model = ToyModel().eval()
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with toy_llm(tmp_path, model) as llm:
        # Four sessions, three turns each, interleaved; turn ends fall anywhere (not on 4- or 8-token bounds),
        # prompts are chunked (64-token budget) and later turns resume from the snapshot at their last turn.
        history = {f"s{k}": [(k * 7 + i * 5 + 1) % VOCAB for i in range(117 + 11 * k)] for k in range(4)}
        for turn in range(3):
            sids = list(history)
            outs = llm.generate(list(history.values()), sp, session_ids=sids)
            for sid, out in zip(sids, outs, strict=True):
                prompt = history[sid]
                assert out.token_ids == greedy_reference(model, prompt, 6), (sid, turn)
                if turn:
                    assert out.num_cached_tokens >= 0.9 * len(prompt), (sid, turn, out.num_cached_tokens, len(prompt))
                history[sid] = prompt + out.token_ids + [(turn * 3 + len(prompt)) % VOCAB for _ in range(3 + turn)]
            llm.core.check_integrity()
        stats = llm.core.cache.snapshot_stats()
        assert stats is not None and stats.hits >= 8  # the later turns resumed from their snapshots
