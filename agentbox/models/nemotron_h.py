"""Nemotron-H (`NemotronHForCausalLM`, model type `nemotron_h`: Nemotron 3 Nano / 3.5 Lightning 30B-A3B), as
transformers computes it.

Unlike a Llama layer, each layer is one mixer behind one pre-norm and a residual (`layers_block_type`):
- "linear_attention": a Mamba-2 layer (layers/mamba2.py); its conv and SSM state are the model's state group,
  snapshotted at turn ends like Qwen3.5's delta-net state;
- "full_attention": GQA attention without any position embedding (the Mamba layers carry position); its KV is
  the paged group;
- "mlp": up_proj, relu(x)^2, down_proj (no gate);
- "moe": DeepSeek-V3's routing (sigmoid scores, a correction bias that only chooses, groups, renormalised weights
  times `routed_scaling_factor`) over experts that are themselves un-gated relu^2 MLPs (a FusedMoE of
  `MoEActivation.RELU2`: w13 is up alone, in every expert format), optionally inside a latent projection
  (`moe_latent_size`), plus a shared expert MLP.
Norms multiply by their weight in fp32 before casting back. The checkpoint's names start with `backbone.`
(transformers' in-memory `model.` loads too); its multi-token-prediction layers (`mtp.*`, `num_nextn_predict_layers`)
are skipped at load.
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
from agentbox.layers.experts import ExpertShard, FusedMoE, MoEActivation
from agentbox.layers.experts.routing import select_experts_grouped
from agentbox.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from agentbox.layers.mamba2 import Mamba2Mixer
from agentbox.layers.norm import Fp32RMSNorm
from agentbox.layers.quant import QuantConfig, quant_context
from agentbox.models.base import AttentionShape, CausalLM, ExpertWeight, per_expert_weights

MAMBA, ATTENTION, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"


def relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


class ReluSquaredMLP(nn.Module):
    def __init__(self, config: Any, intermediate_size: int, prefix: str) -> None:
        super().__init__()
        if config.mlp_hidden_act != "relu2":
            raise ValueError(f"mlp_hidden_act {config.mlp_hidden_act!r} is not supported (only relu2)")
        bias = bool(config.mlp_bias)
        self.up_proj = ColumnParallelLinear(config.hidden_size, intermediate_size, bias, prefix=f"{prefix}.up_proj")
        self.down_proj = RowParallelLinear(intermediate_size, config.hidden_size, bias, prefix=f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(relu2(self.up_proj(x)))


class NemotronHAttention(nn.Module):
    def __init__(self, config: Any, index: int) -> None:
        super().__init__()
        self.head_dim = d = int(config.head_dim)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, config.num_attention_heads,
                                          config.num_key_value_heads, bool(config.attention_bias))
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        sh = self.qkv_proj.shard
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, config.hidden_size, bool(config.attention_bias),
                                        input_shard=(sh.q_start * d, sh.num_heads * d))
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, d**-0.5, index)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        return self.o_proj(self.attn(q, k, v))


class NemotronHMoE(nn.Module):
    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__()
        e = config.n_routed_experts
        self.gate = nn.Module()  # `mixer.gate.weight` and its correction bias, fp32 as the checkpoint keeps them
        self.gate.weight = nn.Parameter(torch.empty(e, config.hidden_size, dtype=torch.float32), requires_grad=False)
        self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(e, dtype=torch.float32), requires_grad=False)
        self.top_k, self.n_group, self.topk_group = config.num_experts_per_tok, config.n_group, config.topk_group
        self.renormalize, self.scaling = bool(config.norm_topk_prob), float(config.routed_scaling_factor)
        latent = config.moe_latent_size
        self.latent = latent is not None
        if self.latent:
            with quant_context(QuantConfig()):
                self.fc1_latent_proj = ReplicatedLinear(config.hidden_size, latent, bool(config.mlp_bias))
                self.fc2_latent_proj = ReplicatedLinear(latent, config.hidden_size, bool(config.mlp_bias))
        # un-gated relu^2 experts: every expert method of layers/experts/ runs them (w13 holds up alone)
        self.experts = FusedMoE(e, self.top_k, latent or config.hidden_size, config.moe_intermediate_size,
                                renormalize=False, activation=MoEActivation.RELU2, prefix=f"{prefix}.experts")
        self.shared_experts = ReluSquaredMLP(config, config.moe_shared_expert_intermediate_size,
                                             f"{prefix}.shared_experts")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.gate.weight.float())
        weights, ids = select_experts_grouped(logits, self.top_k, self.gate.e_score_correction_bias, self.n_group,
                                              self.topk_group, self.renormalize, self.scaling)
        h = self.fc1_latent_proj(x) if self.latent else x
        routed = self.experts.forward_routed(h, weights, ids)
        if self.latent:
            routed = self.fc2_latent_proj(routed)
        return routed + self.shared_experts(x)


class NemotronHBlock(nn.Module):
    def __init__(self, config: Any, layer_id: int, index: int) -> None:
        """index: the layer's place among its kind (KV layer of the pool, or state layer)."""
        super().__init__()
        self.kind = config.layers_block_type[layer_id]
        prefix = f"backbone.layers.{layer_id}.mixer"
        self.norm = Fp32RMSNorm(config.hidden_size, config.layer_norm_epsilon)
        if self.kind == MAMBA:
            self.mixer: nn.Module = Mamba2Mixer(config, index, prefix)
        elif self.kind == ATTENTION:
            self.mixer = NemotronHAttention(config, index)
        elif self.kind == MLP:
            self.mixer = ReluSquaredMLP(config, config.intermediate_size, prefix)
        elif self.kind == MOE:
            self.mixer = NemotronHMoE(config, prefix)
        else:
            raise ValueError(f"Nemotron-H layer type {self.kind!r} is not supported ({MAMBA}, {ATTENTION}, {MLP}, {MOE})")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.mixer(self.norm(hidden))


