"""The one protocol every model class follows: `CausalLM`, what the loader, the weight loader and the runner read
of a model. Each member is declared here with its default, so a model states what differs and nothing outside
the model asks it whether it has something.

- Weight names (models/weight_loader.py): `checkpoint_renames`, `packed_modules_mapping`, `expert_mapping`,
  `skip_checkpoint_names`, `tie_word_embeddings`.
- What it caches (`cache_layout`, layers/cache_layout.py): the engine sizes its pools, page tables and state
  slots from it. The attention backend's default shape is `attention_shape`.
- How the runner may run a step: `supports_cuda_graphs` (decode captured in CUDA graphs), and
  `fused_cpu_decode_target` (the decoder stack the CPU fused decode of engine/exec/cpu_decode.py runs, if any),
  `fused_cpu_hybrid_target` (the Qwen3.5-style hybrid stack engine/exec/cpu_hybrid.py runs, if any).
- The step itself: `forward(input_ids, positions)` -> hidden states, `compute_logits(hidden)` -> fp32 logits.
- A draft head the checkpoint ships (`add_mtp_head`, then `mtp`: models/mtp.py), built only when asked for.
- Tables too large to load (`host_table_names`, `map_host_tables`, `host_tables`: layers/host_table.py): the
  loader never reads those tensors; the model maps them from the checkpoint's files after the load.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from agentbox.layers.cache_layout import CacheLayout
from agentbox.layers.experts import ExpertShard
from agentbox.layers.host_table import HostTable, TensorLocation
from agentbox.parallel.state import head_shard


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def num_kv_heads_of(config: Any) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


@dataclass(frozen=True)
class ExpertWeight:
    """One row of a model's `expert_mapping`. A checkpoint name holding `{e}` is one tensor per expert (Qwen3-MoE:
    `experts.3.gate_proj.weight`); one without it holds every expert stacked on dim 0 (gpt-oss:
    `experts.gate_up_proj`), and the load hands each expert's slice over in turn."""

    checkpoint: str  # suffix of the checkpoint name; `{e}` stands for the expert index when per expert
    param: str  # suffix of our parameter's name that replaces it
    shard: ExpertShard  # passed to the parameter's loader
    transposed: bool = False  # the checkpoint stores [in, out] per expert (gpt-oss bf16); ours is [out, in]

    def pattern(self) -> re.Pattern[str]:
        return re.compile(re.escape(self.checkpoint).replace(re.escape("{e}"), r"(\d+)") + "$")


# The tensor names one expert projection has in the safetensors layouts the expert methods load: bf16
# `weight`; FP8 block `weight` + `weight_scale_inv`; AWQ `qweight`/`qzeros`/`scales`; GPTQ those + `g_idx`;
# NVFP4 ModelOpt `weight` + `weight_scale` / `weight_scale_2` / `input_scale`, compressed-tensors `weight_packed`
# + `weight_scale` / `weight_global_scale` / `input_global_scale`.
EXPERT_TENSOR_NAMES = (
    "weight", "weight_scale_inv", "qweight", "qzeros", "scales", "g_idx",
    "weight_scale", "weight_scale_2", "input_scale", "weight_packed", "weight_global_scale", "input_global_scale",
)


def per_expert_weights(
    gate: str | None, up: str, down: str, shards: tuple[ExpertShard, ExpertShard, ExpertShard]
) -> tuple[ExpertWeight, ...]:
    """Rows for checkpoints with one tensor per expert and projection (`experts.{e}.gate_proj.qweight`):
    each name maps onto the layer's `w13_<name>` (gate, up) or `w2_<name>` (down). `shards`: the layer's
    (gate, up, down) shard ids; `gate` None: un-gated experts (up alone). A method holds only the names of its
    own format; others never match."""
    g, u, d = shards
    projections = [(gate, "w13", g)] if gate is not None else []
    return tuple(
        ExpertWeight(f"experts.{{e}}.{proj}.{name}", f"experts.{param}_{name}", shard)
        for name in EXPERT_TENSOR_NAMES
        for proj, param, shard in (*projections, (up, "w13", u), (down, "w2", d))
    )


