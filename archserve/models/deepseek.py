"""DeepSeek-V2 (V2, V2-Lite), DeepSeek-V3, V3.2 and GLM-5: MLA attention and MoE with shared
experts; V3.2 and GLM-5 attend sparsely (DSA: a lightning indexer picks each query's keys,
models/layers/indexer.py).

The decoder is the MoE decoder (Llama's layer, norms and checkpoint handling) with two
family parts swapped in:

- attention: ``MLAAttention`` (models/layers/mla.py) on every layer, over the latent
  paged cache; q through a LoRA (``q_lora_rank``, V2 and V3) or one projection (V2-Lite);
- the sparse MLP of layers from ``first_k_dense_replace`` on (every ``moe_layer_freq``-th):
  the routed experts plus ``n_shared_experts`` always-on experts (stacked after the routed
  ones in the same fused experts; a quantized checkpoint's stay one gated MLP,
  ``shared_experts``), routed as ``routing.grouped_route`` says (by the MoE backend: one
  Triton launch on GPUs, torch elsewhere): V2 softmax top-k (optionally within
  groups, ``group_limited_greedy``), V3 sigmoid scores with ``e_score_correction_bias``
  choosing within the ``topk_group`` best of ``n_group`` groups; weights times
  ``routed_scaling_factor``. The router runs in fp32, as DeepSeek's does.

The earlier layers are dense (``intermediate_size``). YaRN RoPE comes from the config
(models/layers/rotary.py); its mscale enters the softmax scale (mla.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from archserve.kernels.elementwise.dispatch import fusion_not_disabled
from archserve.models.layers.linear import apply_linear, linear_weights_deferred
from archserve.models.layers.mla import MLAAttention
from archserve.models.layers.moe import (
    HF_EXPERT_NAMES,
    FusedMoE,
    GatedMLP,
    Router,
    RouterFirstBlock,
)
from archserve.models.mixtral import MoEFamily, MoEForCausalLM, MoEModel

if TYPE_CHECKING:
    from archserve.models.config import ModelConfig


class DeepseekRouter(Router):
    """fp32 router logits from fp32 weights; V3's gate also holds the score correction bias.

    The weight and the bias stay float32 in a 16-bit model, as transformers keeps them
    (``_keep_in_fp32_modules_strict``; vLLM keeps the bias): rounded to bf16 they move the
    sigmoid scores by a few thousandths, as far apart as near-tied experts are. x stays in
    the model dtype: the linear routine widens it (the decode GEMV in its kernel, saving
    a conversion launch per layer) and returns the logits of x.float() and the weight."""

    def __init__(self, num_experts: int, hidden_size: int, correction_bias: bool) -> None:
        super().__init__(num_experts, hidden_size, dtype=torch.float32)
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(num_experts, dtype=torch.float32), requires_grad=False)
            if correction_bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_linear(x, self.weight)


class DeepseekMoE(RouterFirstBlock):
    """Router, routed experts and the shared experts. With 16-bit experts the shared ones
    are stacked after the routed ones in the same ``FusedMoE`` (its ``num_shared_experts``;
    the checkpoint's ``shared_experts`` matrices are split into them on load,
    ``shared_experts_as_experts``); experts a checkpoint quantizes keep the shared experts
    as their own gated MLP of quantized linears."""

    def __init__(self, config: ModelConfig, hf: Any, family: DeepseekFamily) -> None:
        super().__init__()
        num_experts = family.num_experts(hf)
        self.top_k = int(hf.num_experts_per_tok)
        self.sigmoid = family.scoring(hf) == "sigmoid"
        self.gate = DeepseekRouter(num_experts, config.hidden_size, self.sigmoid)
        num_shared = family.num_shared_experts(hf)
        fold_shared = (num_shared > 0 and not linear_weights_deferred()
                       and fusion_not_disabled("shared_experts"))
        self.experts = FusedMoE(num_experts, self.top_k, config.hidden_size,
                                family.expert_intermediate_size(hf), family.renormalize(hf),
                                HF_EXPERT_NAMES, num_shared if fold_shared else 0)
        shared = family.shared_intermediate_size(hf)
        self.shared_experts = (GatedMLP(config.hidden_size, shared)
                               if shared and not fold_shared else None)
        grouped = family.grouped(hf)
        self.grouping = dict(
            scoring=family.scoring(hf),
            num_groups=int(hf.n_group or 1) if grouped else 1,
            topk_groups=int(hf.topk_group or 1) if grouped else 1,
            scaling=float(getattr(hf, "routed_scaling_factor", 1.0) or 1.0))

    def _experts(self, x: torch.Tensor, logits: torch.Tensor, residual: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        grouping = {**self.grouping, "correction_bias": self.gate.e_score_correction_bias}
        if self.shared_experts is None:
            return self.experts.forward_add(x, logits, residual, grouping)
        return self.experts(x, logits, grouping) + self.shared_experts(x), residual

    def _other_readers(self) -> tuple[nn.Module | None, ...]:
        shared = self.shared_experts
        return (shared.gate_up_proj if shared is not None else None,)


_SHARED_EXPERT = re.compile(r"^(?P<mlp>.*\.mlp)\.shared_experts\."
                            r"(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def shared_experts_as_experts(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
                              ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's shared-expert matrices of layers that stack their shared experts
    after the routed ones, as those experts' matrices: gate and up [S * I, H] split into S
    blocks of I rows, down [H, S * I] into S blocks of I columns (expert E + j takes
    channels j * I to (j + 1) * I). Everything else passes through unchanged."""
    modules = dict(model.named_modules())
    for name, tensor in weights:
        m = _SHARED_EXPERT.match(name)
        block = modules.get(m["mlp"]) if m else None
        experts = getattr(block, "experts", None)
        if not isinstance(experts, FusedMoE) or not experts.num_shared_experts:
            yield name, tensor
            continue
        dim = 1 if m["proj"] == "down_proj" else 0
        for j, part in enumerate(tensor.chunk(experts.num_shared_experts, dim=dim)):
            yield f"{m['mlp']}.experts.{experts.num_experts + j}.{m['proj']}.weight", part


