"""The few facts about a model that routing needs, read without touching any weight.

Reads ``config.json`` of a Hugging Face directory, or a GGUF file's metadata. The
loader's ModelConfig (archserve.loader.config) is the full description for running a
model; this summary only covers what ``explain`` routes on: attention shape, MLA,
experts and quantization.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from archserve.quant.schemes import scheme_from_config


@dataclass(frozen=True)
class ModelSummary:
    architecture: str
    head_size: int
    num_heads: int
    num_kv_heads: int
    sliding_window: int | None = None
    logit_soft_cap: float | None = None
    use_mla: bool = False
    mla_sparse: bool = False
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    num_experts: int = 0
    experts_per_token: int = 0
    hidden_size: int = 4096
    intermediate_size: int = 11008
    quantization: str | None = None      # an archserve.quant scheme name
    dtype: str | None = None             # the checkpoint's dtype name
    quantization_config: dict[str, Any] | None = field(default=None, compare=False)
    is_gguf: bool = False

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def read_model_summary(path: str) -> ModelSummary:
    """A summary from an HF model directory (config.json) or a .gguf file."""
    if os.path.isdir(path):
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise ValueError(f"{path}: no config.json, so this is not a Hugging Face model "
                             "directory")
        with open(config_path, encoding="utf-8") as f:
            return summary_from_hf_config(json.load(f))
    if path.endswith(".gguf") and os.path.isfile(path):
        return summary_from_gguf(path)
    raise ValueError(f"{path}: expected a Hugging Face model directory or a .gguf file")


def summary_from_hf_config(config: dict[str, Any]) -> ModelSummary:
    text = config.get("text_config")
    if isinstance(text, dict):   # multimodal wrappers keep the decoder's facts here
        config = {**text, "quantization_config": config.get("quantization_config")}
    heads = int(config.get("num_attention_heads", 32))
    hidden = int(config.get("hidden_size", 4096))
    kv_lora_rank = config.get("kv_lora_rank")
    use_mla = kv_lora_rank is not None
    rope = int(config.get("qk_rope_head_dim", 64))
    experts = (config.get("num_local_experts") or config.get("num_experts")
               or config.get("n_routed_experts") or 0)
    head_size = (int(kv_lora_rank) + rope if use_mla
                 else int(config.get("head_dim") or hidden // heads))
    return ModelSummary(
        architecture=(config.get("architectures") or [config.get("model_type", "unknown")])[0],
        head_size=head_size,
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        sliding_window=config.get("sliding_window") if config.get("use_sliding_window",
                                                                  True) else None,
        logit_soft_cap=config.get("attn_logit_softcapping"),
        use_mla=use_mla,
        mla_sparse=config.get("index_topk") is not None,
        kv_lora_rank=int(kv_lora_rank or 512),
        qk_rope_head_dim=rope,
        qk_nope_head_dim=int(config.get("qk_nope_head_dim", 128)),
        v_head_dim=int(config.get("v_head_dim", 128)),
        num_experts=int(experts),
        experts_per_token=int(config.get("num_experts_per_tok") or 0),
        hidden_size=hidden,
        intermediate_size=int(config.get("moe_intermediate_size")
                              or config.get("intermediate_size") or 4 * hidden),
        quantization=scheme_from_config(config.get("quantization_config")),
        dtype=config.get("dtype") or config.get("torch_dtype"),
        quantization_config=config.get("quantization_config"),
    )


def summary_from_gguf(path: str) -> ModelSummary:
    """GGUF metadata only: GGUFReader maps the file but reads no tensor data here."""
    from gguf import GGUFReader

    reader = GGUFReader(path)

    def field(key: str, default: Any = None) -> Any:
        f = reader.fields.get(key)
        if f is None or not f.data:
            return default
        value = f.parts[f.data[0]]
        if f.types and f.types[0].name == "STRING":
            return bytes(value).decode("utf-8")
        return value.tolist()[0] if hasattr(value, "tolist") else value

    arch = field("general.architecture", "llama")
    heads = int(field(f"{arch}.attention.head_count", 32))
    hidden = int(field(f"{arch}.embedding_length", 4096))
    return ModelSummary(
        architecture=arch,
        head_size=int(field(f"{arch}.attention.key_length", hidden // heads)),
        num_heads=heads,
        num_kv_heads=int(field(f"{arch}.attention.head_count_kv", heads)),
        sliding_window=field(f"{arch}.attention.sliding_window"),
        num_experts=int(field(f"{arch}.expert_count", 0)),
        experts_per_token=int(field(f"{arch}.expert_used_count", 0)),
        hidden_size=hidden,
        intermediate_size=int(field(f"{arch}.feed_forward_length", 4 * hidden)),
        quantization="gguf",
        is_gguf=True,
    )
