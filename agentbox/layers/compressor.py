"""Compressed KV entries (DeepSeek-V4's CSA and HCA): every `rate` tokens a layer pools one entry of its K=V head
from the tokens' projections, and keeps it in a paged group of `rate` tokens an entry (layers/paged_entries.py).

Entry e covers tokens [e r, (e + 1) r) and is complete once token (e + 1) r - 1 is computed. It is a softmax-gated
pool per channel: kv_proj and gate_proj project each token, a learned bias per place in the window (`ape`) joins
the gate, and the softmax over the window weighs the kv. With `overlap` (CSA, r = 4) each token projects two
series: its first half pools into the next entry and its second half into its own, so entry e pools 2r tokens
([(e - 1) r, (e + 1) r), stride r; entry 0's missing half weighs nothing). The pooled entry is RMS-normed, and its
trailing rope channels are turned at the entry's first position.

What a sequence carries from step to step is the raw kv and gate of its last 2r (overlap) or r positions, in a
ring of the state group (layers/position_ring.py): a resumed sequence finds there the partial window its entry
still needs, exactly as it was at the snapshot's position.

The lightning indexer (`Indexer`) keeps its own compressed keys the same way (a smaller head, always
overlapping) and scores each query against them: sum over its heads of w[t, h] relu(q[t, h] . k[e]); each query
keeps its `top_k` best complete entries (transformers breaks ties at the boundary its own way: a tie there is
two scores equal to the last bit, in practice all of an entry's ReLUs at zero, which a model with few indexer
heads meets and V4's 64 do not).
"""

from __future__ import annotations

import torch
from torch import nn

from agentbox.layers import position_ring
from agentbox.layers.linear import ReplicatedLinear
from agentbox.layers.norm import Fp32RMSNorm
from agentbox.layers.paged_entries import EntryStep
from agentbox.layers.position_ring import RingSpec
from agentbox.layers.recurrent_state import StateStep
from agentbox.layers.rotary import InterleavedRope, rotate_interleaved

SCORE_BUDGET = 1 << 24  # indexer scores (query x head x entry) computed at once: 64 MiB in fp32


