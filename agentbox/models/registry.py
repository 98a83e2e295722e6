"""Model classes keyed by the Hugging Face `architectures` name in config.json."""

from __future__ import annotations

from typing import Any

from agentbox.models.base import CausalLM
from agentbox.models.deepseek_v4 import DeepseekV4ForCausalLM
from agentbox.models.gemma4 import (
    Gemma4ForCausalLM,
    Gemma4ForConditionalGeneration,
    Gemma4UnifiedForConditionalGeneration,
)
from agentbox.models.gguf_hybrid import HYBRID_CLASS
from agentbox.models.glm4_moe_lite import Glm4MoeLiteForCausalLM
from agentbox.models.glm5_next import Glm5NextForConditionalGeneration
from agentbox.models.gpt_oss import GptOssForCausalLM
from agentbox.models.laguna import LagunaForCausalLM
from agentbox.models.llama import LlamaForCausalLM
from agentbox.models.nemotron_h import NemotronHForCausalLM
from agentbox.models.qwen3_5 import Qwen3_5ForConditionalGeneration, Qwen3HybridGGUF, Qwen3NextForCausalLM
from agentbox.models.qwen3_moe import Qwen3MoeForCausalLM
from agentbox.models.qwen4_exp import Qwen4ExpForCausalLM, Qwen4ExpForConditionalGeneration

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Glm4MoeLiteForCausalLM": Glm4MoeLiteForCausalLM,
    "DeepseekV4ForCausalLM": DeepseekV4ForCausalLM,
    "Glm5NextForConditionalGeneration": Glm5NextForConditionalGeneration,
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "LagunaForCausalLM": LagunaForCausalLM,
    "NemotronHForCausalLM": NemotronHForCausalLM,
    "Gemma4ForConditionalGeneration": Gemma4ForConditionalGeneration,
    "Gemma4UnifiedForConditionalGeneration": Gemma4UnifiedForConditionalGeneration,
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForConditionalGeneration,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5ForConditionalGeneration,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Qwen4ExpForConditionalGeneration": Qwen4ExpForConditionalGeneration,
    "Qwen4ExpForCausalLM": Qwen4ExpForCausalLM,
    HYBRID_CLASS: Qwen3HybridGGUF,
}


def model_class(config: Any) -> type[CausalLM]:
    """The first supported class among config.architectures; a clear error naming them otherwise."""
    archs = list(getattr(config, "architectures", None) or [])
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    found = ", ".join(archs) if archs else "none listed in config.json"
    raise ValueError(
        f"unsupported model architecture ({found}); supported: {', '.join(sorted(MODEL_REGISTRY))}"
    )
