"""The weights one decode step reads, counted once for the self-check and the bench.

Every body weight is read once per step; so is the LM head (tied or not: a tied head
reads the embedding table as its matrix). The embedding table itself is a row gather,
one row per token, and is not counted. A quantized layer's bytes are what it holds
(packed integers and scales); its parameters (for FLOPs) are the weights it stands for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepWeights:
    body_params: int        # every weight except the embedding table and the LM head
    body_bytes: int
    lm_head_params: int
    lm_head_bytes: int

    @property
    def bytes_per_step(self) -> int:
        return self.body_bytes + self.lm_head_bytes


def _is_embedding_table(name: str, param: torch.Tensor, vocab_size: int) -> bool:
    return "embed" in name and param.dim() == 2 and param.shape[0] >= vocab_size


def _is_lm_head(name: str) -> bool:
    return name.startswith("lm_head") or ".lm_head." in name


def step_weights(model: torch.nn.Module, model_config) -> StepWeights:
    from archserve.quant.linear_state import quantized_layers

    quantized = {name: state for name, state in quantized_layers(model)}
    body_params = body_bytes = 0
    head_bytes_per_param = 2
    for name, param in model.named_parameters():
        if _is_embedding_table(name, param, model_config.vocab_size):
            head_bytes_per_param = param.element_size()
            continue
        if _is_lm_head(name):
            head_bytes_per_param = param.element_size()
            continue
        if name.rpartition(".")[0] not in quantized:
            body_params += param.numel()
        body_bytes += param.numel() * param.element_size()
    body_params += sum(s.in_features * sum(s.rows) for s in quantized.values())
    lm_head_params = model_config.vocab_size * model_config.hidden_size
    return StepWeights(body_params, body_bytes, lm_head_params,
                       lm_head_params * head_bytes_per_param)
