"""GLM-5.3-Flash (`glm5_next`, `Glm5NextForConditionalGeneration`): KDA linear attention on three layers of four,
latent attention with a pooled-key sparse indexer on the rest, hyper-connected residual streams and a
shared-expert MoE. transformers' models/glm5_next is the reference.

- `layer_types`: "linear_attention" layers are Kimi Delta Attention (layers/kda.py: a state per sequence);
  "indexed_attention" layers are MLA without RoPE (the GLM-4.7-Flash latent path, qk_rope_head_dim 0: a
  kv_lora_rank latent per token is all the cache keeps) whose queries attend only what the indexer picks
  (layers/kpool_indexer.py: the best index_topk / index_kpool pools of index_kpool tokens plus the query's own
  incomplete pool). `indexer_types` "shared" layers run no indexer: they reuse the previous layer's selection.
- Residual: `hc_mult` streams mixed around each block by hyper-connections (DeepSeek-V4's,
  layers/hyper_connection.py), collapsed at the end by a plain mean (not V4's weighted head).
- MLP: `mlp_layer_types` "dense" layers are one SwiGLU, "sparse" ones route each token to top-k of
  n_routed_experts (sigmoid scores, correction bias that only chooses, group-limited, renormalised, times
  routed_scaling_factor) plus the shared expert; every gate and up is clamped at `swiglu_limit`.

What it caches (`cache_layout`): one token-granular paged group holding each indexed layer's latent
([kv_lora_rank]) and each indexer's per-token key and pooling logits ([2 index_head_dim], replicated on every
rank); and a state group of each KDA layer's conv inputs and [Dk, Dv] matrices, snapshotted at turn ends.

Checkpoints: the image-text release layout transformers saves (`model.language_model.`, the vision tower
`model.visual.` skipped, `hc_attn_fn` for the hyper-connection's `fn`, per-expert weights); the MTP layer (layer
index num_hidden_layers) is skipped.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from agentbox.layers.backends.base import KVLayerSpec
from agentbox.layers.backends.mla import write_latent
from agentbox.layers.backends.torch_backend import build_layout
from agentbox.layers.cache_layout import CacheLayout, PagedGroup, StateGroup
from agentbox.layers.context import get_forward_context
from agentbox.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from agentbox.layers.experts import ExpertShard, FusedMoE, MoEActivation
from agentbox.layers.experts.routing import select_experts_grouped
from agentbox.layers.hyper_connection import HyperConnection
from agentbox.layers.kda import KimiDeltaAttention
from agentbox.layers.kpool_indexer import KPoolIndexer
from agentbox.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from agentbox.layers.norm import RMSNorm
from agentbox.layers.selected_attention import selected_attention
from agentbox.models.base import AttentionShape, CausalLM, per_expert_weights
from agentbox.models.glm4_moe_lite import NoAuxRouter
from agentbox.parallel.state import tp_size


class LayerKind(Enum):
    KDA = "linear_attention"
    INDEXED = "indexed_attention"


class StepView:
    """The step's batch layout for the indexed layers, built once a step: each sequence's cache slots, the
    causal mask, each padded query's position, and the map from the step's tokens to padded query rows."""

    def __init__(self) -> None:
        meta = get_forward_context().meta
        self.layout = build_layout(meta, meta.slot_mapping.device)
        self.query_pos = self.layout.query_pos[:, 0, :, 0]  # [B, max_q]

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [B, max_q, ...] (zero rows for padding)."""
        lay = self.layout
        out = x.new_zeros(lay.num_seqs * lay.max_q, *x.shape[1:])
        out[lay.q_index] = x
        return out.view(lay.num_seqs, lay.max_q, *x.shape[1:])

    def unpadded(self, x: torch.Tensor) -> torch.Tensor:
        """[B, max_q, ...] -> [T, ...]."""
        return x.flatten(0, 1)[self.layout.q_index]


