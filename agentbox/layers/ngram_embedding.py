"""Qwen3.8-Flash-Next's per-layer n-gram embedding (PLE; transformers' `Qwen4ExpTextNGramEmbedding` and
`Qwen4ExpTextPLELayer` are the reference): a few Gated DeltaNet layers add, before their block, a feature of the
token n-grams ending at each position, read from a huge hashed table.

Ids: for n = 2..ngram_size, the n-gram ending at a token (the token and its n-1 predecessors) is hashed
`heads_per_ngram` ways: xor of token_i * multiplier_i, modulo a distinct prime per head (rows of that head's
part of the layer's table). A predecessor across an end-of-text token is the end-of-text token itself (documents
packed in one sequence do not see each other), and so is one before position 0. The rows of every head
concatenate to the token's embedding [ple_embed_dim]; the table itself is a `HostTable` (layers/host_table.py),
mapped from the checkpoint, and only the rows a step hashes to are read and moved to the compute device.

The layer: a key per residual stream and one value from the embedding; each stream's normed activations gate the
value (a signed square root of the scaled dot product, through a sigmoid); the gated values, normed, go through a
depthwise conv of kernel K dilated by ngram_size, and silu(conv) is added to them. The result [T, hc * hidden] is
added to the streams.

What it carries between steps, per sequence (a state of the state group, so a turn-end snapshot holds it): the
last ngram_size - 1 token ids (`IdRingSpec`, int64: a bf16 state would round ids) and the conv's last
(K - 1) * ngram_size inputs (a `RingSpec`). Everything here is replicated over tensor-parallel ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from agentbox.layers import position_ring
from agentbox.layers.context import get_forward_context
from agentbox.layers.host_table import HostTable
from agentbox.layers.linear import ReplicatedLinear
from agentbox.layers.position_ring import RingSpec

_MASK64 = (1 << 64) - 1
_GAMMA, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_LAYER_PRIME = 10007


def _splitmix64(value: int) -> int:
    value = (value + _GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * _M1) & _MASK64
    value = ((value ^ (value >> 27)) * _M2) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def layer_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """The odd multiplier of each n-gram position, small enough that token * multiplier fits in int64."""
    half = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = seed + _LAYER_PRIME * ple_index
    return [2 * (_splitmix64((base + _GAMMA * (i + 1)) & _MASK64) % half) + 1 for i in range(ngram_size)]


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def head_vocab_sizes(base: int, first_head: int, count: int) -> list[int]:
    """Heads first_head .. first_head + count - 1 of the model (numbered over every PLE layer) take the
    (head + 1)-th prime at or above `base`, in turn."""
    sizes, prime = [], base - 1
    for head in range(first_head + count):
        prime += 1
        while not _is_prime(prime):
            prime += 1
        if head >= first_head:
            sizes.append(prime)
    return sizes


@dataclass(frozen=True)
class IdRingSpec(RingSpec):
    """A ring of token ids: int64 whatever the model's dtype."""

    def bytes(self, dtype: torch.dtype) -> int:
        return self.size * sum(self.widths) * 8

    def allocate(self, num_slots: int, dtype: torch.dtype, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        return tuple(torch.zeros(num_slots, self.size, w, dtype=torch.int64, device=device) for w in self.widths)


class GroupRMSNorm(nn.Module):
    """Zero-centred RMSNorm over each `group` channels of the last dim (one per residual stream)."""

    def __init__(self, size: int, group: int, eps: float) -> None:
        super().__init__()
        self.group, self.eps = group, eps
        self.weight = nn.Parameter(torch.zeros(size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = x.float().unflatten(-1, (-1, self.group))
        normed = F.rms_norm(g, (self.group,), None, self.eps).flatten(-2)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class NGramIds(nn.Module):
    """The hashed row ids of one PLE layer: token ids with their context -> [T, (ngram_size - 1) * heads]."""

    def __init__(self, config: Any, ple_index: int) -> None:
        super().__init__()
        self.n, self.per = config.ngram_size, config.heads_per_ngram
        heads = (self.n - 1) * self.per
        sizes = head_vocab_sizes(config.ngram_vocab_size_base, ple_index * heads, heads)
        offsets = [sum(sizes[:i]) for i in range(heads)]
        divisor = config.make_ngram_vocab_size_divisible_by
        self.rows = -(-sum(sizes) // divisor) * divisor
        mult = layer_multipliers(config.vocab_size, self.n, ple_index, config.seed)
        self.register_buffer("multipliers", torch.tensor(mult, dtype=torch.int64), persistent=False)
        self.register_buffer("sizes", torch.tensor(sizes, dtype=torch.int64), persistent=False)
        self.register_buffer("offsets", torch.tensor(offsets, dtype=torch.int64), persistent=False)

    def forward(self, history: torch.Tensor, eos: int) -> torch.Tensor:
        """history [L + n - 1]: the n - 1 ids before the L new tokens (eos where none), then theirs -> [L, heads]."""
        ctx = self.n - 1
        pos = torch.arange(history.shape[0], device=history.device)
        last_eos = torch.cummax(torch.where(history == eos, pos, -1), dim=0).values
        before = torch.cat([last_eos.new_full((1,), -1), last_eos[:-1]])  # the last eos strictly before
        blocks, mixed = [], history[ctx:] * self.multipliers[0]
        for shift in range(1, self.n):
            src = pos[ctx:] - shift
            shifted = torch.where(src > before[ctx:], history[src], torch.full_like(src, eos))
            mixed = torch.bitwise_xor(mixed, shifted * self.multipliers[shift])
            lo = (shift - 1) * self.per
            blocks.append(torch.remainder(mixed[:, None], self.sizes[lo : lo + self.per]) + self.offsets[lo : lo + self.per])
        return torch.cat(blocks, dim=-1)


class PLELayer(nn.Module):
    def __init__(self, config: Any, ple_index: int, state_index: int, prefix: str) -> None:
        super().__init__()
        h, hc = config.hidden_size, config.hc_count
        self.hidden, self.hc, e = h, hc, config.ple_embed_dim
        self.ids = NGramIds(config, ple_index)
        self.table: HostTable | None = None  # mapped after the load (CausalLM.map_host_tables)
        eos = config.eos_token_id
        self.eos = int(eos[0] if isinstance(eos, list) else eos)
        self.key_proj = ReplicatedLinear(e, hc * h, bias=False, prefix=f"{prefix}.key_proj")
        self.value_proj = ReplicatedLinear(e, h, bias=False, prefix=f"{prefix}.value_proj")
        self.norm_key = GroupRMSNorm(hc * h, h, config.rms_norm_eps)
        self.norm_query = GroupRMSNorm(hc * h, h, config.rms_norm_eps)
        self.norm_conv = GroupRMSNorm(hc * h, h, config.rms_norm_eps)
        self.kernel, self.dilation = config.ple_conv_kernel_size, config.ngram_size
        self.conv_len = (self.kernel - 1) * self.dilation
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(hc * h, 1, self.kernel), requires_grad=False)
        # state_index: the token-id ring; state_index + 1: the conv's inputs
        self.state_index = state_index

    def state_specs(self) -> list[RingSpec]:
        return [IdRingSpec(self.dilation - 1, (1,)), RingSpec(self.conv_len, (self.hc * self.hidden,))]

    def embed(self, ids: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        if self.table is None:
            raise RuntimeError("a PLE layer ran before its n-gram table was mapped (CausalLM.map_host_tables)")
        return self.table.gather(ids, device, dtype).flatten(-2)

    def forward(self, input_ids: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """input_ids [T], streams [T, hc * hidden] -> what to add to the streams."""
        step = get_forward_context().state
        if step is None:
            raise RuntimeError("a PLE layer ran without its state slots (the runner sets them per step)")
        id_ring, conv_ring = step.cache.layers[self.state_index][0], step.cache.layers[self.state_index + 1][0]
        ctx = self.dilation - 1
        rows, starts = [], [0]
        for n in step.query_lens:
            starts.append(starts[-1] + n)
        for i, slot in enumerate(step.slots):
            lo, hi, start = starts[i], starts[i + 1], step.starts[i]
            prev = position_ring.before(id_ring, slot, start, ctx)[:, 0].to(input_ids.device)
            pad = input_ids.new_full((ctx - prev.shape[0],), self.eos)
            rows.append(self.ids(torch.cat([pad, prev, input_ids[lo:hi].long()]), self.eos))
        emb = self.embed(torch.cat(rows), streams.device, streams.dtype)  # [T, ple_embed_dim]
        t = streams.shape[0]
        key = self.norm_key(self.key_proj(emb)).view(t, self.hc, self.hidden)
        query = self.norm_query(streams).view(t, self.hc, self.hidden)
        gate = (key * query).sum(-1, keepdim=True) / math.sqrt(self.hidden)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        gated = (torch.sigmoid(gate) * self.value_proj(emb)[:, None, :]).flatten(1)  # [T, hc * hidden]
        normed = self.norm_conv(gated)
        conv = torch.empty_like(normed)
        w = self.conv1d.weight[:, 0, :]  # [C, K]
        for i, slot in enumerate(step.slots):
            lo, hi, start = starts[i], starts[i + 1], step.starts[i]
            prev = position_ring.before(conv_ring, slot, start, self.conv_len).to(normed.dtype)
            x = torch.cat([normed.new_zeros(self.conv_len - prev.shape[0], normed.shape[1]), prev, normed[lo:hi]])
            conv[lo:hi] = F.conv1d(x.t()[None], w[:, None, :], groups=w.shape[0], dilation=self.dilation)[0].t()
            position_ring.update(step, self.state_index, i, [input_ids[lo:hi, None].long()])
            position_ring.update(step, self.state_index + 1, i, [normed[lo:hi]])
        return gated + F.silu(conv)
