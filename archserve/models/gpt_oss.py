"""gpt-oss (OpenAI's gpt-oss-20b and -120b): the MoE decoder with what OpenAI's model adds.

* Attention: biases on q, k, v and o; a learned sink logit per query head (the layer's
  Attention holds them; every attention backend that runs them says so in its rules);
  sliding-window (128) and full layers alternating, as ``layer_types`` says; YaRN RoPE.
* MoE: a router with a bias (top-k of the logits, then a softmax over those k: the same
  as the softmax's top k renormalised); experts with a bias after each projection and the
  clamped SwiGLU (``swiglu_alpha``, ``swiglu_limit``; expert_activation.py).

Checkpoints: transformers' bf16 form stacks each layer's experts transposed and with gate
and up interleaved (``experts.gate_up_proj`` [E, H, 2I]: gate the even columns, up the
odd; ``experts.down_proj`` [E, I, H]); OpenAI's MXFP4 form stores the same matrices
untransposed as ``*_blocks`` (uint8 [E, N, K/32, 16]) and ``*_scales`` (e8m0 [E, N, K/32]),
gate and up interleaved by rows. Both are renamed here into the per-expert matrices of
the MoE decoder (gate rows, up rows, down), so the dense and the quantized loaders fill
them as any MoE family's.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from archserve.kernels.moe.expert_activation import SWIGLU_OAI, GatedActivation
from archserve.models.layers.moe import HF_EXPERT_NAMES, SparseMoEBlock
from archserve.models.mixtral import MoEFamily, MoEForCausalLM, MoEModel

if TYPE_CHECKING:
    from archserve.models.config import ModelConfig


class GptOssFamily(MoEFamily):
    block_name = "mlp"
    expert_names = HF_EXPERT_NAMES

    def renormalize(self, hf: Any) -> bool:
        return True

    def make_block(self, config: ModelConfig, hf: Any) -> nn.Module:
        activation = GatedActivation(SWIGLU_OAI, float(getattr(hf, "swiglu_alpha", 1.702)),
                                     float(getattr(hf, "swiglu_limit", 7.0)))
        return SparseMoEBlock(config.hidden_size, self.num_experts(hf),
                              int(hf.num_experts_per_tok), self.expert_intermediate_size(hf),
                              self.renormalize(hf), self.expert_names, router_bias=True,
                              activation=activation, expert_bias=config.expert_bias)


class GptOssModel(MoEModel):
    family = GptOssFamily()


_EXPERTS = re.compile(r"^(?P<block>.*\.mlp)\.experts\.(?P<proj>gate_up_proj|down_proj)"
                      r"(?P<suffix>|_bias|_blocks|_scales)$")
_ROUTER = re.compile(r"^(?P<block>.*\.mlp)\.router\.(?P<param>weight|bias)$")


def gpt_oss_checkpoint_names(weights: Iterable[tuple[str, torch.Tensor]]
                             ) -> Iterator[tuple[str, torch.Tensor]]:
    """gpt-oss's stacked expert tensors and router as the MoE decoder names them: per
    expert ``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj`` (``weight``, or the
    MXFP4 ``blocks`` [N, K/2] and ``scales`` [N, K/32]), the biases stacked as the layer's
    ``w13_bias`` (gate then up) and ``w2_bias``, the router as ``gate``."""
    gate_name, up_name, down_name = HF_EXPERT_NAMES
    for name, tensor in weights:
        if m := _ROUTER.match(name):
            yield f"{m['block']}.gate.{m['param']}", tensor
            continue
        m = _EXPERTS.match(name)
        if m is None:
            yield name, tensor
            continue
        prefix, suffix = f"{m['block']}.experts", m["suffix"]
        if suffix == "_bias":
            if m["proj"] == "down_proj":
                yield f"{prefix}.w2_bias", tensor
            else:
                yield f"{prefix}.w13_bias", torch.cat((tensor[:, 0::2], tensor[:, 1::2]), 1)
            continue
        for e, matrix in enumerate(tensor):
            if suffix == "":            # bf16, transposed: [K, N]
                matrix = matrix.t()
            param = {"": "weight", "_blocks": "blocks", "_scales": "scales"}[suffix]
            if suffix == "_blocks":     # [N, K/32, 16] -> [N, K/2]
                matrix = matrix.reshape(matrix.shape[0], -1)
            if m["proj"] == "down_proj":
                yield f"{prefix}.{e}.{down_name}.{param}", matrix
            else:                       # gate the even rows, up the odd
                yield f"{prefix}.{e}.{gate_name}.{param}", matrix[0::2]
                yield f"{prefix}.{e}.{up_name}.{param}", matrix[1::2]


class GptOssForCausalLM(MoEForCausalLM):
    model_class = GptOssModel

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(gpt_oss_checkpoint_names(weights))