class IndexedAttention(nn.Module):
    def __init__(self, config: Any, has_indexer: bool, prefix: str) -> None:
        super().__init__()
        total, tp = config.num_attention_heads, tp_size()
        if total % tp:
            raise ValueError(f"{total} attention heads do not split over {tp} tensor-parallel ranks")
        if config.qk_rope_head_dim:
            raise ValueError(f"GLM-5.3-Flash's attention has no RoPE; qk_rope_head_dim is {config.qk_rope_head_dim}")
        self.num_heads = total // tp
        self.nope, self.rank, self.v_dim = config.qk_nope_head_dim, config.kv_lora_rank, config.v_head_dim
        bias = bool(getattr(config, "attention_bias", False))
        hidden, q_rank = config.hidden_size, config.q_lora_rank
        self.q_a_proj = ReplicatedLinear(hidden, q_rank, bias, prefix=f"{prefix}.q_a_proj")
        self.q_a_layernorm = RMSNorm(q_rank, config.rms_norm_eps)
        self.q_b_proj = ColumnParallelLinear(q_rank, total * self.nope, False, prefix=f"{prefix}.q_b_proj")
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.rank, bias, prefix=f"{prefix}.kv_a_proj_with_mqa")
        self.kv_a_layernorm = RMSNorm(self.rank, config.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(self.rank, total * (self.nope + self.v_dim), False,
                                              prefix=f"{prefix}.kv_b_proj")
        self.o_proj = RowParallelLinear(total * self.v_dim, hidden, bias, prefix=f"{prefix}.o_proj")
        self.scale = self.nope**-0.5
        self.indexer = KPoolIndexer(config, f"{prefix}.indexer") if has_indexer else None
        self.latent_layer = self.index_layer = -1  # this layer's tensors in the paged pool (the model sets them)

    def forward(self, x: torch.Tensor, view: StepView, shared: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (out [T, hidden], the selection [B, max_q, max_kv] it attended, for a shared layer)."""
        t, ctx, lay = x.shape[0], get_forward_context(), view.layout
        q_residual = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_residual).view(t, self.num_heads, self.nope)
        latent = self.kv_a_layernorm(self.kv_a_proj_with_mqa(x))
        cache = write_latent(ctx.backend, self.latent_layer, latent)
        if self.indexer is not None:
            entries = write_latent(ctx.backend, self.index_layer, self.indexer.entries(x))
            selection = self.indexer.select(x, q_residual, entries[lay.kv_slots][:, :, 0], view.query_pos, view.padded)
        elif shared is None:
            raise ValueError("a shared-indexer layer needs the previous layer's selection (indexer_types)")
        else:
            selection = shared
        mask = lay.mask[:, 0] & selection
        mask |= lay.mask[:, 0] & ~mask.any(-1, keepdim=True)  # padding rows only: keep softmax finite
        kv = cache[lay.kv_slots][:, :, 0].to(x.dtype)  # [B, max_kv, rank]
        b, n = kv.shape[:2]
        up = self.kv_b_proj(kv.reshape(b * n, self.rank)).view(b, n, self.num_heads, self.nope + self.v_dim)
        keys, values = up.split([self.nope, self.v_dim], dim=-1)
        out = view.unpadded(selected_attention(view.padded(q), keys, values, mask, self.scale))
        return self.o_proj(out.reshape(t, self.num_heads * self.v_dim)), selection


class ClampedMLP(nn.Module):
    """SwiGLU with gate clamped above and up both ways at `limit` (the dense layers and the shared expert)."""

    def __init__(self, hidden: int, inter: int, limit: float, prefix: str) -> None:
        super().__init__()
        self.limit = limit
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(inter, hidden, prefix=f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit))


class MoE(nn.Module):
    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__()
        self.gate = NoAuxRouter(config)
        self.top_k = config.num_experts_per_tok
        self.n_group, self.topk_group = int(config.n_group or 1), int(config.topk_group or 1)
        self.renormalize = bool(config.norm_topk_prob)
        self.scaling = float(config.routed_scaling_factor)
        limit = float(config.swiglu_limit)
        self.experts = FusedMoE(
            config.n_routed_experts, self.top_k, config.hidden_size, config.moe_intermediate_size,
            renormalize=self.renormalize, activation=MoEActivation.SILU_CLAMPED, swiglu_limit=limit,
            prefix=f"{prefix}.experts",
        )
        shared = config.moe_intermediate_size * int(config.n_shared_experts or 1)
        self.shared_experts = ClampedMLP(config.hidden_size, shared, limit, f"{prefix}.shared_experts")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts_grouped(
            self.gate(x), self.top_k, self.gate.e_score_correction_bias, self.n_group, self.topk_group,
            self.renormalize, self.scaling,
        )
        return self.experts.forward_routed(x, weights, ids) + self.shared_experts(x)


class Glm5NextBlock(nn.Module):
    def __init__(self, config: Any, layer_id: int, state_index: int) -> None:
        super().__init__()
        prefix = f"model.language_model.layers.{layer_id}"
        hc = (config.hidden_size, config.hc_mult, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps)
        self.hc_attn, self.hc_ffn = HyperConnection(*hc), HyperConnection(*hc)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.kind = LayerKind(config.layer_types[layer_id])
        self.self_attn: KimiDeltaAttention | IndexedAttention
        if self.kind is LayerKind.KDA:
            self.self_attn = KimiDeltaAttention(config, state_index, f"{prefix}.self_attn")
        else:
            shared = config.indexer_types[layer_id] == "shared"
            self.self_attn = IndexedAttention(config, not shared, f"{prefix}.self_attn")
        limit = float(config.swiglu_limit)
        self.mlp: nn.Module = (
            MoE(config, f"{prefix}.mlp") if config.mlp_layer_types[layer_id] == "sparse"
            else ClampedMLP(config.hidden_size, config.intermediate_size, limit, f"{prefix}.mlp")
        )

    def forward(self, positions: torch.Tensor, streams: torch.Tensor, view: StepView | None,
                selection: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (the new streams, the selection this layer attended (None for KDA): what a shared layer reuses)."""
        post, comb, x = self.hc_attn(streams)
        x = self.input_layernorm(x)
        if isinstance(self.self_attn, KimiDeltaAttention):
            out, selection = self.self_attn(positions, x), None
        else:
            assert view is not None
            out, selection = self.self_attn(x, view, selection)
        streams = HyperConnection.merge(streams, out, post, comb)
        post, comb, x = self.hc_ffn(streams)
        return HyperConnection.merge(streams, self.mlp(self.post_attention_layernorm(x)), post, comb), selection


class Glm5NextModel(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        kda_before = [sum(1 for k in config.layer_types[:i] if k == LayerKind.KDA.value)
                      for i in range(config.num_hidden_layers)]
        self.layers = nn.ModuleList([Glm5NextBlock(config, i, kda_before[i]) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hc_mult = int(config.hc_mult)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        streams = h[:, None, :].expand(-1, self.hc_mult, -1).contiguous()
        view = StepView() if any(b.kind is LayerKind.INDEXED for b in self.layers) else None
        selection = None
        for layer in self.layers:
            streams, selection = layer(positions, streams, view, selection)
        return self.norm(streams.mean(dim=1))  # the release's head is an unweighted mean of the streams


class Glm5NextForConditionalGeneration(CausalLM):
    checkpoint_renames = ((r"\.hc_(attn|ffn)_(fn|base|scale)$", r".hc_\1.\2"),)
    packed_modules_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    expert_mapping = per_expert_weights(
        "gate_proj", "up_proj", "down_proj", (ExpertShard.GATE, ExpertShard.UP, ExpertShard.DOWN)
    )
    # The indexed layers build masks from host-side lengths and the KDA layers loop over sequences in Python.
    supports_cuda_graphs = False

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        text = config.get_text_config()
        self.text = text
        validate(text)
        self.model = nn.Module()
        self.model.language_model = Glm5NextModel(text)
        self.lm_head = ParallelLMHead(text.vocab_size, text.hidden_size)
        self.tie_word_embeddings = bool(getattr(text, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.language_model.embed_tokens)
        n = text.num_hidden_layers
        self.skip_checkpoint_names = {
            "model.visual.": "vision tower (agentbox serves the text model)",
            f"model.language_model.layers.{n}.": "multi-token-prediction layer (a draft model, unused)",
        }
        self._number_cache()

    @property
    def language_model(self) -> Glm5NextModel:
        return self.model.language_model  # type: ignore[return-value]

    def _number_cache(self) -> None:
        """Each indexed layer's latent, then each indexer's entries, in the one paged group."""
        attns = [b.self_attn for b in self.language_model.layers if isinstance(b.self_attn, IndexedAttention)]
        if not attns:
            raise ValueError("a GLM-5.3-Flash config with no indexed-attention layer keeps nothing in the paged pool")
        for j, a in enumerate(attns):
            a.latent_layer = j
        for j, a in enumerate(a for a in attns if a.indexer is not None):
            a.index_layer = len(attns) + j
        self._attns = attns

    def attention_shape(self) -> AttentionShape:
        return AttentionShape(self.text.num_attention_heads // tp_size(), 1, self.text.kv_lora_rank)

    def cache_layout(self) -> CacheLayout:
        """Latents (kv_lora_rank) and indexer entries (2 index_head_dim) a token, replicated on every rank; the
        KDA layers' state."""
        c = self.text
        latent = KVLayerSpec(1, c.kv_lora_rank, c.kv_lora_rank, tied=True)
        index = KVLayerSpec(1, 2 * c.index_head_dim, tied=True)
        indexers = sum(1 for a in self._attns if a.indexer is not None)
        specs = tuple(b.self_attn.state_spec() for b in self.language_model.layers
                      if isinstance(b.self_attn, KimiDeltaAttention))
        return CacheLayout((PagedGroup((latent,) * len(self._attns) + (index,) * indexers),), StateGroup(specs))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.language_model(input_ids, positions)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def validate(text: Any) -> None:
    """Refuse what this implementation does not compute (clearly, at load)."""
    kinds, indexers = list(text.layer_types), list(text.indexer_types)
    for i, (kind, mode) in enumerate(zip(kinds, indexers, strict=True)):
        LayerKind(kind)
        if kind == LayerKind.INDEXED.value and mode == "shared":
            if i == 0 or kinds[i - 1] != LayerKind.INDEXED.value:
                raise ValueError(f"layer {i} reuses the previous layer's top-k, but layer {i - 1} is not indexed")
    if int(text.num_attention_heads) != int(text.num_key_value_heads):
        raise ValueError("GLM-5.3-Flash's latent attention has one key head per query head")
