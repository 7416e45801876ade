"""The roofline floor of a traced run, and how close the run came to it.

Per step, the floor is max(FLOPs / measured matmul rate, bytes / measured copy
bandwidth), summed over steps; roofline efficiency is floor / measured step time
(1.0 would be at the roofline). MBU (model bandwidth utilisation) is, over decode-only
steps, bytes moved / time / measured bandwidth.

What a step costs, for each scheduled sequence with ``n`` new tokens after ``c``
cached ones:

- FLOPs: ``2 * body_params * n`` for the transformer body (for MoE, the dense body plus
  k experts per layer), ``2 * lm_head_params`` if
  the chunk is sampled (the engine runs the LM head on sampled rows only), and per
  layer ``4 * head_dim * num_heads * attended`` for QK^T and PV, where
  ``attended = n*c + n*(n+1)/2`` (causal: token i sees the c cached tokens and i+1 new).
- bytes: the weights once per step (body + LM head; the embedding is a row gather and
  is not counted; of an MoE layer's routed experts, those the step's tokens touch:
  engine/step_weights.py), plus per layer ``kv_bytes_per_token * (c + n)``: the cached context
  is read and the new tokens' keys and values are written.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

from archserve.bench.step_trace import ScheduledWork, StepTrace
from archserve.engine.ceilings import Ceilings
from archserve.engine.step_weights import StepWeights


@dataclass(frozen=True)
class ModelFacts:
    body_params: int             # every weight except the embedding table and the LM head
    lm_head_params: int
    weight_bytes: int            # bytes read per step: body + LM head
    num_layers: int
    num_heads: int
    head_dim: int
    kv_bytes_per_token_per_layer: int   # keys + values of one token in one layer
    # Routed experts (MoE), apart from body_params / weight_bytes: a step reads the ones
    # its tokens touch (engine/step_weights.py).
    expert_params: int = 0
    expert_bytes: int = 0
    num_experts: int = 0
    top_k: int = 0
    # Where a layer reads less than its whole cached context (DeepSeek V4: a window and
    # compressed entries), the bytes one sequence's step reads over every layer, from
    # (context, new tokens); None: kv_bytes_per_token_per_layer * (context + new) a layer.
    cache_read_bytes: Callable[[int, int], int] | None = None

    def weights(self) -> StepWeights:
        return StepWeights(self.body_params, self.weight_bytes, self.lm_head_params, 0,
                           self.expert_params, self.expert_bytes, self.num_experts,
                           self.top_k)


def model_facts(engine) -> ModelFacts:
    """The facts of a loaded engine, from its model config and its actual parameters.
    With tensor parallelism, those of one rank (its heads, its shard of the weights): the
    ranks run their shards at the same time, so a step's floor is one rank's."""
    from archserve.distributed.layout import rank_model_config
    from archserve.engine.kv_cache import kv_dtype_of

    mc = rank_model_config(engine.model_config, engine.config.tensor_parallel_size, 0)
    weights = engine.step_weights
    kv_dtype = kv_dtype_of(engine.report.kv_cache_dtype, engine.report.dtype)
    # What a token keeps per layer in the cache's own layout (an MLA latent: one plane).
    kv_bytes = mc.kv_cache_planes * mc.kv_cache_heads * mc.kv_cache_head_size * kv_dtype.itemsize
    return ModelFacts(cache_read_bytes=_compressed_read_bytes(mc, kv_dtype, engine),
                      body_params=weights.body_params, lm_head_params=weights.lm_head_params,
                      weight_bytes=weights.body_bytes + weights.lm_head_bytes,
                      num_layers=mc.num_layers, num_heads=mc.num_heads, head_dim=mc.head_dim,
                      kv_bytes_per_token_per_layer=kv_bytes,
                      expert_params=weights.expert_params, expert_bytes=weights.expert_bytes,
                      num_experts=weights.num_experts, top_k=weights.top_k)


def _compressed_read_bytes(mc, kv_dtype, engine) -> Callable[[int, int], int] | None:  # noqa: ANN001
    """DeepSeek V4's cache reads per sequence and step (each layer's window and entries)."""
    from archserve.engine.kv_cache import compressed_layouts
    layouts = compressed_layouts(mc, kv_dtype, engine.report.block_size)
    if layouts is None:
        return None
    topk = mc.compressed_attention.index_topk
    return lambda context, new: sum(layout.read_bytes(context, new, topk)
                                    for layout in layouts)


def attended_pairs(num_new_tokens: int, context_len: int) -> int:
    n, c = num_new_tokens, context_len
    return n * c + n * (n + 1) // 2


def step_flops(facts: ModelFacts, work: list[ScheduledWork]) -> float:
    tokens = sum(w.num_new_tokens for w in work)
    sampled = sum(1 for w in work if w.samples)
    pairs = sum(attended_pairs(w.num_new_tokens, w.context_len) for w in work)
    attention = facts.num_layers * 4 * facts.head_dim * facts.num_heads * pairs
    return (2.0 * facts.weights().active_params_per_token * tokens
            + 2.0 * facts.lm_head_params * sampled + attention)


def step_bytes(facts: ModelFacts, work: list[ScheduledWork]) -> float:
    tokens = sum(w.num_new_tokens for w in work)
    if facts.cache_read_bytes is not None:
        cache = sum(facts.cache_read_bytes(w.context_len, w.num_new_tokens) for w in work)
    else:
        kv_tokens = sum(w.context_len + w.num_new_tokens for w in work)
        cache = facts.num_layers * facts.kv_bytes_per_token_per_layer * kv_tokens
    return float(facts.weights().bytes_for_tokens(tokens) + cache)


def step_floor_seconds(facts: ModelFacts, work: list[ScheduledWork], ceilings: Ceilings
                       ) -> float:
    return max(step_flops(facts, work) / ceilings.matmul_flops_per_s,
               step_bytes(facts, work) / ceilings.copy_bytes_per_s)


@dataclass(frozen=True)
class RooflineReport:
    num_steps: int
    num_decode_steps: int
    compute_bound_steps: int
    floor_s: float
    measured_s: float
    roofline_efficiency: float
    total_flops: float
    total_bytes: float
    achieved_flops_per_s: float
    achieved_bytes_per_s: float
    mbu: float                    # decode steps only; nan when there were none
    decode_bytes_per_s: float
    decode_step_s_mean: float     # measured time of a decode step, on average
    decode_floor_s_mean: float    # its floor, on average (the target's yardstick)

    def to_json(self) -> dict:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v)
                for k, v in asdict(self).items()}


def analyze(trace: StepTrace, facts: ModelFacts, ceilings: Ceilings) -> RooflineReport:
    floor = flops = moved = 0.0
    decode_bytes = decode_s = decode_floor = 0.0
    decode_steps = compute_bound = 0
    for step in trace.steps:
        f, b = step_flops(facts, step.work), step_bytes(facts, step.work)
        compute_s, memory_s = f / ceilings.matmul_flops_per_s, b / ceilings.copy_bytes_per_s
        step_floor = max(compute_s, memory_s)
        floor += step_floor
        compute_bound += compute_s > memory_s
        flops += f
        moved += b
        if step.is_decode:
            decode_steps += 1
            decode_bytes += b
            decode_s += step.seconds
            decode_floor += step_floor
    measured = trace.seconds
    decode_rate = decode_bytes / decode_s if decode_s > 0 else math.nan
    return RooflineReport(
        num_steps=len(trace.steps), num_decode_steps=decode_steps,
        compute_bound_steps=int(compute_bound), floor_s=floor, measured_s=measured,
        roofline_efficiency=floor / measured if measured > 0 else math.nan,
        total_flops=flops, total_bytes=moved,
        achieved_flops_per_s=flops / measured if measured > 0 else math.nan,
        achieved_bytes_per_s=moved / measured if measured > 0 else math.nan,
        mbu=decode_rate / ceilings.copy_bytes_per_s, decode_bytes_per_s=decode_rate,
        decode_step_s_mean=decode_s / decode_steps if decode_steps else math.nan,
        decode_floor_s_mean=decode_floor / decode_steps if decode_steps else math.nan)


def _beats(report: RooflineReport) -> float:
    """How far a run went past its ceilings (> 1: a figure over 100%), else 1."""
    figures = [v for v in (report.roofline_efficiency, report.mbu) if not math.isnan(v)]
    return max([1.0, *figures])


def analyze_within_ceilings(trace: StepTrace, facts: ModelFacts, ceilings: Ceilings,
                            remeasure: Callable[[], Ceilings]
                            ) -> tuple[RooflineReport, Ceilings]:
    """``analyze``, with ceilings no run can beat: a run faster than its (cached) ceilings
    measures them again (``remeasure``); still faster, it raises them to what it reached.
    Returns the report and the ceilings it used."""
    report = analyze(trace, facts, ceilings)
    if _beats(report) > 1:
        ceilings = remeasure()
        report = analyze(trace, facts, ceilings)
        factor = _beats(report)
        if factor > 1:
            ceilings = ceilings.raised(factor)
            report = analyze(trace, facts, ceilings)
    return report, ceilings
