"""The hybrid Qwen family: Qwen3.5 / Qwen3.6 (dense and MoE, `Qwen3_5*ForConditionalGeneration`) and Qwen3-Next
(`Qwen3NextForCausalLM`). Layers follow `config.layer_types`: Gated DeltaNet (linear_attention, three in four)
or gated full attention; every norm outside the delta net is zero-centred (weight stored as w - 1).

Gated attention: q_proj yields a query and an output gate per head (o = attn * sigmoid(gate)), q and k get a
per-head RMSNorm, and rope turns only the first `partial_rotary_factor` of each head (0.25). Only these layers
keep KV pages, so the KV pool has one layer per attention layer (the paged group of `cache_layout`); the
delta-net layers keep a fixed-size state per sequence instead (its state group, layers/recurrent_state.py).

The ConditionalGeneration checkpoints hold an image-text model: the text model sits under
`model.language_model.` (this class nests the same way, so the names match), the vision tower (`model.visual.`)
and, unless the engine drafts with it (models/mtp.py), the multi-token-prediction head (`mtp.`) are skipped at
load and named in the log. Qwen3.5's rope is multimodal (mrope) but for text every section has the same position, which is rope.
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
from agentbox.layers.experts.base import ExpertShard
from agentbox.layers.experts.layer import FusedMoE
from agentbox.layers.gated_deltanet import GatedDeltaNet
from agentbox.layers.linear import LinearBase, QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from agentbox.layers.norm import RMSNorm
from agentbox.layers.quant import QuantConfig, quant_context
from agentbox.layers.rotary import RotaryEmbedding, rope_parameters
from agentbox.models.base import CausalLM, head_dim_of, num_kv_heads_of, per_expert_weights
from agentbox.models.llama import LlamaForCausalLM, LlamaMLP
from agentbox.models.mtp import MTP_PREFIX, MultiTokenPredictor, mtp_layers_of
from agentbox.parallel.state import head_shard

LINEAR = "linear_attention"


class ZeroCenteredRMSNorm(RMSNorm):
    """norm(x) * (1 + w), in fp32 then cast (the checkpoint stores w around zero)."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), self.weight.shape, 1.0 + self.weight.float(), self.eps).to(x.dtype)


class GatedQKVParallelLinear(QKVParallelLinear):
    """QKV whose q part holds two rows per head dim, [query | gate] of each head, split with the heads."""

    def __init__(self, hidden_size: int, head_dim: int, total_heads: int, total_kv_heads: int, prefix: str) -> None:
        self.head_dim = head_dim
        self.shard = head_shard(total_heads, total_kv_heads)
        self.num_heads, self.num_kv_heads = self.shard.num_heads, self.shard.num_kv_heads
        LinearBase.__init__(self, hidden_size, 2 * (self.num_heads + self.num_kv_heads) * head_dim, False, 0, prefix)

    def out_range(self, shard_id: str | int | None) -> tuple[int, int, int]:
        d, sh = self.head_dim, self.shard
        if shard_id == "q":
            return 0, 2 * sh.q_start * d, 2 * sh.num_heads * d
        offset, start, size = super().out_range(shard_id)
        return offset + sh.num_heads * d, start, size


class GatedAttention(nn.Module):
    def __init__(self, config: Any, kv_index: int, prefix: str) -> None:
        super().__init__()
        if getattr(config, "attention_bias", False):
            raise ValueError("attention_bias is not supported for gated attention (no released checkpoint has it)")
        self.head_dim = head_dim_of(config)
        self.qkv_proj = GatedQKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads, num_kv_heads_of(config), f"{prefix}.qkv_proj"
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        sh = self.qkv_proj.shard
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, False,
            prefix=f"{prefix}.o_proj", input_shard=(sh.q_start * self.head_dim, sh.num_heads * self.head_dim),
        )
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)
        theta, scaling = rope_parameters(config)
        params = getattr(config, "rope_parameters", None) or {}
        factor = float(params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)))
        self.rotary_dim = int(self.head_dim * factor)
        self.rotary = RotaryEmbedding(self.rotary_dim, config.max_position_embeddings, theta, scaling)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, kv_index)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        t, d = hidden.shape[0], self.head_dim
        q_size, kv_size = 2 * self.num_heads * d, self.num_kv_heads * d
        qg, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q, gate = qg.view(t, self.num_heads, 2 * d).chunk(2, dim=-1)
        q = self.q_norm(q.contiguous())
        k = self.k_norm(k.reshape(t, self.num_kv_heads, d))
        r = self.rotary_dim
        q = torch.cat([self.rotary.rotate(positions, q[..., :r]), q[..., r:]], dim=-1)
        k = torch.cat([self.rotary.rotate(positions, k[..., :r]), k[..., r:]], dim=-1)
        out = self.attn(q, k, v.reshape(t, self.num_kv_heads, d))
        return self.o_proj(out * torch.sigmoid(gate.reshape(t, -1)))