class NemotronHModel(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        if ATTENTION not in config.layers_block_type:
            raise ValueError("a Nemotron-H config without a full_attention layer has nothing for the paged pool")
        self.embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        counts = {MAMBA: 0, ATTENTION: 0}
        layers = []
        for i, kind in enumerate(config.layers_block_type):
            layers.append(NemotronHBlock(config, i, counts.get(kind, 0)))
            if kind in counts:
                counts[kind] += 1
        self.layers = nn.ModuleList(layers)
        self.norm_f = Fp32RMSNorm(config.hidden_size, config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embeddings(input_ids)
        for layer in self.layers:
            hidden = layer(hidden)
        return self.norm_f(hidden)


class NemotronHForCausalLM(CausalLM):
    checkpoint_renames = ((r"^model\.", "backbone."),)
    packed_modules_mapping = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}
    expert_mapping = (
        *per_expert_weights(None, "up_proj", "down_proj", (ExpertShard.GATE, ExpertShard.UP, ExpertShard.DOWN)),
        ExpertWeight("experts.up_proj", "experts.w13_weight", ExpertShard.UP),  # transformers' in-memory stack
        ExpertWeight("experts.down_proj", "experts.w2_weight", ExpertShard.DOWN),
    )
    skip_checkpoint_names = {"mtp.": "multi-token-prediction layers (a draft model, unused)"}
    # The Mamba layers' prefill runs one sequence at a time on host-side lengths.
    supports_cuda_graphs = False

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.backbone = NemotronHModel(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.backbone.embeddings)

    def _mixers(self, kind: str) -> list[nn.Module]:
        return [layer.mixer for layer in self.backbone.layers if layer.kind == kind]

    def cache_layout(self) -> CacheLayout:
        """The attention layers' KV in pages; each Mamba layer's conv and SSM state, in layer order."""
        paged = PagedGroup(tuple(KVLayerSpec(a.num_kv_heads, a.head_dim) for a in self._mixers(ATTENTION)))
        states = tuple(m.state_spec() for m in self._mixers(MAMBA))
        return CacheLayout((paged,), StateGroup(states) if states else None)

    def attention_shape(self) -> AttentionShape:
        first = self._mixers(ATTENTION)[0]
        return AttentionShape(first.num_heads, first.num_kv_heads, first.head_dim)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.backbone(input_ids, positions)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
