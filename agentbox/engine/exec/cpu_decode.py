"""Decode steps of a Llama-family model on CPU through kernels/cpu_decode.c: one C call per layer.

What a CUDA graph is on a GPU, this is on a CPU: the step's small ops (residual adds, RMSNorm, rotary, the
KV store, attention, SiLU) cost more in PyTorch's per-op dispatch than the quantised matmuls cost in arithmetic,
so the layer runs as one call. The runner chooses it (`CpuDecode.build` once per model, `fits` per step), as
it chooses a CUDA graph; the model file knows nothing of it. A model qualifies when every layer is a
Llama-family layer (Llama, Qwen2's qkv bias, Qwen3's q/k norm; no other biases, no sinks or windows) with a dense
SiLU MLP or Qwen3-MoE's routed experts, whose linears run the CPU SIMD kernels (kernels/cpu_gemv's 4-bit one,
kernels/cpu_bits' k-bit one, or runs of both: layers/quant/cpu_parts.py) and whose experts declare their CPU form
(`ExpertMethod.cpu_parts`), in fp32 at tensor-parallel size 1; a step qualifies when every sequence brings at most
MAX_QUERY tokens (a decode, a speculative verify, a short extend). Anything else runs the torch layers, which define
the numbers this path must match (tests/test_cpu_decode.py, tests/test_cpu_decode_moe.py).

A sequence's several tokens run as that many rows, each attending to the sequence's pages up to its own
position: the C layer stores every row's k/v before any row attends, so a row sees the rows before it, and
its numbers are those of a one-token decode at that position (the 4-bit kernel's rows do not depend on the
step's size, and the attention reads each block of keys once for all the rows and GQA heads of a sequence, in
each query's own order). A verify of k drafts is thus one pass over the weights and one over the keys for
k + 1 rows, and its accepted tokens are bit for bit what decoding them one by one gives.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from agentbox.layers.backends.base import AttentionMetadata, KVCache
from agentbox.layers.context import get_forward_context
from agentbox.layers.experts import FusedMoE
from agentbox.layers.experts.base import MoEActivation
from agentbox.layers.experts.placement import ExpertClock, ExpertHome
from agentbox.layers.quant.cpu_parts import MoeStruct, PartStruct, cpu_parts, moe_struct, part_struct
from agentbox.models.base import CausalLM
from agentbox.models.llama import LlamaDecoderLayer, LlamaMLP
from agentbox.models.qwen3_moe import Qwen3MoeSparseBlock

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_enabled = True
# Tokens of one sequence the fused path takes in a step: a verify of the largest draft and a short extend
# (a warm turn's few new tokens); longer prefills run the torch layers (their sgemm-free attention is O(n^2)
# per row here, and a prefill is compute-bound anyway).
MAX_QUERY = 32


PARTS = 3  # AB_PARTS: runs of rows a linear may have


class _Linear(ctypes.Structure):
    _fields_ = [("part", PartStruct * PARTS), ("parts", _i64)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear), ("moe", _ptr),
                ("ln1", _ptr), ("ln2", _ptr), ("qkv_bias", _ptr), ("q_norm", _ptr), ("k_norm", _ptr),
                ("k_cache", _ptr), ("v_cache", _ptr), ("kv_f16", _i64), ("moe_seconds", _ptr)]
# The KV pool's element types the C layer stores and reads (kv_f16 says which): fp16 is the default CPU pool.
KV_DTYPES = (torch.float32, torch.float16)


class _Dims(ctypes.Structure):
    _fields_ = [("hidden", _i64), ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64), ("inter", _i64),
                ("cos", _ptr), ("sin", _ptr), ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Decode through the torch layers inside (the twin this path is tested against)."""
    global _enabled
    previous, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = previous


def _linear(linear: nn.Module) -> _Linear:
    parts = cpu_parts(linear)
    assert parts is not None and len(parts) <= PARTS  # eligible() checked
    out = _Linear()
    for i, p in enumerate(parts):
        out.part[i] = part_struct(p)
    out.parts = len(parts)
    return out


def _linears(layer: nn.Module) -> list[nn.Module]:
    attn = [layer.self_attn.qkv_proj, layer.self_attn.o_proj]
    return attn if type(layer.mlp) is Qwen3MoeSparseBlock else [*attn, layer.mlp.gate_up_proj, layer.mlp.down_proj]


