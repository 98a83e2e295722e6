"""Linear methods: how a linear layer holds and applies its weight, chosen by the checkpoint."""

from agentbox.layers.quant import (  # noqa: F401  (registers the methods)
    awq,
    compressed_tensors,
    fp8,
    gguf,
    gptq,
    nvfp4,
    unquantized,
)
from agentbox.layers.quant.base import (
    LinearMethod,
    QuantConfig,
    Sharding,
    linear_method,
    process_weights_after_loading,
    quant_context,
    quant_param,
    registered,
    resident_weight_bytes,
)
from agentbox.layers.quant.formats import QuantMethod

__all__ = [
    "LinearMethod",
    "QuantConfig",
    "QuantMethod",
    "Sharding",
    "linear_method",
    "process_weights_after_loading",
    "quant_context",
    "quant_param",
    "registered",
    "resident_weight_bytes",
]
