"""The weights one decode step reads, counted once for the self-check and the bench.

Every body weight is read once per step; so is the LM head (tied or not: a tied head
reads the embedding table as its matrix). The embedding table itself is a row gather,
one row per token, and is not counted. A head with a lower-precision copy that serves
one-row steps (the CPU's 8-bit head) counts the copy's bytes. A quantized layer's bytes
are what it holds (packed integers and scales); its parameters (for FLOPs) are the
weights it stands for.

The routed experts of an MoE layer are the exception: a step reads only the experts its
tokens are routed to. They are counted apart (``expert_*``), and ``bytes_for_tokens``
charges each step the experts that ``tokens`` tokens touch: k per layer for one token,
and for more the expected number of distinct experts under uniform routing,
E * (1 - (1 - k/E)^tokens), since which experts a batch picks is only known on the device.
Shared experts stacked with the routed ones (``FusedMoE.num_shared_experts``) are read
every step: they count as body.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from archserve.kernels.moe.routing import experts_touched

__all__ = ["StepWeights", "experts_touched", "step_weights"]


@dataclass(frozen=True)
class StepWeights:
    body_params: int        # every weight except the embedding table and the LM head
    body_bytes: int
    lm_head_params: int
    lm_head_bytes: int
    expert_params: int = 0  # the routed experts of every MoE layer (not in body_*)
    expert_bytes: int = 0
    num_experts: int = 0    # per MoE layer
    top_k: int = 0

    @property
    def bytes_per_step(self) -> int:
        """What a batch-1 decode step reads."""
        return self.bytes_for_tokens(1)

    def bytes_for_tokens(self, tokens: int) -> float:
        return (self.body_bytes + self.lm_head_bytes
                + self.expert_bytes * experts_touched(tokens, self.num_experts, self.top_k)
                / max(self.num_experts, 1))

    @property
    def active_params_per_token(self) -> float:
        """Body parameters one token multiplies: the dense body and its k experts a layer."""
        return self.body_params + self.expert_params * self.top_k / max(self.num_experts, 1)


def _is_embedding_table(name: str, param: torch.Tensor, vocab_size: int) -> bool:
    return "embed" in name and param.dim() == 2 and param.shape[0] >= vocab_size


def _is_lm_head(name: str) -> bool:
    return name.startswith("lm_head") or ".lm_head." in name


def _vocab_rows(model: torch.nn.Module, vocab_size: int) -> int:
    """The vocabulary rows the model's LM head holds: all of them, or on a tensor-parallel
    rank its part (padded to the same count on every rank)."""
    from archserve.models.layers.parallel_embedding import ParallelLMHead

    head = next((m for m in model.modules() if isinstance(m, ParallelLMHead)), None)
    return head.weight.shape[0] if head is not None and head.tp.size > 1 else vocab_size


def step_weights(model: torch.nn.Module, model_config) -> StepWeights:
    """What one decode step of ``model`` reads; a tensor-parallel rank's model counts its
    own shard (every rank reads its shard at the same time)."""
    from archserve.models.layers.moe import FusedMoE
    from archserve.quant.linear_state import quantized_layers

    vocab_rows = _vocab_rows(model, model_config.vocab_size)
    quantized = {name: state for name, state in quantized_layers(model)}
    moes = {name: m for name, m in model.named_modules() if isinstance(m, FusedMoE)}
    expert_params = expert_bytes = 0
    body_params = body_bytes = 0
    for moe in moes.values():
        held = moe.held_bytes()
        shared = held * moe.num_shared_experts // moe.num_stacked_experts
        expert_params += moe.expert_params()
        expert_bytes += held - shared
        body_params += moe.expert_params(shared=True)
        body_bytes += shared
    head_bytes_per_param = 2
    for name, param in model.named_parameters():
        if _is_embedding_table(name, param, vocab_rows):
            head_bytes_per_param = param.element_size()
            continue
        if _is_lm_head(name):
            head_bytes_per_param = param.element_size()
            continue
        if any(name.startswith(f"{m}.") for m in moes):
            continue
        if name.rpartition(".")[0] not in quantized:
            body_params += param.numel()
        body_bytes += param.numel() * param.element_size()
    body_params += sum(s.in_features * sum(s.rows) for s in quantized.values())
    lm_head_params = vocab_rows * model_config.hidden_size
    head_bytes = _low_precision_head_bytes(model)
    if head_bytes is None:
        head_bytes = lm_head_params * head_bytes_per_param
    first = next(iter(moes.values()), None)
    return StepWeights(body_params, body_bytes, lm_head_params, head_bytes,
                       expert_params, expert_bytes,
                       first.num_experts if first else 0, first.top_k if first else 0)


def _low_precision_head_bytes(model: torch.nn.Module) -> int | None:
    """What a one-row step's LM head reads where a lower-precision copy serves it (the
    CPU's 8-bit head), else None."""
    from archserve.models.layers.embedding import LMHead

    return next((b for m in model.modules() if isinstance(m, LMHead)
                 and (b := m.decode_bytes()) is not None), None)
