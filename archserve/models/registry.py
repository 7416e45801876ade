"""Architecture name (config.json ``architectures[0]``) -> model class."""

from __future__ import annotations

from torch import nn

from archserve.models.config import default_architecture
from archserve.models.deepseek import (
    DeepseekV2ForCausalLM,
    DeepseekV3ForCausalLM,
    DeepseekV32ForCausalLM,
    GlmMoeDsaForCausalLM,
)
from archserve.models.deepseek_v4 import DeepseekV4ForCausalLM
from archserve.models.gemma3 import Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from archserve.models.gpt_oss import GptOssForCausalLM
from archserve.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from archserve.models.mixtral import MixtralForCausalLM
from archserve.models.qwen2_moe import Qwen2MoeForCausalLM
from archserve.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "DeepseekV32ForCausalLM": DeepseekV32ForCausalLM,
    "GlmMoeDsaForCausalLM": GlmMoeDsaForCausalLM,
    "DeepseekV4ForCausalLM": DeepseekV4ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
}


def op_kinds_of_supported_architectures() -> set[str]:
    """The op kinds (attention, linear, moe, mla_attention) some loadable model runs."""
    return {op for cls in MODEL_REGISTRY.values() for op in getattr(cls, "op_kinds", ())}


def architecture_unsupported(architecture: str) -> str | None:
    """None when this build runs the architecture (an HF class name, or the GGUF/model-type
    family name such as "llama"), else the reason."""
    if architecture in MODEL_REGISTRY or default_architecture(architecture) in MODEL_REGISTRY:
        return None
    return (f"architecture {architecture!r} is not supported in this build (supported: "
            f"{', '.join(sorted(MODEL_REGISTRY))})")


def model_class_for(architecture: str) -> type[nn.Module]:
    reason = architecture_unsupported(architecture)
    if reason:
        raise ValueError(reason)
    return MODEL_REGISTRY.get(architecture) or MODEL_REGISTRY[default_architecture(architecture)]
