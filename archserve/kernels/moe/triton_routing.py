"""MoE routing in one Triton launch: scores, group limits, top-k and weights per token.

``routing.route`` and ``routing.grouped_route`` are the references and the CPU path, but on
a GPU they are four (softmax top-k) to a dozen (DeepSeek's grouped top-k) launches per layer,
and at batch 1 a decode step is made of such launches: each costs a few µs of a CUDA graph's
replay, times 48 layers for Qwen3-30B-A3B (H200 profile of DeepSeek-V2-Lite: torch's top-k
alone took 0.26 ms of a 3.3 ms step). Here one program per token loads its E logits as
[groups, experts per group], scores them in fp32 (softmax over all experts, sigmoid, or
DeepSeek V4's sqrt(softplus)),
adds the selection bias, keeps the ``topk_groups`` best groups (a group scores its best
expert, or its best two summed when there is a bias: DeepSeek-V2's group_limited_greedy and
V3's noaux_tc), picks the top k (the lower index on a tie, which is what torch.topk returns
for equal values in practice: up to MAX_RANKED_LANES lanes by every lane's rank at once,
past them by k passes of a max over keys that name their lane; past them with 16-bit
softmax logits the keys are the logits', so two logits whose scores round to one fp32
value are ordered by logit, not by index), and writes the unbiased scores of
the chosen experts, renormalised when asked and times ``scaling``, as weights fp32 [T, k]
with expert ids int32 [T, k], in the references' order (best choice first; a NaN score
ranks below every other, where torch.topk puts it first); then, for a
layer with shared experts stacked after its routed ones, their slots (ids E.., weight 1).
With ``fixed_ids`` (DeepSeek V4's hash routing: the experts come from a table of token ids)
the k experts are given, and only their weights are computed.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    from archserve.kernels.elementwise.triton_argmax import ordered_keys
    from archserve.kernels.pdl import pdl_enabled, pdl_launch_options, pdl_start
except ImportError:  # the fused backend's availability rule reports it
    triton = None

MAX_EXPERTS = 4096      # one program holds a token's logits in registers
# Up to this many lanes (experts, padded to powers of two) the top k comes from every
# lane's rank, a [lanes, lanes] comparison on one SM; past it, k passes. Measured in a
# chain of launches on an H200 (benchmarks/bench_chain_latency.py): 64 lanes
# top-6 (DeepSeek-V2-Lite) 1.32 µs a launch ranked against 1.59 by argmax passes; 128 lanes
# top-8 (Qwen3-30B-A3B) 2.31-4.41 ranked (by warps) against 2.14: the comparisons grow with
# the square of the lanes, the passes with k. The passes key on bf16 logits, one int32 max
# a pass (a warp's redux.sync): 1.52 µs.
MAX_RANKED_LANES = 64
# Comparisons a thread makes for the ranks (the warps follow, 1 to 16): at 64 lanes, 2
# warps (1.32 µs) beat 1 (1.55) and 4 (1.79).
RANK_COMPARISONS_PER_THREAD = 64
# Low bits of a float32 that are zero in every value of a 16-bit float: bf16 keeps 7 of the
# 23 mantissa bits, fp16 10.
_FREE_LOW_BITS = {torch.bfloat16: 16, torch.float16: 13}
SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus")


if triton is not None:

    @triton.jit
    def _route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, stride_t, scaling,
                      TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, GROUPS: tl.constexpr,
                      PER_GROUP: tl.constexpr, TOPK_GROUPS: tl.constexpr,
                      BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr, SCORING: tl.constexpr,
                      HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr,
                      SHARED: tl.constexpr = 0, RANKED: tl.constexpr = False,
                      LOGIT_KEY_BITS: tl.constexpr = 0, PDL: tl.constexpr = False,
                      fixed_ids_ptr=None, FIXED: tl.constexpr = False):
        pdl_start(PDL)
        token = tl.program_id(0).to(tl.int64)
        group = tl.arange(0, BLOCK_G)
        member = tl.arange(0, BLOCK_P)
        expert = group[:, None] * PER_GROUP + member[None, :]      # [BLOCK_G, BLOCK_P]
        real = (group < GROUPS)[:, None] & (member < PER_GROUP)[None, :]
        logits = tl.load(logits_ptr + token * stride_t + expert, mask=real,
                         other=-float("inf")).to(tl.float32)
        if SCORING == 1:
            scores = tl.sigmoid(logits)
        elif SCORING == 2:     # sqrt(softplus), softplus as torch's (x itself past 20)
            small = tl.exp(-tl.abs(logits))
            log1p = tl.where(small < 1e-4, small - 0.5 * small * small, tl.log(1.0 + small))
            softplus = tl.where(logits > 20.0, logits, tl.maximum(logits, 0.0) + log1p)
            scores = tl.sqrt(softplus)
        else:
            exps = tl.exp(logits - tl.max(tl.max(logits, axis=1), axis=0))
            scores = exps / tl.sum(tl.sum(exps, axis=1), axis=0)
        if FIXED:      # the experts are given: their scores are the weights
            slots = tl.arange(0, BLOCK_K)
            given = slots < TOP_K
            ids = tl.load(fixed_ids_ptr + token * TOP_K + slots, mask=given, other=0)
            flat_scores = tl.reshape(scores, (BLOCK_G * BLOCK_P,))
            flat_expert = tl.reshape(expert, (BLOCK_G * BLOCK_P,))
            picked = tl.sum(tl.where(flat_expert[None, :] == ids[:, None], flat_scores[None, :],
                                     0.0), axis=1)
            picked = tl.where(given, picked, 0.0)
            if RENORMALIZE:
                picked = picked / (tl.sum(picked, axis=0) + 1e-20)
            out = token * (TOP_K + SHARED) + slots
            shared = (slots >= TOP_K) & (slots < TOP_K + SHARED)
            tl.store(weights_ptr + out, tl.where(shared, 1.0, picked * scaling),
                     mask=given | shared)
            tl.store(ids_ptr + out, tl.where(shared, GROUPS * PER_GROUP + slots - TOP_K, ids),
                     mask=given | shared)
            return
        choice = scores
        if HAS_BIAS:
            choice = choice + tl.load(bias_ptr + expert, mask=real, other=0.0).to(tl.float32)
        # Padding lanes (and, below, the experts of dropped groups) are never picked.
        choice = tl.where(real, choice, -float("inf"))
        # NaN (a NaN logit makes every score NaN) counts as a quarter of the lowest finite
        # value: below every real score, above the -inf of padding and dropped lanes, and
        # finite when a group sums its best two. Each of the k slots then names a distinct
        # real expert of distinct kept groups, whatever the row holds.
        choice = tl.where(choice == choice, choice, -8.507059173023462e37)
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
        # Top k over the flattened lanes; lane order is expert order.
        lane = tl.arange(0, BLOCK_G * BLOCK_P)
        choice = tl.reshape(choice, (BLOCK_G * BLOCK_P,))
        scores = tl.reshape(scores, (BLOCK_G * BLOCK_P,))
        expert = tl.reshape(expert, (BLOCK_G * BLOCK_P,))
        LANES: tl.constexpr = BLOCK_G * BLOCK_P
        slots = tl.arange(0, BLOCK_K)
        out = token * (TOP_K + SHARED) + slots
        # The shared experts' slots: experts GROUPS * PER_GROUP + j, weight 1.
        shared = (slots >= TOP_K) & (slots < TOP_K + SHARED)
        tl.store(weights_ptr + out, tl.where(shared, 1.0, 0.0), mask=shared)
        tl.store(ids_ptr + out, GROUPS * PER_GROUP + slots - TOP_K, mask=shared)
        if RANKED:
            # Every lane's rank at once: how many lanes beat it (a higher choice, or an
            # equal one at a lower index); the lanes of rank below k store themselves into
            # slot rank. One reduction, where k passes chain k of them one after the
            # other. One int64 key a lane orders (choice, then the lower lane), so a rank
            # is the count of larger keys, one comparison each; [other lane, lane]: the
            # reduction runs down each lane's column, in a thread's registers.
            keys = ordered_keys(choice).to(tl.int64) * LANES + (LANES - 1 - lane)
            slot = tl.sum((keys[:, None] > keys[None, :]).to(tl.int32), axis=0)
        else:
            # k passes; a lane remembers the pass that took it, its slot (no argmax index to
            # carry, no gather of the chosen score).
            slot = lane * 0 + TOP_K
            if LOGIT_KEY_BITS > 0:
                # The choice is the softmax of the logits, whose order it keeps: the key is
                # the logit's, exact in the top bits of an int32 (a 16-bit float's value in
                # fp32 leaves LOGIT_KEY_BITS low bits zero), the lane in those low bits: one
                # 32-bit max a pass (one redux.sync in a warp). (Two logits whose scores
                # round to one value are ordered by the logits here, by the lower index in
                # torch's top-k.)
                LOWEST: tl.constexpr = -0x7FFFFFFF - 1   # padding's key, and a taken lane's
                raw = tl.reshape(logits, (LANES,))
                keys = (ordered_keys(raw) >> LOGIT_KEY_BITS) << LOGIT_KEY_BITS
                # NaN: the lowest key above padding's, below every real logit (-inf too).
                keys = tl.where(raw == raw, keys, LOWEST + (1 << LOGIT_KEY_BITS))
                keys = keys | (LANES - 1 - lane)
                keys = tl.where(tl.reshape(real, (LANES,)), keys, LOWEST)
                for j in tl.static_range(TOP_K):
                    hit = keys == tl.max(keys, axis=0)
                    slot = tl.where(hit, j, slot)
                    keys = tl.where(hit, LOWEST, keys)
            else:
                # The best choice, then the lowest lane holding it (an int32 min).
                for j in tl.static_range(TOP_K):
                    best = tl.max(choice, axis=0)
                    hit = lane == tl.min(tl.where(choice == best, lane, LANES), axis=0)
                    slot = tl.where(hit, j, slot)
                    choice = tl.where(hit, -float("inf"), choice)
        chosen = slot < TOP_K
        weights = tl.where(chosen, scores, 0.0)
        if RENORMALIZE:
            weights = weights / (tl.sum(weights, axis=0) + 1e-20)
        weights = weights * scaling
        at = token * (TOP_K + SHARED) + slot
        tl.store(weights_ptr + at, weights, mask=chosen)
        tl.store(ids_ptr + at, expert, mask=chosen)


def triton_route(router_logits: torch.Tensor, top_k: int, renormalize: bool, *,
                 scoring: str = "softmax", num_groups: int = 1, topk_groups: int = 1,
                 correction_bias: torch.Tensor | None = None, scaling: float = 1.0,
                 shared_experts: int = 0, fixed_ids: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``routing.grouped_route`` (``routing.route`` with the defaults) in one launch:
    (weights [T, k + shared_experts] float32, expert ids [T, k + shared_experts] int32)."""
    num_tokens, num_experts = router_logits.shape
    if not 1 <= top_k <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"routes top-{top_k} of at most {MAX_EXPERTS} experts, "
                         f"not of {num_experts}")
    if scoring not in SCORINGS:
        raise ValueError(f"scores experts by {', '.join(SCORINGS)}, not {scoring!r}")
    grouped = num_groups > 1 and topk_groups < num_groups
    if grouped and (num_experts % num_groups or topk_groups < 1
                    or topk_groups * (num_experts // num_groups) < top_k):
        raise ValueError(f"top-{top_k} of {num_experts} experts within {topk_groups} of "
                         f"{num_groups} groups")
    groups = num_groups if grouped else 1
    per_group = num_experts // groups
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    device = router_logits.device
    slots = top_k + shared_experts
    weights = torch.empty(num_tokens, slots, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, slots, dtype=torch.int32, device=device)
    if num_tokens == 0:
        return weights, ids
    block_g, block_p = triton.next_power_of_2(groups), triton.next_power_of_2(per_group)
    bias = correction_bias.contiguous() if correction_bias is not None else weights
    lanes = block_g * block_p
    ranked = lanes <= MAX_RANKED_LANES
    # The passes key on the logits where the choice is their softmax and a 16-bit float
    # leaves the lanes room in an int32 (LOGIT_KEY_BITS); else they take the best choice.
    free_bits = _FREE_LOW_BITS.get(router_logits.dtype, 0)
    logit_key_bits = free_bits if (not ranked and not grouped and scoring == "softmax"
                                   and correction_bias is None
                                   and lanes <= 1 << free_bits) else 0
    # The passes: one warp reduces with shuffles alone (past 1024 lanes it would hold too
    # many each).
    warps = (min(max(lanes * lanes // (32 * RANK_COMPARISONS_PER_THREAD), 1), 16) if ranked
             else 1 if lanes <= 1024 else 4)
    pdl = pdl_enabled(device)
    _route_kernel[(num_tokens,)](
        router_logits, bias, weights, ids, router_logits.stride(0), float(scaling),
        TOP_K=top_k, BLOCK_K=triton.next_power_of_2(slots), GROUPS=groups,
        PER_GROUP=per_group, TOPK_GROUPS=topk_groups if grouped else groups,
        BLOCK_G=block_g, BLOCK_P=block_p, SCORING=SCORINGS.index(scoring),
        HAS_BIAS=correction_bias is not None, RENORMALIZE=renormalize,
        SHARED=shared_experts, RANKED=ranked, LOGIT_KEY_BITS=logit_key_bits, PDL=pdl,
        fixed_ids_ptr=fixed_ids.contiguous() if fixed_ids is not None else None,
        FIXED=fixed_ids is not None,
        num_warps=warps,
        **pdl_launch_options(pdl))
    return weights, ids
