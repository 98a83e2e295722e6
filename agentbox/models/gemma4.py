"""Gemma 4 (31B dense, 26B-A4B MoE, and the small ones without shared KV): `Gemma4ForCausalLM` and the text model
of `Gemma4ForConditionalGeneration`, as transformers computes them.

What differs from Llama:
- layers are sliding (window `sliding_window`, default rope) or global (`per_layer_config`: a wider head,
  `global_head_dim`, often fewer KV heads, `num_global_key_value_heads`; "proportional" rope that turns the first
  quarter of the frequencies over the whole head). Only the global layers keep pages in the pool (the paged
  group of `cache_layout`, their own head size); each sliding layer keeps its last `sliding_window` positions
  in a ring per sequence (its state group, layers/window_kv.py), so its memory does not grow with the context;
- `attention_k_eq_v` on global layers: no v_proj, V comes from the same projection as K. The cache still keeps
  both: K is normed with a weight and rotated, V normed without one and not rotated, so they are different
  tensors (storing one would need the backend to re-derive K from V per position);
- q, k and v get a per-head RMSNorm (v's has no weight) and the attention scale is 1;
- four norms a layer ("sandwich": after attention, before and after the MLP), every one x / rms(x) * w in fp32;
  the layer ends by multiplying by a learned `layer_scalar`;
- embeddings scaled by sqrt(hidden) in the model dtype; tied LM head with optional final logit soft-capping;
- MoE layers (26B-A4B) run the dense MLP and the experts side by side on the same input, each with its own
  norms; the router normalises its input without weight, scales it, and multiplies each chosen expert's
  renormalised probability by a learned per-expert scale;
- per-layer input embeddings (the small models): a second embedding of num_layers x hidden_size_per_layer_input
  per token, mixed with a projection of the embeddings and fed to each layer through a gate.

Layers sharing another layer's KV (`num_kv_shared_layers`, Gemma 4 E2B/E4B) are refused with a message.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from agentbox.layers.attention import Attention
from agentbox.layers.backends.base import KVLayerSpec
from agentbox.layers.cache_layout import CacheLayout, PagedGroup, StateGroup
from agentbox.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from agentbox.layers.experts.base import ExpertShard, MoEActivation
from agentbox.layers.experts.layer import FusedMoE
from agentbox.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from agentbox.layers.norm import RMSNorm
from agentbox.layers.quant import QuantConfig, quant_context
from agentbox.layers.rotary import RotaryEmbedding
from agentbox.layers.window_kv import WindowAttention
from agentbox.models.base import AttentionShape, CausalLM, ExpertWeight, per_expert_weights
from agentbox.models.llama import LlamaForCausalLM
from agentbox.parallel.state import head_shard

SLIDING, GLOBAL = "sliding_attention", "full_attention"


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * w, all in fp32, then cast (transformers' Gemma4RMSNorm; w is stored as is, not w - 1)."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps).to(x.dtype)


def unit_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """The weightless RMSNorm (v_norm, the router's input norm)."""
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


class QKParallelLinear(QKVParallelLinear):
    """q and k in one matmul, no v (a global layer with attention_k_eq_v)."""

    def __init__(self, hidden_size: int, head_dim: int, total_heads: int, total_kv_heads: int, bias: bool) -> None:
        self.head_dim = head_dim
        self.shard = head_shard(total_heads, total_kv_heads)
        self.num_heads, self.num_kv_heads = self.shard.num_heads, self.shard.num_kv_heads
        LinearBase.__init__(self, hidden_size, (self.num_heads + self.num_kv_heads) * head_dim, bias, 0, "")

    def out_range(self, shard_id: str | int | None) -> tuple[int, int, int]:
        if shard_id == "v":
            raise ValueError("this layer ties V to K (attention_k_eq_v): the checkpoint should have no v_proj")
        return super().out_range(shard_id)


def layer_shape(config: Any, layer_id: int) -> tuple[int, int]:
    """(head_dim, total KV heads) of one layer: global layers read their per_layer_config."""
    per_layer = getattr(config, "per_layer_config", None)
    layer = per_layer[layer_id] if per_layer is not None else config
    return int(layer.head_dim), int(layer.num_key_value_heads)


def make_rotary(config: Any, kind: str, head_dim: int) -> RotaryEmbedding:
    params = dict(config.rope_parameters[kind])
    theta = float(params.pop("rope_theta"))
    scaling = None if params.get("rope_type", "default") == "default" else params
    return RotaryEmbedding(head_dim, config.max_position_embeddings, theta, scaling)


class Gemma4Attention(nn.Module):
    def __init__(self, config: Any, layer_id: int, rotary: RotaryEmbedding, index: int) -> None:
        """index: the layer's place among its kind (KV layer of the pool for a global layer, ring slot layer
        for a sliding one)."""
        super().__init__()
        self.sliding = config.layer_types[layer_id] == SLIDING
        self.head_dim, total_kv = layer_shape(config, layer_id)
        self.k_eq_v = bool(getattr(config, "attention_k_eq_v", False)) and not self.sliding
        bias = bool(getattr(config, "attention_bias", False))
        linear = QKParallelLinear if self.k_eq_v else QKVParallelLinear
        self.qkv_proj = linear(config.hidden_size, self.head_dim, config.num_attention_heads, total_kv, bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        sh = self.qkv_proj.shard
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias,
            input_shard=(sh.q_start * self.head_dim, sh.num_heads * self.head_dim),
        )
        self.eps = config.rms_norm_eps
        self.q_norm = GemmaRMSNorm(self.head_dim, self.eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, self.eps)
        self.rotary = rotary  # one per layer kind, shared
        # Scale 1: q and k are RMS-normed per head, the norm's weight carries the temperature. Sliding layers keep
        # their last `sliding_window` positions in a ring per sequence (layers/window_kv.py), global layers every
        # position in the paged pool.
        self.attn: nn.Module = (
            WindowAttention(self.num_heads, self.num_kv_heads, self.head_dim, 1.0, int(config.sliding_window), index)
            if self.sliding else Attention(self.num_heads, self.num_kv_heads, self.head_dim, 1.0, index)
        )

    def kv_spec(self) -> KVLayerSpec:
        return KVLayerSpec(self.num_kv_heads, self.head_dim)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        t, d = hidden.shape[0], self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        qkv = self.qkv_proj(hidden)
        q, k = qkv[:, :q_size], qkv[:, q_size : q_size + kv_size]
        v = k if self.k_eq_v else qkv[:, q_size + kv_size :]
        q = self.rotary.rotate(positions, self.q_norm(q.reshape(t, self.num_heads, d)))
        k = self.rotary.rotate(positions, self.k_norm(k.reshape(t, self.num_kv_heads, d)))
        v = unit_rms_norm(v.reshape(t, self.num_kv_heads, d), self.eps)
        return self.o_proj(self.attn(q, k, v))


class GeluMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        if config.hidden_activation != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation {config.hidden_activation!r} is not supported (gelu_pytorch_tanh)")
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter])
        self.down_proj = RowParallelLinear(inter, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma4Router(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.eps, self.top_k = config.rms_norm_eps, config.top_k_experts
        with quant_context(QuantConfig()):  # routers stay unquantised
            self.proj = ReplicatedLinear(config.hidden_size, config.num_experts)
        self.scale = nn.Parameter(torch.empty(config.hidden_size), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.empty(config.num_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k])."""
        x = unit_rms_norm(x, self.eps) * self.scale * x.shape[-1] ** -0.5
        probs = torch.softmax(self.proj(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[ids].float(), ids


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_id: int, rotary: RotaryEmbedding, index: int) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma4Attention(config, layer_id, rotary, index)
        self.mlp = GeluMLP(config)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, GemmaRMSNorm(h, eps))
        self.layer_scalar = nn.Parameter(torch.empty(1), requires_grad=False)
        self.moe = bool(getattr(config, "enable_moe_block", False))
        if self.moe:
            self.router = Gemma4Router(config)
            self.experts = FusedMoE(
                config.num_experts, config.top_k_experts, h, config.moe_intermediate_size, renormalize=True,
                activation=MoEActivation.GELU_TANH,
            )
            for name in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2"):
                setattr(self, name, GemmaRMSNorm(h, eps))
        self.per_layer = int(getattr(config, "hidden_size_per_layer_input", 0) or 0)
        if self.per_layer:
            self.per_layer_input_gate = ReplicatedLinear(h, self.per_layer)
            self.per_layer_projection = ReplicatedLinear(self.per_layer, h)
            self.post_per_layer_input_norm = GemmaRMSNorm(h, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, per_layer: torch.Tensor | None) -> torch.Tensor:
        residual = hidden
        hidden = self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(hidden)))
        hidden = residual = residual + hidden
        out = self.mlp(self.pre_feedforward_layernorm(hidden))
        if self.moe:
            weights, ids = self.router(residual)
            routed = self.experts.forward_routed(self.pre_feedforward_layernorm_2(residual), weights, ids)
            out = self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(routed)
        hidden = residual + self.post_feedforward_layernorm(out)
        if per_layer is not None:
            gate = F.gelu(self.per_layer_input_gate(hidden), approximate="tanh") * per_layer
            hidden = hidden + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return hidden * self.layer_scalar


class Gemma4TextModel(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        if getattr(config, "num_kv_shared_layers", 0):
            raise ValueError("Gemma 4 layers that reuse another layer's KV (num_kv_shared_layers, the E2B/E4B "
                             "models) are not supported; serve gemma-4-31b or gemma-4-26b-a4b")
        if getattr(config, "use_bidirectional_attention", None) == "all":
            raise ValueError("use_bidirectional_attention='all' is an encoder setting; agentbox serves causal models")
        self.hidden_size = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        kinds = sorted(set(config.layer_types))
        first = {kind: config.layer_types.index(kind) for kind in kinds}
        self.rotary = nn.ModuleDict(
            {kind: make_rotary(config, kind, layer_shape(config, first[kind])[0]) for kind in kinds}
        )
        counts = dict.fromkeys(kinds, 0)
        layers = []
        for i, kind in enumerate(config.layer_types):
            layers.append(Gemma4DecoderLayer(config, i, self.rotary[kind], counts[kind]))
            counts[kind] += 1
        self.layers = nn.ModuleList(layers)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ple_size = int(getattr(config, "hidden_size_per_layer_input", 0) or 0)
        if self.ple_size:  # per-layer input embeddings (the names transformers gives them)
            width = config.num_hidden_layers * self.ple_size
            self.embed_tokens_per_layer = VocabParallelEmbedding(config.vocab_size_per_layer_input, width)
            self.per_layer_model_projection = ReplicatedLinear(config.hidden_size, width)
            self.per_layer_projection_norm = GemmaRMSNorm(self.ple_size, config.rms_norm_eps)

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """[T, num_layers, P]: the token's own per-layer embedding mixed with a projection of its embedding."""
        t, n, p, dtype = input_ids.shape[0], len(self.layers), self.ple_size, embeds.dtype
        tokens = self.embed_tokens_per_layer(input_ids) * torch.tensor(p**0.5, dtype=dtype)
        projected = self.per_layer_model_projection(embeds) * embeds.shape[-1] ** -0.5
        projected = self.per_layer_projection_norm(projected.reshape(t, n, p))
        return (projected + tokens.reshape(t, n, p)) * 2.0**-0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        hidden = hidden * torch.tensor(self.hidden_size**0.5, dtype=hidden.dtype)  # rounded as transformers does
        per_layer = self.per_layer_inputs(input_ids, hidden) if self.ple_size else None
        for rotary in self.rotary.values():
            rotary.begin(positions, hidden.dtype)
        for i, layer in enumerate(self.layers):
            hidden = layer(positions, hidden, None if per_layer is None else per_layer[:, i])
        return self.norm(hidden)


class Gemma4ForCausalLM(CausalLM):
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping
    expert_mapping = (
        ExpertWeight("experts.gate_up_proj", "experts.w13_weight", ExpertShard.GATE_UP),
        ExpertWeight("experts.down_proj", "experts.w2_weight", ExpertShard.DOWN),
        # GGUF files: one weight per expert and projection (models/gguf_gemma4.py)
        *per_expert_weights("gate_proj", "up_proj", "down_proj", (ExpertShard.GATE, ExpertShard.UP, ExpertShard.DOWN)),
    )
    prefix = "model"

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        text = config.get_text_config()
        self.text_config = text
        self.model = self.text_model(text)
        self.lm_head = ParallelLMHead(text.vocab_size, text.hidden_size)
        self.tie_word_embeddings = bool(getattr(text, "tie_word_embeddings", True))
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.language_model.embed_tokens)
        self.softcap = getattr(text, "final_logit_softcapping", None)

    def text_model(self, text: Any) -> nn.Module:
        return Gemma4TextModel(text)

    @property
    def language_model(self) -> Gemma4TextModel:
        return self.model  # type: ignore[return-value]

    def _attention(self, sliding: bool) -> list[Gemma4Attention]:
        return [layer.self_attn for layer in self.language_model.layers if layer.self_attn.sliding == sliding]

    def cache_layout(self) -> CacheLayout:
        """The global layers' KV in pages (each its own shape on this rank); each sliding layer's ring, in layer
        order (its state index)."""
        rings = tuple(a.attn.state_spec() for a in self._attention(True))
        paged = PagedGroup(tuple(a.kv_spec() for a in self._attention(False)))
        return CacheLayout((paged,), StateGroup(rings) if rings else None)

    def attention_shape(self) -> AttentionShape:
        """The first global layer's on this rank (backends read each layer's own)."""
        first = self._attention(False)[0]
        return AttentionShape(first.num_heads, first.num_kv_heads, first.head_dim)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.language_model(input_ids, positions)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    """The text model of the image-text(-audio) checkpoint, under `model.language_model.`."""

    skip_checkpoint_names = {
        "model.vision_tower.": "vision tower (agentbox serves the text model)",
        "model.embed_vision.": "vision embedder (agentbox serves the text model)",
        "model.audio_tower.": "audio tower (agentbox serves the text model)",
        "model.embed_audio.": "audio embedder (agentbox serves the text model)",
    }

    def text_model(self, text: Any) -> nn.Module:
        outer = nn.Module()
        outer.language_model = Gemma4TextModel(text)
        return outer

    @property
    def language_model(self) -> Gemma4TextModel:
        return self.model.language_model  # type: ignore[return-value]


class Gemma4UnifiedForConditionalGeneration(Gemma4ForConditionalGeneration):
    """Gemma 4 12B (`gemma4_unified`): the text model of the unified audio / vision / text checkpoint, the same
    decoder as `gemma4` (no per-layer inputs, no MoE) under `model.language_model.`. Its image patches and audio
    frames enter the language model through embedders (vision tokens attend bidirectionally, text stays causal):
    serving text, they are skipped."""

    skip_checkpoint_names = {
        **Gemma4ForConditionalGeneration.skip_checkpoint_names,
        "model.vision_embedder.": "vision patch embedder (agentbox serves the text model)",
    }

