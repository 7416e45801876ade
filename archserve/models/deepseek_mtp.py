"""The multi-token-prediction (MTP) layers of a DeepSeek-V3-family checkpoint, as a draft
network for speculative decoding (engine/spec_decode).

A checkpoint with ``num_nextn_predict_layers`` = n stores, after its N decoder layers,
layers N .. N + n - 1, each:

    h' = eh_proj([enorm(embed(t_{i+1})), hnorm(h_i)])      # 2H -> H
    h'' = decoder layer N + j (the family's: MLA, MoE; DSA's indexer where the family
          has one) over h' at position i, with its own KV cache
    logits = shared_head.head(shared_head.norm(h''))         # the token at i + 2

where h_i is the target's final (normed) hidden state at position i, and t_{i+1} the token
after it. Chained, the layer reads its own previous output h'' as h. The embedding sits in
the first MTP layer's weights and serves them all (as vLLM loads it). As in vLLM, the
embedding of a position-0 input is zeroed.

As a network of the engine, ``forward(input_ids, positions)`` reads h from
``previous_hidden`` (rows the drafter fills) and leaves h'' in ``output_hidden``: static
buffers, so the same forward is captured in CUDA graphs. Its attention layers index the
drafter's own cache list (layer j at index j), whatever their index in the checkpoint.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from archserve.models.deepseek import DeepseekV2ForCausalLM, shared_experts_as_experts
from archserve.models.layers.linear import Linear
from archserve.models.layers.moe import expert_checkpoint_names
from archserve.models.layers.norm import RMSNorm
from archserve.models.layers.parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from archserve.models.llama import LlamaForCausalLM
from archserve.models.mixtral import moe_decoder_layer

if TYPE_CHECKING:
    from archserve.models.config import ModelConfig

# The MTP layer's own parts (the rest of its tensors belong to its decoder layer).
_OWN_PARTS = ("enorm", "hnorm", "eh_proj", "shared_head")


def num_mtp_layers(config: ModelConfig) -> int:
    """The checkpoint's MTP layer count (0: none)."""
    hf = getattr(config.hf_config, "text_config", None) or config.hf_config
    return int(getattr(hf, "num_nextn_predict_layers", 0) or 0)


def mtp_unsupported(config: ModelConfig) -> str | None:
    """None when ``config``'s checkpoint has MTP layers this build runs, else why not."""
    from archserve.models.registry import model_class_for
    try:
        target = model_class_for(config.architecture)
    except ValueError:
        target = None
    if target is None or not issubclass(target, DeepseekV2ForCausalLM):
        return (f"{config.architecture} has no multi-token-prediction layers archserve "
                f"runs (the DeepSeek-V3 family's: DeepseekV3ForCausalLM, "
                f"DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM)")
    if num_mtp_layers(config) < 1:
        return ("this checkpoint has no multi-token-prediction layers "
                "(num_nextn_predict_layers is 0)")
    return None


def mtp_model_config(config: ModelConfig) -> ModelConfig:
    """``config`` reaching the MTP layers: per-layer facts extended over them (their
    attention is full and runs its own indexer)."""
    n = num_mtp_layers(config)
    extended = dataclasses.replace(
        config, num_layers=config.num_layers + n,
        layer_sliding_windows=[*config.layer_sliding_windows, *[None] * n])
    sparse = config.sparse_attention
    if sparse is not None:
        extended.sparse_attention = dataclasses.replace(
            sparse, indexer_layers=(*sparse.indexer_layers, *(True,) * n))
    return extended


def mtp_cache_config(config: ModelConfig) -> ModelConfig:
    """The config the drafter sizes its KV cache by: one layer per MTP layer."""
    return dataclasses.replace(config, num_layers=num_mtp_layers(config))


