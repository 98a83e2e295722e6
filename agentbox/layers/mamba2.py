"""The Mamba-2 layer (Nemotron-H's `linear_attention` mixer): in_proj to [z | x B C | dt], a short causal conv with
bias and SiLU over x B C, the selective state-space scan (SSD), a gated group RMSNorm and out_proj.

The state a sequence carries is fixed-size, like a Gated DeltaNet's (layers/recurrent_state.py): the conv's last K-1
inputs and, per head, a [head_dim, state_size] matrix (fp32). It lives in the step's `StateCache` slot and rides the
same turn-end snapshots. A prefill chunk runs the chunked scan (`ssd_chunked`: transformers' torch fallback
`mamba2_chunk_scan`, the numerical reference, for one sequence with an initial state); a decode runs the recurrent
step (`ssd_step`) for every decoding sequence at once. A verify (speculative decoding) leaves its slot and stashes
its per-position inputs; `Mamba2StateSpec.commit` replays the kept ones with the recurrent step.

dt: softplus(dt + dt_bias), clamped to `time_step_limit` in both forms (transformers clamps in the chunked form
only; the default limit (0, inf) makes that no clamp at all, and one rule for both keeps a state independent of how
it was computed).

Tensor parallel: heads and groups split across ranks (a rank's heads read its own groups' B and C); z, x and dt
follow the heads, B and C the groups, the conv's channels what they carry; out_proj is row-parallel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from agentbox.layers.context import get_forward_context
from agentbox.layers.gated_deltanet import SegmentedColumnParallelLinear, split_rows
from agentbox.layers.linear import RowParallelLinear
from agentbox.layers.weight_loading import set_weight_loader
from agentbox.parallel.state import tp_size


@dataclass(frozen=True)
class Mamba2StateSpec:
    """One Mamba-2 layer's state on this rank: the conv's last `conv_len` inputs of `conv_channels`, and a
    [head_dim, state_size] fp32 matrix per head."""

    conv_channels: int
    conv_len: int
    num_heads: int
    head_dim: int
    state_size: int

    def bytes(self, dtype: torch.dtype) -> int:
        conv = self.conv_channels * self.conv_len * torch.empty(0, dtype=dtype).element_size()
        return conv + self.num_heads * self.head_dim * self.state_size * 4

    def allocate(self, num_slots: int, dtype: torch.dtype, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        return (
            torch.zeros(num_slots, self.conv_channels, self.conv_len, dtype=dtype, device=device),
            torch.zeros(num_slots, self.num_heads, self.head_dim, self.state_size, dtype=torch.float32, device=device),
        )

    def commit(self, tensors: tuple[torch.Tensor, ...], slot: int, stash: tuple, lo: int, hi: int) -> None:
        """stash: a verify's conv inputs xbc [n, C], its post-conv x [n, H, P], dt [n, H] (softplus'd), B [n, H, N]
        (per head), A [H], and its final matrix and conv state (a draft kept whole: no replay)."""
        conv, ssm = tensors
        xbc, x, dt, b, a, last, conv_last = stash
        if lo == 0 and hi == xbc.shape[0]:
            conv[slot], ssm[slot] = conv_last, last
            return
        conv[slot] = torch.cat([conv[slot].to(xbc.dtype), xbc[lo:hi].t()], dim=-1)[:, -self.conv_len :]
        state = ssm[slot]
        for t in range(lo, hi):
            state = decay_and_add(state[None], x[t][None], dt[t][None], a, b[t][None])[0]
        ssm[slot] = state


def decay_and_add(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor,
                  b: torch.Tensor) -> torch.Tensor:
    """One position for a batch: state [S, H, P, N] * exp(dt A) + dt x B^T. x [S, H, P]; dt [S, H]; b [S, H, N]."""
    decay = torch.exp(dt * a)[..., None, None]
    return state * decay + (dt[..., None] * x.float())[..., None] * b.float()[:, :, None, :]


def ssd_step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             c: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrent step (mamba_ssm's selective_state_update): (y [S, H, P] fp32, the new state)."""
    state = decay_and_add(state, x, dt, a, b)
    y = (state * c.float()[:, :, None, :]).sum(-1) + x.float() * d.float()[:, None]
    return y, state


def _segment_sum(x: torch.Tensor) -> torch.Tensor:
    """[..., T] -> [..., T, T]: sum of x over (j, i] below the diagonal, -inf above (transformers' segment_sum)."""
    t = x.shape[-1]
    x = x[..., None].expand(*x.shape, t)
    x = x.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=-1), 0)
    s = torch.cumsum(x, dim=-2)
    return s.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=0), -torch.inf)


