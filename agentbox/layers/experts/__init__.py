"""Mixture-of-experts layers, laid out as layers/quant/ is: the interface, the registry and what every format
shares (base.py), routing (routing.py), the FusedMoE layer (layer.py), and one file per storage format of the
experts' weights: unquantised (unquantized.py), canonical int4 (int4.py) and the checkpoints converted into it
(awq.py, gptq.py), FP8 block (fp8.py), k-bit (bits.py), GGUF (gguf.py), NVFP4 (nvfp4.py), MXFP4 (mxfp4.py), plus the CPU
kernels' repacked form (cpu.py, made by a load step). A format is an `ExpertMethod`; the checkpoint's
QuantConfig picks it from the registry filled here (`QuantConfig.experts` where the experts' format is not the
linears'). MXFP4 is here in DeepSeek-V4's per-expert layout (`expert_dtype: fp4`); gpt-oss's model picks its own
blocks layout from its config (its quantization_config names only the experts).
"""

from agentbox.layers.experts.awq import AwqExperts
from agentbox.layers.experts.base import (
    ExpertMethod,
    ExpertShard,
    MoEActivation,
    activate,
    expert_method,
    moe_ref,
    register_expert_method,
    registered_expert_methods,
)
from agentbox.layers.experts.fp8 import Fp8BlockExperts
from agentbox.layers.experts.gguf import GGUFExperts
from agentbox.layers.experts.gptq import GptqExperts
from agentbox.layers.experts.layer import FusedMoE
from agentbox.layers.experts.mxfp4 import Mxfp4Experts, Mxfp4Layout
from agentbox.layers.experts.nvfp4 import NvFp4Experts
from agentbox.layers.experts.routing import select_experts
from agentbox.layers.experts.unquantized import UnquantizedExperts
from agentbox.layers.quant.formats import QuantMethod

register_expert_method(QuantMethod.UNQUANTIZED, lambda config: UnquantizedExperts())
register_expert_method(QuantMethod.FP8_BLOCK, Fp8BlockExperts)
register_expert_method(QuantMethod.AWQ, AwqExperts)
register_expert_method(QuantMethod.GPTQ, GptqExperts)
register_expert_method(QuantMethod.GGUF, lambda config: GGUFExperts())
register_expert_method(QuantMethod.NVFP4, NvFp4Experts)
register_expert_method(QuantMethod.MXFP4, lambda config: Mxfp4Experts(Mxfp4Layout.PACKED_ROWS))

__all__ = [
    "ExpertMethod",
    "ExpertShard",
    "FusedMoE",
    "MoEActivation",
    "activate",
    "expert_method",
    "moe_ref",
    "registered_expert_methods",
    "select_experts",
]
