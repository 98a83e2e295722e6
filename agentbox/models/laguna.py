"""Laguna (poolside's Laguna XS.2 / XS-2.1, `LagunaForCausalLM`, model type `laguna`), as transformers computes it.

What differs from Llama:
- layers are sliding (window `sliding_window`, 512 in XS.2) or global (`layer_types`, 3 : 1). As for Gemma 4, only
  the global layers keep pages in the pool (the paged group of `cache_layout`); each sliding layer keeps its last
  `sliding_window` positions in a ring per sequence (its state group, layers/window_kv.py), so its memory does not
  grow with the context. Rope is per layer kind (`rope_parameters[kind]`: its own theta, type (YaRN on XS.2's
  global layers) and `partial_rotary_factor`, 0.5 on global layers: only the first half of each head turns);
- each layer has its own query-head count (`num_attention_heads_per_layer`); KV heads and head size are shared;
- q and k get a per-head RMSNorm before rope;
- the attention output is gated by softplus(g_proj(x)), one gate per head (`gating` true / "per-head") or per
  element ("per-element"), before o_proj;
- `mlp_layer_types`: "dense" layers run an MLP of `intermediate_size`, "sparse" ones a MoE: a sigmoid router
  whose logits are soft-capped (`moe_router_logit_softcapping`: c * tanh(l / c)), top k chosen with a per-expert
  correction bias that only chooses, weights renormalised; the routed sum times `moe_routed_scaling_factor`,
  plus an always-on shared expert of `shared_expert_intermediate_size`.

Checkpoints: transformers saves one tensor per expert with the router's bias under `mlp.experts.` and the shared
MLP as `mlp.shared_expert.`; its in-memory names (`mlp.experts.gate_up_proj` stacked, `mlp.gate.
e_score_correction_bias`, `mlp.shared_experts.`) load too. `moe_apply_router_weight_on_input` (no released
checkpoint sets it, and transformers refuses it) is refused.
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
from agentbox.layers.experts import ExpertShard, FusedMoE
from agentbox.layers.experts.routing import select_experts_grouped
from agentbox.layers.linear import ColumnParallelLinear, LinearBase, QKVParallelLinear, RowParallelLinear
from agentbox.layers.norm import RMSNorm
from agentbox.layers.rotary import RotaryEmbedding
from agentbox.layers.window_kv import WindowAttention
from agentbox.models.base import AttentionShape, CausalLM, ExpertWeight, per_expert_weights
from agentbox.models.llama import LlamaForCausalLM, LlamaMLP
from agentbox.parallel.state import HeadShard

SLIDING, GLOBAL = "sliding_attention", "full_attention"


class HeadGateLinear(ColumnParallelLinear):
    """g_proj: `width` outputs per query head (1 per head, head_dim per element), split with this rank's heads."""

    def __init__(self, hidden_size: int, shard: HeadShard, width: int) -> None:
        self.width, self.shard = width, shard
        LinearBase.__init__(self, hidden_size, shard.num_heads * width, False, 0, "")

    def out_range(self, shard_id: str | int | None) -> tuple[int, int, int]:
        return 0, self.shard.q_start * self.width, self.shard.num_heads * self.width


