"""DeepSeek-V4's attention core: every query head attends one shared K=V head over the last `window` raw tokens
(kept in a ring of the state group, layers/position_ring.py) and, in a compressed layer, over that layer's
compressed entries (layers/compressor.py); a learned logit per head (a sink) joins the softmax and adds no value.

A query at position p sees raw tokens p - window + 1 .. p, and of the entries either every one complete by p
(HCA: entry e once (e + 1) r <= p + 1) or the ones its indexer chose (CSA). Per sequence, in torch, in blocks of
`QUERY_BLOCK` queries: a block reads its band of raw keys (block + window - 1 of them) and its entries (all the
visible ones, or each query's chosen k), so memory stays bounded by the block whatever the chunk and the context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from agentbox.layers import position_ring
from agentbox.layers.position_ring import RingSpec
from agentbox.layers.recurrent_state import StateStep

QUERY_BLOCK = 128  # queries per block: a V4-Flash block gathers 128 x 512 chosen entries of 512 values (64 MiB)


@dataclass
class SeqEntries:
    """One sequence's compressed entries for a step: `values` [E, D], its complete ones; entry e is visible from
    position (e + 1) `rate` - 1 on. `chosen` [n, k]: the entries each of its queries attends (-1: none), or None:
    every visible one."""

    values: torch.Tensor
    rate: int
    chosen: torch.Tensor | None = None


class WindowEntryAttention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, window: int, scale: float, sinks: nn.Parameter) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.window, self.scale = num_heads, head_dim, window, scale
        self.sinks = sinks  # [num_heads] fp32, the owning module's parameter (this rank's heads)
        self.state_index = -1  # the model numbers its state specs and sets it

    def state_spec(self) -> RingSpec:
        return RingSpec(self.window, (self.head_dim,))

    def forward(self, q: torch.Tensor, kv: torch.Tensor, state: StateStep,
                entries: list[SeqEntries] | None = None) -> torch.Tensor:
        """q [T, H, D], kv [T, D] of the step's flattened batch; entries: per sequence (a compressed layer).
        Returns [T, H, D] in q's dtype."""
        (ring,) = state.cache.layers[self.state_index]
        outs, lo = [], 0
        for i, (slot, n, start) in enumerate(zip(state.slots, state.query_lens, state.starts, strict=True)):
            earlier = position_ring.before(ring, slot, start, self.window - 1)
            keys = torch.cat([earlier.to(kv.dtype), kv[lo : lo + n]])  # positions start - len(earlier) ..
            first = start - earlier.shape[0]
            for a in range(0, n, QUERY_BLOCK):
                b = min(n, a + QUERY_BLOCK)
                outs.append(self._block(q[lo + a : lo + b], keys, first, start + a,
                                        None if entries is None else entries[i], a))
            position_ring.update(state, self.state_index, i, [kv[lo : lo + n]])
            lo += n
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _block(self, q: torch.Tensor, keys: torch.Tensor, first: int, start: int, ent: SeqEntries | None,
               offset: int) -> torch.Tensor:
        """Queries q [b, H, D] at positions start .. over raw keys (positions first ..) and the entries."""
        b, dev = q.shape[0], q.device
        lo = max(first, start - self.window + 1)  # the band of raw keys the block sees
        band = keys[lo - first : start + b - first]
        key_pos = torch.arange(lo, start + b, device=dev)
        query_pos = torch.arange(start, start + b, device=dev)[:, None]
        seen = (key_pos[None, :] <= query_pos) & (key_pos[None, :] > query_pos - self.window)
        logits = (torch.einsum("bhd,md->bhm", q, band) * self.scale).masked_fill(~seen[:, None, :], float("-inf"))
        parts, values = [logits], [band]
        if ent is not None:
            if ent.chosen is None:  # every entry complete by the block's last query; each query its own
                count = min(ent.values.shape[0], (start + b) // ent.rate)
                vals = ent.values[:count].to(q.dtype)
                visible = torch.arange(count, device=dev)[None, :] < ((query_pos + 1) // ent.rate)
                more = torch.einsum("bhd,ed->bhe", q, vals) * self.scale
            else:  # each query's chosen entries
                chosen = ent.chosen[offset : offset + b]
                vals = ent.values[chosen.clamp(min=0)].to(q.dtype)  # [b, k, D]
                visible = chosen >= 0
                more = torch.einsum("bhd,bkd->bhk", q, vals) * self.scale
            parts.append(more.masked_fill(~visible[:, None, :], float("-inf")))
            values.append(vals)
        dtype = torch.promote_types(q.dtype, self.sinks.dtype)  # bf16 logits join the fp32 sinks in fp32
        parts.append(self.sinks.to(dtype)[None, :, None].expand(b, -1, 1))
        logits = torch.cat([p.to(dtype) for p in parts], dim=-1)
        probs = torch.softmax(logits - logits.max(dim=-1, keepdim=True).values, dim=-1).to(q.dtype)
        out = torch.einsum("bhm,md->bhd", probs[..., : band.shape[0]], band)
        if ent is not None:
            p = probs[..., band.shape[0] : -1]
            out = out + (torch.einsum("bhe,ed->bhd", p, values[1]) if ent.chosen is None
                         else torch.einsum("bhk,bkd->bhd", p, values[1]))
        return out
