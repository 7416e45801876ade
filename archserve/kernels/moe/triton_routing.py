"""MoE routing in one Triton launch: scores, group limits, top-k and weights per token.

``routing.route`` and ``routing.grouped_route`` are the references and the CPU path, but on
a GPU they are four (softmax top-k) to a dozen (DeepSeek's grouped top-k) launches per layer,
and at batch 1 a decode step is made of such launches: each costs a few µs of a CUDA graph's
replay, times 48 layers for Qwen3-30B-A3B (H200 profile of DeepSeek-V2-Lite: torch's top-k
alone took 0.26 ms of a 3.3 ms step). Here one program per token loads its E logits as
[groups, experts per group], scores them in fp32 (softmax over all experts, or sigmoid),
adds the selection bias, keeps the ``topk_groups`` best groups (a group scores its best
expert, or its best two summed when there is a bias: DeepSeek-V2's group_limited_greedy and
V3's noaux_tc), picks the top k by k passes of argmax (the lower index on a tie, which is
what torch.topk returns for equal values in practice), and writes the unbiased scores of
the chosen experts, renormalised when asked and times ``scaling``, as weights fp32 [T, k]
with expert ids int32 [T, k], in the references' order (best choice first); then, for a
layer with shared experts stacked after its routed ones, their slots (ids E.., weight 1).

That per-token routing is ``route_token``, which the fused MoE's pair layout
(triton_fused_moe, ``MoETile.pair_rows``) calls too: there each program routes its own
(token, slot) pair's token from the logits and takes its slot, so a decode step needs no
routing launch. ``describe_routing`` checks a routing and describes it (``Routing``) without running
it; the fused MoE decides by its tile whether its kernels route or ``Routing.run`` does.
The two give the same bits: see ``route_token`` on its reductions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

try:
    import triton
    import triton.language as tl

    from archserve.kernels.pdl import pdl_enabled, pdl_launch_options, pdl_start
except ImportError:  # the fused backend's availability rule reports it
    triton = None

MAX_EXPERTS = 4096      # one program holds a token's logits in registers


@dataclass(eq=False)
class Routing:
    """One batch's routing (``routing.grouped_route``'s), checked and described but not run:
    ``run`` routes it in one launch, and the fused MoE's pair layout has each program route
    its own (token, slot) pair from it instead (no launch of its own). ``constants`` are the
    routing's constexprs, named as every kernel that routes takes them."""

    logits: torch.Tensor                 # [T, E], contiguous in E
    correction_bias: torch.Tensor | None
    scaling: float
    top_k: int
    shared_experts: int
    constants: dict[str, Any]

    @property
    def slots(self) -> int:
        """Experts each token runs: its top k, then the shared ones."""
        return self.top_k + self.shared_experts

    def kernel_arguments(self) -> dict[str, Any]:
        """``route_token``'s arguments but the token, by the names the kernels take them."""
        bias = self.correction_bias if self.correction_bias is not None else self.logits
        return dict(logits_ptr=self.logits, bias_ptr=bias, stride_lt=self.logits.stride(0),
                    scaling=self.scaling, **self.constants)

    def run(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, slots] float32, expert ids [T, slots] int32), in one launch."""
        num_tokens, device = self.logits.shape[0], self.logits.device
        weights = torch.empty(num_tokens, self.slots, dtype=torch.float32, device=device)
        ids = torch.empty(num_tokens, self.slots, dtype=torch.int32, device=device)
        if num_tokens == 0:
            return weights, ids
        lanes = self.constants["BLOCK_G"] * self.constants["BLOCK_P"]
        pdl = pdl_enabled(device)
        # One warp reduces with shuffles alone; past 1024 lanes it would hold too many each.
        _route_kernel[(num_tokens,)](
            weights, ids, **self.kernel_arguments(), PDL=pdl,
            num_warps=1 if lanes <= 1024 else 4, **pdl_launch_options(pdl))
        return weights, ids


def describe_routing(router_logits: torch.Tensor, top_k: int, renormalize: bool, *,
                     scoring: str = "softmax", num_groups: int = 1, topk_groups: int = 1,
                     correction_bias: torch.Tensor | None = None, scaling: float = 1.0,
                     shared_experts: int = 0) -> Routing:
    """The ``Routing`` of ``routing.grouped_route``'s arguments (``routing.route``'s with the
    defaults), refused here where the kernels cannot route it. Reads only shapes: no launch,
    no host synchronisation."""
    num_experts = router_logits.shape[1]
    if not 1 <= top_k <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"routes top-{top_k} of at most {MAX_EXPERTS} experts, "
                         f"not of {num_experts}")
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"scores experts by softmax or sigmoid, not {scoring!r}")
    grouped = num_groups > 1 and topk_groups < num_groups
    if grouped and (num_experts % num_groups or topk_groups < 1
                    or topk_groups * (num_experts // num_groups) < top_k):
        raise ValueError(f"top-{top_k} of {num_experts} experts within {topk_groups} of "
                         f"{num_groups} groups")
    groups = num_groups if grouped else 1
    per_group = num_experts // groups
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    if correction_bias is not None:
        correction_bias = correction_bias.contiguous()
    constants = dict(
        ROUTED_K=top_k, SHARED=shared_experts,
        BLOCK_S=triton.next_power_of_2(top_k + shared_experts), GROUPS=groups,
        PER_GROUP=per_group, TOPK_GROUPS=topk_groups if grouped else groups,
        BLOCK_G=triton.next_power_of_2(groups), BLOCK_P=triton.next_power_of_2(per_group),
        SIGMOID=scoring == "sigmoid", HAS_BIAS=correction_bias is not None,
        RENORMALIZE=renormalize)
    return Routing(router_logits, correction_bias, float(scaling), top_k, shared_experts,
                   constants)


def triton_route(router_logits: torch.Tensor, top_k: int, renormalize: bool, **grouping
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``routing.grouped_route`` (``routing.route`` with no ``grouping``) in one launch:
    (weights [T, k + shared_experts] float32, expert ids [T, k + shared_experts] int32)."""
    return describe_routing(router_logits, top_k, renormalize, **grouping).run()


