"""Gemma 3 text decoder (``Gemma3ForCausalLM``; also the text half of a
``Gemma3ForConditionalGeneration`` checkpoint).

Where it departs from Llama: the embedding is scaled by sqrt(hidden_size) (rounded to the
model dtype, as Hugging Face does); every RMSNorm scales by (1 + weight) in fp32; each
layer has four norms, the attention and MLP outputs being normalised before they join
the residual; q and k get a per-head norm; the attention scale is
query_pre_attn_scalar^-1/2; the MLP is GeGLU (tanh-approximated GELU); sliding-window
layers (five of every six) use a local RoPE base, full-attention layers the global one
(with its scaling, if any). Module names are the checkpoint's, so weight loading is
LlamaForCausalLM's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from archserve.kernels.elementwise import gelu_tanh_and_mul
from archserve.models.layers.attention import Attention
from archserve.models.layers.norm import GemmaRMSNorm
from archserve.models.layers.parallel_embedding import VocabParallelEmbedding
from archserve.models.layers.parallel_linear import (
    GateUpParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from archserve.models.layers.rotary import RotaryEmbedding
from archserve.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from archserve.models.config import ModelConfig

# Names transformers gives the tanh-approximated GELU (Gemma 3 configs use the first).
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast")


class Gemma3Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int,
                 rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        h, d = config.num_heads, config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, h, config.num_kv_heads,
                                          bias=config.attention_bias)
        self.o_proj = RowParallelLinear(h * d, config.hidden_size, bias=config.attention_bias)
        self.q_norm = GemmaRMSNorm(d, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(d, config.rms_norm_eps)
        self.rotary_emb = rotary_emb  # shared by every layer with the same RoPE
        # No attention soft-capping: Gemma 3 replaced Gemma 2's with the q/k norms, and
        # transformers ignores a config's attn_logit_softcapping for it too.
        heads = self.qkv_proj.heads          # this rank's heads
        self.attn = Attention(heads.num_heads, heads.num_kv_heads, d,
                              scale=config.attention_scale,
                              layer_index=layer_index,
                              sliding_window=config.layer_sliding_windows[layer_index])
        self.head_dim = d

    def _per_head_norm(self, norm: GemmaRMSNorm, x: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        return norm(x.view(num_tokens, -1, self.head_dim))[0].view(num_tokens, -1)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = self._per_head_norm(self.q_norm, q)
        k = self._per_head_norm(self.k_norm, k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v.contiguous()))


class Gemma3MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.hidden_activation not in _GELU_TANH:
            raise ValueError(f"Gemma 3 MLP activation {config.hidden_activation!r} is not "
                             f"supported; supported: {', '.join(_GELU_TANH)}")
        self.gate_up_proj = GateUpParallelLinear(config.hidden_size, config.intermediate_size,
                                                 bias=config.mlp_bias)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size,
                                           bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x)))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int,
                 rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Gemma3Attention(config, layer_index, rotary_emb)
        self.mlp = Gemma3MLP(config)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add is fused into the next pre-norm: that norm sees
        # residual + post_norm(block output), exactly the sum Hugging Face forms.
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden))[0]
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden))[0], residual


class Gemma3Model(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # A tensor in the model dtype (bf16 rounds sqrt(640) to 25.25), as in HF.
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size ** 0.5),
                             persistent=False)
        ropes: dict[tuple, RotaryEmbedding] = {}
        layers = []
        for i in range(config.num_layers):
            base, scaling = config.layer_rope(i)
            key = (base, repr(sorted((scaling or {}).items())))
            if key not in ropes:
                ropes[key] = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                             base, scaling)
            layers.append(Gemma3DecoderLayer(config, i, ropes[key]))
        self.layers = nn.ModuleList(layers)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) * self.embed_scale
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        return self.norm(hidden, residual)[0]


class Gemma3ForCausalLM(LlamaForCausalLM):
    model_class = Gemma3Model

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None
                       ) -> torch.Tensor:
        cap = self.config.final_logit_soft_cap
        logits = self.lm_head(hidden, None if cap else out)   # capped: a new tensor
        if cap:
            logits = cap * torch.tanh(logits / cap)
        return logits


# Multimodal checkpoint prefixes of the decoder (transformers 5, then 4) and of the parts
# a text-only engine does not run.
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.")
_VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.",
                    "multi_modal_projector.")


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The text decoder of a multimodal Gemma 3 checkpoint; images are not supported, so
    the vision tower's weights are skipped."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights((text, tensor) for name, tensor in weights
                                    if (text := _text_name(name)) is not None)

    def checkpoint_module_name(self, name: str) -> str | None:
        return _text_name(name)


def _text_name(name: str) -> str | None:
    """A multimodal checkpoint's name in the text decoder's names; None for the vision
    tower's."""
    if name.startswith(_VISION_PREFIXES):
        return None
    for prefix in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    if name.startswith("language_model.lm_head"):
        return name.removeprefix("language_model.")
    return name
