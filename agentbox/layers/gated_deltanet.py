"""The Gated DeltaNet layer of Qwen3.5 / Qwen3.6 / Qwen3-Next: projections, short causal conv, the gated delta
rule (layers/delta_rule.py), a gated RMSNorm and the output projection.

Its state lives in the step's `StateCache` slot (layers/recurrent_state.py): a sequence that starts in this
step starts from zeros; one that continues reads and writes its slot. Decoding sequences (one token each)
run the recurrent form together; prefill chunks run the chunked form one sequence at a time (on the CPU, one C call
from the in-projections to the gated norm: kernels/cpu_delta_rule.py).

Tensor parallel: key heads and value heads are split across ranks like attention heads (each rank's value
heads read the key heads they are grouped with), the conv's channels follow the q, k and v heads they carry,
and out_proj is row-parallel (one all-reduce per layer, as attention's o_proj).

Checkpoint layouts: Qwen3.5/3.6 store `in_proj_qkv` ([q | k | v] of every head), `in_proj_z`, `in_proj_b`,
`in_proj_a`; Qwen3-Next stores `in_proj_qkvz` and `in_proj_ba` grouped by key head ([q k v z] of each group),
so a contiguous row range there is whole groups and a plain column split keeps them together.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from agentbox.layers import delta_rule
from agentbox.layers.context import get_forward_context
from agentbox.layers.delta_rule_backends import DeltaRuleBackendName, delta_rule_for
from agentbox.layers.linear import ColumnParallelLinear, RowParallelLinear
from agentbox.layers.quant.lazy import materialize
from agentbox.layers.recurrent_state import LinearStateSpec
from agentbox.layers.weight_loading import set_weight_loader
from agentbox.parallel.state import tp_rank, tp_size


class SegmentedColumnParallelLinear(ColumnParallelLinear):
    """One checkpoint tensor whose output rows are several segments ([q | k | v]); each rank holds its slice
    of every segment, in segment order."""

    def __init__(self, input_size: int, segments: list[int], bias: bool = False, prefix: str = "") -> None:
        self.segments = segments
        super().__init__(input_size, sum(segments), bias, prefix)

    def out_range(self, shard_id: str | int | None) -> tuple[int, int, int]:
        i = int(shard_id or 0)
        local = [s // self.tp_size for s in self.segments]
        return sum(local[:i]), sum(self.segments[:i]) + self.tp_rank * local[i], local[i]

    def weight_loader(self, param: nn.Parameter, loaded_weight: Any, shard_id: str | int | None = None) -> None:
        for i in range(len(self.segments)) if shard_id is None else [int(shard_id)]:
            super().weight_loader(param, loaded_weight, i)


def split_rows(param: nn.Parameter, segments: list[int], loaded: Any) -> None:
    """Copy this rank's rows of each segment of `loaded` (dim 0) into `param`, in order."""
    tp, rank = tp_size(), tp_rank()
    loaded = materialize(loaded)
    parts, start = [], 0
    for size in segments:
        local = size // tp
        parts.append(loaded.narrow(0, start + rank * local, local))
        start += size
    value = torch.cat(parts).reshape(param.shape)
    param.data.copy_(value)