def routed_pairs(routed: Routing | tuple[torch.Tensor, torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, expert ids) of ``routed``: as they are, or a ``Routing`` run."""
    return routed.run() if isinstance(routed, Routing) else routed


if triton is not None:

    # The softmax's denominator is summed as integers of 2**-50 (exps are at most 1, so the
    # sum of MAX_EXPERTS of them fits an int64): integer addition has no order, so the sum,
    # and each score, has the same bits whatever layout Triton gives the lanes (a float
    # sum's order follows the warps: the pair layout's programs route with 4 or 8, the
    # routing kernel with 1). Terms lose their bits below 2**-50, far below the resolution
    # of a float32 sum of at least 1 (2**-23). Powers of two: both scalings are exact.
    FIXED_ONE: tl.constexpr = tl.constexpr(2.0 ** 50)
    FIXED_ULP: tl.constexpr = tl.constexpr(2.0 ** -50)

    @triton.jit
    def route_token(logits_ptr, bias_ptr, token, stride_lt, scaling,
                    ROUTED_K: tl.constexpr, SHARED: tl.constexpr, BLOCK_S: tl.constexpr,
                    GROUPS: tl.constexpr, PER_GROUP: tl.constexpr,
                    TOPK_GROUPS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr,
                    SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr):
        """(weights [BLOCK_S] float32, expert ids [BLOCK_S] int32) of ``token``'s slots: its
        ROUTED_K experts, best first, then its SHARED ones. Every reduction here has one
        result whatever the order of its lanes (maxima, argmaxima with the lower lane on a
        tie, integer sums, sums of one lane and zeros; the float sums go in slot order), so
        a kernel with any number of warps routes to the same bits as ``_route_kernel``."""
        group = tl.arange(0, BLOCK_G)
        member = tl.arange(0, BLOCK_P)
        expert = group[:, None] * PER_GROUP + member[None, :]      # [BLOCK_G, BLOCK_P]
        real = (group < GROUPS)[:, None] & (member < PER_GROUP)[None, :]
        logits = tl.load(logits_ptr + token * stride_lt + expert, mask=real,
                         other=-float("inf")).to(tl.float32)
        if SIGMOID:
            scores = tl.sigmoid(logits)
        else:
            exps = tl.exp(logits - tl.max(tl.max(logits, axis=1), axis=0))
            fixed = (exps * FIXED_ONE).to(tl.int64)
            scores = exps / (tl.sum(tl.sum(fixed, axis=1), axis=0).to(tl.float32) * FIXED_ULP)
        choice = scores
        if HAS_BIAS:
            choice = choice + tl.load(bias_ptr + expert, mask=real, other=0.0).to(tl.float32)
        # Padding lanes (and, below, the experts of dropped groups) are never picked.
        choice = tl.where(real, choice, -float("inf"))
        if TOPK_GROUPS < GROUPS:
            best = tl.max(choice, axis=1)
            group_score = best
            if HAS_BIAS:   # V3: a group scores its best two experts
                first = tl.argmax(choice, axis=1, tie_break_left=True)
                second = tl.max(tl.where(member[None, :] == first[:, None], -float("inf"),
                                         choice), axis=1)
                group_score = best + second
            group_score = tl.where(group < GROUPS, group_score, -float("inf"))
            keep = group < 0
            for _ in tl.static_range(TOPK_GROUPS):
                pick = tl.argmax(group_score, axis=0, tie_break_left=True)
                keep = keep | (group == pick)
                group_score = tl.where(group == pick, -float("inf"), group_score)
            choice = tl.where(keep[:, None], choice, -float("inf"))
        # Top k over the flattened lanes; lane order is expert order, and lane
        # g * BLOCK_P + p is expert g * PER_GROUP + p.
        lane = tl.arange(0, BLOCK_G * BLOCK_P)
        choice = tl.reshape(choice, (BLOCK_G * BLOCK_P,))
        scores = tl.reshape(scores, (BLOCK_G * BLOCK_P,))
        slots = tl.arange(0, BLOCK_S)
        weights = tl.zeros((BLOCK_S,), dtype=tl.float32)
        ids = tl.zeros((BLOCK_S,), dtype=tl.int32)
        total = 0.0
        for j in tl.static_range(ROUTED_K):
            pick = tl.argmax(choice, axis=0, tie_break_left=True)
            hit = lane == pick
            weight = tl.sum(tl.where(hit, scores, 0.0), axis=0)
            total += weight
            weights = tl.where(slots == j, weight, weights)
            ids = tl.where(slots == j, (pick // BLOCK_P) * PER_GROUP + pick % BLOCK_P, ids)
            choice = tl.where(hit, -float("inf"), choice)
        if RENORMALIZE:
            weights = weights / (total + 1e-20)
        weights = weights * scaling
        # The shared experts' slots: experts GROUPS * PER_GROUP + j, weight 1.
        shared = (slots >= ROUTED_K) & (slots < ROUTED_K + SHARED)
        weights = tl.where(shared, 1.0, weights)
        ids = tl.where(shared, GROUPS * PER_GROUP + slots - ROUTED_K, ids)
        return weights, ids

    @triton.jit
    def _route_kernel(weights_ptr, ids_ptr, logits_ptr, bias_ptr, stride_lt, scaling,
                      ROUTED_K: tl.constexpr, SHARED: tl.constexpr, BLOCK_S: tl.constexpr,
                      GROUPS: tl.constexpr, PER_GROUP: tl.constexpr,
                      TOPK_GROUPS: tl.constexpr, BLOCK_G: tl.constexpr,
                      BLOCK_P: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
                      RENORMALIZE: tl.constexpr, PDL: tl.constexpr = False):
        pdl_start(PDL)
        token = tl.program_id(0).to(tl.int64)
        weights, ids = route_token(logits_ptr, bias_ptr, token, stride_lt, scaling, ROUTED_K,
                                   SHARED, BLOCK_S, GROUPS, PER_GROUP, TOPK_GROUPS, BLOCK_G,
                                   BLOCK_P, SIGMOID, HAS_BIAS, RENORMALIZE)
        slots = tl.arange(0, BLOCK_S)
        out = token * (ROUTED_K + SHARED) + slots
        tl.store(weights_ptr + out, weights, mask=slots < ROUTED_K + SHARED)
        tl.store(ids_ptr + out, ids, mask=slots < ROUTED_K + SHARED)
