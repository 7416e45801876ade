"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): the MoE decoder with Qwen3's attention.

Per-head q/k RMSNorm before RoPE (as dense Qwen3), no shared expert, top-k weights
renormalised when ``norm_topk_prob`` is set (true in the released models), and dense
layers wherever ``mlp_only_layers`` / ``decoder_sparse_step`` say so.
"""

from __future__ import annotations

from archserve.models.mixtral import MoEForCausalLM, MoEModel, QwenMoEFamily


class Qwen3MoeModel(MoEModel):
    family = QwenMoEFamily()


class Qwen3MoeForCausalLM(MoEForCausalLM):
    model_class = Qwen3MoeModel
