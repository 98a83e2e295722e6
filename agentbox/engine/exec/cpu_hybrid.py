"""Decode steps of a Qwen3.5-layout hybrid on CPU through kernels/cpu_hybrid.c: one C call per layer.

engine/exec/cpu_decode.py's idea for the hybrid (Qwen3.5 / Qwen3.6 dense, 3 Gated DeltaNet : 1 gated attention):
the torch layers spend ~40 dispatched ops on a delta-net layer's token and ~30 on a gated attention layer's, more
time than the matmuls at hidden 512, so a decode step runs each layer as one call. The model declares the stack
(`fused_cpu_hybrid_target`); `eligible` checks each layer once: a delta-net layer in the Qwen3.5 layout (z, b and a
apart from [q | k | v]) with a SiLU output gate, a gated attention layer without a window or sinks, a dense SiLU
MLP, every linear an fp16 or bf16 weight the CPU reads as stored (kernels/cpu_f16.py; an fp32 or `--exact-cpu`
model runs the torch layers), tensor-parallel size 1. A step qualifies when every sequence brings at most MAX_QUERY tokens (a
decode, a speculative verify, a short extend); longer prefills take the torch layers, which define the numbers this
path must match (tests/test_cpu_hybrid.py).

A sequence's rows run in order over its state: in its slot, or for a verify (whose slot waits for the sampler's
verdict) over a working copy, with what the torch layer stashes for the next step's commit (the conv inputs,
prepared k, v, decay and beta of each position, the final state) written beside it: the commit then runs as it
does after a torch verify. An extend runs the recurrent form token by token where the torch layers run the
chunked one: the same sums, in another order.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from agentbox.engine.exec.cpu_decode import KV_DTYPES
from agentbox.layers.backends.base import AttentionMetadata, KVCache
from agentbox.layers.context import get_forward_context
from agentbox.models.base import CausalLM
from agentbox.models.llama import LlamaMLP
from agentbox.models.qwen3_5 import HybridDecoderLayer

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_enabled = True
# Tokens of one sequence the fused path takes in a step (cpu_decode.py's bound: a verify of the largest draft, a
# warm turn's few new tokens); a longer prefill runs the torch layers' chunked delta rule and sgemm.
MAX_QUERY = 32


class _F16(ctypes.Structure):
    _fields_ = [("w", _ptr), ("n", _i64), ("k", _i64), ("bf16", _i64)]


class _Layer(ctypes.Structure):
    _fields_ = [("in_qkv", _F16), ("in_z", _F16), ("in_b", _F16), ("in_a", _F16), ("out", _F16), ("qkv", _F16),
                ("o", _F16), ("gate_up", _F16), ("down", _F16), ("ln1", _ptr), ("ln2", _ptr), ("conv_w", _ptr),
                ("a_log", _ptr), ("dt_bias", _ptr), ("gdn_norm", _ptr), ("conv_state", _ptr), ("matrix", _ptr),
                ("q_norm", _ptr), ("k_norm", _ptr), ("k_cache", _ptr), ("v_cache", _ptr), ("linear", _i64),
                ("kv_f16", _i64)]


class _Dims(ctypes.Structure):
    _fields_ = [("hidden", _i64), ("inter", _i64), ("hk", _i64), ("hv", _i64), ("dk", _i64), ("dv", _i64),
                ("kernel", _i64), ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64), ("rotary_dim", _i64),
                ("cos", _ptr), ("sin", _ptr), ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


class _Step(ctypes.Structure):
    _fields_ = [("positions", _ptr), ("state_slots", _ptr), ("work", _ptr), ("kv_slots", _ptr), ("kv_lens", _ptr),
                ("page_table", _ptr), ("pt_stride", _i64), ("page_size", _i64), ("conv_work", _ptr),
                ("matrix_work", _ptr), ("stash_x", _ptr), ("stash_k", _ptr), ("stash_v", _ptr), ("stash_g", _ptr),
                ("stash_b", _ptr)]


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Decode through the torch layers inside (the twin this path is tested against)."""
    global _enabled
    previous, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = previous