def ssd_chunked(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                d: torch.Tensor, chunk: int, initial: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's chunked scan (state space duality), as transformers' `mamba2_chunk_scan` computes it.
    x [L, H, P]; dt [L, H] (softplus'd); a [H]; b, c [L, H, N] (per head); initial [H, P, N] fp32.
    Returns (y [L, H, P] fp32 with the D skip, the final state [H, P, N])."""
    length = x.shape[0]
    pad = (chunk - length % chunk) % chunk
    xf = x.float()
    skip = d.float()[:, None] * xf
    xs = F.pad(xf * dt[..., None], (0, 0, 0, 0, 0, pad))
    adt = F.pad(a[None] * dt, (0, 0, 0, pad))
    bs, cs = (F.pad(t.float(), (0, 0, 0, 0, 0, pad)) for t in (b, c))
    n = (length + pad) // chunk
    xs, bs, cs = (t.reshape(n, chunk, *t.shape[1:]) for t in (xs, bs, cs))  # [c, l, h, .]
    adt = adt.reshape(n, chunk, -1).permute(2, 0, 1)  # [h, c, l]
    a_cum = torch.cumsum(adt, dim=-1)
    decay_in = torch.exp(_segment_sum(adt))  # [h, c, l, s]
    scores = torch.einsum("clhn,cshn->clsh", cs, bs)
    y_diag = torch.einsum("clsh,cshp->clhp", scores * decay_in.permute(1, 2, 3, 0), xs)
    decay_states = torch.exp(a_cum[:, :, -1:] - a_cum)  # [h, c, l]
    states = torch.einsum("clhn,clhp->chpn", bs * decay_states.permute(1, 2, 0)[..., None], xs)
    states = torch.cat([initial[None].to(states.dtype), states])  # [c + 1, h, p, n]
    decay_chunk = torch.exp(_segment_sum(F.pad(a_cum[:, :, -1], (1, 0)))).permute(1, 2, 0)  # [z, c, h]
    new_states = torch.einsum("zch,zhpn->chpn", decay_chunk.transpose(0, 1), states)
    states, final = new_states[:-1], new_states[-1]
    y_off = torch.einsum("clhn,chpn->clhp", cs, states) * torch.exp(a_cum).permute(1, 2, 0)[..., None]
    y = (y_diag + y_off).reshape(n * chunk, *x.shape[1:])[:length]
    return y + skip, final


class GatedGroupRMSNorm(nn.Module):
    """x * silu(z) in fp32, RMS-normed over groups of `group_size`, cast back, times the weight."""

    def __init__(self, dim: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.group_size, self.eps = group_size, eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float() * F.silu(z.float())
        h = F.rms_norm(h.unflatten(-1, (-1, self.group_size)), (self.group_size,), None, self.eps).flatten(-2)
        return self.weight * h.to(dtype)


class Mamba2Mixer(nn.Module):
    def __init__(self, config: Any, state_index: int, prefix: str) -> None:
        super().__init__()
        tp = tp_size()
        h, g = config.mamba_num_heads, config.n_groups
        for what, v in (("mamba_num_heads", h), ("n_groups", g)):
            if v % tp:
                raise ValueError(f"{what} ({v}) is not divisible by the tensor-parallel size ({tp})")
        if config.mamba_hidden_act != "silu":
            raise ValueError(f"mamba_hidden_act {config.mamba_hidden_act!r} is not supported (only silu)")
        self.state_index = state_index
        self.p, self.n, self.kernel = config.mamba_head_dim, config.ssm_state_size, config.conv_kernel
        self.h, self.g = h // tp, g // tp  # this rank's heads and groups
        self.chunk = int(config.chunk_size)
        low, high = config.time_step_limit
        self.dt_min, self.dt_max = float(low), float(high)
        inner, groups = h * self.p, g * self.n
        bias = bool(config.use_bias)
        self.conv_segments = [inner, groups, groups]
        self.in_proj = SegmentedColumnParallelLinear(config.hidden_size, [inner, *self.conv_segments, h], bias,
                                                     prefix=f"{prefix}.in_proj")
        channels = sum(self.conv_segments) // tp
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(channels, 1, self.kernel), requires_grad=False)
        params = [self.conv1d.weight]
        if config.use_conv_bias:
            self.conv1d.bias = nn.Parameter(torch.empty(channels), requires_grad=False)
            params.append(self.conv1d.bias)
        else:
            self.conv1d.bias = None
        for p in params:
            set_weight_loader(p, lambda p, w, _=None: split_rows(p, self.conv_segments, w))
        self.A_log = nn.Parameter(torch.empty(self.h), requires_grad=False)
        self.D = nn.Parameter(torch.empty(self.h), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.h), requires_grad=False)
        for p in (self.A_log, self.D, self.dt_bias):
            set_weight_loader(p, lambda p, w, _=None: split_rows(p, [h], w))
        self.norm = GatedGroupRMSNorm(self.h * self.p, inner // g, config.layer_norm_epsilon)
        set_weight_loader(self.norm.weight, lambda p, w, _=None: split_rows(p, [inner], w))
        self.out_proj = RowParallelLinear(inner, config.hidden_size, bias, prefix=f"{prefix}.out_proj")

    def state_spec(self) -> Mamba2StateSpec:
        return Mamba2StateSpec(self.conv1d.weight.shape[0], self.kernel - 1, self.h, self.p, self.n)

    def _conv(self, xbc: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """xbc [L, C] after the K-1 inputs of state [C, K-1]: (silu(conv + bias) [L, C], the new state)."""
        full = torch.cat([state.to(xbc.dtype), xbc.t()], dim=-1)
        w = self.conv1d.weight
        out = F.conv1d(full[None].to(w.dtype), w, self.conv1d.bias, groups=full.shape[0])[0]
        return F.silu(out).to(xbc.dtype).t(), full[:, full.shape[1] - state.shape[1] :]

    def _heads(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[..., C] -> x [..., H, P], B and C [..., H, N] (each group's repeated for its heads)."""
        x, b, c = y.split([self.h * self.p, self.g * self.n, self.g * self.n], dim=-1)
        r = self.h // self.g
        b = b.unflatten(-1, (self.g, self.n)).repeat_interleave(r, dim=-2)
        c = c.unflatten(-1, (self.g, self.n)).repeat_interleave(r, dim=-2)
        return x.unflatten(-1, (self.h, self.p)), b, c

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        step = get_forward_context().state
        if step is None:
            raise RuntimeError("a Mamba-2 layer ran without a recurrent-state slot (the runner sets one per step)")
        t, inner = hidden.shape[0], self.h * self.p
        z, xbc, dt = self.in_proj(hidden).split([inner, inner + 2 * self.g * self.n, self.h], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(self.dt_min, self.dt_max)
        a = -torch.exp(self.A_log.float())
        conv_cache, ssm_cache = step.cache.layers[self.state_index]
        out = torch.empty(t, self.h, self.p, dtype=torch.float32, device=hidden.device)
        starts = [0]
        for n in step.query_lens:
            starts.append(starts[-1] + n)
        decode = [i for i, (n, fresh, pend) in enumerate(zip(step.query_lens, step.fresh, step.pending, strict=True))
                  if n == 1 and not fresh and not pend]
        if decode:
            rows = torch.tensor([starts[i] for i in decode], device=hidden.device)
            slots = torch.tensor([step.slots[i] for i in decode], device=hidden.device)
            full = torch.cat([conv_cache[slots].to(xbc.dtype), xbc[rows][..., None]], dim=-1)  # [S, C, K]
            conv_cache[slots] = full[..., 1:].to(conv_cache.dtype)
            y = (full * self.conv1d.weight[:, 0]).sum(-1)
            y = F.silu(y if self.conv1d.bias is None else y + self.conv1d.bias).to(xbc.dtype)
            x, b, c = self._heads(y)
            o, ssm_cache[slots] = ssd_step(ssm_cache[slots], x, dt[rows], a, b, c, self.D)
            out[rows] = o
        done = set(decode)
        for i, slot in enumerate(step.slots):
            if i in done:
                continue
            lo, hi = starts[i], starts[i + 1]
            conv_state = torch.zeros_like(conv_cache[slot]) if step.fresh[i] else conv_cache[slot]
            y, conv_next = self._conv(xbc[lo:hi], conv_state)
            x, b, c = self._heads(y)
            state = torch.zeros_like(ssm_cache[slot]) if step.fresh[i] else ssm_cache[slot]
            o, last = ssd_chunked(x, dt[lo:hi], a, b, c, self.D, self.chunk, state)
            out[lo:hi] = o
            if step.pending[i]:  # a verify: its slot waits for the positions the sampler keeps (commit)
                step.keep(self.state_index, i, (xbc[lo:hi], x, dt[lo:hi], b, a, last, conv_next))
                continue
            conv_cache[slot], ssm_cache[slot] = conv_next.to(conv_cache.dtype), last
        y = self.norm(out.to(hidden.dtype).reshape(t, inner), z)
        return self.out_proj(y)
