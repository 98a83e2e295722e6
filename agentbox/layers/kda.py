"""Kimi Delta Attention (KDA, Kimi Linear; GLM-5.3-Flash's linear layers): the gated delta rule with a decay per
key channel (layers/delta_rule.py), after separate q, k, v projections each through its own short causal conv.

Per token: q, k, v = silu(conv(W_q x)), silu(conv(W_k x)), silu(conv(W_v x)) split into heads; the forget gate
is a low-rank pair (f_a_proj, f_b_proj) giving one value per head and key channel, g = lower_bound *
sigmoid(exp(A_log) * (f + dt_bias)) (a log decay in (lower_bound, 0): the "safe gate" the release uses), beta =
sigmoid(b_proj x) per head. The output is RMSNormed per head, times sigmoid of a low-rank gate (g_a_proj,
g_b_proj), and projected back. transformers' models/glm5_next (`Glm5NextTextLinearAttention`) is the reference.

Its state (the conv's last K-1 inputs of q|k|v, and a [Dk, Dv] fp32 matrix per head) lives in the step's
`StateCache` slot (layers/recurrent_state.py), exactly as Gated DeltaNet's: `KDAStateSpec` is `LinearStateSpec`
whose speculative commit replays the per-channel decay.

Tensor parallel: heads split over the ranks (q, k, v, f_b_proj, g_b_proj, b_proj by rows; dt_bias, A_log and the
convs by the heads they carry; f_a_proj, g_a_proj replicated; o_proj row-parallel).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from agentbox.layers import delta_rule
from agentbox.layers.context import get_forward_context
from agentbox.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from agentbox.layers.quant.lazy import materialize
from agentbox.layers.recurrent_state import LinearStateSpec
from agentbox.layers.weight_loading import set_weight_loader
from agentbox.parallel.state import tp_rank, tp_size


@dataclass(frozen=True)
class KDAStateSpec(LinearStateSpec):
    """A KDA layer's state: LinearStateSpec's tensors; a verify's stash carries g per key channel."""

    def commit(self, tensors: tuple[torch.Tensor, ...], slot: int, stash: tuple, lo: int, hi: int) -> None:
        conv, matrix = tensors
        x, k, v, g, beta, last, conv_last = stash
        if lo == 0 and hi == x.shape[-1]:
            conv[slot], matrix[slot] = conv_last, last
            return
        conv[slot] = torch.cat([conv[slot].to(x.dtype), x[:, lo:hi]], dim=-1)[:, -self.conv_len :]
        sel = slice(lo, hi)
        _, matrix[slot] = delta_rule.recurrent(  # q is unused for the state: k stands in
            k[None, :, sel], k[None, :, sel], v[None, :, sel], g[None, :, sel], beta[None, :, sel], matrix[slot][None]
        )


def _row_shard(param: nn.Parameter, loaded: Any, _shard: Any = None) -> None:
    """This rank's contiguous share of dim 0 (heads, or the channels of this rank's heads)."""
    loaded = materialize(loaded)
    n = loaded.shape[0] // tp_size()
    param.data.copy_(loaded.narrow(0, tp_rank() * n, n).reshape(param.shape))


def _fp32_sharded(*shape: int) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape, dtype=torch.float32), requires_grad=False)
    set_weight_loader(p, _row_shard)
    return p