def _linears(layer: nn.Module) -> list[nn.Module]:
    mixer = [layer.linear_attn.in_proj_qkv, layer.linear_attn.in_proj_z, layer.linear_attn.in_proj_b,
             layer.linear_attn.in_proj_a, layer.linear_attn.out_proj] if layer.is_linear else [
             layer.self_attn.qkv_proj, layer.self_attn.o_proj]
    return [*mixer, layer.mlp.gate_up_proj, layer.mlp.down_proj]


def _norms(layer: nn.Module) -> list[nn.Module]:
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    return norms + ([layer.linear_attn.norm] if layer.is_linear else [layer.self_attn.q_norm, layer.self_attn.k_norm])


def eligible(model: nn.Module) -> bool:
    """Static checks, once per model (see the module notes)."""
    from agentbox.kernels import cpu_f16, cpu_gemv
    from agentbox.layers.gated_deltanet import GATE_ACTIVATIONS

    if not cpu_gemv.available():
        return False
    eps, rotary = model.norm.eps, None
    for layer in model.layers:
        if type(layer) is not HybridDecoderLayer or type(layer.mlp) is not LlamaMLP:
            return False
        for lin in _linears(layer):
            if not cpu_f16.supported(lin.weight) or lin.bias is not None or lin.tp_size != 1:
                return False
        if any(n.weight.dtype != torch.float32 or n.eps != eps for n in _norms(layer)):
            return False  # one eps for every norm, as the C layer takes it
        if layer.is_linear:
            net = layer.linear_attn
            if net.fused_qkvz or net.norm.act is not GATE_ACTIVATIONS["silu"] or net.conv1d.weight.dtype != torch.float32:
                return False
        else:
            attn = layer.self_attn
            if attn.attn.sinks is not None or attn.attn.sliding_window is not None or attn.head_dim % 8:
                return False  # the C attention reads a head in 8-lane vectors
            if attn.rotary_dim % 2 or attn.rotary.cos_cached.dtype != torch.float32:
                return False
            if rotary is None:
                rotary = attn.rotary
            elif not torch.equal(rotary.cos_cached, attn.rotary.cos_cached):
                return False  # one table for every attention layer
    return True


@dataclass
class _Plan:
    layers: list[_Layer]
    dims: _Dims
    cache_key: tuple[int, ...]  # the KV and state tensors the layer structs point into
    keep: list[torch.Tensor] = field(default_factory=list)  # tensors made here that the structs point into


def _f16(linear: nn.Module) -> _F16:
    w = linear.weight
    return _F16(w.data_ptr(), w.shape[0], w.shape[1], int(w.dtype == torch.bfloat16))


def _cache_key(kv: Any, state: Any) -> tuple[int, ...]:
    return tuple(t.data_ptr() for t in (*kv.k, *kv.v, *(x for ts in state.cache.layers for x in ts)))


def _plan(model: nn.Module, kv: Any, state: Any) -> _Plan:
    keep: list[torch.Tensor] = []

    def ptr(t: torch.Tensor) -> int:
        t = t.detach().float().contiguous()
        keep.append(t)
        return t.data_ptr()

    none = _F16(None, 0, 0, 0)
    layers, dims = [], _Dims()
    for layer in model.layers:
        mlp = layer.mlp
        common = dict(gate_up=_f16(mlp.gate_up_proj), down=_f16(mlp.down_proj),
                      ln1=ptr(1.0 + layer.input_layernorm.weight), ln2=ptr(1.0 + layer.post_attention_layernorm.weight))
        dims.hidden, dims.inter = layer.input_layernorm.weight.numel(), mlp.down_proj.weight.shape[1]
        if layer.is_linear:
            net = layer.linear_attn
            conv, matrix = state.cache.layers[net.state_index]
            layers.append(_Layer(
                in_qkv=_f16(net.in_proj_qkv), in_z=_f16(net.in_proj_z), in_b=_f16(net.in_proj_b),
                in_a=_f16(net.in_proj_a), out=_f16(net.out_proj), qkv=none, o=none, **common,
                conv_w=ptr(net.conv1d.weight.squeeze(1)), a_log=ptr(net.A_log), dt_bias=ptr(net.dt_bias),
                gdn_norm=ptr(net.norm.weight), conv_state=conv.data_ptr(), matrix=matrix.data_ptr(), linear=1))
            dims.hk, dims.hv, dims.dk, dims.dv, dims.kernel = net.hk, net.hv, net.dk, net.dv, net.kernel
        else:
            attn = layer.self_attn
            i = attn.attn.layer_id
            layers.append(_Layer(
                in_qkv=none, in_z=none, in_b=none, in_a=none, out=none, qkv=_f16(attn.qkv_proj), o=_f16(attn.o_proj),
                **common, q_norm=ptr(1.0 + attn.q_norm.weight), k_norm=ptr(1.0 + attn.k_norm.weight),
                k_cache=kv.k[i].data_ptr(), v_cache=kv.v[i].data_ptr(), linear=0,
                kv_f16=int(kv.k[i].dtype == torch.float16)))
            dims.heads, dims.kv_heads, dims.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
            dims.rotary_dim, dims.scale = attn.rotary_dim, attn.attn.scale
            dims.cos, dims.sin = attn.rotary.cos_cached.data_ptr(), attn.rotary.sin_cached.data_ptr()
    dims.eps = model.norm.eps
    return _Plan(layers, dims, _cache_key(kv, state), keep)


