"""The decode-step floor of a tensor-parallel run: what one rank must read over the
measured copy bandwidth, plus the all-reduces a step waits for.

Every layer all-reduces twice (after the row-parallel o_proj and down_proj), a message
of the step's tokens x hidden_size elements, and a layer cannot start before the last
one's sum is in: the all-reduces add to the step rather than overlap it. Their time
comes from the all-reduce table that ``benchmarks/tp_perf.py`` measures on the same
GPUs (rows of ``bytes``, ``nccl_graph_us`` and ``one_shot_us``). The memory part is the
roofline floor of the step with one rank's facts (``roofline.model_facts`` under tensor
parallelism); at batch 1 that is one rank's weights over the copy bandwidth.
"""

from __future__ import annotations

from archserve.bench.roofline import ModelFacts, step_floor_seconds
from archserve.bench.step_trace import StepTrace
from archserve.engine.ceilings import Ceilings

ALL_REDUCES_PER_LAYER = 2


def allreduce_seconds(table: list[dict], nbytes: int) -> float:
    """One all-reduce of ``nbytes`` as a decode step runs it (inside a CUDA graph): the
    faster of NCCL and the one-shot peer path, at the smallest measured size that holds
    the message."""
    for row in sorted(table, key=lambda r: r["bytes"]):
        if row["bytes"] >= nbytes:
            times = [t for t in (row["nccl_graph_us"], row.get("one_shot_us")) if t is not None]
            return min(times) * 1e-6
    largest = max((r["bytes"] for r in table), default=0)
    raise ValueError(f"no all-reduce was measured at {nbytes} bytes or more "
                     f"(the largest measured: {largest})")


def step_allreduce_seconds(table: list[dict] | None, num_layers: int, tokens: int,
                           hidden_size: int, dtype_bytes: int) -> float:
    """The all-reduces of one step of ``tokens`` tokens; none at one rank (no table)."""
    if table is None:
        return 0.0
    message = tokens * hidden_size * dtype_bytes
    return ALL_REDUCES_PER_LAYER * num_layers * allreduce_seconds(table, message)


def mean_decode_floor(trace: StepTrace, facts: ModelFacts, ceilings: Ceilings,
                      table: list[dict] | None, hidden_size: int, dtype_bytes: int
                      ) -> tuple[float, float]:
    """(memory/compute floor, all-reduce time) of a decode step, each averaged over the
    trace's decode steps; their sum is the step's floor."""
    decodes = [s for s in trace.steps if s.is_decode]
    if not decodes:
        raise ValueError("the trace has no decode step")
    memory = sum(step_floor_seconds(facts, s.work, ceilings) for s in decodes)
    reduce = sum(step_allreduce_seconds(table, facts.num_layers, s.num_tokens, hidden_size,
                                        dtype_bytes) for s in decodes)
    return memory / len(decodes), reduce / len(decodes)
