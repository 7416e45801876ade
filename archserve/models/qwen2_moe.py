"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): the MoE decoder with a shared expert.

Each sparse layer adds to its routed experts a shared expert (a gated MLP of
``shared_expert_intermediate_size``) scaled by sigmoid(shared_expert_gate(x)). q/k/v carry
biases (``qkv_bias``); top-k weights are renormalised only when ``norm_topk_prob`` is set;
``decoder_sparse_step`` and ``mlp_only_layers`` leave some layers dense.
"""

from __future__ import annotations

from archserve.models.mixtral import MoEForCausalLM, MoEModel, QwenMoEFamily


class Qwen2MoeModel(MoEModel):
    family = QwenMoEFamily()


class Qwen2MoeForCausalLM(MoEForCausalLM):
    model_class = Qwen2MoeModel