def _experts_eligible(mlp: Qwen3MoeSparseBlock) -> bool:
    experts: FusedMoE = mlp.experts
    if experts.tp_size != 1 or experts.w13_bias is not None or experts.w2_bias is not None:
        return False
    if experts.activation is not MoEActivation.SILU or experts.method.cpu_parts(experts) is None:
        return False
    router = mlp.gate.weight  # unquantised (qwen3_moe.py): a dense fp32 [E, H] table
    return (router.dtype == torch.float32 and tuple(router.shape) == (experts.num_experts, experts.hidden_size)
            and mlp.gate.bias is None and router.is_contiguous())


def _moe(mlp: Qwen3MoeSparseBlock) -> MoeStruct:
    experts: FusedMoE = mlp.experts
    parts = experts.method.cpu_parts(experts)
    assert parts is not None  # eligible() checked
    return moe_struct(*parts, experts.num_experts, experts.top_k, experts.renormalize, experts.intermediate_local,
                      mlp.gate.weight)


def eligible(model: nn.Module) -> bool:
    """Static checks, once per model (see the module notes)."""
    from agentbox.kernels import cpu_gemv

    if not cpu_gemv.available():
        return False
    for layer in model.layers:
        if type(layer) is not LlamaDecoderLayer:
            return False
        if type(layer.mlp) is Qwen3MoeSparseBlock:
            if not _experts_eligible(layer.mlp):
                return False
        elif type(layer.mlp) is not LlamaMLP:
            return False
        attn = layer.self_attn
        if attn.sinks is not None or attn.attn.sliding_window is not None or attn.qkv_proj.tp_size != 1:
            return False
        if attn.head_dim % 8:
            return False  # the C attention reads a head in 8-lane vectors
        for lin in _linears(layer):
            parts = cpu_parts(lin)
            if parts is None or len(parts) > PARTS:
                return False
            if lin.bias is not None and (lin is not attn.qkv_proj or lin.bias.dtype != torch.float32):
                return False  # the layer adds a qkv bias (Qwen2) only
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if attn.qk_norm:
            norms += [attn.q_norm, attn.k_norm]
        if any(n.weight.dtype != torch.float32 or n.eps != layer.input_layernorm.eps for n in norms):
            return False  # one eps for every norm of the layer, as the C layer takes it
    return model.rotary.cos_cached.dtype == torch.float32


@dataclass
class _Plan:
    layers: list[_Layer]
    dims: _Dims
    cache_key: tuple[int, ...]  # the KV tensors the layer structs point into
    moes: list[MoeStruct | None]  # what the layer structs' moe point to (kept alive here)
    timed: list[tuple[ctypes.c_double, ExpertClock]]  # host experts' layers: where C adds their time, their clock


def _plan(model: nn.Module, kv: Any) -> _Plan:
    first = model.layers[0].self_attn
    rotary = model.rotary
    layers, moes, timed = [], [], []
    dense = [layer.mlp for layer in model.layers if type(layer.mlp) is LlamaMLP]
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        moe = _moe(layer.mlp) if type(layer.mlp) is Qwen3MoeSparseBlock else None
        mlp = (_Linear(), _Linear()) if moe is not None else (_linear(layer.mlp.gate_up_proj), _linear(layer.mlp.down_proj))
        bias = attn.qkv_proj.bias
        qn, kn = (attn.q_norm.weight.data_ptr(), attn.k_norm.weight.data_ptr()) if attn.qk_norm else (None, None)
        moes.append(moe)
        experts = layer.mlp.experts if moe is not None else None
        seconds = None  # where C adds the routed experts' time: host experts only, as FusedMoE's own path counts it
        if experts is not None and experts.home is ExpertHome.HOST:
            timed.append((ctypes.c_double(0.0), experts.clock))
            seconds = ctypes.addressof(timed[-1][0])
        layers.append(_Layer(_linear(attn.qkv_proj), _linear(attn.o_proj), *mlp,
                             None if moe is None else ctypes.addressof(moe), layer.input_layernorm.weight.data_ptr(),
                             layer.post_attention_layernorm.weight.data_ptr(), None if bias is None else bias.data_ptr(),
                             qn, kn, kv.k[i].data_ptr(), kv.v[i].data_ptr(), int(kv.k[i].dtype == torch.float16),
                             seconds))
    inter = dense[0].down_proj.input_size if dense else 1  # the dense MLP's scratch (MoE layers use none)
    dims = _Dims(model.layers[0].input_layernorm.weight.numel(), first.num_heads, first.num_kv_heads, first.head_dim,
                 inter, rotary.cos_cached.data_ptr(), rotary.sin_cached.data_ptr(),
                 model.layers[0].input_layernorm.eps, first.attn.scale)
    return _Plan(layers, dims, _cache_key(kv), moes, timed)


