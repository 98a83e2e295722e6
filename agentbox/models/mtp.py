"""The multi-token-prediction head of the hybrid Qwen family (Qwen3.5 / 3.6 / 3.8 dense and MoE, Qwen3-Next): a
draft model the checkpoint ships (`mtp.*`), which `--speculative mtp` drafts with (engine/exec/mtp.py).

Given the model's final hidden state at position p and the token at p + 1, it predicts the token at p + 2:

    x = fc([pre_fc_norm_embedding(embed(token_{p+1})) | pre_fc_norm_hidden(hidden_p)])
    out = norm(decoder_layer(x))          # one gated full-attention layer with its own KV
    logits = lm_head(out)                 # the model's own embedding and LM head

and it drafts further by feeding `out` back as the hidden state with the token it predicted. Its attention layer
is one more layer of the paged KV group (the model's `cache_layout`): its entry for a pair (hidden_p,
token_{p+1}) sits in position p's slot, at rope position p, so every slot it writes is one the model itself
has. All its norms are zero-centred like the model's. It is built only when the engine drafts with it
(`with_mtp`) and the checkpoint is unquantised (models/loader.py; the planner counts it so, hub/weight_bytes.py).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from agentbox.layers.linear import ReplicatedLinear
from agentbox.layers.quant import QuantConfig, QuantMethod, quant_context

MTP_PREFIX = "mtp."


def mtp_layers_of(config: Any) -> int:
    """How many MTP layers the (text) config declares (`mtp_num_hidden_layers`; 0 where it names none)."""
    text = config.get_text_config()
    return int(getattr(text, "mtp_num_hidden_layers", 0) or 0)


def mtp_loadable(quant: QuantConfig) -> bool:
    """Whether the head of a checkpoint so quantised is loaded: an unquantised one's only. Whether a quantised
    release keeps its head quantised, and which of its linears, is not known here; such a checkpoint drafts from
    the text (auto) and the planner counts no head for it (hub/profiles.py Variant.carries_mtp)."""
    return quant.method is QuantMethod.UNQUANTIZED


class MultiTokenPredictor(nn.Module):
    """`mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.layers.0.*`, `mtp.norm`."""

    def __init__(self, text: Any, kv_index: int, embed: nn.Module, layer_cls: type[nn.Module],
                 norm_cls: type[nn.Module]) -> None:
        super().__init__()
        h, eps = text.hidden_size, text.rms_norm_eps
        # Its one layer is a full-attention layer whatever the model's first layer is; MoE models' is MoE.
        cfg = copy.copy(text)
        cfg.layer_types = ["full_attention"]
        cfg.mlp_only_layers = []
        with quant_context(QuantConfig()):
            self.fc = ReplicatedLinear(2 * h, h, bias=False, prefix="mtp.fc")
            self.layers = nn.ModuleList([layer_cls(cfg, 0, kv_index, "mtp.layers.0", False)])
        self.pre_fc_norm_embedding = norm_cls(h, eps)
        self.pre_fc_norm_hidden = norm_cls(h, eps)
        self.norm = norm_cls(h, eps)
        self._embed = [embed]  # the model's table, not a submodule of the head (its weights load once)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(token_{p+1}, hidden_p, p) rows -> the head's hidden state per row (what the LM head reads, and the
        hidden state of the next draft step). Runs inside a forward context that maps its attention's slots."""
        embeds = self.pre_fc_norm_embedding(self._embed[0](input_ids))
        x = self.fc(torch.cat([embeds, self.pre_fc_norm_hidden(hidden)], dim=-1))
        out, residual = self.layers[0](positions, x, None)
        out, _ = self.norm(out, residual)
        return out
