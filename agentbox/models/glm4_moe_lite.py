"""GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`): multi-head latent attention and a shared-expert MoE; the DeepSeek-V3
layout at 30B-A3B.

Attention (MLA, layers/backends/mla.py): the query goes through a low-rank pair (q_a_proj, an RMSNorm, q_b_proj)
into per-head [q_nope 192 | q_pe 64]; the hidden state goes through kv_a_proj_with_mqa into one latent of
kv_lora_rank (512, RMSNormed) and one rope key k_pe (64) shared by every head. Only latent + k_pe are cached
(576 values a token and layer). kv_b_proj maps a latent to each head's k_nope (192) and v (256). Rope turns
pairs of adjacent dims (`rope_interleave`): the q_pe / k_pe dims are reordered evens-then-odds once, so the
usual rotate-half rope applies (dot products are unchanged by the same reordering of q and k).

Tensor parallel: q_b_proj, kv_b_proj split by heads (column parallel), o_proj by its input (row parallel);
q_a_proj and kv_a_proj_with_mqa are replicated, so every rank computes and keeps the whole latent cache.

MLP: the first `first_k_dense_replace` layers (or `mlp_layer_types`) are dense; the others route each token
to top-k of n_routed_experts ("noaux_tc": sigmoid scores, a per-expert correction bias used only to choose,
best `topk_group` of `n_group` groups first, weights renormalised and scaled by routed_scaling_factor) plus
n_shared_experts always-on experts as one MLP. The checkpoint's multi-token-prediction layer (layer index
num_hidden_layers, `num_nextn_predict_layers`) is skipped at load and named in the log.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from agentbox.layers.backends.base import KVLayerSpec
from agentbox.layers.backends.mla import (
    MLAWeights,
    expanded_reference,
    mla_absorbed,
    takes_absorbed,
    write_latent,
)
from agentbox.layers.cache_layout import CacheLayout, PagedGroup
from agentbox.layers.context import get_forward_context
from agentbox.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from agentbox.layers.experts import ExpertShard, FusedMoE
from agentbox.layers.experts.routing import select_experts_grouped
from agentbox.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from agentbox.layers.norm import RMSNorm
from agentbox.layers.rotary import RotaryEmbedding, rope_parameters
from agentbox.models.base import CausalLM, per_expert_weights
from agentbox.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from agentbox.parallel.state import tp_size


def mla_scale(config: Any) -> float:
    """1/sqrt(qk head dim), times YaRN's mscale squared when the rope is scaled with mscale_all_dim (as
    transformers' DeepSeek / GLM attention computes it)."""
    scale = float(config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    _, scaling = rope_parameters(config)
    factor = float((scaling or {}).get("factor") or 1.0)
    if scaling and scaling.get("mscale_all_dim") and factor > 1:
        m = 0.1 * float(scaling["mscale_all_dim"]) * math.log(factor) + 1.0
        scale *= m * m
    return scale


def kv_spec(config: Any) -> KVLayerSpec:
    """One cached "head" per token and layer: the latent (its first kv_lora_rank values are V) and the rope key."""
    return KVLayerSpec(1, config.kv_lora_rank + config.qk_rope_head_dim, config.kv_lora_rank, tied=True)


class MLAttention(nn.Module):
    def __init__(self, config: Any, layer_id: int, rotary: RotaryEmbedding, prefix: str) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.total_heads = config.num_attention_heads
        self.num_heads = self.total_heads // tp_size()
        if self.total_heads % tp_size():
            raise ValueError(f"{self.total_heads} attention heads do not split over {tp_size()} tensor-parallel ranks")
        self.nope, self.rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.rank, self.v_dim = config.kv_lora_rank, config.v_head_dim
        bias = bool(getattr(config, "attention_bias", False))
        q_dim = self.total_heads * (self.nope + self.rope)
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        if self.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(config.hidden_size, self.q_lora_rank, bias, prefix=f"{prefix}.q_a_proj")
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, q_dim, False, prefix=f"{prefix}.q_b_proj")
        else:
            self.q_proj = ColumnParallelLinear(config.hidden_size, q_dim, False, prefix=f"{prefix}.q_proj")
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            config.hidden_size, self.rank + self.rope, bias, prefix=f"{prefix}.kv_a_proj_with_mqa"
        )
        self.kv_a_layernorm = RMSNorm(self.rank, config.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(
            self.rank, self.total_heads * (self.nope + self.v_dim), False, prefix=f"{prefix}.kv_b_proj"
        )
        self.o_proj = RowParallelLinear(self.total_heads * self.v_dim, config.hidden_size, bias, prefix=f"{prefix}.o_proj")
        self.rotary = rotary
        self.interleaved = bool(getattr(config, "rope_interleave", False))
        self.scale = mla_scale(config)
        self.absorbed: MLAWeights | None = None  # built on first use: after loading and any quant conversion

    def _weights(self) -> MLAWeights:
        if self.absorbed is None:
            # kv_b_proj applied to the identity gives its dense weight whatever its storage (bf16, FP8, int4).
            ref = self.kv_a_layernorm.weight
            w = self.kv_b_proj(torch.eye(self.rank, device=ref.device, dtype=ref.dtype)).T  # [H*(nope+v), rank]
            w = w.reshape(self.num_heads, self.nope + self.v_dim, self.rank)
            self.absorbed = MLAWeights(w[:, : self.nope].contiguous(), w[:, self.nope :].contiguous())
        return self.absorbed

    def _rope(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.interleaved:
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return self.rotary.rotate(positions, x)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        t = hidden.shape[0]
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        else:
            q = self.q_proj(hidden)
        q = q.view(t, self.num_heads, self.nope + self.rope)
        q_nope, q_pe = q[..., : self.nope], self._rope(positions, q[..., self.nope :])
        kv = self.kv_a_proj_with_mqa(hidden)
        latent = self.kv_a_layernorm(kv[:, : self.rank].contiguous())
        k_pe = self._rope(positions, kv[:, None, self.rank :])[:, 0]
        ctx = get_forward_context()
        cache = write_latent(ctx.backend, self.layer_id, torch.cat([latent, k_pe], dim=-1))
        if takes_absorbed(ctx.backend, ctx.meta):
            out = mla_absorbed(ctx.backend, q_nope, q_pe, cache, self._weights(), self.scale)
        else:
            dims = (self.rank, self.nope, self.v_dim)
            out = expanded_reference(torch.cat([q_nope, q_pe], -1), cache, ctx.meta, self.kv_b_proj, dims, self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.v_dim))


class NoAuxRouter(nn.Module):
    """The router's logits in fp32 (the checkpoint keeps `gate.weight` and the correction bias in fp32)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        n = config.n_routed_experts
        self.weight = nn.Parameter(torch.empty(n, config.hidden_size, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(n, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.float(), self.weight)


class SharedExpertsMoE(nn.Module):
    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__()
        self.gate = NoAuxRouter(config)
        self.top_k = config.num_experts_per_tok
        self.n_group, self.topk_group = int(config.n_group or 1), int(config.topk_group or 1)
        self.renormalize = bool(config.norm_topk_prob)
        self.scaling = float(config.routed_scaling_factor)
        self.experts = FusedMoE(
            config.n_routed_experts, self.top_k, config.hidden_size, config.moe_intermediate_size,
            renormalize=self.renormalize, prefix=f"{prefix}.experts",
        )
        shared = config.moe_intermediate_size * int(config.n_shared_experts or 0)
        self.shared_experts = LlamaMLP(config, shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts_grouped(
            self.gate(x), self.top_k, self.gate.e_score_correction_bias, self.n_group, self.topk_group,
            self.renormalize, self.scaling,
        )
        out = self.experts.forward_routed(x, weights, ids)
        return out if self.shared_experts is None else out + self.shared_experts(x)


def is_sparse_layer(config: Any, layer_id: int) -> bool:
    types = getattr(config, "mlp_layer_types", None)
    if types:
        return types[layer_id] == "sparse"
    return layer_id >= int(getattr(config, "first_k_dense_replace", 0) or 0)


class Glm4MoeLiteDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm residual layer (its forward) around MLA and, past the first dense layers, the
    shared-expert MoE."""

    def __init__(self, config: Any, layer_id: int, rotary: RotaryEmbedding) -> None:
        nn.Module.__init__(self)
        prefix = f"model.layers.{layer_id}"
        self.self_attn = MLAttention(config, layer_id, rotary, f"{prefix}.self_attn")
        self.mlp = SharedExpertsMoE(config, f"{prefix}.mlp") if is_sparse_layer(config, layer_id) else LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Glm4MoeLiteModel(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        theta, scaling = rope_parameters(config)
        self.rotary = RotaryEmbedding(config.qk_rope_head_dim, config.max_position_embeddings, theta, scaling)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [Glm4MoeLiteDecoderLayer(config, i, self.rotary) for i in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        self.rotary.begin(positions, hidden.dtype)
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Glm4MoeLiteForCausalLM(CausalLM):
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping
    expert_mapping = per_expert_weights(
        "gate_proj", "up_proj", "down_proj", (ExpertShard.GATE, ExpertShard.UP, ExpertShard.DOWN)
    )
    # The attention reads host-side lengths (the torch reference): decode is not captured in CUDA graphs yet.
    supports_cuda_graphs = False

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.model = Glm4MoeLiteModel(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)
        # The MTP layers follow the decoder layers in the checkpoint (GLM-4.7-Flash: model.layers.47.).
        mtp = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
        n = config.num_hidden_layers
        self.skip_checkpoint_names = {
            f"model.layers.{i}.": "multi-token-prediction layer (a draft model, unused)" for i in range(n, n + max(mtp, 1))
        }

    def cache_layout(self) -> CacheLayout:
        """Every layer's latent + rope key, one "head" a token (replicated on every rank)."""
        return CacheLayout((PagedGroup((kv_spec(self.config),) * self.config.num_hidden_layers),))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