GATE_ACTIVATIONS = {"silu": F.silu, "sigmoid": torch.sigmoid}


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's values, then times act(z): the output gate of the delta rule (SiLU; Qwen3.8-Flash-
    Next's `output_gate_type` may name sigmoid)."""

    def __init__(self, dim: int, eps: float, activation: str = "silu") -> None:
        super().__init__()
        if activation not in GATE_ACTIVATIONS:
            raise ValueError(f"output gate {activation!r} is not supported (only {', '.join(GATE_ACTIVATIONS)})")
        self.eps = eps
        self.act = GATE_ACTIVATIONS[activation]
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        normed = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return (self.weight * normed.to(dtype) * self.act(z.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, config: Any, state_index: int, prefix: str, fused_qkvz: bool) -> None:
        super().__init__()
        tp = tp_size()
        hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
        for what, n in (("linear_num_key_heads", hk), ("linear_num_value_heads", hv)):
            if n % tp:
                raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size ({tp})")
        if hv % hk:
            raise ValueError(f"linear_num_value_heads ({hv}) is not a multiple of linear_num_key_heads ({hk})")
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        self.state_index = state_index  # this layer's place in the StateCache
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        self.hk, self.hv = hk // tp, hv // tp  # this rank's heads
        self.fused_qkvz = fused_qkvz
        key_dim, value_dim = hk * self.dk, hv * self.dv
        self.conv_segments = [key_dim, key_dim, value_dim]
        hidden = config.hidden_size
        if fused_qkvz:
            self.in_proj_qkvz = ColumnParallelLinear(hidden, 2 * key_dim + 2 * value_dim, prefix=f"{prefix}.in_proj_qkvz")
            self.in_proj_ba = ColumnParallelLinear(hidden, 2 * hv, prefix=f"{prefix}.in_proj_ba")
        else:
            self.in_proj_qkv = SegmentedColumnParallelLinear(hidden, self.conv_segments, prefix=f"{prefix}.in_proj_qkv")
            self.in_proj_z = ColumnParallelLinear(hidden, value_dim, prefix=f"{prefix}.in_proj_z")
            self.in_proj_b = ColumnParallelLinear(hidden, hv, prefix=f"{prefix}.in_proj_b")
            self.in_proj_a = ColumnParallelLinear(hidden, hv, prefix=f"{prefix}.in_proj_a")
        self.kernel = config.linear_conv_kernel_dim
        channels = sum(self.conv_segments) // tp
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(channels, 1, self.kernel), requires_grad=False)
        set_weight_loader(self.conv1d.weight, lambda p, w, _=None: split_rows(p, self.conv_segments, w))
        self.A_log = nn.Parameter(torch.empty(self.hv), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.hv), requires_grad=False)
        for p in (self.A_log, self.dt_bias):
            set_weight_loader(p, lambda p, w, _=None: split_rows(p, [hv], w))
        gate = getattr(config, "output_gate_type", None) or config.hidden_act
        self.norm = GatedRMSNorm(self.dv, config.rms_norm_eps, gate)
        self.out_proj = RowParallelLinear(value_dim, hidden, prefix=f"{prefix}.out_proj")

    def state_spec(self) -> LinearStateSpec:
        return LinearStateSpec(self.conv1d.weight.shape[0], self.kernel - 1, self.hv, self.dk, self.dv)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(mixed q|k|v [T, C], z [T, Hv, Dv], b [T, Hv], a [T, Hv]) for this rank's heads."""
        t = x.shape[0]
        if not self.fused_qkvz:
            z = self.in_proj_z(x).view(t, self.hv, self.dv)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        r = self.hv // self.hk  # value heads per key head
        qkvz = self.in_proj_qkvz(x).view(t, self.hk, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = qkvz.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        b, a = self.in_proj_ba(x).view(t, self.hk, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return mixed, z.reshape(t, self.hv, self.dv), b.reshape(t, self.hv), a.reshape(t, self.hv)

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[..., C] -> q, k [..., Hv, Dk] (key heads repeated for their value heads) and v [..., Hv, Dv]."""
        kd = self.hk * self.dk
        q, k, v = mixed.split([kd, kd, self.hv * self.dv], dim=-1)
        r = self.hv // self.hk
        q = q.unflatten(-1, (self.hk, self.dk)).repeat_interleave(r, dim=-2)
        k = k.unflatten(-1, (self.hk, self.dk)).repeat_interleave(r, dim=-2)
        return q, k, v.unflatten(-1, (self.hv, self.dv))

    def _mix_in_c(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_state: torch.Tensor,
                  state: torch.Tensor, out: torch.Tensor) -> bool:
        """A prefill chunk from the in-projections to the gated norm's input in one C call (kernels/cpu_delta_rule.py)
        where the CPU backend runs and the tensors suit it; the slots are updated in place. False: not taken."""
        if delta_rule_for(mixed.device).name is not DeltaRuleBackendName.CPU:
            return False
        from agentbox.kernels import cpu_delta_rule

        chunk = cpu_delta_rule.MixerChunk(mixed, b, a, self.conv1d.weight.squeeze(1), conv_state, self.A_log,
                                          self.dt_bias, self.hk, state, out)
        if not cpu_delta_rule.mixer_supported(chunk):
            return False
        cpu_delta_rule.delta_net_chunk(chunk)
        return True

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        step = get_forward_context().state
        if step is None:
            raise RuntimeError("a Gated DeltaNet layer ran without a recurrent-state slot (the runner sets one per step)")
        mixed, z, b, a = self._project(hidden)
        beta = b.float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        conv_w = self.conv1d.weight.squeeze(1)
        rule = delta_rule_for(hidden.device)  # flash-linear-attention on CUDA where it imports, else torch
        conv_cache, matrix_cache = step.cache.layers[self.state_index]
        out = torch.empty(hidden.shape[0], self.hv, self.dv, dtype=torch.float32, device=hidden.device)
        starts = [0]
        for n in step.query_lens:
            starts.append(starts[-1] + n)
        decode = [i for i, (n, fresh) in enumerate(zip(step.query_lens, step.fresh, strict=True)) if n == 1 and not fresh]
        if decode:
            rows = torch.tensor([starts[i] for i in decode], device=hidden.device)
            slots = torch.tensor([step.slots[i] for i in decode], device=hidden.device)
            x, conv_cache[slots] = delta_rule.causal_conv_step(mixed[rows], conv_w, conv_cache[slots])
            q, k, v = self._heads(x)  # [B, Hv, D]
            q, k = delta_rule.prepare_qk(q, k)
            o, matrix_cache[slots] = rule.recurrent(
                q.unsqueeze(2), k.unsqueeze(2), v.float().unsqueeze(2), g[rows].unsqueeze(-1),
                beta[rows].unsqueeze(-1), matrix_cache[slots],
            )
            out[rows] = o.squeeze(2)
        done = set(decode)
        for i, slot in enumerate(step.slots):
            if i in done:
                continue
            lo, hi = starts[i], starts[i + 1]
            conv_state = conv_cache[slot].zero_() if step.fresh[i] else conv_cache[slot]
            state = matrix_cache[slot].zero_() if step.fresh[i] else matrix_cache[slot]
            if not step.pending[i] and self._mix_in_c(mixed[lo:hi], b[lo:hi], a[lo:hi], conv_state, state, out[lo:hi]):
                continue
            x, conv_next = delta_rule.causal_conv(mixed[lo:hi].t(), conv_w, conv_state)
            q, k, v = self._heads(x.t())  # [L, Hv, D]
            q, k = delta_rule.prepare_qk(q.transpose(0, 1), k.transpose(0, 1))
            v, gi, bi = v.float().transpose(0, 1), g[lo:hi].t(), beta[lo:hi].t()
            if step.pending[i]:  # a verify: its slot waits for the positions the sampler keeps (commit)
                o, last = rule.recurrent(q[None], k[None], v[None], gi[None], bi[None], state[None])
                step.keep(self.state_index, i, (mixed[lo:hi].t(), k, v, gi, bi, last[0], conv_next))
                out[lo:hi] = o[0].transpose(0, 1)
                continue
            conv_cache[slot] = conv_next
            o, matrix_cache[slot] = rule.chunked(q, k, v, gi, bi, state)
            out[lo:hi] = o.transpose(0, 1)
        normed = self.norm(out.to(hidden.dtype), z)
        return self.out_proj(normed.reshape(hidden.shape[0], self.hv * self.dv))
