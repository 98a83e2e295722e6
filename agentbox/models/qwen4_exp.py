"""Qwen3.8-Flash-Next (`qwen4_exp`, `Qwen4ExpForConditionalGeneration` / `Qwen4ExpForCausalLM`): Qwen3.5's hybrid
of Gated DeltaNet and gated attention, with three additions. transformers' models/qwen4_exp is the reference.

- `layer_types`: "linear_attention" layers are Qwen3.5's Gated DeltaNet (layers/gated_deltanet.py; the output
  gate's activation is `output_gate_type`); "indexed_attention" layers are Qwen3.5's gated attention (models/
  qwen3_5.py: query and gate per head, q/k norms, partial rope) whose queries attend only what the QSA indexer
  picks (layers/qsa_indexer.py: the best indexer_budget / indexer_compress_ratio mean-pooled blocks plus the
  query's own incomplete block).
- PLE: the layers of `ple_layer_ids` (one-indexed, delta-net layers only) first add a hashed n-gram feature to the
  streams (layers/ngram_embedding.py); its tables stay in the checkpoint's file, memory-mapped
  (layers/host_table.py), never loaded into RAM or onto the accelerator.
- Residual: `hc_count` streams mixed around each block by gated residuals (layers/gated_residual.py), collapsed at
  the end by the same mix; there is no norm before a block, nor a final norm.
- MLP: routed experts (softmax top-k) plus the shared expert behind its sigmoid gate, on every layer (Qwen3.5-MoE's).

What it caches (`cache_layout`): one token-granular paged group holding each indexed layer's K and V (heads split
over tensor-parallel ranks) and then each indexer's raw key per token ([indexer_head_dim], replicated); a state
group of, per delta-net layer in order, its PLE rings when it has PLE (the last ngram_size - 1 token ids, the
conv's last inputs) and its conv and matrix. The whole state group is snapshotted at turn ends.

Checkpoints: the image-text release layout (`model.language_model.`, the vision tower `model.visual.` skipped;
the n-gram tables as `ngram_embedding.shard_{i}.weight` row shards, mapped, not read; the hash constants transformers
saves as buffers are recomputed from the config). The text-only `Qwen4ExpForCausalLM` has the same text model
under `model.`. A multi-token-prediction head (`mtp.`) is skipped: its layer would be this model's block (streams,
PLE), not Qwen3.5's MTP layer, so drafts come from the text alone (suffix drafts).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from agentbox.layers.backends.base import KVLayerSpec
from agentbox.layers.cache_layout import CacheLayout, PagedGroup, StateGroup
from agentbox.layers.context import get_forward_context
from agentbox.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from agentbox.layers.experts import ExpertShard
from agentbox.layers.gated_deltanet import GatedDeltaNet
from agentbox.layers.gated_residual import GatedResidual
from agentbox.layers.host_table import HostTable, TensorLocation
from agentbox.layers.linear import RowParallelLinear
from agentbox.layers.ngram_embedding import NGramIds, PLELayer
from agentbox.layers.qsa_indexer import QSAIndexer
from agentbox.layers.recurrent_state import StateSpec
from agentbox.layers.rotary import RotaryEmbedding, rope_parameters
from agentbox.layers.selected_attention import selected_attention
from agentbox.models.base import CausalLM, head_dim_of, num_kv_heads_of, per_expert_weights
from agentbox.models.glm5_next import StepView
from agentbox.models.llama import LlamaForCausalLM
from agentbox.models.qwen3_5 import GatedQKVParallelLinear, SharedExpertMoE, ZeroCenteredRMSNorm

LINEAR, INDEXED = "linear_attention", "indexed_attention"
NGRAM_TABLE = "ple.ple_embedding.ngram_embedding."


class QSAAttention(nn.Module):
    """Qwen3.5's gated attention over the tokens the QSA indexer selects."""

    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__()
        if getattr(config, "attention_bias", False):
            raise ValueError("attention_bias is not supported for QSA attention (no released checkpoint has it)")
        self.head_dim = d = head_dim_of(config)
        self.qkv_proj = GatedQKVParallelLinear(config.hidden_size, d, config.num_attention_heads,
                                               num_kv_heads_of(config), f"{prefix}.qkv_proj")
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        sh = self.qkv_proj.shard
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, config.hidden_size, False,
                                        prefix=f"{prefix}.o_proj", input_shard=(sh.q_start * d, sh.num_heads * d))
        self.q_norm = ZeroCenteredRMSNorm(d, config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(d, config.rms_norm_eps)
        theta, scaling = rope_parameters(config)
        params = getattr(config, "rope_parameters", None) or {}
        self.rotary_dim = int(d * float(params.get("partial_rotary_factor", 1.0)))
        self.rotary = RotaryEmbedding(self.rotary_dim, config.max_position_embeddings, theta, scaling)
        self.indexer = QSAIndexer(config, self.rotary, self.rotary_dim, f"{prefix}.indexer")
        self.kv_layer = self.index_layer = -1  # this layer's tensors in the paged pool (the model sets them)

    def _rope(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        r = self.rotary_dim
        return torch.cat([self.rotary.rotate(positions, x[..., :r]), x[..., r:]], dim=-1)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, view: StepView) -> torch.Tensor:
        t, d, ctx, lay = x.shape[0], self.head_dim, get_forward_context(), view.layout
        q_size, kv_size = 2 * self.num_heads * d, self.num_kv_heads * d
        qg, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q, gate = qg.view(t, self.num_heads, 2 * d).chunk(2, dim=-1)
        q = self._rope(positions, self.q_norm(q.contiguous()))
        k = self._rope(positions, self.k_norm(k.reshape(t, self.num_kv_heads, d)))
        index_q, index_k = self.indexer.project(x, positions)
        cache = ctx.backend.kv_cache
        slots = ctx.meta.slot_mapping.to(x.device, torch.int64)
        k_cache, v_cache, i_cache = cache.k[self.kv_layer], cache.v[self.kv_layer], cache.k[self.index_layer]
        k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.index_copy_(0, slots, v.reshape(t, self.num_kv_heads, d).to(v_cache.dtype))
        i_cache.index_copy_(0, slots, index_k[:, None].to(i_cache.dtype))
        selection = self.indexer.select(view.padded(index_q), i_cache[lay.kv_slots][:, :, 0], view.query_pos)
        mask = lay.mask[:, 0] & selection
        mask |= lay.mask[:, 0] & ~mask.any(-1, keepdim=True)  # padding rows only: keep softmax finite
        group = self.num_heads // self.num_kv_heads
        keys = k_cache[lay.kv_slots].to(x.dtype).repeat_interleave(group, dim=2)  # [B, max_kv, H, d]
        values = v_cache[lay.kv_slots].to(x.dtype).repeat_interleave(group, dim=2)
        out = view.unpadded(selected_attention(view.padded(q), keys, values, mask, d**-0.5))
        out = out.reshape(t, self.num_heads * d)
        return self.o_proj(out * torch.sigmoid(gate.reshape(t, -1)))


class Qwen4ExpBlock(nn.Module):
    def __init__(self, config: Any, layer_id: int, state_index: int, prefix: str) -> None:
        """state_index: where this layer's states start in the state group (PLE's rings first, then the delta
        net's), for a delta-net layer."""
        super().__init__()
        self.kind = config.layer_types[layer_id]
        ple_ids = list(config.ple_layer_ids or [])
        self.ple: PLELayer | None = None
        if layer_id + 1 in ple_ids:
            self.ple = PLELayer(config, ple_ids.index(layer_id + 1), state_index, f"{prefix}.ple")
            state_index += len(self.ple.state_specs())
        self.mixer: GatedDeltaNet | QSAAttention
        if self.kind == LINEAR:
            self.linear_attn = self.mixer = GatedDeltaNet(config, state_index, f"{prefix}.linear_attn", False)
        else:
            self.self_attn = self.mixer = QSAAttention(config, f"{prefix}.self_attn")
        self.mlp = SharedExpertMoE(config, f"{prefix}.mlp", bool(getattr(config, "norm_topk_prob", True)))
        self.attn_hyper_connection = GatedResidual(config, f"{prefix}.attn_hyper_connection")
        self.mlp_hyper_connection = GatedResidual(config, f"{prefix}.mlp_hyper_connection")

    def state_specs(self) -> list[StateSpec]:
        specs: list[StateSpec] = list(self.ple.state_specs()) if self.ple is not None else []
        if isinstance(self.mixer, GatedDeltaNet):
            specs.append(self.mixer.state_spec())
        return specs

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, streams: torch.Tensor,
                view: StepView | None) -> torch.Tensor:
        if self.ple is not None:
            streams = streams + self.ple(input_ids, streams)
        mixer = self.mixer
        if isinstance(mixer, QSAAttention):
            assert view is not None
            streams = self.attn_hyper_connection(streams, lambda x: mixer(positions, x, view))
        else:
            streams = self.attn_hyper_connection(streams, lambda x: mixer(positions, x))
        return self.mlp_hyper_connection(streams, self.mlp)


