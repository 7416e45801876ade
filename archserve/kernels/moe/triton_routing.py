"""MoE routing in one Triton launch: softmax, top-k and renormalisation per token.

``routing.route`` is the reference and the CPU path, but on a GPU it is four launches
(softmax, topk, sum, div) per layer, and at batch 1 a decode step is made of such launches:
each costs a few µs of a CUDA graph's replay, times 48 layers for Qwen3-30B-A3B. Here one
program per token loads its E logits, takes the softmax in fp32, picks the top k by k passes
of argmax (the lower index on a tie, which is what torch.topk returns for equal values in
practice), renormalises when asked and writes weights fp32 [T, k] and expert ids int32 [T, k]
in route's order (largest weight first).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the fused backend's availability rule reports it
    triton = None

MAX_EXPERTS = 4096      # one program holds a token's logits in registers


if triton is not None:

    @triton.jit
    def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_t,
                      TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                      RENORMALIZE: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        experts = tl.arange(0, BLOCK_E)
        real = experts < num_experts
        logits = tl.load(logits_ptr + token * stride_t + experts, mask=real,
                         other=-float("inf")).to(tl.float32)
        exps = tl.exp(logits - tl.max(logits, axis=0))
        # Padding lanes below any probability, so they are never picked.
        probs = tl.where(real, exps / tl.sum(exps, axis=0), -1.0)
        slots = tl.arange(0, BLOCK_K)
        weights = tl.zeros((BLOCK_K,), dtype=tl.float32)
        ids = tl.zeros((BLOCK_K,), dtype=tl.int32)
        for j in tl.static_range(TOP_K):
            best, best_id = tl.max(probs, axis=0, return_indices=True,
                                   return_indices_tie_break_left=True)
            weights = tl.where(slots == j, best, weights)
            ids = tl.where(slots == j, best_id.to(tl.int32), ids)
            probs = tl.where(experts == best_id, -1.0, probs)
        if RENORMALIZE:
            weights = weights / tl.sum(weights, axis=0)   # slots past TOP_K hold 0
        out = token * TOP_K + slots
        tl.store(weights_ptr + out, weights, mask=slots < TOP_K)
        tl.store(ids_ptr + out, ids, mask=slots < TOP_K)


def triton_route(router_logits: torch.Tensor, top_k: int, renormalize: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """routing.route in one launch: (weights [T, k] float32, expert ids [T, k] int32)."""
    num_tokens, num_experts = router_logits.shape
    if not 1 <= top_k <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"routes top-{top_k} of at most {MAX_EXPERTS} experts, "
                         f"not of {num_experts}")
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    device = router_logits.device
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
    if num_tokens == 0:
        return weights, ids
    block_e = triton.next_power_of_2(num_experts)
    # One warp reduces with shuffles alone; past 1024 logits it would hold too many each.
    _route_kernel[(num_tokens,)](
        router_logits, weights, ids, num_experts, router_logits.stride(0), TOP_K=top_k,
        BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
        num_warps=1 if block_e <= 1024 else 4)
    return weights, ids
