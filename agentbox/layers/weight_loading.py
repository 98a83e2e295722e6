"""What the model's weight-load loop (models/weight_loader.py) asks of layers, declared here rather than probed:

- how a parameter takes its checkpoint tensor: a layer whose parameters need more than a whole copy (this rank's
  tensor-parallel shard, its part of a fused projection, one expert of many) registers a loader for each
  (`set_weight_loader`); a parameter without one (a norm, a router) is copied whole. A loader takes the
  parameter, the full checkpoint tensor and the shard ids the model's name mapping gives: a fused projection's
  part, or an expert's (expert id, ExpertShard).
- what a module converts once every weight is in (repacking for a kernel): `ConvertsAfterLoading`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

WeightLoader = Callable[..., None]

# Keyed by the parameter object (weakly: a parameter a method replaces at post-processing takes its entry with it).
_loaders: WeakIdKeyDictionary = WeakIdKeyDictionary()


def set_weight_loader(param: nn.Parameter, loader: WeightLoader) -> None:
    _loaders[param] = loader


def load_weight(param: nn.Parameter, loaded: Any, *shard: Any) -> None:
    """Copy a checkpoint tensor into `param` through the loader its layer registered, or whole where it has none
    (then there is no shard to name: a fused or expert name mapped onto a plain parameter is refused)."""
    loader = _loaders.get(param)
    if loader is not None:
        loader(param, loaded, *shard)
        return
    if shard:
        raise ValueError(f"a parameter without a loader cannot take shard {shard!r}")
    if param.data.shape != loaded.shape:
        raise ValueError(f"weight shape {tuple(loaded.shape)} != parameter shape {tuple(param.data.shape)}")
    param.data.copy_(loaded)


class ConvertsAfterLoading(ABC):
    """A module with one conversion to run after every weight of the model is loaded (the MoE layer's expert
    method, the embedding's row form)."""

    @abstractmethod
    def process_weights_after_loading(self) -> None: ...