class PartialRotary(nn.Module):
    """Rope on the first `rotary_dim` channels of each head; the rest pass through."""

    def __init__(self, config: Any, kind: str) -> None:
        super().__init__()
        params = dict(config.rope_parameters[kind])
        theta = float(params.pop("rope_theta"))
        self.rotary_dim = int(config.head_dim * float(params.get("partial_rotary_factor", 1.0)))
        # YaRN on the global layers (XS.2's release) is computed over the rotated channels only, as transformers does
        scaling = None if params.get("rope_type", "default") == "default" else params
        self.rope = RotaryEmbedding(self.rotary_dim, config.max_position_embeddings, theta, scaling)

    def begin(self, positions: torch.Tensor, dtype: torch.dtype) -> None:
        self.rope.begin(positions, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        r = self.rotary_dim
        if r == x.shape[-1]:
            return self.rope.rotate(positions, x)
        return torch.cat([self.rope.rotate(positions, x[..., :r]), x[..., r:]], dim=-1)


class LagunaAttention(nn.Module):
    def __init__(self, config: Any, layer_id: int, rotary: PartialRotary, index: int) -> None:
        """index: the layer's place among its kind (KV layer of the pool for a global layer, ring of the state
        group for a sliding one)."""
        super().__init__()
        self.sliding = config.layer_types[layer_id] == SLIDING
        self.head_dim = d = int(config.head_dim)
        total_heads = int(config.num_attention_heads_per_layer[layer_id])
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, total_heads, config.num_key_value_heads, bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        sh = self.qkv_proj.shard
        self.o_proj = RowParallelLinear(
            total_heads * d, config.hidden_size, bias, input_shard=(sh.q_start * d, sh.num_heads * d),
        )
        gating = config.gating
        if gating not in (True, "per-head", "per-element"):
            raise ValueError(f"Laguna gating {gating!r} is not supported (true, 'per-head' or 'per-element')")
        self.gate_per_head = gating is True or gating == "per-head"
        self.g_proj = HeadGateLinear(config.hidden_size, sh, 1 if self.gate_per_head else d)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.rotary = rotary  # one per layer kind, shared
        scale = d**-0.5
        self.attn: nn.Module = (
            WindowAttention(self.num_heads, self.num_kv_heads, d, scale, int(config.sliding_window), index)
            if self.sliding else Attention(self.num_heads, self.num_kv_heads, d, scale, index)
        )

    def kv_spec(self) -> KVLayerSpec:
        return KVLayerSpec(self.num_kv_heads, self.head_dim)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        t, d = hidden.shape[0], self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q = self.rotary(positions, self.q_norm(q.reshape(t, self.num_heads, d)))
        k = self.rotary(positions, self.k_norm(k.reshape(t, self.num_kv_heads, d)))
        out = self.attn(q, k, v.reshape(t, self.num_kv_heads, d))
        # The gate in fp32 then the model's dtype, as transformers rounds it.
        gate = F.softplus(self.g_proj(hidden).float()).to(out.dtype)
        if self.gate_per_head:
            out = (out.view(t, self.num_heads, d) * gate.unsqueeze(-1)).view(t, -1)
        else:
            out = out * gate
        return self.o_proj(out)


class LagunaRouter(nn.Module):
    """`mlp.gate`: logits in the model's dtype then fp32 (as transformers), soft-capped; the correction bias (fp32)
    only chooses experts, it never weights an output."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        n = config.num_experts
        self.weight = nn.Parameter(torch.empty(n, config.hidden_size), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(n, dtype=torch.float32), requires_grad=False)
        self.softcap = float(config.moe_router_logit_softcapping or 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.weight).float()
        if self.softcap > 0:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class LagunaSparseMoe(nn.Module):
    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__()
        if config.moe_apply_router_weight_on_input:
            raise ValueError("Laguna moe_apply_router_weight_on_input=True is not supported (no released checkpoint "
                             "sets it; transformers refuses it too)")
        self.gate = LagunaRouter(config)
        self.top_k = int(config.num_experts_per_tok)
        self.scaling = float(config.moe_routed_scaling_factor)
        self.experts = FusedMoE(
            config.num_experts, self.top_k, config.hidden_size, config.moe_intermediate_size, renormalize=True,
            prefix=f"{prefix}.experts",
        )
        self.shared_expert = LlamaMLP(config, config.shared_expert_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Sigmoid scores, biased choice, renormalised weights times the routed scaling: DeepSeek-V3's routing
        # with one group.
        weights, ids = select_experts_grouped(
            self.gate(x), self.top_k, self.gate.e_score_correction_bias, 1, 1, True, self.scaling
        )
        return self.experts.forward_routed(x, weights, ids) + self.shared_expert(x)


class LagunaDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_id: int, rotary: PartialRotary, index: int) -> None:
        super().__init__()
        self.self_attn = LagunaAttention(config, layer_id, rotary, index)
        kind = config.mlp_layer_types[layer_id]
        if kind not in ("dense", "sparse"):
            raise ValueError(f"Laguna mlp_layer_types entry {kind!r} is not supported (dense or sparse)")
        self.mlp: nn.Module = (
            LagunaSparseMoe(config, f"model.layers.{layer_id}.mlp") if kind == "sparse" else LlamaMLP(config)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LagunaModel(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        kinds = sorted(set(config.layer_types))
        if not set(kinds) <= {SLIDING, GLOBAL}:
            raise ValueError(f"Laguna layer types {kinds} are not supported ({SLIDING}, {GLOBAL})")
        if GLOBAL not in kinds:
            raise ValueError("a Laguna config without a full_attention layer has nothing for the paged pool to key on")
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.rotary = nn.ModuleDict({kind: PartialRotary(config, kind) for kind in kinds})
        counts = dict.fromkeys(kinds, 0)
        layers = []
        for i, kind in enumerate(config.layer_types):
            layers.append(LagunaDecoderLayer(config, i, self.rotary[kind], counts[kind]))
            counts[kind] += 1
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for rotary in self.rotary.values():
            rotary.begin(positions, hidden.dtype)
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LagunaForCausalLM(CausalLM):
    checkpoint_renames = (
        (r"\.mlp\.experts\.e_score_correction_bias$", ".mlp.gate.e_score_correction_bias"),
        (r"\.mlp\.shared_experts\.", ".mlp.shared_expert."),
    )
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping
    expert_mapping = (
        # transformers' in-memory layout: every expert stacked
        ExpertWeight("experts.gate_up_proj", "experts.w13_weight", ExpertShard.GATE_UP),
        ExpertWeight("experts.down_proj", "experts.w2_weight", ExpertShard.DOWN),
        *per_expert_weights("gate_proj", "up_proj", "down_proj", (ExpertShard.GATE, ExpertShard.UP, ExpertShard.DOWN)),
    )

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.model = LagunaModel(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def _attention(self, sliding: bool) -> list[LagunaAttention]:
        return [layer.self_attn for layer in self.model.layers if layer.self_attn.sliding == sliding]

    def cache_layout(self) -> CacheLayout:
        """The global layers' KV in pages; each sliding layer's ring, in layer order (its state index)."""
        rings = tuple(a.attn.state_spec() for a in self._attention(True))
        paged = PagedGroup(tuple(a.kv_spec() for a in self._attention(False)))
        return CacheLayout((paged,), StateGroup(rings) if rings else None)

    def attention_shape(self) -> AttentionShape:
        """The first global layer's on this rank (the layers in the pool; rings attend by themselves). XS.2's global
        layers share one head count; a backend planned once per step for one shape (flashinfer) needs that."""
        first = self._attention(False)[0]
        return AttentionShape(first.num_heads, first.num_kv_heads, first.head_dim)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
