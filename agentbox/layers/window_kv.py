"""Sliding-window attention whose keys and values live in a per-sequence ring of `window` positions, not in
the paged pool (Gemma 4's sliding layers: 50 of the 31B's 60 layers, whose KV would otherwise grow with the
whole context).

A query at position p sees keys p-W+1 .. p (the convention of layers/attention.py). So what a sequence carries
from one step to the next is its last W-1 positions' k and v: a fixed-size state, held like the linear layers'
recurrent state (layers/recurrent_state.py) in the slot of its page-table row. The ring holds R = W + `slack`
positions, position p at index p % R. The slack is one page (`page_slack`): a ring that has computed up to c
still holds every position a sequence resuming at any s in [c - page, c] reads (s-W+1 .. s-1), so the live
ring is its own page-aligned copy (a hybrid's delta-net state needs a second slot for that, runner.py) and a
rejected tail of up to a page is undone by resuming at the accepted position. The scheduler keeps per-session
snapshots (engine/cache/state_snapshots.py), so a session's next turn resumes with the ring exactly as it
was; a cached prefix without a snapshot at that position is recomputed, never resumed wrong. The global layers
keep every position in the paged pool, so the radix cache still holds the whole history for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from agentbox.layers.context import get_forward_context


@dataclass(frozen=True)
class WindowKVSpec:
    """One sliding layer's ring on this rank: `window` + `slack` positions of num_kv_heads x head_dim, for K
    and for V."""

    num_kv_heads: int
    head_dim: int
    window: int
    slack: int = 0  # positions kept beyond the window: how far back the live ring can resume

    @property
    def ring(self) -> int:
        return self.window + self.slack

    def bytes(self, dtype: torch.dtype) -> int:
        return 2 * self.ring * self.num_kv_heads * self.head_dim * torch.empty(0, dtype=dtype).element_size()

    def allocate(self, num_slots: int, dtype: torch.dtype, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        shape = (num_slots, self.ring, self.num_kv_heads, self.head_dim)
        return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)

    def commit(self, tensors: tuple[torch.Tensor, ...], slot: int, stash: tuple, lo: int, hi: int) -> None:
        """stash: a verify's k, v [n, Hkv, D] and its first position; positions [lo, hi) of them into the ring."""
        k_ring, v_ring = tensors
        k, v, start = stash
        r = k_ring.shape[1]  # the ring: the window plus any slack
        kept = torch.arange(max(lo, hi - r), hi, device=k.device)  # the last R win: no index twice
        k_ring[slot, (start + kept) % r] = k[kept].to(k_ring.dtype)
        v_ring[slot, (start + kept) % r] = v[kept].to(v_ring.dtype)


def page_slack(specs: Sequence[object], page_size: int) -> list[WindowKVSpec] | None:
    """The specs with a page of slack when every state layer is a ring (the live slot then resumes at its last
    page boundary itself); None when some layer's state resumes only where it was saved (delta-net)."""
    if not specs or not all(isinstance(s, WindowKVSpec) for s in specs):
        return None
    return [replace(s, slack=page_size) for s in specs]  # type: ignore[arg-type]


class WindowAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, window: int,
                 state_index: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.window, self.state_index = scale, window, state_index

    def state_spec(self) -> WindowKVSpec:
        return WindowKVSpec(self.num_kv_heads, self.head_dim, self.window)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] of the step's flattened batch. Returns [T, H*D]."""
        step = get_forward_context().state
        if step is None:
            raise RuntimeError("a sliding-window layer ran without a state slot (the runner sets one per step)")
        k_ring, v_ring = step.cache.layers[self.state_index]
        w, r, outs, lo = self.window, k_ring.shape[1], [], 0
        for slot, n, start in zip(step.slots, step.query_lens, step.starts, strict=True):
            hi = lo + n
            kept = torch.arange(max(0, start - w + 1), start, device=q.device)  # earlier positions still seen
            keys = torch.cat([k_ring[slot, kept % r], k[lo:hi].to(k_ring.dtype)]).to(q.dtype)
            values = torch.cat([v_ring[slot, kept % r], v[lo:hi].to(v_ring.dtype)]).to(q.dtype)
            key_pos = torch.cat([kept, torch.arange(start, start + n, device=q.device)])
            query_pos = torch.arange(start, start + n, device=q.device)[:, None]
            mask = (key_pos[None, :] <= query_pos) & (key_pos[None, :] > query_pos - w)
            out = F.scaled_dot_product_attention(
                q[lo:hi].transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                attn_mask=mask, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads,
            )
            outs.append(out[0].transpose(0, 1).reshape(n, -1))
            if step.pending[len(outs) - 1]:  # a verify: the positions the sampler keeps go in at the commit
                step.keep(self.state_index, len(outs) - 1, (k[lo:hi], v[lo:hi], start))
                lo = hi
                continue
            # After the read: the step's last (up to R) positions go into the ring for the next step.
            new = torch.arange(max(start, start + n - r), start + n, device=q.device)
            k_ring[slot, new % r] = k[new - start + lo].to(k_ring.dtype)
            v_ring[slot, new % r] = v[new - start + lo].to(v_ring.dtype)
            lo = hi
        return outs[0] if len(outs) == 1 else torch.cat(outs)
