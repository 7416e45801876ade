"""ModelConfig: the facts about a decoder that archserve needs, normalised from HF or GGUF.

Hugging Face configs differ between model families and transformers versions (rope
parameters moved from ``rope_theta``/``rope_scaling`` to ``rope_parameters``; Qwen2 has
biases on q/k/v only; head_dim may be absent). This is the one place that reads them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

# Families whose attention has q/k/v biases regardless of the ``attention_bias`` field.
_QKV_BIAS_ALWAYS = {"qwen2"}
_QK_NORM = {"qwen3"}


@dataclass
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None        # None means plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool                       # biases on q, k and v
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool                              # per-head RMSNorm on q and k before RoPE
    sliding_window: int | None                 # the window of the layers that use one
    layer_sliding_windows: list[int | None]    # per layer: window or None (full attention)
    bos_token_id: int | None
    eos_token_ids: list[int]
    torch_dtype: torch.dtype | None
    hf_config: Any = field(default=None, repr=False)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @classmethod
    def from_hf_config(cls, hf_config: Any, generation_config: dict[str, Any] | None = None
                       ) -> ModelConfig:
        architectures = getattr(hf_config, "architectures", None) or []
        model_type = hf_config.model_type
        architecture = architectures[0] if architectures else _default_architecture(model_type)
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        num_layers = hf_config.num_hidden_layers
        rope_theta, rope_scaling = _rope(hf_config)
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        generation_config = generation_config or {}
        eos = generation_config.get("eos_token_id", hf_config.eos_token_id)
        bos = generation_config.get("bos_token_id", hf_config.bos_token_id)
        window, per_layer = _sliding_windows(hf_config, num_layers)
        # transformers 5 names it `dtype` (reading `torch_dtype` there logs a deprecation).
        dtype = (hf_config.dtype if hasattr(hf_config, "dtype")
                 else getattr(hf_config, "torch_dtype", None))
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, None)
        return cls(
            architecture=architecture,
            model_type=model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            intermediate_size=hf_config.intermediate_size,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=attention_bias or model_type in _QKV_BIAS_ALWAYS,
            o_proj_bias=attention_bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            qk_norm=model_type in _QK_NORM,
            sliding_window=window,
            layer_sliding_windows=per_layer,
            bos_token_id=bos,
            eos_token_ids=_as_list(eos),
            torch_dtype=dtype if isinstance(dtype, torch.dtype) else None,
            hf_config=hf_config,
        )


def _default_architecture(model_type: str) -> str:
    # GGUF-derived configs carry no `architectures`; the model type names the family.
    return {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}.get(
                model_type, f"{model_type}ForCausalLM")


def _as_list(token_ids: Any) -> list[int]:
    if token_ids is None:
        return []
    if isinstance(token_ids, int):
        return [token_ids]
    return [int(t) for t in token_ids]


def _rope(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = getattr(hf_config, "rope_scaling", None)
    if not params and legacy:
        params = dict(legacy)
    theta = params.pop("rope_theta", None) or getattr(hf_config, "rope_theta", None) or 10000.0
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    params["rope_type"] = rope_type
    params.pop("type", None)
    return float(theta), params


def _sliding_windows(hf_config: Any, num_layers: int) -> tuple[int | None, list[int | None]]:
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        per_layer = [window if kind == "sliding_attention" else None for kind in layer_types]
    elif window is not None and getattr(hf_config, "use_sliding_window", True) is not False:
        per_layer = [window] * num_layers
    else:
        per_layer = [None] * num_layers
    return (window if any(w is not None for w in per_layer) else None), per_layer


def read_generation_config(model_dir: str) -> dict[str, Any]:
    """generation_config.json as a dict (empty when absent); its eos ids win over config's."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc


def load_hf_model_config(model_dir: str) -> ModelConfig:
    """ModelConfig from a local HF directory (config.json + optional generation_config.json)."""
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ValueError(f"{model_dir}: no config.json, so this is not a Hugging Face model "
                         "directory")
    try:
        hf_config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"{model_dir}/config.json could not be read: {exc}") from exc
    return ModelConfig.from_hf_config(hf_config, read_generation_config(model_dir))


def load_gguf_model_config(gguf_path: str) -> ModelConfig:
    """ModelConfig from a GGUF file's metadata, through transformers' GGUF support."""
    from archserve.loader.gguf_cache import gguf_hf_config

    try:
        hf_config = gguf_hf_config(os.path.abspath(gguf_path))
    except Exception as exc:  # the gguf reader raises bare ValueError/struct/numpy errors
        raise ValueError(f"{gguf_path}: cannot read GGUF metadata ({type(exc).__name__}: "
                         f"{exc})") from exc
    return ModelConfig.from_hf_config(hf_config)