class KimiDeltaAttention(nn.Module):
    def __init__(self, config: Any, state_index: int, prefix: str) -> None:
        super().__init__()
        heads, d, tp = config.linear_num_heads, config.linear_head_dim, tp_size()
        if heads % tp:
            raise ValueError(f"linear_num_heads ({heads}) is not divisible by the tensor-parallel size ({tp})")
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        self.state_index = state_index  # this layer's place in the StateCache
        self.heads, self.d = heads // tp, d
        self.lower_bound = config.linear_lower_bound  # None: the softplus decay (no safe gate)
        self.eps = config.rms_norm_eps
        hidden, dim = config.hidden_size, heads * d
        self.q_proj = ColumnParallelLinear(hidden, dim, prefix=f"{prefix}.q_proj")
        self.k_proj = ColumnParallelLinear(hidden, dim, prefix=f"{prefix}.k_proj")
        self.v_proj = ColumnParallelLinear(hidden, dim, prefix=f"{prefix}.v_proj")
        self.kernel = config.linear_conv_kernel_dim
        # the release keeps the three convs apart (q_conv1d, k_conv1d, v_conv1d), in fp32
        self.q_conv1d, self.k_conv1d, self.v_conv1d = nn.Module(), nn.Module(), nn.Module()
        for conv in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
            conv.weight = _fp32_sharded(dim // tp, 1, self.kernel)
        self.f_a_proj = ReplicatedLinear(hidden, d, prefix=f"{prefix}.f_a_proj")
        self.f_b_proj = ColumnParallelLinear(d, dim, prefix=f"{prefix}.f_b_proj")
        self.dt_bias = _fp32_sharded(dim // tp)
        self.A_log = _fp32_sharded(heads // tp)
        self.b_proj = ColumnParallelLinear(hidden, heads, prefix=f"{prefix}.b_proj")
        self.g_a_proj = ReplicatedLinear(hidden, d, prefix=f"{prefix}.g_a_proj")
        self.g_b_proj = ColumnParallelLinear(d, dim, prefix=f"{prefix}.g_b_proj")
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(d), requires_grad=False)
        self.o_proj = RowParallelLinear(dim, hidden, prefix=f"{prefix}.o_proj")

    def state_spec(self) -> KDAStateSpec:
        return KDAStateSpec(3 * self.heads * self.d, self.kernel - 1, self.heads, self.d, self.d)

    def _decay(self, x: torch.Tensor) -> torch.Tensor:
        """The log decay g [T, H, Dk] (<= 0), in fp32."""
        f = self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias
        f = f.view(x.shape[0], self.heads, self.d)
        rate = self.A_log.exp()[None, :, None]
        if self.lower_bound is not None:
            return float(self.lower_bound) * torch.sigmoid(rate * f)
        return -rate * F.softplus(f, threshold=20.0)

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[..., 3 * H * D] -> q, k, v [..., H, D]."""
        q, k, v = mixed.chunk(3, dim=-1)
        return tuple(x.unflatten(-1, (self.heads, self.d)) for x in (q, k, v))  # type: ignore[return-value]

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        step = get_forward_context().state
        if step is None:
            raise RuntimeError("a KDA layer ran without a recurrent-state slot (the runner sets one per step)")
        t = hidden.shape[0]
        mixed = torch.cat([self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)], dim=-1)
        conv_w = torch.cat([c.weight for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)]).squeeze(1)
        g = self._decay(hidden)  # [T, H, Dk]
        beta = torch.sigmoid(self.b_proj(hidden).float())  # [T, H]
        conv_cache, matrix_cache = step.cache.layers[self.state_index]
        out = torch.empty(t, self.heads, self.d, dtype=torch.float32, device=hidden.device)
        starts = [0]
        for n in step.query_lens:
            starts.append(starts[-1] + n)
        decode = [i for i, (n, fresh) in enumerate(zip(step.query_lens, step.fresh, strict=True)) if n == 1 and not fresh]
        if decode:
            rows = torch.tensor([starts[i] for i in decode], device=hidden.device)
            slots = torch.tensor([step.slots[i] for i in decode], device=hidden.device)
            x, conv_cache[slots] = delta_rule.causal_conv_step(mixed[rows].float(), conv_w, conv_cache[slots])
            q, k, v = self._heads(x)  # [B, H, D]
            q, k = delta_rule.prepare_qk(q, k)
            o, matrix_cache[slots] = delta_rule.recurrent(
                q.unsqueeze(2), k.unsqueeze(2), v.float().unsqueeze(2), g[rows].unsqueeze(2),
                beta[rows].unsqueeze(-1), matrix_cache[slots],
            )
            out[rows] = o.squeeze(2)
        done = set(decode)
        for i, slot in enumerate(step.slots):
            if i in done:
                continue
            lo, hi = starts[i], starts[i + 1]
            conv_state = conv_cache[slot].zero_() if step.fresh[i] else conv_cache[slot]
            x, conv_next = delta_rule.causal_conv(mixed[lo:hi].float().t(), conv_w, conv_state)
            q, k, v = self._heads(x.t())  # [L, H, D]
            q, k = delta_rule.prepare_qk(q.transpose(0, 1), k.transpose(0, 1))
            state = matrix_cache[slot].zero_() if step.fresh[i] else matrix_cache[slot]
            v, gi, bi = v.float().transpose(0, 1), g[lo:hi].transpose(0, 1), beta[lo:hi].t()
            if step.pending[i]:  # a verify: its slot waits for the positions the sampler keeps (commit)
                o, last = delta_rule.recurrent(q[None], k[None], v[None], gi[None], bi[None], state[None])
                step.keep(self.state_index, i, (mixed[lo:hi].float().t(), k, v, gi, bi, last[0], conv_next))
                out[lo:hi] = o[0].transpose(0, 1)
                continue
            conv_cache[slot] = conv_next
            o, matrix_cache[slot] = delta_rule.chunked_per_channel(q, k, v, gi, bi, state)
            out[lo:hi] = o.transpose(0, 1)
        gate = self.g_b_proj(self.g_a_proj(hidden)).view(t, self.heads, self.d)
        # fp32 norm and gate, as the reference's RMSNormGated (sigmoid, not Gated DeltaNet's silu)
        normed = F.rms_norm(out, (self.d,), self.o_norm.weight.float(), self.eps) * torch.sigmoid(gate.float())
        return self.o_proj(normed.to(hidden.dtype).reshape(t, self.heads * self.d))