class DeepseekFamily(MoEFamily):
    block_name = "mlp"
    expert_names = HF_EXPERT_NAMES
    rope_interleaved_default = True

    def num_experts(self, hf: Any) -> int:
        return int(hf.n_routed_experts or 0)

    def expert_intermediate_size(self, hf: Any) -> int:
        return int(hf.moe_intermediate_size)

    def renormalize(self, hf: Any) -> bool:
        return bool(getattr(hf, "norm_topk_prob", False))

    def num_shared_experts(self, hf: Any) -> int:
        return int(getattr(hf, "n_shared_experts", 0) or 0)

    def shared_intermediate_size(self, hf: Any) -> int:
        return int(hf.moe_intermediate_size) * self.num_shared_experts(hf)

    def scoring(self, hf: Any) -> str:
        return "softmax"

    def grouped(self, hf: Any) -> bool:
        return getattr(hf, "topk_method", "greedy") == "group_limited_greedy"

    def is_sparse(self, hf: Any, layer_index: int) -> bool:
        # V3.2 and GLM-5 list the decoder layers' kinds; an MTP layer after them is not in
        # the list (transformers sizes it by num_hidden_layers) and follows the rule below.
        kinds = getattr(hf, "mlp_layer_types", None)
        if kinds is not None and layer_index < len(kinds):
            return self.num_experts(hf) > 0 and kinds[layer_index] == "sparse"
        freq = int(getattr(hf, "moe_layer_freq", 1) or 1)
        return (self.num_experts(hf) > 0 and layer_index >= int(hf.first_k_dense_replace or 0)
                and layer_index % freq == 0)

    def make_block(self, config: ModelConfig, hf: Any) -> nn.Module:
        return DeepseekMoE(config, hf, self)

    def make_attention(self, config: ModelConfig, layer_index: int) -> nn.Module:
        hf = config.hf_config
        hf = getattr(hf, "text_config", None) or hf
        interleaved = getattr(hf, "rope_interleave", self.rope_interleaved_default)
        return MLAAttention(config, layer_index, rope_interleaved=bool(interleaved))


class DeepseekV3Family(DeepseekFamily):
    def scoring(self, hf: Any) -> str:
        return str(getattr(hf, "scoring_func", "sigmoid") or "sigmoid")

    def grouped(self, hf: Any) -> bool:
        return True


class DeepseekV2Model(MoEModel):
    family = DeepseekFamily()

    def make_layer(self, config: ModelConfig, layer_index: int) -> nn.Module:
        # Every layer reads one cos/sin table (V3's covers 163840 positions): the first
        # layer's, which later layers take in place of the one they built.
        layer = super().make_layer(config, layer_index)
        if layer_index == 0:
            self.__dict__["_shared_rotary"] = layer.self_attn.rotary_emb
        else:
            layer.self_attn.rotary_emb = self.__dict__["_shared_rotary"]
        return layer


class DeepseekV3Model(DeepseekV2Model):
    family = DeepseekV3Family()


class DeepseekV2ForCausalLM(MoEForCausalLM):
    op_kinds = ("mla_attention", "linear", "moe")
    model_class = DeepseekV2Model

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # V3 checkpoints carry a multi-token-prediction layer after the last decoder layer.
        last = self.config.num_layers
        return super().load_weights(shared_experts_as_experts(
            self, ((n, t) for n, t in weights if not _layer_at_or_after(n, last))))


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    model_class = DeepseekV3Model


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3.2: V3 with DeepSeek sparse attention, a lightning indexer on every layer
    (MLAAttention takes it from ModelConfig.sparse_attention)."""


class GlmMoeDsaForCausalLM(DeepseekV3ForCausalLM):
    """GLM-5: V3.2's design (its routing with one group); the indexer's rope pairs are
    interleaved, and layers the config marks "shared" reuse the previous indexer layer's
    selection."""


def _layer_at_or_after(name: str, first: int) -> bool:
    parts = name.split(".")
    return (len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
            and int(parts[2]) >= first)
