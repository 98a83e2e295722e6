"""The one weight-load loop: checkpoint names -> our parameters, for every model class.

A model class declares only how its names differ from the checkpoint's:

- `packed_modules_mapping`: HF module name -> (our fused module, shard id), e.g. q_proj -> (qkv_proj, "q").
- `expert_mapping`: `ExpertWeight` rows for MoE experts (`per_expert_weights` writes them for every
  quantised layout). A checkpoint name holding `{e}` is one tensor per
  expert (Qwen3-MoE: `experts.3.gate_proj.weight`); one without it holds every expert stacked on dim 0
  (gpt-oss: `experts.gate_up_proj`), and the loop hands each expert's slice over in turn. Either way the
  parameter's loader is called as `weight_loader(param, tensor, expert_id, shard)`.
- `skip_checkpoint_names`: substrings of checkpoint names that have no parameter (rotary tables); a dict
  maps each to what it is, and the load logs how many tensors each skipped (a vision tower, MTP layers).

Each parameter's `weight_loader` takes the full (unsharded) tensor and copies this rank's shard.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

DEFAULT_SKIPS = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class ExpertWeight:
    checkpoint: str  # suffix of the checkpoint name; `{e}` stands for the expert index when per expert
    param: str  # suffix of our parameter's name that replaces it
    shard: Any  # passed to the parameter's weight_loader (the MoE layer's ExpertShard)
    transposed: bool = False  # the checkpoint stores [in, out] per expert (gpt-oss bf16); ours is [out, in]

    def pattern(self) -> re.Pattern[str]:
        return re.compile(re.escape(self.checkpoint).replace(re.escape("{e}"), r"(\d+)") + "$")


# The tensor names one expert projection has in the safetensors layouts the expert methods load: bf16
# `weight`; FP8 block `weight` + `weight_scale_inv`; AWQ `qweight`/`qzeros`/`scales`; GPTQ those + `g_idx`.
EXPERT_TENSOR_NAMES = ("weight", "weight_scale_inv", "qweight", "qzeros", "scales", "g_idx")


def per_expert_weights(gate: str, up: str, down: str, shards: Any) -> tuple[ExpertWeight, ...]:
    """Rows for checkpoints with one tensor per expert and projection (`experts.{e}.gate_proj.qweight`):
    each name maps onto the layer's `w13_<name>` (gate, up) or `w2_<name>` (down). `shards`: the layer's
    (gate, up, down) shard ids. A method holds only the names of its own format; others never match."""
    g, u, d = shards
    return tuple(
        ExpertWeight(f"experts.{{e}}.{proj}.{name}", f"experts.{param}_{name}", shard)
        for name in EXPERT_TENSOR_NAMES
        for proj, param, shard in ((gate, "w13", g), (up, "w13", u), (down, "w2", d))
    )


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
    if param.data.shape != loaded_weight.shape:
        raise ValueError(
            f"weight shape {tuple(loaded_weight.shape)} != parameter shape {tuple(param.data.shape)}"
        )
    param.data.copy_(loaded_weight)


def _expert_match(
    name: str, mapping: Iterable[ExpertWeight]
) -> tuple[str, ExpertWeight, int | None] | None:
    for ew in mapping:
        m = ew.pattern().search(name)
        if m is not None:
            expert = int(m.group(1)) if m.groups() else None
            return name[: m.start()] + ew.param, ew, expert
    return None


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load HF-named tensors into `model`; a parameter no checkpoint tensor wrote is an error."""
    params = dict(model.named_parameters())
    packed: dict[str, tuple[str, Any]] = getattr(model, "packed_modules_mapping", {})
    experts: tuple[ExpertWeight, ...] = tuple(getattr(model, "expert_mapping", ()))
    skips = DEFAULT_SKIPS + tuple(getattr(model, "skip_checkpoint_names", ()))
    tied = bool(getattr(model, "tie_word_embeddings", False))
    skipped: Counter[str] = Counter()
    loaded: set[str] = set()
    for name, tensor in weights:
        if hit := next((s for s in skips if s in name), None):
            skipped[hit] += 1
            continue
        if name == "lm_head.weight" and tied:
            continue  # some tied checkpoints still carry a copy
        if (hit := _expert_match(name, experts)) is not None:
            ours, ew, expert = hit
            param = _param(params, ours, name, model)
            loader = param.weight_loader  # type: ignore[attr-defined]
            per_expert = [(expert, tensor)] if expert is not None else list(enumerate(tensor))
            with torch.no_grad():
                for e, t in per_expert:
                    loader(param, t.t() if ew.transposed else t, e, ew.shard)
            loaded.add(ours)
            continue
        shard_id: Any = None
        for hf_key, (ours, shard) in packed.items():
            if f".{hf_key}." in name:
                name, shard_id = name.replace(f".{hf_key}.", f".{ours}."), shard
                break
        param = _param(params, name, name, model)
        loader = getattr(param, "weight_loader", default_weight_loader)
        with torch.no_grad():
            if shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
        loaded.add(name)
    described = getattr(model, "skip_checkpoint_names", {})
    for skip, n in skipped.items():
        if isinstance(described, dict) and skip in described:
            log.info("skipped %d checkpoint tensors under %r: %s", n, skip, described[skip])
    missing = [n for n in params if n not in loaded]
    if missing:
        raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:10])}")
    for module in model.modules():  # once, after every weight is in place (repacking for kernels)
        hook = getattr(module, "process_weights_after_loading", None)
        if callable(hook):
            hook()


def _param(params: dict[str, nn.Parameter], ours: str, name: str, model: nn.Module) -> nn.Parameter:
    param = params.get(ours)
    if param is None:
        raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}")
    return param