class HybridCpuDecode:
    """The fused decode of one hybrid stack: embedding, the C layers, the final norm. The runner calls `run` inside
    the step's forward context when `fits` says so."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._plan: _Plan | None = None

    @staticmethod
    def build(lm: CausalLM, device: torch.device) -> HybridCpuDecode | None:
        """The fused decode of `lm`, or None when the model does not qualify (see the module notes)."""
        inner = lm.fused_cpu_hybrid_target()
        if device.type != "cpu" or inner is None or not eligible(inner):
            return None
        probe = inner.embed_tokens(torch.zeros(1, dtype=torch.int64, device=device))
        return HybridCpuDecode(inner) if probe.dtype == torch.float32 else None

    def fits(self, meta: AttentionMetadata, kv: KVCache) -> bool:
        """Whether this step runs fused: every sequence brings at most MAX_QUERY tokens, fp32 or fp16 KV (cpu_decode.c's
        store and attention take either), fp32 state."""
        state = get_forward_context().state
        if not _enabled or state is None or meta.max_query_len > MAX_QUERY or (kv.k and kv.k[0].dtype not in KV_DTYPES):
            return False
        return all(t.dtype == torch.float32 for ts in state.cache.layers for t in ts)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The final hidden states [T, H], as the model's forward returns them (inside a forward context)."""
        from agentbox.kernels import cpu_gemv

        model = self.model
        ctx = get_forward_context()
        kv, state, meta = ctx.backend.kv_cache, ctx.state, ctx.meta
        if self._plan is None or self._plan.cache_key != _cache_key(kv, state):
            self._plan = _plan(model, kv, state)
        plan = self._plan
        hidden = model.embed_tokens(input_ids).contiguous()  # the embedding's fresh output: updated in place
        m = hidden.shape[0]
        if m != sum(meta.query_lens):
            raise ValueError(f"the step has {m} tokens, its metadata {sum(meta.query_lens)}")
        residual = torch.empty_like(hidden)
        rows = _Rows.of(meta, state)
        for i, fresh in enumerate(state.fresh):
            if fresh:  # a sequence that starts here starts from zeros, as the torch layers do
                for tensors in state.cache.layers:
                    for t in tensors:
                        t[state.slots[i]].zero_()
        pos = positions.to(torch.int64).contiguous()
        kv_slots = meta.slot_mapping.to(torch.int64).contiguous()
        step = _Step(pos.data_ptr(), rows.slots.data_ptr(), rows.work.data_ptr(), kv_slots.data_ptr(),
                     rows.kv_lens.data_ptr(), rows.table.data_ptr(), rows.table.shape[1], meta.page_size)
        lib, threads = cpu_gemv._lib(), cpu_gemv.threads()
        dims = ctypes.addressof(plan.dims)
        for i, (layer, module) in enumerate(zip(plan.layers, model.layers, strict=True)):
            stash = _Stash.of(module, m, rows.verifies) if layer.linear and rows.verifies else None
            if stash is not None:
                stash.point(step)
            rc = lib.ab_hybrid_layer(ctypes.addressof(layer), dims, ctypes.addressof(step), hidden.data_ptr(),
                                     residual.data_ptr(), int(i == 0), m, threads)
            if rc != 0:
                raise RuntimeError(f"the CPU hybrid layer {i} failed (code {rc})")
            if stash is not None:
                stash.keep(module.linear_attn, state, rows)
        hidden, _ = model.norm(hidden, residual)
        return hidden


