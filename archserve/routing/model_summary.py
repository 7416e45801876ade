"""The few facts about a model that routing needs, read without touching any weight.

For a Hugging Face directory the summary is derived from the ModelConfig the loader reads
(archserve.loader.config), so explain and the engine read config.json one way (the same
sliding-window rule, the same multimodal unwrapping). A GGUF file's metadata is read here.
The summary covers what ``explain`` routes on: attention shape, MLA, experts, quantization.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from archserve.distributed.layout import split_widths
from archserve.models.attention_facts import AttentionFacts
from archserve.quant.schemes import scheme_from_config

if TYPE_CHECKING:
    from archserve.models.config import ModelConfig


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
    index_topk: int | None = None        # sparse MLA: the keys a query attends to
    index_head_dim: int = 0
    index_num_heads: int = 0
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    num_experts: int = 0
    experts_per_token: int = 0
    expert_activation: str = "silu"      # kernels/moe/expert_activation.py
    expert_bias: bool = False
    hidden_size: int = 4096
    intermediate_size: int = 11008
    quantization: str | None = None      # an archserve.quant scheme name
    dtype: str | None = None             # the checkpoint's dtype name
    quantization_config: dict[str, Any] | None = field(default=None, compare=False)
    is_gguf: bool = False
    # Sinks, causality, the checkpoint's KV cache, a vision encoder (models.attention_facts).
    attention_facts: AttentionFacts = field(default_factory=AttentionFacts)
    # (what, width) of every width tensor parallelism splits (distributed.layout.split_widths)
    split_widths: tuple[tuple[str, int], ...] = field(default=(), compare=False)
    # DeepSeek V4: (its name, its AttentionSpec fields) of each attention layer kind.
    attention_kinds: tuple[tuple[str, dict[str, Any]], ...] = field(default=(), compare=False)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def read_model_summary(path: str) -> ModelSummary:
    """A summary from an HF model directory (config.json) or a .gguf file."""
    if os.path.isdir(path):
        from archserve.loader.config import load_hf_model_config
        return summary_from_model_config(load_hf_model_config(path))
    if path.endswith(".gguf") and os.path.isfile(path):
        return summary_from_gguf(path)
    raise ValueError(f"{path}: expected a Hugging Face model directory or a .gguf file")


def summary_from_hf_config(config: dict[str, Any]) -> ModelSummary:
    """A summary from config.json's contents, parsed by transformers as the loader does."""
    from transformers import AutoConfig

    from archserve.models.config import ModelConfig

    fields = dict(config)
    model_type = fields.pop("model_type", None)
    if not model_type:
        raise ValueError("config.json has no model_type")
    try:
        hf_config = AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"config.json could not be read: {exc}") from exc
    return summary_from_model_config(ModelConfig.from_hf_config(hf_config))


def summary_from_model_config(model_config: ModelConfig, is_gguf: bool = False
                              ) -> ModelSummary:
    """Routing's facts from the loader's ModelConfig: config.json is read once, and the
    attention shape and sliding windows are the ones the engine runs with. What only routing
    asks (MLA latents, experts, soft-capping) comes from the same parsed HF config."""
    hf_config = model_config.hf_config
    text = getattr(hf_config, "text_config", None) or hf_config

    def get(name: str) -> Any:
        return getattr(text, name, None)

    kv_lora_rank = get("kv_lora_rank")
    compressed = model_config.compressed_attention
    use_mla = kv_lora_rank is not None or compressed is not None
    rope = int(get("qk_rope_head_dim") or 64)
    experts = get("num_local_experts") or get("num_experts") or get("n_routed_experts") or 0
    dtype = model_config.torch_dtype
    return ModelSummary(
        architecture=model_config.architecture,
        head_size=int(kv_lora_rank) + rope if kv_lora_rank is not None else model_config.head_dim,
        num_heads=model_config.num_heads,
        num_kv_heads=model_config.num_kv_heads,
        sliding_window=model_config.sliding_window,
        logit_soft_cap=get("attn_logit_softcapping"),
        use_mla=use_mla,
        mla_sparse=get("index_topk") is not None,
        index_topk=get("index_topk"),
        index_head_dim=int(get("index_head_dim") or 0),
        index_num_heads=int(get("index_n_heads") or 0),
        kv_lora_rank=int(kv_lora_rank or 512),
        qk_rope_head_dim=rope,
        qk_nope_head_dim=int(get("qk_nope_head_dim") or 128),
        v_head_dim=int(get("v_head_dim") or 128),
        num_experts=int(experts),
        experts_per_token=int(get("num_experts_per_tok") or 0),
        expert_activation=model_config.expert_activation,
        expert_bias=model_config.expert_bias,
        hidden_size=model_config.hidden_size,
        intermediate_size=int(get("moe_intermediate_size") or model_config.intermediate_size),
        # A GGUF file's scheme is its format (its config has no quantization_config), as
        # summary_from_gguf says: explain's vLLM comparison and routes hang on it.
        quantization="gguf" if is_gguf else scheme_from_config(model_config.quantization_config),
        dtype=str(dtype).removeprefix("torch.") if dtype is not None else None,
        quantization_config=model_config.quantization_config,
        is_gguf=is_gguf,
        attention_facts=model_config.attention_facts,
        split_widths=split_widths(model_config),
        attention_kinds=tuple((compressed.describe(kind), compressed.spec_fields(kind))
                              for kind in compressed.kinds) if compressed is not None else (),
    )


def summary_from_gguf(path: str) -> ModelSummary:
    """GGUF metadata only: GGUFReader maps the file but reads no tensor data here."""
    from archserve.loader.gguf_loader import open_gguf

    reader = open_gguf(path)

    def field(key: str, default: Any = None) -> Any:
        f = reader.fields.get(key)
        if f is None or not f.data:
            return default
        value = f.parts[f.data[0]]
        if f.types and f.types[0].name == "STRING":
            return bytes(value).decode("utf-8")
        return value.tolist()[0] if hasattr(value, "tolist") else value

    from archserve.loader.gguf_loader import gguf_model_type

    arch = field("general.architecture", "llama")
    heads = int(field(f"{arch}.attention.head_count", 32))
    hidden = int(field(f"{arch}.embedding_length", 4096))
    num_experts = int(field(f"{arch}.expert_count", 0))
    return ModelSummary(
        architecture=gguf_model_type(arch, num_experts),
        head_size=int(field(f"{arch}.attention.key_length", hidden // heads)),
        num_heads=heads,
        num_kv_heads=int(field(f"{arch}.attention.head_count_kv", heads)),
        sliding_window=field(f"{arch}.attention.sliding_window"),
        num_experts=num_experts,
        experts_per_token=int(field(f"{arch}.expert_used_count", 0)),
        hidden_size=hidden,
        intermediate_size=int(field(f"{arch}.feed_forward_length", 4 * hidden)),
        quantization="gguf",
        is_gguf=True,
    )
