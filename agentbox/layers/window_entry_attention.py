"""DeepSeek-V4's attention core: every query head attends one shared K=V head over the last `window` raw tokens
(kept in a ring of the state group, layers/position_ring.py) and, in a compressed layer, over that layer's
compressed entries (layers/compressor.py) the caller chose for it; a learned logit per head (a sink) joins the
softmax and adds no value.

A query at position p sees raw tokens p - window + 1 .. p and the entries the caller marks (complete by p: entry e
once (e + 1) r <= p + 1, and for CSA only its indexer's top-k). Per sequence, in torch: prefill chunks and decode
take the same path.
"""

from __future__ import annotations

import torch
from torch import nn

from agentbox.layers import position_ring
from agentbox.layers.position_ring import RingSpec
from agentbox.layers.recurrent_state import StateStep


class WindowEntryAttention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, window: int, scale: float, sinks: nn.Parameter) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.window, self.scale = num_heads, head_dim, window, scale
        self.sinks = sinks  # [num_heads] fp32, the owning module's parameter (this rank's heads)
        self.state_index = -1  # the model numbers its state specs and sets it

    def state_spec(self) -> RingSpec:
        return RingSpec(self.window, (self.head_dim,))

    def forward(self, q: torch.Tensor, kv: torch.Tensor, state: StateStep,
                entries: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:
        """q [T, H, D], kv [T, D] of the step's flattened batch; entries: per sequence, its entries [E, D] and which
        of them each of its queries sees, bool [n, E]. Returns [T, H, D] in q's dtype."""
        (ring,) = state.cache.layers[self.state_index]
        outs, lo = [], 0
        for i, (slot, n, start) in enumerate(zip(state.slots, state.query_lens, state.starts, strict=True)):
            hi = lo + n
            earlier = position_ring.before(ring, slot, start, self.window - 1)
            keys = torch.cat([earlier.to(kv.dtype), kv[lo:hi]])  # positions start - len(earlier) ..
            key_pos = torch.arange(start - earlier.shape[0], start + n, device=q.device)
            query_pos = torch.arange(start, start + n, device=q.device)[:, None]
            seen = (key_pos[None, :] <= query_pos) & (key_pos[None, :] > query_pos - self.window)
            qi = q[lo:hi]
            logits = torch.einsum("nhd,md->nhm", qi, keys) * self.scale
            logits = logits.masked_fill(~seen[:, None, :], float("-inf"))
            values = keys
            if entries is not None:
                ent, visible = entries[i]
                more = (torch.einsum("nhd,ed->nhe", qi, ent.to(qi.dtype)) * self.scale)
                logits = torch.cat([logits, more.masked_fill(~visible[:, None, :], float("-inf"))], dim=-1)
                values = torch.cat([keys, ent.to(keys.dtype)])
            dtype = torch.promote_types(logits.dtype, self.sinks.dtype)  # bf16 logits join the fp32 sinks in fp32
            logits = torch.cat([logits.to(dtype), self.sinks.to(dtype)[None, :, None].expand(n, -1, 1)], dim=-1)
            logits = logits - logits.max(dim=-1, keepdim=True).values
            probs = torch.softmax(logits, dim=-1)[..., :-1].to(values.dtype)
            outs.append(torch.einsum("nhm,md->nhd", probs, values))
            position_ring.update(state, self.state_index, i, [kv[lo:hi]])
            lo = hi
        return outs[0] if len(outs) == 1 else torch.cat(outs)
