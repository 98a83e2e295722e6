"""The linear-method registry: what the planner reads matches what is implemented, methods are chosen
from the checkpoint's config, unknown ones are refused by name, and resident bytes come from the tensors."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from agentbox.hub.engine_support import ENGINE_FORMATS
from agentbox.layers.linear import ColumnParallelLinear
from agentbox.layers.quant import QuantConfig, QuantMethod, quant_context, registered, resident_weight_bytes
from agentbox.layers.quant.formats import METHODS


def test_planner_formats_are_the_registered_methods() -> None:
    assert set(METHODS) == set(registered())
    assert {"bf16", "fp16", "fp32"} <= ENGINE_FORMATS
    assert ENGINE_FORMATS == {f for info in METHODS.values() for f in info.formats}


def test_method_comes_from_quantization_config() -> None:
    assert QuantConfig.of(LlamaConfig()).method is QuantMethod.UNQUANTIZED
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes' is not supported"):
        QuantConfig.of(LlamaConfig(quantization_config={"quant_method": "bitsandbytes"}))


def test_resident_bytes_are_measured_and_shared_storage_counted_once() -> None:
    with quant_context(QuantConfig()):
        layer = ColumnParallelLinear(64, 32, bias=True)
    assert resident_weight_bytes(layer) == (64 * 32 + 32) * 4
    holder = torch.nn.Module()
    holder.a, holder.b = layer, layer
    assert resident_weight_bytes(holder) == (64 * 32 + 32) * 4
