"""Mixtral, and the decoder every MoE family here shares.

An MoE decoder is the Llama decoder (same attention, norms, RoPE, checkpoint handling)
whose MLP is, on the layers the config makes sparse, a ``SparseMoEBlock``: a router, the
routed experts and, for some families, a shared expert. A family says only what differs:
which config fields hold the expert facts, the block's checkpoint name, its experts'
matrix names, whether top-k weights are renormalised, which layers are sparse.

Mixtral: every layer sparse, block ``block_sparse_moe``, experts ``w1``/``w3``/``w2``
(gate/up/down; some checkpoints name them gate_proj/up_proj/down_proj, or stack them as
transformers 5 does: the loader accepts all three), softmax top-k always renormalised.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from archserve.models.layers.moe import (
    HF_EXPERT_NAMES,
    MIXTRAL_EXPERT_NAMES,
    FusedMoE,
    SparseMoEBlock,
    expert_checkpoint_names,
)
from archserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

if TYPE_CHECKING:
    from archserve.models.config import ModelConfig


class MoEFamily:
    """How one MoE family's config and checkpoint name its parts (Mixtral's by default)."""

    block_name = "block_sparse_moe"
    expert_names: tuple[str, str, str] = MIXTRAL_EXPERT_NAMES

    def num_experts(self, hf: Any) -> int:
        return int(hf.num_local_experts)

    def expert_intermediate_size(self, hf: Any) -> int:
        return int(hf.intermediate_size)

    def renormalize(self, hf: Any) -> bool:
        return True

    def shared_intermediate_size(self, hf: Any) -> int:
        return 0

    def is_sparse(self, hf: Any, layer_index: int) -> bool:
        return True

    def make_block(self, config: ModelConfig, hf: Any) -> nn.Module:
        """The sparse MLP of a sparse layer."""
        return SparseMoEBlock(config.hidden_size, self.num_experts(hf),
                              int(hf.num_experts_per_tok), self.expert_intermediate_size(hf),
                              self.renormalize(hf), self.expert_names,
                              self.shared_intermediate_size(hf))

    def make_attention(self, config: ModelConfig, layer_index: int) -> nn.Module | None:
        """The attention of every layer; None is Llama's."""
        return None


class QwenMoEFamily(MoEFamily):
    """Qwen2-MoE and Qwen3-MoE: block ``mlp``; sparse unless listed in mlp_only_layers or off
    the decoder_sparse_step grid; top-k renormalised when norm_topk_prob says so."""

    block_name = "mlp"
    expert_names = HF_EXPERT_NAMES

    def num_experts(self, hf: Any) -> int:
        return int(hf.num_experts)

    def expert_intermediate_size(self, hf: Any) -> int:
        return int(hf.moe_intermediate_size)

    def renormalize(self, hf: Any) -> bool:
        return bool(getattr(hf, "norm_topk_prob", False))

    def shared_intermediate_size(self, hf: Any) -> int:
        return int(getattr(hf, "shared_expert_intermediate_size", 0) or 0)

    def is_sparse(self, hf: Any, layer_index: int) -> bool:
        step = int(getattr(hf, "decoder_sparse_step", 1) or 1)
        return (layer_index not in (getattr(hf, "mlp_only_layers", None) or [])
                and self.num_experts(hf) > 0 and (layer_index + 1) % step == 0)


def _text_config(config: ModelConfig) -> Any:
    hf = config.hf_config
    return getattr(hf, "text_config", None) or hf


def moe_decoder_layer(config: ModelConfig, layer_index: int, family: MoEFamily
                      ) -> LlamaDecoderLayer:
    """Llama's layer with, where the config makes the layer sparse, the sparse MoE block
    under the family's checkpoint name (Mixtral's is "block_sparse_moe")."""
    hf = _text_config(config)
    attention = family.make_attention(config, layer_index)
    if not family.is_sparse(hf, layer_index):
        return LlamaDecoderLayer(config, layer_index, attention=attention)
    return LlamaDecoderLayer(config, layer_index, family.make_block(config, hf),
                             family.block_name, attention=attention)


class MoEModel(LlamaModel):
    family: MoEFamily = MoEFamily()

    def make_layer(self, config: ModelConfig, layer_index: int) -> nn.Module:
        return moe_decoder_layer(config, layer_index, self.family)


class MoEForCausalLM(LlamaForCausalLM):
    """Llama's checkpoint handling, after expert tensors are renamed to the family's names."""

    op_kinds = ("attention", "linear", "moe")
    model_class: type[nn.Module] = MoEModel

    def moe_layers(self) -> list[FusedMoE]:
        return [m for m in self.modules() if isinstance(m, FusedMoE)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        family = self.model_class.family
        return super().load_weights(
            expert_checkpoint_names(weights, family.block_name, family.expert_names))


class MixtralForCausalLM(MoEForCausalLM):
    pass
