"""The Llama family in one file: Llama 2/3, SmolLM2, Mistral (dense), Qwen2/2.5 (qkv bias), Qwen3 (q/k norm).

The differences are small switches read from the config: qkv bias (Qwen2 always, others from
`attention_bias`), a per-head RMSNorm on q and k before rope (Qwen3), explicit head_dim (Qwen3, Mistral
Nemo), tied embeddings, per-layer sliding windows (`layer_types`) and learned attention sinks (gpt-oss).
MoE families (qwen3_moe.py, gpt_oss.py) reuse this attention and decoder layer and bring their own MLP.
The file only composes layers and names the checkpoint's weights; TP splitting lives in the layers' weight
loaders, and how a step runs (eager, a CUDA graph, the CPU fused decode of engine/exec/cpu_decode.py) is the
runner's choice.
The model sees one flattened batch: input_ids [T] and positions [T]; where each token's sequence and cache
pages are is the attention backend's business (the forward context).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from agentbox.layers.attention import Attention
from agentbox.layers.cache_layout import CacheLayout
from agentbox.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from agentbox.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from agentbox.layers.norm import RMSNorm
from agentbox.layers.rotary import RotaryEmbedding, rope_parameters
from agentbox.layers.weight_loading import set_weight_loader
from agentbox.models.base import CausalLM, head_dim_of, num_kv_heads_of

QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")
SINK_MODEL_TYPES = ("gpt_oss",)


def sliding_window_of(config: Any, layer_id: int) -> int | None:
    """The layer's window when config.layer_types marks it sliding (gpt-oss: every other layer)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types and layer_types[layer_id] == "sliding_attention":
        return int(config.sliding_window)
    return None


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        total_heads, total_kv_heads = config.num_attention_heads, num_kv_heads_of(config)
        self.total_heads = total_heads
        self.head_dim = head_dim_of(config)
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = config.model_type == "qwen2" or attention_bias  # Qwen2 has q/k/v bias, no o_proj bias
        # prefixes: the checkpoint's module names, which a quantised checkpoint's exclusion lists match
        prefix = f"model.layers.{layer_id}.self_attn"
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, total_heads, total_kv_heads, qkv_bias, prefix=f"{prefix}.qkv_proj"
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        sh = self.qkv_proj.shard
        self.o_proj = RowParallelLinear(
            total_heads * self.head_dim, config.hidden_size, attention_bias,
            input_shard=(sh.q_start * self.head_dim, sh.num_heads * self.head_dim), prefix=f"{prefix}.o_proj",
        )
        self.qk_norm = config.model_type in QK_NORM_MODEL_TYPES
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.sinks: nn.Parameter | None = None
        if config.model_type in SINK_MODEL_TYPES:  # one learned logit per head, split with the heads
            self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
            set_weight_loader(self.sinks, self._load_sinks)
        self.rotary_emb = rotary  # shared by every layer: one cos/sin table for the model
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, layer_id,
            sliding_window=sliding_window_of(config, layer_id), sinks=self.sinks,
        )

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        sh = self.qkv_proj.shard  # the sinks follow this rank's query heads
        if loaded.numel() != self.total_heads:
            raise ValueError(f"sinks: {loaded.numel()} values for {self.total_heads} heads")
        param.data.copy_(loaded.narrow(0, sh.q_start, sh.num_heads))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        t = hidden.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self.qkv_proj(hidden)
        v = qkv[:, q_size + kv_size :].reshape(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim))
            k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim))
            q, k = self.rotary_emb(positions, q, k)
        else:  # q and k are adjacent columns of qkv: rotate them as one [T, H + Hkv, D] view
            qk = self.rotary_emb.rotate(positions, qkv[:, : q_size + kv_size].view(t, -1, self.head_dim))
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, intermediate_size: int | None = None, prefix: str = "") -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        bias = bool(getattr(config, "mlp_bias", False))
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias, prefix=f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from agentbox.kernels import cpu_dense

        gate_up = self.gate_up_proj(x)
        act = cpu_dense.silu_mul_rows(gate_up)  # one pass in C on the CPU; None elsewhere
        if act is None:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        return self.down_proj(act)


MLPFactory = Callable[[Any, int], nn.Module]  # (config, layer_id) -> the layer's MLP


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_id: int, rotary: RotaryEmbedding, make_mlp: MLPFactory) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, rotary)
        self.mlp = make_mlp(config, layer_id)
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


class LlamaModel(nn.Module):
    def __init__(self, config: Any, make_mlp: MLPFactory) -> None:
        super().__init__()
        theta, scaling = rope_parameters(config)
        self.rotary = rotary = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings, theta, scaling)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(config, i, rotary, make_mlp) for i in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        self.rotary.begin(positions, hidden.dtype)
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(CausalLM):
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    @staticmethod
    def make_mlp(config: Any, layer_id: int) -> nn.Module:
        return LlamaMLP(config, prefix=f"model.layers.{layer_id}.mlp")

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.model = LlamaModel(config, self.make_mlp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def cache_layout(self) -> CacheLayout:
        shape = self.attention_shape()
        return CacheLayout.uniform(self.config.num_hidden_layers, shape.num_kv_heads, shape.head_dim)

    def fused_cpu_decode_target(self) -> LlamaModel:
        return self.model

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] for the step's flattened batch. Runs inside a forward context."""
        return self.model(input_ids, positions)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
