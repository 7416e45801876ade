"""Routing and token sorting for MoE: shared by every backend.

``route``: softmax over the router logits, top-k, optionally renormalised (Mixtral and
Qwen3 renormalise, Qwen2-MoE's default does not).

``experts_touched``: how many distinct experts a batch reads (expected, uniform routing),
for the bytes a step moves and for the choice of the fused kernel's layout.

``align_to_blocks``: the token order of a grouped GEMM. The T*k (token, slot) pairs are
sorted by expert and each expert's run is padded to a multiple of the GEMM's row tile,
so one program of the kernel reads one expert's weights for one tile of its tokens and
no expert is padded to the whole batch. Every size here is fixed by (T, k, E, tile): the
padded length is the worst case, so nothing reads a device value back to the host and a
decode step that runs it can be captured once in a CUDA graph and replayed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]) from router logits [T, E]: the softmax
    top-k, ``grouped_route`` with no groups, bias or scaling (the renormalisation's 1e-20
    is below float32's resolution of a top-k sum, which is at least 1/E)."""
    return grouped_route(router_logits, top_k, renormalize=renormalize)


def grouped_route(router_logits: torch.Tensor, top_k: int, *, scoring: str = "softmax",
                  renormalize: bool = False, num_groups: int = 1, topk_groups: int = 1,
                  correction_bias: torch.Tensor | None = None, scaling: float = 1.0,
                  shared_experts: int = 0, fixed_ids: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's routing: (weights [T, k] float32, expert ids [T, k]).

    Scores are softmax (V2), sigmoid (V3) or sqrt(softplus) (V4) of the logits. Experts are
    chosen on the scores plus ``correction_bias`` (V3's e_score_correction_bias), only
    among the ``topk_groups`` best of ``num_groups`` expert groups: a group scores its best
    expert (V2's group_limited_greedy) or, with a correction bias, its best two summed (V3's
    noaux_tc).
    The weights are the unbiased scores of the chosen experts, renormalised when asked, times
    ``scaling`` (routed_scaling_factor). ``fixed_ids`` [T, k]: the experts are given (V4's
    hash routing, a table of token ids), only their weights computed.

    ``shared_experts`` S: the layer's always-on experts, stacked after its E routed ones
    (``FusedMoE``'s ``num_shared_experts``), as S more slots after the top k: experts E to
    E + S - 1, weight 1 (neither renormalised nor scaled: DeepSeek adds its shared
    experts' output as it is). The results are then [T, k + S].
    """
    logits = router_logits.float()
    if scoring == "sigmoid":
        scores = logits.sigmoid()
    elif scoring == "sqrtsoftplus":
        scores = torch.nn.functional.softplus(logits).sqrt()
    else:
        scores = logits.softmax(dim=-1)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if fixed_ids is None and num_groups > 1 and topk_groups < num_groups:
        grouped = choice.view(choice.shape[0], num_groups, -1)
        group_scores = (grouped.max(dim=-1).values if correction_bias is None
                        else grouped.topk(2, dim=-1).values.sum(dim=-1))
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_groups, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=1),
                                    float("-inf"))
    experts = (fixed_ids.long() if fixed_ids is not None
               else choice.topk(top_k, dim=-1).indices)
    weights = scores.gather(1, experts)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * scaling
    if shared_experts:
        num_tokens, num_experts = router_logits.shape
        shared = torch.arange(num_experts, num_experts + shared_experts,
                              device=experts.device).expand(num_tokens, -1)
        experts = torch.cat((experts, shared), dim=1)
        weights = torch.cat((weights, weights.new_ones(num_tokens, shared_experts)), dim=1)
    return weights, experts


def experts_touched(tokens: int, num_experts: int, top_k: int) -> float:
    """Distinct experts a layer reads for ``tokens`` tokens (expected, uniform routing)."""
    if num_experts == 0 or tokens <= 0:
        return 0.0
    if tokens == 1:
        return float(top_k)
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows the sorted order can need: every pair, plus at most block_m - 1 of padding for
    each expert that gets a pair (no more experts than pairs get one), to a whole tile."""
    padded = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-padded // block_m) * block_m


@dataclass
class BlockAlignment:
    """The grouped-GEMM order of one batch.

    ``sorted_pairs`` [P]: pair index t*k + j in expert order, each expert's run padded to a
    multiple of the tile with the sentinel T*k (a row the kernels skip).
    ``block_expert`` [P / block_m]: the expert of each tile of rows; -1 past the last one.
    """

    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    block_m: int

    @property
    def num_blocks(self) -> int:
        return self.block_expert.numel()


def align_to_blocks(expert_ids: torch.Tensor, num_experts: int, block_m: int
                    ) -> BlockAlignment:
    """Sort the (token, slot) pairs of ``expert_ids`` [T, k] by expert, padded per expert."""
    flat = expert_ids.reshape(-1).to(torch.int64)
    pairs = flat.numel()
    device = flat.device
    # scatter_add, not bincount: CUDA's bincount reads the maximum back to the host.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    first = counts.cumsum(0) - counts              # first sorted position of each expert
    order = torch.sort(flat, stable=True).indices  # pair indices, grouped by expert
    by_expert = flat[order]
    rank = torch.arange(pairs, device=device) - first[by_expert]
    total = max_padded_rows(pairs, num_experts, block_m)
    sorted_pairs = torch.full((total,), pairs, dtype=torch.int32, device=device)
    sorted_pairs[padded_start[by_expert] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, total, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return BlockAlignment(sorted_pairs, block_expert, block_m)
