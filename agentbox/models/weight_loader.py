"""The one weight-load loop: checkpoint names -> our parameters, for every model class.

A model class (models/base.py CausalLM) declares only how its names differ from the checkpoint's:

- `checkpoint_renames`: regex substitutions, in order, from a checkpoint's names to ours (one class reading
  several layouts of the same weights).
- `packed_modules_mapping`: HF module name -> (our fused module, shard id), e.g. q_proj -> (qkv_proj, "q").
- `expert_mapping`: `ExpertWeight` rows for MoE experts (`per_expert_weights` writes them for every
  quantised layout); the parameter's loader is called as `loader(param, tensor, expert_id, shard)`.
- `skip_checkpoint_names`: substrings of checkpoint names that have no parameter, each mapped to what it is;
  the load logs how many tensors each skipped (a vision tower, MTP layers).

Each parameter's loader (the one its layer registered, layers/weight_loading.py) takes the full (unsharded)
tensor and copies this rank's shard; a parameter without one is copied whole.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from agentbox.layers.weight_loading import ConvertsAfterLoading, load_weight
from agentbox.models.base import CausalLM, ExpertWeight

log = logging.getLogger(__name__)

DEFAULT_SKIPS = ("rotary_emb.inv_freq",)
# FP8 KV-cache scales (ModelOpt's `k_proj.k_scale` / `v_proj.v_scale`, kv_cache_quant_algo FP8): the KV cache here
# stays in the compute dtype, which needs no scale; the load logs how many it left.
KV_CACHE_SCALES = (".k_scale", ".v_scale")


def _expert_match(
    name: str, mapping: Iterable[ExpertWeight]
) -> tuple[str, ExpertWeight, int | None] | None:
    for ew in mapping:
        m = ew.pattern().search(name)
        if m is not None:
            expert = int(m.group(1)) if m.groups() else None
            return name[: m.start()] + ew.param, ew, expert
    return None


def load_weights(model: CausalLM, weights: Iterable[tuple[str, Any]]) -> None:
    """Load HF-named tensors into `model`; a parameter no checkpoint tensor wrote is an error."""
    params = dict(model.named_parameters())
    packed, experts, tied = model.packed_modules_mapping, model.expert_mapping, model.tie_word_embeddings
    skips = DEFAULT_SKIPS + tuple(model.skip_checkpoint_names)
    renames = [(re.compile(p), r) for p, r in model.checkpoint_renames]
    skipped: Counter[str] = Counter()
    loaded: set[str] = set()
    for name, tensor in weights:
        for pattern, replacement in renames:
            name = pattern.sub(replacement, name)
        if hit := next((s for s in skips if s in name), None):
            skipped[hit] += 1
            continue
        if name.endswith(KV_CACHE_SCALES):
            skipped["kv-cache scales"] += 1
            continue
        if name == "lm_head.weight" and tied:
            continue  # some tied checkpoints still carry a copy
        if (hit := _expert_match(name, experts)) is not None:
            ours, ew, expert = hit
            param = _param(params, ours, name, model)
            per_expert = [(expert, tensor)] if expert is not None else list(enumerate(tensor))
            with torch.no_grad():
                for e, t in per_expert:
                    load_weight(param, t.t() if ew.transposed else t, e, ew.shard)
            loaded.add(ours)
            continue
        shard: tuple[str | int, ...] = ()  # a part of a fused module, or none
        for hf_key, (ours, part) in packed.items():
            if f".{hf_key}." in name:
                name, shard = name.replace(f".{hf_key}.", f".{ours}."), (part,)
                break
        param = _param(params, name, name, model)
        with torch.no_grad():
            load_weight(param, tensor, *shard)
        loaded.add(name)
    if n := skipped.get("kv-cache scales"):
        log.info("skipped %d FP8 KV-cache scales: the KV cache stays in the compute dtype", n)
    for skip, n in skipped.items():
        if skip in model.skip_checkpoint_names:
            log.info("skipped %d checkpoint tensors under %r: %s", n, skip, model.skip_checkpoint_names[skip])
    missing = [n for n in params if n not in loaded]
    if missing:
        raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:10])}")
    for module in model.modules():  # once, after every weight is in place (repacking for kernels)
        if isinstance(module, ConvertsAfterLoading):
            module.process_weights_after_loading()


def _param(params: dict[str, nn.Parameter], ours: str, name: str, model: nn.Module) -> nn.Parameter:
    param = params.get(ours)
    if param is None:
        raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}")
    return param