class Compressor(nn.Module):
    def __init__(self, hidden_size: int, head_dim: int, rate: int, overlap: bool, eps: float, rope: InterleavedRope,
                 prefix: str) -> None:
        super().__init__()
        self.head_dim, self.rate, self.overlap = head_dim, rate, overlap
        width = (2 if overlap else 1) * head_dim
        self.span = (2 if overlap else 1) * rate  # tokens an entry pools
        self.wkv = ReplicatedLinear(hidden_size, width, prefix=f"{prefix}.wkv")
        self.wgate = ReplicatedLinear(hidden_size, width, prefix=f"{prefix}.wgate")
        self.ape = nn.Parameter(torch.empty(rate, width, dtype=torch.float32), requires_grad=False)
        self.norm = Fp32RMSNorm(head_dim, eps)
        self.rope = rope
        self.state_index = -1  # the model numbers its state specs (`state_spec`) and sets it

    def state_spec(self) -> RingSpec:
        width = (2 if self.overlap else 1) * self.head_dim
        return RingSpec(self.span, (width, width))

    def forward(self, x: torch.Tensor, entries: EntryStep, state: StateStep, cache: torch.Tensor) -> None:
        """x [T, hidden]: the step's inputs. The entries the step completes go into `cache` (this layer's tensor
        of the group, [slots, 1, head_dim]) at the step's slots; each sequence's ring moves on."""
        kv, gate = self.wkv(x), self.wgate(x)
        ring_kv, ring_gate = state.cache.layers[self.state_index]
        out = kv.new_zeros(kv.shape[0], 1, self.head_dim)
        r, lo = self.rate, 0
        for i, (slot, n, start) in enumerate(zip(state.slots, state.query_lens, state.starts, strict=True)):
            hi = lo + n
            first, last = start // r, (start + n) // r  # the entries this step completes
            if last > first:
                prev_kv = position_ring.before(ring_kv, slot, start, self.span - 1)
                prev_gate = position_ring.before(ring_gate, slot, start, self.span - 1)
                base = start - prev_kv.shape[0]  # the position of the buffer's first row
                buf_kv = torch.cat([prev_kv.to(kv.dtype), kv[lo:hi]])
                buf_gate = torch.cat([prev_gate.to(gate.dtype), gate[lo:hi]])
                e = torch.arange(first, last, device=x.device)
                pos = ((e + 1) * r - self.span)[:, None] + torch.arange(self.span, device=x.device)[None, :]
                at = (pos - base).clamp(min=0)  # a position before 0 (overlap, entry 0) is masked below
                out[lo + (e + 1) * r - 1 - start, 0] = self._pool(buf_kv[at], buf_gate[at], pos, e * r)
            position_ring.update(state, self.state_index, i, [kv[lo:hi], gate[lo:hi]])
            lo = hi
        entries.write(cache, out)

    def _pool(self, kv: torch.Tensor, gate: torch.Tensor, pos: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """kv, gate [E, span, width] of each entry's window at positions pos [E, span] -> the entries [E, head_dim]."""
        r, d = self.rate, self.head_dim
        gate = gate + self.ape[pos % r]  # fp32, as the reference adds its fp32 bias
        if self.overlap:  # the previous window's first halves, then this window's second halves
            kv = torch.cat([kv[:, :r, :d], kv[:, r:, d:]], dim=1)
            gate = torch.cat([gate[:, :r, :d], gate[:, r:, d:]], dim=1)
            valid = (pos >= 0)[..., None]
            kv = torch.where(valid, kv, torch.zeros((), dtype=kv.dtype, device=kv.device))
            gate = torch.where(valid, gate, torch.full((), float("-inf"), dtype=gate.dtype, device=gate.device))
        pooled = self.norm((kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1))
        cos, sin = self.rope.tables(first, pooled.dtype)
        return rotate_interleaved(pooled[:, None], cos, sin)[:, 0]


class Indexer(nn.Module):
    """The lightning indexer of a CSA layer: its compressed keys (`compressor`, one per `rate` tokens, in their
    own layer of the paged group) and the scoring of queries against them."""

    def __init__(self, hidden_size: int, q_lora_rank: int, num_heads: int, head_dim: int, rate: int, top_k: int,
                 eps: float, rope: InterleavedRope, prefix: str) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.rate, self.top_k = num_heads, head_dim, rate, top_k
        self.wq_b = ReplicatedLinear(q_lora_rank, num_heads * head_dim, prefix=f"{prefix}.wq_b")
        self.weights_proj = ReplicatedLinear(hidden_size, num_heads, prefix=f"{prefix}.weights_proj")
        self.compressor = Compressor(hidden_size, head_dim, rate, True, eps, rope, f"{prefix}.compressor")
        self.rope = rope

    def select(self, x: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor, entries: EntryStep,
               keys: torch.Tensor) -> list[torch.Tensor]:
        """For each sequence, int64 [n, min(top_k, E)]: the complete entries each of its queries attends, its best
        by score (-1 where fewer are complete). `keys`: the indexer's layer of the group, with this step's keys
        already written. Scored in blocks of queries (a V4-Flash query scores 64 heads against every entry)."""
        t = x.shape[0]
        q = self.wq_b(q_residual).view(t, self.num_heads, self.head_dim)
        cos, sin = self.rope.tables(positions, x.dtype)
        q = rotate_interleaved(q, cos, sin).float()
        weights = self.weights_proj(x).float() * self.num_heads**-0.5  # [T, heads]
        out, lo = [], 0
        for i, n in enumerate(entries.query_lens):
            k = entries.gather(keys, i)[:, 0].float()  # [E, head_dim]
            count = min(self.top_k, k.shape[0])
            block = max(1, SCORE_BUDGET // max(1, self.num_heads * k.shape[0]))
            chosen = []
            for a in range(lo, lo + n, block):
                b = min(lo + n, a + block)
                ready = ((positions[a:b] + 1) // self.rate)[:, None]  # entries complete by each query
                scores = torch.relu(torch.einsum("nhd,ed->nhe", q[a:b], k)) * self.head_dim**-0.5
                scores = (scores * weights[a:b, :, None]).sum(dim=1)
                future = torch.arange(k.shape[0], device=x.device)[None, :] >= ready
                top = scores.masked_fill(future, float("-inf")).topk(count, dim=-1).indices
                chosen.append(torch.where(top < ready, top, -1))
            out.append(torch.cat(chosen) if chosen else torch.empty(0, count, dtype=torch.int64, device=x.device))
            lo += n
        return out