class SharedHead(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = ParallelLMHead(config.vocab_size, config.hidden_size)


class MTPLayer(nn.Module):
    def __init__(self, config: ModelConfig, block: nn.Module) -> None:
        super().__init__()
        h = config.hidden_size
        self.enorm = RMSNorm(h, config.rms_norm_eps)
        self.hnorm = RMSNorm(h, config.rms_norm_eps)
        self.eh_proj = Linear(2 * h, h, bias=False)
        self.shared_head = SharedHead(config)
        self.mtp_block = block


class DeepseekMTP(LlamaForCausalLM):
    """A DeepSeek-V3-family checkpoint's MTP layers (see the module's note). Checkpoint
    handling is Llama's over the layer's own module names."""

    def __init__(self, config: ModelConfig) -> None:
        nn.Module.__init__(self)
        from archserve.models.registry import model_class_for
        reason = mtp_unsupported(config)
        if reason is not None:
            raise ValueError(reason)
        target = model_class_for(config.architecture)
        self.op_kinds = target.op_kinds
        self.model_class = target.model_class        # its family: MLA, MoE, DSA
        self.config = config
        self.first_layer = config.num_layers
        extended = mtp_model_config(config)
        family = self.model_class.family
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleDict()
        for j in range(num_mtp_layers(config)):
            block = moe_decoder_layer(extended, self.first_layer + j, family)
            for module in block.modules():   # its attention reads the drafter's cache j
                if hasattr(module, "layer_index"):
                    module.layer_index = j
            self.layers[str(self.first_layer + j)] = MTPLayer(config, block)
        self.current = 0      # the MTP layer the next forward runs (chained steps cycle)
        self.previous_hidden: torch.Tensor | None = None
        self.output_hidden: torch.Tensor | None = None

    def allocate_hidden_buffers(self, max_tokens: int, dtype: torch.dtype,
                                device: torch.device) -> None:
        shape = (max_tokens, self.config.hidden_size)
        self.previous_hidden = torch.zeros(shape, dtype=dtype, device=device)
        self.output_hidden = torch.zeros(shape, dtype=dtype, device=device)

    def _layer(self) -> MTPLayer:
        return self.layers[str(self.first_layer + self.current)]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        layer = self._layer()
        tokens = input_ids.shape[0]
        embedded = self.embed_tokens(input_ids)
        embedded = embedded.masked_fill((positions == 0)[:, None], 0.0)
        joined = torch.cat([layer.enorm(embedded)[0],
                            layer.hnorm(self.previous_hidden[:tokens])[0]], dim=-1)
        hidden, residual = layer.mtp_block(positions, layer.eh_proj(joined), None)
        if residual is not None:    # None where the block's last GEMM added it
            hidden = hidden + residual
        self.output_hidden[:tokens].copy_(hidden)
        return hidden

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None
                       ) -> torch.Tensor:
        head = self._layer().shared_head
        return head.head(head.norm(hidden)[0], out)

    # ---- weights -------------------------------------------------------------------------

    def reads_checkpoint_tensor(self, name: str) -> bool:
        """Whether ``name`` is one of the MTP layers' tensors (the loader reads no other)."""
        layer = _layer_of(name)
        return layer is not None and layer >= self.first_layer

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        family = self.model_class.family
        return super().load_weights(shared_experts_as_experts(self, expert_checkpoint_names(
            self._own_names(weights), family.block_name, family.expert_names)))

    def _own_names(self, weights: Iterable[tuple[str, torch.Tensor]]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
        """The MTP layers' tensors under this module's names: the first layer's embedding
        as ``embed_tokens``, each layer's own parts in place, the rest in its
        ``mtp_block``. Other layers' embedding copies are skipped (the first serves all)."""
        for name, tensor in weights:
            layer = _layer_of(name)
            if layer is None or layer < self.first_layer:
                continue
            rest = name.split(".", 3)[3]
            part = rest.split(".", 1)[0]
            if part == "embed_tokens":
                if layer == self.first_layer:
                    yield f"embed_tokens.{rest.split('.', 1)[1]}", tensor
            elif part in _OWN_PARTS:
                yield f"layers.{layer}.{rest}", tensor
            else:
                yield f"layers.{layer}.mtp_block.{rest}", tensor


def _layer_of(name: str) -> int | None:
    """The decoder layer index of a checkpoint tensor ``model.layers.<i>....``, or None."""
    parts = name.split(".", 3)
    if len(parts) < 4 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
        return None
    return int(parts[2])
