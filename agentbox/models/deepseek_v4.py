"""DeepSeek-V4 (`DeepseekV4ForCausalLM`: V4-Flash 284B-A13B, V4-Pro): compressed sparse attention, hyper-connected
residual streams and hash-routed then score-routed experts. transformers' models/deepseek_v4 is the reference.

Attention, every layer: a low-rank query (wq_a, an fp32-weight RMSNorm, wq_b, then an unweighted RMSNorm per
head), one shared K=V head (wkv, kv_norm), RoPE on the trailing `qk_rope_head_dim` channels in adjacent pairs, a
sliding window over the last `sliding_window` raw tokens, a learned sink logit per head, and the output turned
back at the query's position (V is K, so it carries K's rotation) before a grouped low-rank projection (`o_groups`
blocks of heads each to `o_lora_rank`, wo_a; then wo_b). `layer_types` adds compressed entries to a layer
(layers/compressor.py): CSA pools one entry per 4 tokens over an overlapping 8-token window and attends only the
top `index_topk` its lightning indexer picks; HCA pools one per 128 tokens and attends all of them. Sliding-only
layers rotate with `rope_theta`, the others with `compress_rope_theta` (and YaRN when configured).

What it caches (`cache_layout`): a paged group of CSA entries (each CSA layer: its entries, 512 values, and its
indexer's keys, 128, one per 4 tokens), a paged group of HCA entries (one per 128 tokens), and a state group of
position rings (layers/position_ring.py): each layer's last `sliding_window` K=V rows, and each compressed layer's
raw projections of the tokens its next entries still pool (8 for CSA and its indexer, 128 for HCA). The engine
snapshots the rings at turn ends and resumes a session there; nothing outside this file knows the kinds.

Residual: `hc_mult` streams mixed around each block by hyper-connections (layers/hyper_connection.py), collapsed
once at the end. MLP: the first layers (`mlp_layer_types` "hash_moe") pick experts by a fixed table of the token
id (`tid2eid`), the others by sqrt(softplus) scores plus a correction bias; the chosen scores are renormalised
and scaled by `routed_scaling_factor`; experts and the shared expert clamp their gate and up at `swiglu_limit`.

Tensor parallel: query heads split (wq_b by rows, the sinks, wo_a by whole groups of heads, wo_b by input);
the K=V head, the compressors and the indexer are replicated, so every rank keeps the whole cache and state.
Checkpoints: DeepSeek's release layout (`layers.0.attn.wq_a.weight`, `embed.weight`, `hc_head_fn`) and the one
transformers' save_pretrained writes (`model.` prefixed, `model.embed_tokens.weight`, `attn.norm` for kv_norm)
both load (`checkpoint_renames`); the MTP layer (`mtp.`) is skipped. The release as DeepSeek ships it is FP8
(quantization_config fp8, `scale_fmt: ue8m0`): an FP8 weight's `scale` (one E8M0 byte per 128 x 128 block) is the
FP8 block method's `weight_scale_inv` (layers/quant/fp8.py converts it); the linears it keeps bf16 or fp32 have no
`scale` and load unquantised (the loader reads which: models/checkpoint_scan.py); its routed experts
(`expert_dtype: fp4`) are MXFP4 per expert, `experts.3.w1.weight` packed codes and `experts.3.w1.scale` E8M0, loaded
into layers/experts/mxfp4.py's blocks (`RELEASE_FP4_EXPERTS`).
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from agentbox.layers.backends.base import KVLayerSpec
from agentbox.layers.cache_layout import CacheLayout, PagedGroup, StateGroup
from agentbox.layers.compressor import Compressor, Indexer
from agentbox.layers.context import get_forward_context
from agentbox.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from agentbox.layers.experts import ExpertShard, FusedMoE, MoEActivation
from agentbox.layers.experts.mxfp4 import Mxfp4Experts
from agentbox.layers.experts.routing import Scoring, weigh_chosen
from agentbox.layers.hyper_connection import HyperConnection, HyperHead, unweighted_rms_norm
from agentbox.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from agentbox.layers.norm import Fp32RMSNorm
from agentbox.layers.quant import QuantConfig, quant_context
from agentbox.layers.quant.unquantized import UnquantizedLinearMethod
from agentbox.layers.recurrent_state import StateSpec
from agentbox.layers.rotary import InterleavedRope, rotate_interleaved
from agentbox.layers.weight_loading import ConvertsAfterLoading, set_weight_loader
from agentbox.layers.window_entry_attention import SeqEntries, WindowEntryAttention
from agentbox.models.base import AttentionShape, CausalLM, ExpertWeight, per_expert_weights
from agentbox.parallel.state import tp_rank, tp_size


class LayerKind(Enum):
    SLIDING = "sliding_attention"
    CSA = "compressed_sparse_attention"
    HCA = "heavily_compressed_attention"


class MlpKind(Enum):
    HASH = "hash_moe"
    SCORED = "moe"


def _ropes(config: Any) -> dict[str, InterleavedRope]:
    """The "main" rope (sliding-only layers) and the "compress" one (the others, their entries and indexer)."""
    out = {}
    for name in ("main", "compress"):
        params = dict(config.rope_parameters[name])
        theta = float(params.pop("rope_theta"))
        kind = params.get("rope_type", params.get("type", "default"))
        out[name] = InterleavedRope(int(config.qk_rope_head_dim), theta, None if kind == "default" else params)
    return out


class GroupedLinear(ColumnParallelLinear, ConvertsAfterLoading):
    """wo_a: `groups` blocks, block g mapping its heads' [in_per_group] outputs to its own [out_per_group]
    (a block-diagonal linear). Stored as the checkpoint's [groups * out, in] rows, split over the ranks by whole
    groups (the groups of the rank's heads); applied as one batched matmul. A quantised checkpoint's weight is
    dequantised once at load for that (its blocks do not split per group)."""

    def __init__(self, in_per_group: int, out_per_group: int, groups: int, prefix: str) -> None:
        super().__init__(in_per_group, out_per_group * groups, False, prefix)
        self.local_groups, self.out_per_group = groups // self.tp_size, out_per_group
        self.dtype = torch.get_default_dtype()
        self.dense: torch.Tensor | None = None  # [groups here, out, in], set after loading

    def process_weights_after_loading(self) -> None:
        if isinstance(self.quant_method, UnquantizedLinearMethod):
            # an fp16 checkpoint's weight is kept fp16 on the CPU for the f16 kernel (quant/unquantized.py), which
            # the batched matmul does not use: widened here, as the quantised ones are
            w = self.weight.data.to(self.dtype)
        else:
            w = self.quant_method.dequantized_weight(self).to(self.dtype)
        self.dense = w.view(self.local_groups, self.out_per_group, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, groups here, in] -> [T, groups here * out]."""
        if self.dense is None:
            self.process_weights_after_loading()
        assert self.dense is not None
        return torch.bmm(x.transpose(0, 1), self.dense.transpose(1, 2)).transpose(0, 1).flatten(1)


class Attention(nn.Module):
    def __init__(self, config: Any, kind: LayerKind, ropes: dict[str, InterleavedRope], prefix: str) -> None:
        super().__init__()
        heads, d, groups, tp = config.num_attention_heads, config.head_dim, config.o_groups, tp_size()
        if heads % groups or groups % tp:
            raise ValueError(f"{heads} heads in {groups} output groups cannot be split over {tp} tensor-parallel ranks")
        self.kind, self.head_dim, self.eps = kind, d, config.rms_norm_eps
        self.num_heads, self.total_heads = heads // tp, heads
        hidden, q_rank = config.hidden_size, config.q_lora_rank
        self.wq_a = ReplicatedLinear(hidden, q_rank, prefix=f"{prefix}.wq_a")
        self.q_norm = Fp32RMSNorm(q_rank, config.rms_norm_eps)
        self.wq_b = ColumnParallelLinear(q_rank, heads * d, prefix=f"{prefix}.wq_b")
        self.wkv = ReplicatedLinear(hidden, d, prefix=f"{prefix}.wkv")
        self.kv_norm = Fp32RMSNorm(d, config.rms_norm_eps)
        self.wo_a = GroupedLinear(heads * d // groups, config.o_lora_rank, groups, f"{prefix}.wo_a")
        self.wo_b = RowParallelLinear(groups * config.o_lora_rank, hidden, prefix=f"{prefix}.wo_b")
        self.attn_sink = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32), requires_grad=False)
        set_weight_loader(self.attn_sink, self._load_sinks)
        self.core = WindowEntryAttention(self.num_heads, d, config.sliding_window, d**-0.5, self.attn_sink)
        self.rope = ropes["main" if kind is LayerKind.SLIDING else "compress"]
        self.rate = 0 if kind is LayerKind.SLIDING else int(config.compress_rates[kind.value])
        self.compressor: Compressor | None = None
        self.indexer: Indexer | None = None
        if kind is not LayerKind.SLIDING:
            self.compressor = Compressor(hidden, d, self.rate, kind is LayerKind.CSA, config.rms_norm_eps,
                                         ropes["compress"], f"{prefix}.compressor")
        if kind is LayerKind.CSA:
            self.indexer = Indexer(hidden, q_rank, config.index_n_heads, config.index_head_dim, self.rate,
                                   config.index_topk, config.rms_norm_eps, ropes["compress"], f"{prefix}.indexer")
        self.entry_layer = self.index_layer = -1  # this layer's tensors in the paged pool (the model sets them)

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if loaded.numel() != self.total_heads:
            raise ValueError(f"attn_sink: {loaded.numel()} values for {self.total_heads} heads")
        param.data.copy_(loaded.narrow(0, tp_rank() * self.num_heads, self.num_heads))

    def state_specs(self) -> list[tuple[Any, StateSpec]]:
        """(the module that owns it, its spec) for each ring this layer keeps, in order."""
        owners: list[Any] = [self.core, self.compressor, self.indexer.compressor if self.indexer else None]
        return [(m, m.state_spec()) for m in owners if m is not None]

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        t, ctx = x.shape[0], get_forward_context()
        q_residual = self.q_norm(self.wq_a(x))
        q = unweighted_rms_norm(self.wq_b(q_residual).view(t, self.num_heads, self.head_dim), self.eps)
        cos, sin = self.rope.tables(positions, x.dtype)
        q = rotate_interleaved(q, cos, sin)
        kv = rotate_interleaved(self.kv_norm(self.wkv(x))[:, None], cos, sin)[:, 0]
        if ctx.state is None:
            raise RuntimeError("DeepSeek-V4 attention ran without its state slots (the runner sets them per step)")
        entries = None
        if self.compressor is not None:
            step, cache = ctx.entries[self.rate], ctx.backend.kv_cache.k[self.entry_layer]
            self.compressor(x, step, ctx.state, cache)
            chosen = None
            if self.indexer is not None:
                keys = ctx.backend.kv_cache.k[self.index_layer]
                self.indexer.compressor(x, step, ctx.state, keys)
                chosen = self.indexer.select(x, q_residual, positions, step, keys)
            entries = [SeqEntries(step.gather(cache, i)[:, 0], self.rate, None if chosen is None else chosen[i])
                       for i in range(len(step.query_lens))]
        out = rotate_interleaved(self.core(q, kv, ctx.state, entries), cos, -sin)
        return self.wo_b(self.wo_a(out.view(t, self.wo_a.local_groups, -1)))