class SharedExpertMoE(nn.Module):
    """Routed experts (softmax top-k) plus one always-on shared expert scaled by sigmoid(shared_expert_gate)."""

    def __init__(self, config: Any, prefix: str, renormalize: bool) -> None:
        super().__init__()
        with quant_context(QuantConfig()):  # routers stay unquantised in every released checkpoint
            self.gate = ReplicatedLinear(config.hidden_size, config.num_experts, bias=False, prefix=f"{prefix}.gate")
            self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1, bias=False, prefix=f"{prefix}.shared_expert_gate")
        self.experts = FusedMoE(
            config.num_experts, config.num_experts_per_tok, config.hidden_size, config.moe_intermediate_size,
            renormalize=renormalize, prefix=f"{prefix}.experts",
        )
        self.shared_expert = LlamaMLP(config, config.shared_expert_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.experts(x, self.gate(x)) + shared


def _mlp(config: Any, layer_id: int, prefix: str) -> nn.Module:
    num_experts = getattr(config, "num_experts", 0) or 0
    if not num_experts:
        return LlamaMLP(config)
    step = getattr(config, "decoder_sparse_step", 1) or 1
    if layer_id in (getattr(config, "mlp_only_layers", None) or []) or (layer_id + 1) % step:
        return LlamaMLP(config)
    # Qwen3.5-MoE always renormalises the top k; Qwen3-Next reads norm_topk_prob.
    return SharedExpertMoE(config, prefix, bool(getattr(config, "norm_topk_prob", True)))


class HybridDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_id: int, index: int, prefix: str, fused_qkvz: bool) -> None:
        """index: the layer's place among its kind (KV layer for attention, state slot for the delta net)."""
        super().__init__()
        self.is_linear = config.layer_types[layer_id] == LINEAR
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config, index, f"{prefix}.linear_attn", fused_qkvz)
        else:
            self.self_attn = GatedAttention(config, index, f"{prefix}.self_attn")
        self.mlp = _mlp(config, layer_id, f"{prefix}.mlp")
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        mixer = self.linear_attn if self.is_linear else self.self_attn
        hidden = mixer(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class HybridModel(nn.Module):
    def __init__(self, config: Any, prefix: str, fused_qkvz: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        counts = {True: 0, False: 0}
        layers = []
        for i in range(config.num_hidden_layers):
            linear = config.layer_types[i] == LINEAR
            layers.append(HybridDecoderLayer(config, i, counts[linear], f"{prefix}.layers.{i}", fused_qkvz))
            counts[linear] += 1
        self.layers = nn.ModuleList(layers)
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen3NextForCausalLM(CausalLM):
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping
    expert_mapping = per_expert_weights(
        "gate_proj", "up_proj", "down_proj", (ExpertShard.GATE, ExpertShard.UP, ExpertShard.DOWN)
    )
    skip_checkpoint_names = {MTP_PREFIX: "multi-token-prediction layers (a draft model, unused)"}
    fused_qkvz = True

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        text = config.get_text_config()
        self.model = self.text_model(text)
        self.lm_head = ParallelLMHead(text.vocab_size, text.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.language_model.embed_tokens)

    def text_model(self, text: Any) -> nn.Module:
        return HybridModel(text, "model", self.fused_qkvz)

    @property
    def language_model(self) -> HybridModel:
        return self.model  # type: ignore[return-value]

    def add_mtp_head(self) -> bool:
        text = self.config.get_text_config()
        if mtp_layers_of(self.config) < 1:
            return False
        layers = self.language_model.layers
        kv_index = sum(1 for layer in layers if not layer.is_linear)  # one KV layer past the model's own
        self.mtp = MultiTokenPredictor(text, kv_index, self.language_model.embed_tokens, HybridDecoderLayer,
                                       ZeroCenteredRMSNorm)
        self.skip_checkpoint_names = {k: v for k, v in self.skip_checkpoint_names.items() if k != MTP_PREFIX}
        return True

    def fused_cpu_hybrid_target(self) -> HybridModel | None:
        # Qwen3-Next's grouped in_proj_qkvz is not the C layer's layout (it reads [q | k | v] rows, z apart)
        return None if self.fused_qkvz else self.language_model

    def cache_layout(self) -> CacheLayout:
        """The attention layers' KV in pages (the MTP head's last, when built); each Gated DeltaNet layer's state,
        in layer order (its `state_index`)."""
        layers = self.language_model.layers
        states = tuple(layer.linear_attn.state_spec() for layer in layers if layer.is_linear)
        shape = self.attention_shape()
        kv_layers = len(layers) - len(states) + (1 if self.mtp is not None else 0)
        paged = PagedGroup(tuple(KVLayerSpec.uniform(kv_layers, shape.num_kv_heads, shape.head_dim)))
        return CacheLayout((paged,), StateGroup(states) if states else None)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.language_model(input_ids, positions)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


class Qwen3_5ForConditionalGeneration(Qwen3NextForCausalLM):
    """Qwen3.5 / Qwen3.6 (dense and MoE): the text model of the image-text checkpoint."""

    skip_checkpoint_names = {
        "model.visual.": "vision tower (agentbox serves the text model)",
        MTP_PREFIX: "multi-token-prediction layers (a draft model, unused)",
    }
    fused_qkvz = False

    def text_model(self, text: Any) -> nn.Module:
        outer = nn.Module()
        outer.language_model = HybridModel(text, "model.language_model", self.fused_qkvz)
        return outer

    @property
    def language_model(self) -> HybridModel:
        return self.model.language_model  # type: ignore[return-value]


class Qwen3HybridGGUF(Qwen3NextForCausalLM):
    """A GGUF file of any of the three (models/gguf_hybrid.py): llama.cpp's converter stores every one in the
    Qwen3.5 layout ([q | k | v] rows, z, b and a apart), under `model.`."""

    fused_qkvz = False