class Qwen4ExpModel(nn.Module):
    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        layers, state_index = [], 0
        for i in range(config.num_hidden_layers):
            layer = Qwen4ExpBlock(config, i, state_index, f"{prefix}.layers.{i}")
            state_index += len(layer.state_specs())
            layers.append(layer)
        self.layers = nn.ModuleList(layers)
        self.hyper_connection_mixer = GatedResidual(config, f"{prefix}.hyper_connection_mixer", combine=False)
        self.hc = int(config.hc_count)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        streams = self.embed_tokens(input_ids).repeat(1, self.hc)  # [T, hc * hidden]: every stream the embedding
        view = StepView() if any(b.kind == INDEXED for b in self.layers) else None
        for layer in self.layers:
            streams = layer(input_ids, positions, streams, view)
        return self.hyper_connection_mixer.mix(streams)[0]


class Qwen4ExpForConditionalGeneration(CausalLM):
    narrow_cpu_kv = False  # the indexer scores the raw index cache against fp32 queries
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping
    expert_mapping = per_expert_weights(
        "gate_proj", "up_proj", "down_proj", (ExpertShard.GATE, ExpertShard.UP, ExpertShard.DOWN)
    )
    skip_checkpoint_names = {
        "model.visual.": "vision tower (agentbox serves the text model)",
        "mtp.": "multi-token-prediction layers (a draft model, unused)",
        "ple.ple_embedding.layer_multipliers": "n-gram hash constants (recomputed from the config, checked)",
        "ple.ple_embedding.ngram_heads_": "n-gram hash constants (recomputed from the config, checked)",
    }
    host_table_names = (NGRAM_TABLE,)
    # The indexed layers build masks from host-side lengths, and PLE and the delta net loop over sequences.
    supports_cuda_graphs = False
    text_prefix = "model.language_model"

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        text = config.get_text_config()
        self.text = text
        for i in text.ple_layer_ids or []:
            if text.layer_types[i - 1] != LINEAR:
                raise ValueError(f"PLE on layer {i} (one-indexed), which is not a linear-attention layer")
        self.model = nn.Module()
        lm = Qwen4ExpModel(text, self.text_prefix)
        if self.text_prefix == "model":
            self.model = lm
        else:
            self.model.language_model = lm
        self.lm_head = ParallelLMHead(text.vocab_size, text.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.tie_to(lm.embed_tokens)
        attns = [b.mixer for b in lm.layers if isinstance(b.mixer, QSAAttention)]
        if not attns:
            raise ValueError("a Qwen3.8-Flash-Next config with no indexed-attention layer keeps nothing in the pool")
        for j, a in enumerate(attns):
            a.kv_layer, a.index_layer = j, len(attns) + j
        self._attns = attns

    @property
    def language_model(self) -> Qwen4ExpModel:
        return self.model if self.text_prefix == "model" else self.model.language_model  # type: ignore[return-value]

    def map_host_tables(self, locations: Mapping[str, TensorLocation]) -> None:
        """Each PLE layer's n-gram table from its row shards in the checkpoint (in shard order)."""
        for i, layer in enumerate(self.language_model.layers):
            if layer.ple is None:
                continue
            prefix = f"{self.text_prefix}.layers.{i}.{NGRAM_TABLE}"
            names = [n for n in locations if n.startswith(prefix) and n.endswith(".weight")]
            shard = re.compile(r"shard_(\d+)\.weight$")
            names.sort(key=lambda n: int(m.group(1)) if (m := shard.search(n)) else 0)
            if not names:
                raise ValueError(f"checkpoint has no n-gram table for layer {i} ({prefix}*)")
            table = HostTable([locations[n] for n in names])
            if table.rows != layer.ple.ids.rows:
                raise ValueError(f"layer {i}'s n-gram table has {table.rows} rows; the config hashes into "
                                 f"{layer.ple.ids.rows}")
            layer.ple.table = table
            check_hash_constants(layer.ple.ids, f"{self.text_prefix}.layers.{i}.ple.ple_embedding.", locations)

    def host_tables(self) -> list[HostTable]:
        return [b.ple.table for b in self.language_model.layers if b.ple is not None and b.ple.table is not None]

    def cache_layout(self) -> CacheLayout:
        shape = self.attention_shape()
        kv = KVLayerSpec(shape.num_kv_heads, shape.head_dim)
        index = KVLayerSpec(1, int(self.text.indexer_head_dim), tied=True)
        specs = tuple(s for b in self.language_model.layers for s in b.state_specs())
        paged = PagedGroup((kv,) * len(self._attns) + (index,) * len(self._attns))
        return CacheLayout((paged,), StateGroup(specs) if specs else None)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.language_model(input_ids, positions)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def check_hash_constants(ids: NGramIds, prefix: str, locations: Mapping[str, TensorLocation]) -> None:
    """The multipliers, head offsets and head sizes the checkpoint saved (where it did) equal those computed from
    the config: a table read with other hashes would give plausible-looking nonsense, never an error."""
    for suffix, ours in (("layer_multipliers", ids.multipliers), ("ngram_heads_offsets", ids.offsets),
                         ("ngram_heads_vocab_sizes", ids.sizes)):
        loc = locations.get(prefix + suffix)
        if loc is None:
            continue
        with safe_open(str(loc.path), framework="pt") as f:
            saved = f.get_tensor(prefix + suffix)
        if not torch.equal(saved.to(torch.int64), ours.cpu()):
            raise ValueError(f"{prefix + suffix} in the checkpoint is {saved.tolist()}; the config (seed, "
                             f"ngram_vocab_size_base, vocab_size) gives {ours.tolist()}")


class Qwen4ExpForCausalLM(Qwen4ExpForConditionalGeneration):
    """The text-only checkpoint: the same text model under `model.`."""

    text_prefix = "model"