class ClampedMLP(nn.Module):
    """The shared expert: silu(gate) * up with gate clamped above and up both ways at `limit`."""

    def __init__(self, hidden: int, inter: int, limit: float, prefix: str) -> None:
        super().__init__()
        self.limit = limit
        self.w13 = MergedColumnParallelLinear(hidden, [inter, inter], prefix=f"{prefix}.w13")
        self.w2 = RowParallelLinear(inter, hidden, prefix=f"{prefix}.w2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit))


class Router(nn.Module):
    """The gate's weight (the checkpoint's dtype), and either the correction bias that only chooses (fp32) or
    the hash layers' token-id -> experts table."""

    def __init__(self, config: Any, kind: MlpKind) -> None:
        super().__init__()
        n = config.n_routed_experts
        self.weight = nn.Parameter(torch.empty(n, config.hidden_size), requires_grad=False)
        if kind is MlpKind.HASH:
            self.tid2eid = nn.Parameter(torch.zeros(config.vocab_size, config.num_experts_per_tok, dtype=torch.int64),
                                        requires_grad=False)
        else:
            self.bias = nn.Parameter(torch.zeros(n, dtype=torch.float32), requires_grad=False)


class MoE(nn.Module):
    def __init__(self, config: Any, kind: MlpKind, prefix: str) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        self.kind, self.top_k = kind, config.num_experts_per_tok
        self.scoring = Scoring(config.scoring_func)
        self.scaling = float(config.routed_scaling_factor)
        self.gate = Router(config, kind)
        limit = float(config.swiglu_limit)
        self.experts = FusedMoE(
            config.n_routed_experts, self.top_k, config.hidden_size, config.moe_intermediate_size, renormalize=True,
            activation=MoEActivation.SILU_CLAMPED, swiglu_limit=limit, prefix=f"{prefix}.experts",
        )
        # one shared expert of moe_intermediate_size, as the reference builds it whatever n_shared_experts says
        self.shared_experts = ClampedMLP(config.hidden_size, config.moe_intermediate_size, limit, f"{prefix}.shared_experts")

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        scores = self.scoring.scores(F.linear(x, self.gate.weight))
        if self.kind is MlpKind.HASH:
            ids = self.gate.tid2eid[input_ids]
        else:
            ids = torch.topk(scores + self.gate.bias, self.top_k, dim=-1, sorted=False).indices
        out = self.experts.forward_routed(x, weigh_chosen(scores, ids, self.scaling), ids)
        return out + self.shared_experts(x)


class Block(nn.Module):
    def __init__(self, config: Any, layer_id: int, ropes: dict[str, InterleavedRope]) -> None:
        super().__init__()
        prefix = f"layers.{layer_id}"
        hc = (config.hidden_size, config.hc_mult, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps)
        self.hc_attn, self.hc_ffn = HyperConnection(*hc), HyperConnection(*hc)
        self.attn_norm = Fp32RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn_norm = Fp32RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, LayerKind(config.layer_types[layer_id]), ropes, f"{prefix}.attn")
        self.ffn = MoE(config, MlpKind(config.mlp_layer_types[layer_id]), f"{prefix}.ffn")

    def forward(self, positions: torch.Tensor, streams: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        post, comb, x = self.hc_attn(streams)
        streams = HyperConnection.merge(streams, self.attn(positions, self.attn_norm(x)), post, comb)
        post, comb, x = self.hc_ffn(streams)
        return HyperConnection.merge(streams, self.ffn(self.ffn_norm(x), input_ids), post, comb)


_SHARDS = (("w1", "w13", ExpertShard.GATE), ("w3", "w13", ExpertShard.UP), ("w2", "w2", ExpertShard.DOWN))
# The release's FP4 experts onto the MXFP4 method's parameters (its PACKED_ROWS layout views them as it loads).
RELEASE_FP4_EXPERTS = tuple(
    ExpertWeight(f"experts.{{e}}.{proj}.{src}", f"experts.{param}_{dst}", shard)
    for proj, param, shard in _SHARDS for src, dst in (("weight", "blocks"), ("scale", "scales"))
)


class DeepseekV4ForCausalLM(CausalLM):
    narrow_cpu_kv = False  # the compressor and indexer read compressed entries raw; not checked on an fp16 pool
    checkpoint_renames = (
        # the release's FP8 block scale of a linear (wq_a ... w3, weights_proj; not hc_*.scale, and a routed
        # expert's `scale` is its FP4 method's: kept)
        (r"^(?!.*\.experts\.\d+\.)(.*\.w\w*)\.scale$", r"\1.weight_scale_inv"),
        (r"^model\.", ""),  # transformers' save: `model.` before everything but the head
        (r"^embed_tokens\.", "embed."),
        (r"^hc_head[._]hc_(fn|base|scale)$", r"hc_head.\1"),
        (r"^hc_head_(fn|base|scale)$", r"hc_head.\1"),
        (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".hc_\1.\2"),
        (r"\.attn\.norm\.", ".attn.kv_norm."),  # transformers' save names kv_norm `attn.norm`
    )
    packed_modules_mapping = {"w1": ("w13", 0), "w3": ("w13", 1)}  # the shared expert's gate and up
    expert_mapping = per_expert_weights("w1", "w3", "w2", (ExpertShard.GATE, ExpertShard.UP, ExpertShard.DOWN))
    # The attention reads each sequence's entries and rings in Python: decode is not captured in CUDA graphs.
    supports_cuda_graphs = False

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        if int(config.num_key_value_heads) != 1:
            raise ValueError(f"DeepSeek-V4 keeps one shared K=V head, not {config.num_key_value_heads}")
        ropes = _ropes(config)
        self.ropes = nn.ModuleDict(ropes)
        self.embed = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Block(config, i, ropes) for i in range(config.num_hidden_layers)])
        self.hc_head = HyperHead(config.hidden_size, config.hc_mult, config.hc_eps, config.rms_norm_eps)
        self.norm = Fp32RMSNorm(config.hidden_size, config.rms_norm_eps)
        with quant_context(QuantConfig()):  # the release keeps the head unquantised
            self.head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.hc_mult = int(config.hc_mult)
        if isinstance(self.layers[0].ffn.experts.method, Mxfp4Experts):  # the release's expert_dtype fp4
            self.expert_mapping = RELEASE_FP4_EXPERTS
        n = config.num_hidden_layers
        hash_layers = [i for i, k in enumerate(config.mlp_layer_types) if MlpKind(k) is MlpKind.HASH]
        self.skip_checkpoint_names = {
            "mtp.": "multi-token-prediction layer (a draft model, unused)",
            **{f"layers.{i}.ffn.gate.bias": "a hash layer's router bias (experts come from tid2eid)" for i in hash_layers},
            **{f"layers.{i}.ffn.gate.bias_vl": "the vision tokens' router bias" for i in range(n)},
        }
        self._number_cache()

    def _number_cache(self) -> None:
        """Each compressed layer's place in the paged pool (CSA entries and indexer keys first, then HCA) and each
        ring's place in the state group."""
        attns = [block.attn for block in self.layers]
        csa = [a for a in attns if a.kind is LayerKind.CSA]
        hca = [a for a in attns if a.kind is LayerKind.HCA]
        if not csa and not hca:
            raise ValueError("a DeepSeek-V4 config with no compressed layer keeps nothing in the paged pool")
        for j, a in enumerate(csa):
            a.entry_layer, a.index_layer = 2 * j, 2 * j + 1
        for j, a in enumerate(hca):
            a.entry_layer = 2 * len(csa) + j
        self._state_specs: list[StateSpec] = []
        for a in attns:
            for owner, spec in a.state_specs():
                owner.state_index = len(self._state_specs)
                self._state_specs.append(spec)
        self._groups = (csa, hca)

    def attention_shape(self) -> AttentionShape:
        return AttentionShape(self.config.num_attention_heads // tp_size(), 1, self.config.head_dim)

    def cache_layout(self) -> CacheLayout:
        """CSA: entries and indexer keys, one of each per 4 tokens and layer; HCA: entries, one per 128; both
        replicated on every rank. The rings: the state group."""
        c = self.config
        csa, hca = self._groups
        entry, key = KVLayerSpec(1, c.head_dim, tied=True), KVLayerSpec(1, c.index_head_dim, tied=True)
        paged = []
        if csa:
            paged.append(PagedGroup((entry, key) * len(csa), int(c.compress_rates[LayerKind.CSA.value])))
        if hca:
            paged.append(PagedGroup((entry,) * len(hca), int(c.compress_rates[LayerKind.HCA.value])))
        return CacheLayout(tuple(paged), StateGroup(tuple(self._state_specs)))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        streams = h[:, None, :].expand(-1, self.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer(positions, streams, input_ids)
        return self.norm(self.hc_head(streams))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()
