"""ModelConfig: the facts about a decoder that archserve needs, normalised from HF or GGUF.

Hugging Face configs differ between model families and transformers versions (rope
parameters moved from ``rope_theta``/``rope_scaling`` to ``rope_parameters``, per layer
type for Gemma 3; Qwen2 has biases on q/k/v only; head_dim may be absent; multimodal
wrappers keep the decoder in ``text_config``). This is the one place that reads them.

It imports no other archserve module but its attention facts (models/attention_facts.py, a
leaf too), so every layer that names a ModelConfig (models, loader, routing, engine) can
import it; reading the files is the loader's
(archserve.loader.config).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from archserve.kernels.compressed_attention.layout import CSA, HCA, SLIDING
from archserve.models.attention_facts import AttentionFacts, attention_facts

# Families whose attention has q/k/v biases regardless of the ``attention_bias`` field.
_QKV_BIAS_ALWAYS = {"qwen2"}
_QK_NORM = {"qwen3", "qwen3_moe", "gemma3_text"}
# Families whose experts add a bias after each projection, and their activation where it
# is not silu(gate) * up (kernels/moe/expert_activation.py).
_EXPERT_BIAS = {"gpt_oss"}
_EXPERT_ACTIVATION = {"gpt_oss": "swigluoai", "deepseek_v4": "silu_clamped"}

# config.json's ``model_type`` -> the architecture that runs it. GGUF-derived configs carry
# no ``architectures``; the model type names the family.
ARCHITECTURE_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
    "glm_moe_dsa": "GlmMoeDsaForCausalLM",
    "deepseek_v4": "DeepseekV4ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}


def default_architecture(model_type: str) -> str:
    """The architecture of a config that names none (``<model_type>ForCausalLM`` for a
    family this table does not know, so the refusal names what was asked for)."""
    return ARCHITECTURE_OF_MODEL_TYPE.get(model_type, f"{model_type}ForCausalLM")


@dataclass(frozen=True)
class MlaDims:
    """DeepSeek's multi-head latent attention: the compressed KV latent and the head split."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None        # None: q is one projection (V2-Lite)

    @property
    def latent_size(self) -> int:
        """Values one token keeps in the cache per layer: the latent plus the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class SparseAttentionDims:
    """DeepSeek sparse attention (DSA: DeepSeek-V3.2, GLM-5): a lightning indexer scores the
    cached tokens for each query, which attends to its ``index_topk`` best."""

    index_topk: int
    index_n_heads: int
    index_head_dim: int
    # Per layer: whether it runs its own indexer; a layer that does not reuses the previous
    # indexer layer's selection (GLM-5's "shared" layers) and keeps no indexer key.
    indexer_layers: tuple[bool, ...]
    # The indexer's rope pairs: interleaved (GLM-5) or the two halves (DeepSeek-V3.2).
    indexer_rope_interleaved: bool = False


# The legacy per-layer ``compress_ratios`` ints that name DeepSeek V4's layer kinds.
_KIND_OF_RATIO = {0: SLIDING, 1: SLIDING, 4: CSA, 128: HCA}


@dataclass(frozen=True)
class CompressedAttentionDims:
    """DeepSeek V4's attention: every layer attends to a sliding window of its own keys
    (one shared key = value head, with per-head sinks) and, on compressed layers, to
    entries that each summarise ``compress_rate`` consecutive tokens: all of them (HCA,
    heavily compressed) or the ``index_topk`` a lightning indexer picks (CSA, compressed
    sparse; its compressor overlaps neighbouring windows)."""

    layer_kinds: tuple[str, ...]          # per layer: SLIDING, CSA or HCA
    compress_rates: dict[str, int]        # CSA's and HCA's rate
    sliding_window: int
    rope_head_dim: int                    # the trailing rope slice of each head
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    index_topk: int
    index_n_heads: int
    index_head_dim: int
    # The compressed layers' rope (the sliding layers take ModelConfig's rope_theta).
    compress_rope_theta: float
    compress_rope_scaling: dict[str, Any] | None

    def rate(self, layer_index: int) -> int:
        """The layer's compress rate; 0 for a sliding-window-only layer."""
        return self.compress_rates.get(self.layer_kinds[layer_index], 0)

    @property
    def block_multiple(self) -> int:
        """What every KV block size must be a multiple of: each rate (a compression group
        never straddles two blocks)."""
        return math.lcm(*self.compress_rates.values()) if self.compress_rates else 1

    @property
    def kinds(self) -> tuple[str, ...]:
        """The layer kinds the model has, in SLIDING, CSA, HCA order."""
        return tuple(k for k in (SLIDING, CSA, HCA) if k in self.layer_kinds)

    @property
    def selection_kind(self) -> str:
        """The kind the engine selects one attention backend for: compressed sparse where
        the model has it (its layers ask the most of a backend), else its last kind."""
        return CSA if CSA in self.layer_kinds else self.kinds[-1]

    def spec_fields(self, kind: str) -> dict[str, Any]:
        """AttentionSpec fields of the layers of ``kind`` (with the model's head size,
        dtypes and sinks)."""
        fields: dict[str, Any] = dict(use_mla=True, compress_rate=self.compress_rates.get(kind, 0),
                                      qk_rope_head_dim=self.rope_head_dim)
        if kind == CSA:
            fields.update(mla_sparse=True, index_topk=self.index_topk,
                          index_head_dim=self.index_head_dim, index_num_heads=self.index_n_heads)
        return fields

    def describe(self, kind: str) -> str:
        """How explain names a layer kind, e.g. "compressed sparse, 1 entry per 4 tokens"."""
        rate = self.compress_rates.get(kind, 0)
        return {SLIDING: "sliding window only",
                CSA: f"compressed sparse, 1 entry per {rate} tokens, top-{self.index_topk}",
                HCA: f"heavily compressed, 1 entry per {rate} tokens"}[kind]


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
    quantization_config: dict[str, Any] | None = None   # config.json's, as written
    # Gemma-style switches; the defaults are Llama's.
    hidden_activation: str = "silu"            # of the gated MLP
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power
    final_logit_soft_cap: float | None = None
    # The sliding-window layers' own RoPE where it differs (Gemma 3's local base).
    sliding_rope_theta: float | None = None
    sliding_rope_scaling: dict[str, Any] | None = None
    mla: MlaDims | None = None                 # DeepSeek-style latent attention
    sparse_attention: SparseAttentionDims | None = None   # DSA over the MLA latent
    compressed_attention: CompressedAttentionDims | None = None   # DeepSeek V4
    # Routed experts: their activation (kernels/moe/expert_activation.py: "silu", or
    # gpt-oss's "swigluoai") and biases.
    expert_activation: str = "silu"
    expert_bias: bool = False
    # Sinks, causality, the checkpoint's KV cache, a vision encoder (what selection asks).
    attention_facts: AttentionFacts = field(default_factory=AttentionFacts)
    hf_config: Any = field(default=None, repr=False)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    # The paged KV cache of one layer is [planes, blocks, block_size, heads, head_size]: keys
    # and values (2 planes of num_kv_heads x head_dim), or for MLA one plane holding one
    # latent "head" (kv_lora_rank + qk_rope_head_dim) per token. (Sparse MLA keeps its
    # indexer key in the same row: the selected implementation's layout sizes that row,
    # engine/kv_cache.py; the head size here is the latent's, which attention rules read.
    # DeepSeek V4's blocks hold per layer its window's keys, its compressed entries and its
    # compressor's state: kernels/compressed_attention/layout.py sizes them.)
    @property
    def kv_cache_planes(self) -> int:
        return 1 if self.mla or self.compressed_attention else 2

    @property
    def kv_cache_heads(self) -> int:
        return 1 if self.mla else self.num_kv_heads

    @property
    def kv_cache_head_size(self) -> int:
        return self.mla.latent_size if self.mla else self.head_dim

    @property
    def attention_scale(self) -> float:
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_rope(self, layer_index: int) -> tuple[float, dict[str, Any] | None]:
        """(base, scaling) of one layer's RoPE."""
        if (self.sliding_rope_theta is not None
                and self.layer_sliding_windows[layer_index] is not None):
            return self.sliding_rope_theta, self.sliding_rope_scaling
        return self.rope_theta, self.rope_scaling

    @classmethod
    def from_hf_config(cls, hf_config: Any, generation_config: dict[str, Any] | None = None
                       ) -> ModelConfig:
        architectures = getattr(hf_config, "architectures", None) or []
        model_type = hf_config.model_type
        architecture = architectures[0] if architectures else default_architecture(model_type)
        # The decoder's facts; a multimodal wrapper (Gemma 3) keeps them in text_config.
        text = _text_config(hf_config)
        model_type = text.model_type
        num_heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
        num_layers = text.num_hidden_layers
        rope_theta, rope_scaling = _rope(text)
        sliding_rope_theta, sliding_rope_scaling = _sliding_rope(text)
        attention_bias = bool(getattr(text, "attention_bias", False))
        generation_config = generation_config or {}
        eos = generation_config.get("eos_token_id", getattr(text, "eos_token_id", None))
        bos = generation_config.get("bos_token_id", getattr(text, "bos_token_id", None))
        compressed = _compressed_attention_dims(text, num_layers)
        window, per_layer = _sliding_windows(text, num_layers)
        if compressed is not None:       # every V4 layer has its window
            window, per_layer = compressed.sliding_window, [compressed.sliding_window] * num_layers
        # transformers 5 names it `dtype` (reading `torch_dtype` there logs a deprecation).
        dtype = (hf_config.dtype if hasattr(hf_config, "dtype")
                 else getattr(hf_config, "torch_dtype", None))
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, None)
        return cls(
            architecture=architecture,
            model_type=model_type,
            vocab_size=text.vocab_size,
            hidden_size=text.hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(text, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            intermediate_size=(text.intermediate_size if compressed is None
                               else text.moe_intermediate_size),
            rms_norm_eps=float(text.rms_norm_eps),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=text.max_position_embeddings,
            tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
            # Qwen2-MoE names its q/k/v biases ``qkv_bias`` (o_proj has none).
            attention_bias=(attention_bias or model_type in _QKV_BIAS_ALWAYS
                            or bool(getattr(text, "qkv_bias", False))),
            o_proj_bias=attention_bias,
            mlp_bias=bool(getattr(text, "mlp_bias", False)),
            qk_norm=model_type in _QK_NORM,
            sliding_window=window,
            layer_sliding_windows=per_layer,
            bos_token_id=bos,
            eos_token_ids=_as_list(eos),
            torch_dtype=dtype if isinstance(dtype, torch.dtype) else None,
            quantization_config=_quantization_config(hf_config),
            hidden_activation=(getattr(text, "hidden_activation", None)
                               or getattr(text, "hidden_act", None) or "silu"),
            query_pre_attn_scalar=getattr(text, "query_pre_attn_scalar", None),
            final_logit_soft_cap=getattr(text, "final_logit_softcapping", None),
            sliding_rope_theta=sliding_rope_theta,
            sliding_rope_scaling=sliding_rope_scaling,
            mla=_mla_dims(text),
            sparse_attention=_sparse_attention_dims(text, num_layers),
            compressed_attention=compressed,
            expert_activation=_EXPERT_ACTIVATION.get(model_type, "silu"),
            expert_bias=model_type in _EXPERT_BIAS,
            attention_facts=attention_facts(hf_config, _quantization_config(hf_config)),
            hf_config=hf_config,
        )


def _mla_dims(text: Any) -> MlaDims | None:
    if getattr(text, "kv_lora_rank", None) is None:
        return None
    q_lora = getattr(text, "q_lora_rank", None)
    return MlaDims(kv_lora_rank=int(text.kv_lora_rank),
                   qk_rope_head_dim=int(text.qk_rope_head_dim),
                   qk_nope_head_dim=int(text.qk_nope_head_dim),
                   v_head_dim=int(text.v_head_dim),
                   q_lora_rank=int(q_lora) if q_lora else None)


def _sparse_attention_dims(text: Any, num_layers: int) -> SparseAttentionDims | None:
    topk = getattr(text, "index_topk", None)
    if topk is None or getattr(text, "kv_lora_rank", None) is None:
        return None
    kinds = getattr(text, "indexer_types", None) or ["full"] * num_layers
    interleaved = getattr(text, "indexer_rope_interleave", None)
    if interleaved is None:   # transformers: GLM-5's indexer rotates interleaved pairs
        interleaved = text.model_type == "glm_moe_dsa"
    return SparseAttentionDims(index_topk=int(topk), index_n_heads=int(text.index_n_heads),
                               index_head_dim=int(text.index_head_dim),
                               indexer_layers=tuple(kind != "shared" for kind in kinds),
                               indexer_rope_interleaved=bool(interleaved))


def _compressed_attention_dims(text: Any, num_layers: int) -> CompressedAttentionDims | None:
    """DeepSeek V4's attention, from a transformers 5.25 config (``layer_types``,
    ``compress_rates``, the nested ``main``/``compress`` rope) or the release's own names
    (``compress_ratios`` per layer, ``compress_rate_csa``/``_hca``, ``qk_rope_head_dim``)."""
    if getattr(text, "model_type", None) != "deepseek_v4":
        return None
    kinds = getattr(text, "layer_types", None)
    if kinds is None:
        ratios = getattr(text, "compress_ratios", None) or [128] * num_layers
        kinds = [_KIND_OF_RATIO[int(r)] for r in ratios]
    rates = dict(getattr(text, "compress_rates", None) or {CSA: 4, HCA: 128})
    rope_dim = getattr(text, "qk_rope_head_dim", None) or int(
        text.head_dim * (getattr(text, "partial_rotary_factor", None) or 64 / 512))
    params = getattr(text, "rope_parameters", None) or {}
    compress = dict(params.get("compress") or {})
    theta = compress.pop("rope_theta", None) or getattr(text, "compress_rope_theta", 160000.0)
    compress.pop("partial_rotary_factor", None)
    rope_type = compress.get("rope_type", compress.get("type", "default"))
    return CompressedAttentionDims(
        layer_kinds=tuple(kinds[:num_layers]), compress_rates=rates,
        sliding_window=int(text.sliding_window), rope_head_dim=int(rope_dim),
        q_lora_rank=int(text.q_lora_rank), o_groups=int(text.o_groups),
        o_lora_rank=int(text.o_lora_rank), index_topk=int(text.index_topk),
        index_n_heads=int(text.index_n_heads), index_head_dim=int(text.index_head_dim),
        compress_rope_theta=float(theta),
        compress_rope_scaling=None if rope_type == "default" else compress)


def _text_config(hf_config: Any) -> Any:
    text = getattr(hf_config, "text_config", None)
    return text if text is not None else hf_config


def _quantization_config(hf_config: Any) -> dict[str, Any] | None:
    config = getattr(hf_config, "quantization_config", None)
    if config is None or isinstance(config, dict):
        return config
    return config.to_dict()   # transformers may have parsed it into its own config object


def _as_list(token_ids: Any) -> list[int]:
    if token_ids is None:
        return []
    if isinstance(token_ids, int):
        return [token_ids]
    return [int(t) for t in token_ids]


def _rope(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """(base, scaling) of the full-attention layers (of every layer, for most models)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if "full_attention" in params:   # one set per layer type (Gemma 3, transformers 5)
        params = dict(params["full_attention"] or {})
    legacy = getattr(hf_config, "rope_scaling", None)
    if not params and legacy:
        params = dict(legacy)
    return _theta_and_scaling(params, getattr(hf_config, "rope_theta", None))


def _sliding_rope(hf_config: Any) -> tuple[float | None, dict[str, Any] | None]:
    """The sliding-window layers' own (base, scaling), or (None, None) where they share
    the others'. Gemma 3: ``rope_parameters["sliding_attention"]`` in transformers 5,
    ``rope_local_base_freq`` in configs written by transformers 4."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if params.get("sliding_attention"):
        return _theta_and_scaling(dict(params["sliding_attention"]), None)
    local_base = getattr(hf_config, "rope_local_base_freq", None)
    return (float(local_base), None) if local_base else (None, None)


def _theta_and_scaling(params: dict[str, Any], fallback_theta: float | None
                       ) -> tuple[float, dict[str, Any] | None]:
    theta = params.pop("rope_theta", None) or fallback_theta or 10000.0
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