@dataclass(frozen=True)
class AttentionShape:
    """Query heads, KV heads and head size of the model's attention on this tensor-parallel rank: the attention
    backend's default (layers whose shape differs carry their own, `KVLayerSpec`)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int


class CausalLM(nn.Module, ABC):
    # (pattern, replacement) regex substitutions applied in order to each checkpoint name before anything else:
    # one model class reading the layouts its checkpoints come in (DeepSeek-V4's release and transformers' save)
    checkpoint_renames: ClassVar[tuple[tuple[str, str], ...]] = ()
    # HF checkpoint module name -> (our fused module, shard id passed to its parameter's loader)
    packed_modules_mapping: ClassVar[Mapping[str, tuple[str, str | int]]] = {}
    # MoE experts: checkpoint names -> the FusedMoE parameters (`ExpertWeight` rows, above); an instance whose
    # experts' tensors are named by their format (DeepSeek-V4's FP4 release) sets its own
    expert_mapping: tuple[ExpertWeight, ...] = ()
    # Substrings of checkpoint names that have no parameter -> what they are (the load logs what it skipped)
    skip_checkpoint_names: Mapping[str, str] = {}
    # The LM head is the embedding's table (a tied checkpoint's `lm_head.weight`, if any, is not loaded)
    tie_word_embeddings: bool = False
    # Decode may run under CUDA graphs (an attention that reads host-side lengths cannot be captured)
    supports_cuda_graphs: ClassVar[bool] = True
    # The KV pool may be narrower than the compute dtype (fp16 under fp32 on CPU, EngineConfig.kv_dtype): every
    # read of the cache widens it (`.to(q.dtype)`, the C kernels). False where a layer reads the cache raw.
    narrow_cpu_kv: ClassVar[bool] = True
    # Substrings of checkpoint names the loader leaves in the file: tables the model memory-maps itself
    # (`map_host_tables`), read a few rows a step (Qwen3.8-Flash-Next's n-gram tables, ~95 GiB)
    host_table_names: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.mtp: nn.Module | None = None  # the multi-token-prediction head, once add_mtp_head built it

    def add_mtp_head(self) -> bool:
        """Builds the checkpoint's multi-token-prediction head as `self.mtp` (its weights load with the model's,
        its attention layer joins `cache_layout`); False when this model has none. Called by the loader inside
        the model's device and dtype."""
        return False

    def map_host_tables(self, locations: Mapping[str, TensorLocation]) -> None:
        """Maps the tensors named by `host_table_names` (`locations`: where every checkpoint tensor sits) once the
        weights are loaded. Nothing to do for a model that names none."""
        if self.host_table_names:
            raise NotImplementedError(f"{type(self).__name__} names host tables but does not map them")

    def host_tables(self) -> list[HostTable]:
        """The tables this model reads from mapped files (host RAM's page cache, never the accelerator)."""
        return []

    @abstractmethod
    def cache_layout(self) -> CacheLayout:
        """What this model keeps per token (paged groups) and per sequence (its state group), on this rank."""

    def attention_shape(self) -> AttentionShape:
        """From the (text) config: its heads split over the tensor-parallel ranks, its head size."""
        text = self.config.get_text_config()
        shard = head_shard(text.num_attention_heads, num_kv_heads_of(text))
        return AttentionShape(shard.num_heads, shard.num_kv_heads, head_dim_of(text))

    def fused_cpu_decode_target(self) -> nn.Module | None:
        """The Llama-family decoder stack (`LlamaModel`) the CPU fused decode may run in one C call a layer;
        None: this model's layers are not Llama's. The runner still checks each layer (cpu_decode.eligible)."""
        return None

    def fused_cpu_hybrid_target(self) -> nn.Module | None:
        """The Qwen3.5-layout hybrid stack (Gated DeltaNet and gated attention layers, models/qwen3_5.py) the CPU
        fused decode of engine/exec/cpu_hybrid.py may run in one C call a layer; None: not such a model. The runner
        still checks each layer (cpu_hybrid.eligible)."""
        return None

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] for the step's flattened batch -> hidden states [T, H]. Runs inside a
        forward context (layers/context.py)."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states [N, H] -> logits [N, vocab] in fp32."""