def _cache_key(kv: Any) -> tuple[int, ...]:
    return tuple(t.data_ptr() for t in (*kv.k, *kv.v))


class CpuDecode:
    """The fused decode of one model (the LlamaModel its `fused_cpu_decode_target` names): embedding, the C
    layers, the final norm. The runner calls `run` inside the step's forward context when `fits` says so."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._plan: _Plan | None = None

    @staticmethod
    def build(lm: CausalLM, device: torch.device) -> CpuDecode | None:
        """The fused decode of `lm`, or None when the model does not qualify (see the module notes)."""
        inner = lm.fused_cpu_decode_target()
        if device.type != "cpu" or inner is None or not eligible(inner):
            return None
        probe = inner.embed_tokens(torch.zeros(1, dtype=torch.int64, device=device))
        return CpuDecode(inner) if probe.dtype == torch.float32 else None  # the C layer reads fp32 hidden states

    def fits(self, meta: AttentionMetadata, kv: KVCache) -> bool:
        """Whether this step runs fused: every sequence brings at most MAX_QUERY tokens, into an fp32 or fp16 KV
        pool."""
        return _enabled and meta.max_query_len <= MAX_QUERY and kv.k[0].dtype in KV_DTYPES

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The final hidden states [T, H], as the model's forward returns them (inside a forward context)."""
        model = self.model
        hidden = model.embed_tokens(input_ids)
        ctx = get_forward_context()
        kv = ctx.backend.kv_cache
        if self._plan is None or self._plan.cache_key != _cache_key(kv):
            self._plan = _plan(model, kv)
        plan = self._plan
        hidden, residual = run_layers(plan, hidden, positions, ctx.meta)
        for seconds, clock in plan.timed:  # only host experts' layers: a dense model's step loops over nothing
            clock.add(seconds.value)
            seconds.value = 0.0
        hidden, _ = model.norm(hidden, residual)
        return hidden


def run_layers(
    plan: _Plan, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden, residual) after every layer of the plan: one C call per layer."""
    from agentbox.kernels import cpu_gemv

    if hidden.shape[0] != sum(meta.query_lens):
        raise ValueError(f"the step has {hidden.shape[0]} tokens, its metadata {sum(meta.query_lens)}")
    hidden = hidden.contiguous()  # the embedding's fresh output: updated in place
    residual = torch.empty_like(hidden)
    pos = positions.to(torch.int64).contiguous()
    slots = meta.slot_mapping.to(torch.int64).contiguous()
    table = meta.page_table.to(torch.int32)
    if meta.is_decode_only:
        kv_lens = torch.tensor(meta.kv_lens, dtype=torch.int64)
    else:  # one row per token: its sequence's pages, the keys up to its own position
        table = table.repeat_interleave(torch.tensor(meta.query_lens), dim=0)
        kv_lens = torch.tensor([kv - q + 1 + j for q, kv in zip(meta.query_lens, meta.kv_lens, strict=True)
                                for j in range(q)], dtype=torch.int64)
    table = table.contiguous()
    lib, threads = cpu_gemv._lib(), cpu_gemv.threads()
    args = (hidden.data_ptr(), residual.data_ptr())
    for i, layer in enumerate(plan.layers):
        rc = lib.ab_decode_layer(
            ctypes.addressof(layer), ctypes.addressof(plan.dims), *args, int(i == 0), hidden.shape[0], pos.data_ptr(),
            slots.data_ptr(), table.data_ptr(), table.shape[1], meta.page_size, kv_lens.data_ptr(), threads,
        )
        if rc != 0:
            raise RuntimeError(f"the CPU decode layer {i} failed (code {rc})")
    return hidden, residual
