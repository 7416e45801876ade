"""The token budget of a step that carries running decodes, chosen from what a step costs.

Every streaming request waits for each step: a step that also prefills a long prompt
chunk stretches the gap between two of its tokens (inter-token latency, ITL). The budget
bounds that step (stall-free batching, as in Sarathi-Serve): it is the largest number of
tokens whose step still ends within a target ITL, by a cost model of this device and model,
measured after the warm-up has compiled and tuned every kernel:

- on GPUs, one prefill step at each of ``PROBE_LENGTHS`` tokens (and at the largest
  mixed-step graph bucket, where those are captured; a few hundred ms at start-up). A step
  that a mixed-step graph covers is timed as its replay, as it would run; a longer one
  eagerly;
- on CPUs, steps of ``CPU_PROBE_LENGTHS`` tokens only (about half a second: a 2048-token
  step alone costs seconds there). A CPU's step cost grows with every row from the first on, about
  linearly, so the last slope carries the model to longer steps. The roofline floors of
  these steps were 4.7x below the measured one-token step of the embedded model (Python and
  per-op overhead that no floor counts), which set the target ITL well under a real step;
- on other devices, the roofline floor of the ``PROBE_LENGTHS`` steps: max(matmul FLOPs /
  measured FLOP/s, weight bytes / measured bandwidth).

Between the probes the cost is interpolated linearly, and past the last one it grows at
the last segment's slope. The target is ``target_itl_ms``, or by default
``DEFAULT_ITL_FACTOR`` times the cost of a decode step of ``ANCHOR_SEQS`` sequences (fewer
if ``max_num_seqs`` is smaller): a step may carry as much prompt as costs that many such
decode steps. On a GPU that step costs about what a one-token step costs (each reads the
weights once). On a CPU every row costs from the first on (the embedded model's 16-token
step: 1.9x a one-token step measured), and 3x a one-token step left 16 running streams no
room for prompt tokens: a request arriving beside them got one prompt token a step. The
budget is rounded down to a multiple of 16, and kept within [max_num_seqs,
max_num_batched_tokens] so every running sequence can still decode in one step.

On a CPU the stall is shared (``share_stall``): with R < ANCHOR_SEQS sequences decoding, a
step may stretch each of them longer, as long as the stall they bear together,
R x (step - their decode step), stays within what ANCHOR_SEQS streams bear at the target.
There a prompt token costs about a millisecond, so a budget sized for 16 streams admits one
short prompt a step: a burst of requests (16 clients starting at once) arrived one prompt a
step beside the first few streams, every step stalling all of them (16 streams x 48/32
through HTTP: less output tok/s and a longer ITL p99 than no bound at all). The price:
a stream decoding alone may see one long gap (the embedded model: ~0.9 s) when a burst or
a long prompt arrives, instead of many short ones. On a
GPU a prompt token is nearly free up to hundreds a step, the uniform budget already admits
such a burst in a step or two, and the budget stays one number.

A step without decodes (idle engine, or only prompts in flight) may take
``max_num_batched_tokens`` (the size the activation memory was profiled for): no stream
waits on it, and fewer, larger steps bring the first token sooner. An explicit
``max_num_batched_tokens`` keeps vLLM's meaning: it is the budget of every step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from archserve.platform.decision import Decision

PROBE_LENGTHS = (1, 128, 512, 1024, 2048)
CPU_PROBE_LENGTHS = (1, 16, 64)   # ANCHOR_SEQS among them: the auto target's step, timed
CPU_PROBE_REPEATS = 5             # the fastest counts: more tries to find a quiet moment
DEFAULT_ITL_FACTOR = 3.0   # the serving-tail target: ITL P99 <= 3x TPOT P50 (docs/benchmarks.md)
BUDGET_MULTIPLE = 16      # Triton specialises integer arguments on divisibility by 16
ANCHOR_SEQS = 16          # the decode batch whose step the auto target is a multiple of


@dataclass(frozen=True)
class StepCostModel:
    """Seconds of one step against the tokens in it, from (tokens, seconds) points."""

    points: tuple[tuple[int, float], ...]     # tokens ascending, seconds non-decreasing
    source: str                               # "measured" or "roofline floors"

    def seconds(self, tokens: float) -> float:
        pts = self.points
        if tokens <= pts[0][0]:
            return pts[0][1]
        for (n0, t0), (n1, t1) in zip(pts, pts[1:], strict=False):
            if tokens <= n1:
                return t0 + (t1 - t0) * (tokens - n0) / (n1 - n0)
        return pts[-1][1] + self._last_slope() * (tokens - pts[-1][0])

    def largest_within(self, seconds: float) -> float:
        """The most tokens a step may hold and still take at most ``seconds``
        (0 when not even the smallest step does; inf when the cost stops growing)."""
        pts = self.points
        if seconds < pts[0][1]:
            return 0.0
        for (n0, t0), (n1, t1) in zip(pts, pts[1:], strict=False):
            if seconds < t1:
                return n0 + (n1 - n0) * (seconds - t0) / (t1 - t0)
        slope = self._last_slope()
        return math.inf if slope <= 0 else pts[-1][0] + (seconds - pts[-1][1]) / slope

    def _last_slope(self) -> float:
        pts = self.points
        if len(pts) == 1:
            return pts[0][1] / pts[0][0]           # one point: cost proportional to tokens
        (n0, t0), (n1, t1) = pts[-2], pts[-1]
        return (t1 - t0) / (n1 - n0)

    def describe(self) -> str:
        return ", ".join(f"{n} tok {_ms(t)} ms" for n, t in self.points)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4g}"


def cost_model(points: Sequence[tuple[int, float]], source: str) -> StepCostModel:
    """A model through ``points``; a point cheaper than a smaller one (timing noise) is
    raised to it, so more tokens never cost less."""
    if not points:
        raise ValueError("a step cost model needs at least one (tokens, seconds) point")
    ordered: list[tuple[int, float]] = []
    for n, t in sorted(points):
        if ordered and n == ordered[-1][0]:
            continue
        ordered.append((int(n), max(float(t), ordered[-1][1] if ordered else 0.0)))
    return StepCostModel(tuple(ordered), source)


def probe_lengths(limit: int, lengths: Sequence[int] = PROBE_LENGTHS) -> list[int]:
    """The probe lengths a step of at most ``limit`` tokens can have (``limit`` itself
    stands in for the longer ones)."""
    return sorted({min(n, limit) for n in lengths if limit >= 1})


def measured_cost_model(run_step: Callable[[int], None], lengths: Sequence[int],
                        device: torch.device, repeats: int = 3) -> StepCostModel:
    """Time ``run_step(n)`` (one forward of an ``n``-token step) at each length, after one
    untimed run: on CUDA the median of ``repeats`` (events); on a CPU the fastest, since
    other processes sharing its cores only ever slow a step down (at start-up beside a busy
    process a one-token step's median came out 200x its idle time) and the budget depends
    on the steps' relative costs, not on the load of the moment."""
    points = []
    for n in lengths:
        if device.type == "cuda":
            from archserve.kernels.cuda_timing import median_ms
            seconds = median_ms(lambda n=n: run_step(n), repeats, warmup=1) / 1e3
        else:
            run_step(n)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                run_step(n)
                times.append(time.perf_counter() - t0)
            seconds = min(times)
        points.append((n, seconds))
    return cost_model(points, "measured")


def floor_cost_model(weights, ceilings, lengths: Sequence[int]) -> StepCostModel:
    """The roofline floor of an ``n``-token prefill step at each length: the matmul FLOPs
    (body for every token, LM head for the one sampled row) over the matmul rate, or the
    weights read over the copy bandwidth, whichever is longer. Chunk attention is left out:
    at budget-sized chunks the linear layers dominate."""
    points = []
    for n in lengths:
        flops = 2.0 * (weights.active_params_per_token * n + weights.lm_head_params)
        points.append((n, max(flops / ceilings.matmul_flops_per_s,
                              weights.bytes_for_tokens(n) / ceilings.copy_bytes_per_s)))
    return cost_model(points, "roofline floors")


def choose_decoding_budget(model: StepCostModel, target_s: float, low: int, high: int,
                           graph_buckets: Sequence[int] = ()) -> int:
    """The largest multiple of BUDGET_MULTIPLE tokens whose step fits ``target_s``, kept
    within [low, high]. With mixed-step graphs (``graph_buckets``), a step pads up to the
    bucket above it and costs what that bucket costs: between two buckets the budget drops
    to the lower one (measured: 672 tokens replay the 768 bucket, 2 ms over the target)."""
    fits = model.largest_within(target_s)
    tokens = high if math.isinf(fits) else int(fits)
    if tokens >= BUDGET_MULTIPLE:
        tokens -= tokens % BUDGET_MULTIPLE
    if graph_buckets and tokens < max(graph_buckets):
        tokens = max((b for b in graph_buckets if b <= tokens), default=tokens)
    return max(min(low, high), min(tokens, high))


def shared_stall_budgets(model: StepCostModel, target_s: float, anchor: int, floor: int,
                         high: int, graph_buckets: Sequence[int] = ()) -> tuple[int, ...]:
    """The budgets of steps with 1 .. ``anchor``-1 decodes when the stall is shared: R
    decoding streams may together bear what ``anchor`` streams bear at ``target_s``,
    R x (step - decode step of R) <= anchor x (target_s - decode step of anchor); never
    below ``floor`` (the budget of ``anchor`` streams)."""
    slack = anchor * max(0.0, target_s - model.seconds(anchor))
    return tuple(max(floor, choose_decoding_budget(model, model.seconds(r) + slack / r,
                                                   floor, high, graph_buckets))
                 for r in range(1, anchor))


@dataclass(frozen=True)
class TokenBudget:
    max_num_batched_tokens: int     # any step; the size activations were profiled for
    decoding: int                   # a step that carries running decodes
    decision: Decision
    cost: StepCostModel | None = None     # what the budget was chosen from, if anything
    target_itl_s: float | None = None
    # A step with R < len + 1 decodes (stall shared): entry R - 1; () where one budget holds.
    decoding_by_streams: tuple[int, ...] = ()

    def to_json(self) -> dict:
        return {"max_num_batched_tokens": self.max_num_batched_tokens,
                "decoding_token_budget": self.decoding, "target_itl_s": self.target_itl_s,
                "decoding_token_budget_by_streams": list(self.decoding_by_streams),
                "cost_source": self.cost.source if self.cost else None,
                "cost_points": [list(p) for p in self.cost.points] if self.cost else None,
                "reason": self.decision.reason}


def resolve_token_budget(target_itl_ms: float | str | None, explicit: int | None, cap: int,
                         max_num_seqs: int, chunked_prefill: bool,
                         cost: Callable[[], StepCostModel],
                         graph_buckets: Sequence[int] = (),
                         share_stall: bool = False) -> TokenBudget:
    """The budgets of a step with and without decodes, and the decision that explains them.

    ``target_itl_ms`` is "auto" (DEFAULT_ITL_FACTOR decode steps of ANCHOR_SEQS), a number of ms, or
    None (no bound: the offline default); ``explicit`` is the user's
    max_num_batched_tokens; ``cost`` builds the cost model, only when one is needed;
    ``graph_buckets``: the token buckets of the captured mixed-step graphs, if any;
    ``share_stall``: fewer running streams than the anchor may each wait longer (a CPU's).
    """
    requested = "auto" if explicit is None else str(explicit)

    def unbounded(reason: str) -> TokenBudget:
        return TokenBudget(cap, cap, Decision("max_num_batched_tokens", requested,
                                              f"{cap} every step", reason))

    if explicit is not None:
        return unbounded("set by max_num_batched_tokens: the budget of every step, decodes "
                         "running or not (vLLM's meaning)")
    if target_itl_ms is None:
        return unbounded("no target ITL (the offline default: throughput, not inter-token "
                         "latency)")
    if not chunked_prefill:
        return unbounded("chunked prefill is off: a prompt is prefilled whole, so a step "
                         "with decodes cannot be bounded")
    model = cost()
    anchor = min(ANCHOR_SEQS, max_num_seqs)
    if target_itl_ms == "auto":
        target_s = DEFAULT_ITL_FACTOR * model.seconds(anchor)
        target = (f"target ITL {_ms(target_s)} ms ({DEFAULT_ITL_FACTOR:g}x a decode step of "
                  f"{anchor} sequences)")
    else:
        target_s = float(target_itl_ms) / 1e3
        target = f"target ITL {_ms(target_s)} ms (target_itl_ms)"
    decoding = choose_decoding_budget(model, target_s, max_num_seqs, cap, graph_buckets)
    by_streams = (shared_stall_budgets(model, target_s, anchor, decoding, cap, graph_buckets)
                  if share_stall else ())
    reason = (f"{target}; step cost ({model.source}): {model.describe()}; a step with "
              f"decodes takes at most {decoding} tokens (~{_ms(model.seconds(decoding))} ms; "
              + ("a CUDA graph bucket; " if decoding in graph_buckets else "")
              + f"kept within [max_num_seqs={max_num_seqs}, {cap}])"
              + (f", with fewer than {anchor} decoding the stall shared (R streams x the "
                 f"stall <= {anchor} x the target's): {_by_streams(by_streams)}"
                 if by_streams else "")
              + f"; without decodes, {cap} (first tokens sooner)")
    chosen = (f"{decoding} with decodes ({by_streams[0]} with 1), {cap} without" if by_streams
              else f"{decoding} with decodes, {cap} without")
    return TokenBudget(cap, decoding, Decision("max_num_batched_tokens", requested, chosen,
                                               reason), model, target_s, by_streams)


def _by_streams(budgets: Sequence[int]) -> str:
    """'1: 768, 2: 400, ...' for the stream counts where the budget changes."""
    shown = [(r, b) for r, b in enumerate(budgets, start=1) if r == 1 or b != budgets[r - 2]]
    return ", ".join(f"{r} decoding {b} tokens" for r, b in shown)


def itl_target_decision(platform: str) -> Decision:
    """What `serve`'s default target ITL is on a platform (cuda, rocm, xpu, cpu) and where
    its step cost comes from, for explain and doctor (the start-up prints the numbers)."""
    if platform == "cpu":
        source = (f"measured at start-up: steps of {', '.join(map(str, CPU_PROBE_LENGTHS))} "
                  f"tokens, the fastest of {CPU_PROBE_REPEATS} (longer steps by the last slope); with fewer "
                  f"than {ANCHOR_SEQS} sequences decoding the stall is shared, R x the stall "
                  f"<= {ANCHOR_SEQS} x the target's")
    elif platform in ("cuda", "rocm"):
        source = (f"measured at start-up: prefill steps of "
                  f"{', '.join(map(str, PROBE_LENGTHS))} tokens, the median of 3")
    else:
        source = ("the roofline floors of those steps (matmul FLOP/s and copy bandwidth "
                  "measured at start-up), not timed steps")
    return Decision("target ITL (serve)", "auto",
                    f"{DEFAULT_ITL_FACTOR:g}x a decode step of {ANCHOR_SEQS} sequences",
                    f"step cost {source}; steps carrying decodes take the most tokens that "
                    f"fit; `archserve prepare` prints the target and budget in ms and tokens")


def runner_cost_model(runner, limit: int) -> StepCostModel:
    """The step cost model of a warmed-up runner, for steps of at most ``limit`` tokens:
    measured on CUDA and CPUs (short steps only there), the roofline floors elsewhere. With
    mixed-step graphs the largest bucket is probed too: there the cost jumps from a replay
    to an eager step."""
    limit = min(limit, runner.max_model_len)
    if runner.device.type == "cpu":
        return measured_cost_model(runner.run_prefill_probe,
                                   probe_lengths(limit, CPU_PROBE_LENGTHS), runner.device,
                                   CPU_PROBE_REPEATS)
    lengths = sorted({*probe_lengths(limit),
                      *(b for b in mixed_graph_buckets_of(runner)[-1:] if b <= limit)})
    if runner.device.type == "cuda":
        return measured_cost_model(runner.run_prefill_probe, lengths, runner.device)
    from archserve.engine.ceilings import load_or_measure
    return floor_cost_model(runner.step_weights, load_or_measure(runner.device), lengths)


def mixed_graph_buckets_of(runner) -> list[int]:
    """The token buckets a step with a prompt chunk replays: its runner's captured
    mixed-step graphs ([] without them, and where they replay only steps of a few tokens a
    sequence, an MLA target's verification steps: a prompt chunk runs eagerly there)."""
    graphs = runner.mixed_graphs
    if graphs is None or graphs.max_query_len is not None:
        return []
    return list(graphs.set.sizes)
