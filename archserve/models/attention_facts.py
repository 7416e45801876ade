"""What a model's config says about its attention beyond the shape.

Attention selection asks more than head size and dtype (vLLM 0.33's attention selector
does too): learned sinks, whether attention is causal, encoder and cross attention, the KV
cache a checkpoint was calibrated for (and whether its scales are per head), and a vision
encoder's attention. These are read here once, from config.json, so the engine's
selection and ``explain`` ask the same question of the same model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Model types whose every attention layer carries learned per-head sinks, with no config
# flag saying so (gpt-oss and the privacy filter built on it, DeepSeek V4).
_SINKS_ALWAYS = ("gpt_oss", "openai_privacy_filter", "deepseek_v4")
# Config flags that declare sinks (Granite's SWA checkpoints, MiMo-V2, Laguna ...).
_SINK_FLAGS = ("attention_sinks", "attention_sink", "add_swa_attention_sink_bias",
               "add_full_attention_sink_bias")


@dataclass(frozen=True)
class VisionAttention:
    """A vision encoder's (ViT's) attention: bidirectional over image patches, no KV cache."""

    head_size: int
    num_heads: int


@dataclass(frozen=True)
class AttentionFacts:
    has_sinks: bool = False
    attn_type: str = "decoder"           # decoder | encoder_only | encoder_decoder
    checkpoint_kv_cache_dtype: str | None = None   # the KV cache it was calibrated for
    per_head_kv_scales: bool = False     # its KV scales are per attention head
    vision: VisionAttention | None = None

    @property
    def encoder_decoder(self) -> bool:
        return self.attn_type == "encoder_decoder"

    def spec_fields(self) -> dict[str, Any]:
        """AttentionSpec fields of the model's main (decoder-side) self-attention: an
        encoder-decoder's decoder attends causally; its encoder and cross attention are
        their own layer kinds."""
        return dict(has_sinks=self.has_sinks, per_head_kv_scales=self.per_head_kv_scales,
                    attn_type="decoder" if self.encoder_decoder else self.attn_type)


def attention_facts(hf_config: Any, quantization_config: dict[str, Any] | None
                    ) -> AttentionFacts:
    """The facts of a transformers config (a multimodal wrapper's decoder is its
    ``text_config``)."""
    text = getattr(hf_config, "text_config", None) or hf_config
    kv_dtype, per_head = checkpoint_kv_cache(quantization_config)
    return AttentionFacts(has_sinks=_has_sinks(text), attn_type=_attn_type(hf_config, text),
                          checkpoint_kv_cache_dtype=kv_dtype, per_head_kv_scales=per_head,
                          vision=_vision(hf_config))


def _has_sinks(text: Any) -> bool:
    if getattr(text, "model_type", None) in _SINKS_ALWAYS:
        return True
    if any(getattr(text, flag, False) is True for flag in _SINK_FLAGS):
        return True
    # Granite's SWA checkpoints carry sinks without a flag wherever layer_types is set.
    return (getattr(text, "model_type", None) == "granite"
            and getattr(text, "layer_types", None) is not None
            and getattr(text, "attention_sinks", None) is not False)


def _attn_type(hf_config: Any, text: Any) -> str:
    """``is_encoder_decoder`` (T5, BART, Whisper): encoder, decoder and cross attention.
    ``is_causal: false`` or ``use_bidirectional_attention: true`` (embedding models built on
    decoders: gte-Qwen2, EmbeddingGemma): every token sees every other, as in an encoder."""
    if getattr(hf_config, "is_encoder_decoder", False) is True:
        return "encoder_decoder"
    if (getattr(text, "is_causal", True) is False
            or getattr(text, "use_bidirectional_attention", False) is True):
        return "encoder_only"
    return "decoder"


def checkpoint_kv_cache(quantization_config: dict[str, Any] | None) -> tuple[str | None, bool]:
    """(the KV-cache dtype a checkpoint was calibrated for, whether its scales are per head).

    compressed-tensors' ``kv_cache_scheme`` means an fp8 cache, per head where its strategy
    is ``attn_head``; ModelOpt's ``kv_cache_quant_algo`` (or scheme) names fp8 or nvfp4."""
    if not quantization_config:
        return None, False
    method = str(quantization_config.get("quant_method", "")).lower()
    if method.startswith("modelopt"):
        inner = quantization_config.get("quantization") or quantization_config
        algo = (inner.get("kv_cache_scheme") or quantization_config.get("kv_cache_scheme")
                or inner.get("kv_cache_quant_algo")
                or quantization_config.get("kv_cache_quant_algo"))
        if isinstance(algo, dict):
            if algo.get("type") == "float" and algo.get("num_bits") == 8 \
                    and algo.get("dynamic") is False:
                return "fp8_e4m3", False
            if algo.get("type") == "float" and algo.get("num_bits") == 4:
                return "nvfp4", False
            return None, False
        return {"fp8": "fp8_e4m3", "nvfp4": "nvfp4"}.get(str(algo).lower()), False
    scheme = quantization_config.get("kv_cache_scheme")
    if isinstance(scheme, dict):
        return "fp8", scheme.get("strategy") == "attn_head"
    return None, False


def _vision(hf_config: Any) -> VisionAttention | None:
    vision = getattr(hf_config, "vision_config", None)
    if vision is None:
        return None
    get = (vision.get if isinstance(vision, dict)
           else lambda name, default=None: getattr(vision, name, default))
    heads = get("num_attention_heads") or get("num_heads")
    hidden = get("hidden_size") or get("embed_dim")
    if not heads or not hidden:
        return None
    return VisionAttention(head_size=int(get("head_dim") or int(hidden) // int(heads)),
                           num_heads=int(heads))