@dataclass
class _Rows:
    """Per row of the step: its sequence's state slot, its verify's working-state index (-1: the slot in place),
    its sequence's page-table row and the keys it attends to (up to its own position)."""

    slots: torch.Tensor
    work: torch.Tensor
    table: torch.Tensor
    kv_lens: torch.Tensor
    verifies: list[tuple[int, int, int]]  # (sequence, first row, end row) of each verify, in work-index order

    @staticmethod
    def of(meta: AttentionMetadata, state: Any) -> _Rows:
        slots, work, verifies, lo = [], [], [], 0
        for i, (n, slot, pending) in enumerate(zip(meta.query_lens, state.slots, state.pending, strict=True)):
            slots += [slot] * n
            work += [len(verifies) if pending else -1] * n
            if pending:
                verifies.append((i, lo, lo + n))
            lo += n
        lens = torch.tensor(meta.query_lens)
        table = meta.page_table.to(torch.int32)
        if not meta.is_decode_only:
            table = table.repeat_interleave(lens, dim=0)
        kv_lens = [kv - q + 1 + j for q, kv in zip(meta.query_lens, meta.kv_lens, strict=True) for j in range(q)]
        return _Rows(torch.tensor(slots, dtype=torch.int64), torch.tensor(work, dtype=torch.int64),
                     table.contiguous(), torch.tensor(kv_lens, dtype=torch.int64), verifies)


@dataclass
class _Stash:
    """One delta-net layer's verify outputs: the working states and each row's conv inputs, prepared k, v, decay and
    beta (what the torch layer stashes for the next step's commit, layers/recurrent_state.py)."""

    conv: torch.Tensor  # [verifies, C, K-1]
    matrix: torch.Tensor  # [verifies, Hv, Dk, Dv]
    x: torch.Tensor  # [m, C]
    k: torch.Tensor  # [m, Hk Dk]
    v: torch.Tensor  # [m, Hv Dv]
    g: torch.Tensor  # [m, Hv]
    beta: torch.Tensor  # [m, Hv]

    @staticmethod
    def of(layer: nn.Module, m: int, verifies: list[tuple[int, int, int]]) -> _Stash:
        net = layer.linear_attn
        c, n = net.conv1d.weight.shape[0], len(verifies)
        return _Stash(torch.empty(n, c, net.kernel - 1), torch.empty(n, net.hv, net.dk, net.dv), torch.empty(m, c),
                      torch.empty(m, net.hk * net.dk), torch.empty(m, net.hv * net.dv), torch.empty(m, net.hv),
                      torch.empty(m, net.hv))

    def point(self, step: _Step) -> None:
        step.conv_work, step.matrix_work = self.conv.data_ptr(), self.matrix.data_ptr()
        step.stash_x, step.stash_k, step.stash_v = self.x.data_ptr(), self.k.data_ptr(), self.v.data_ptr()
        step.stash_g, step.stash_b = self.g.data_ptr(), self.beta.data_ptr()

    def keep(self, net: nn.Module, state: Any, rows: _Rows) -> None:
        r = net.hv // net.hk
        for w, (i, lo, hi) in enumerate(rows.verifies):
            n = hi - lo
            k = self.k[lo:hi].view(n, net.hk, net.dk).repeat_interleave(r, dim=1).transpose(0, 1)
            v = self.v[lo:hi].view(n, net.hv, net.dv).transpose(0, 1)
            state.keep(net.state_index, i, (self.x[lo:hi].t(), k, v, self.g[lo:hi].t(), self.beta[lo:hi].t(),
                                            self.matrix[w], self.conv[w]))
