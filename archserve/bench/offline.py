"""Offline throughput: every request queued at once, the engine stepped to completion."""

from __future__ import annotations

from dataclasses import dataclass, field

from archserve.bench.progress import progress_bar
from archserve.bench.stats import rate, summarize
from archserve.bench.step_trace import StepTrace, trace_steps
from archserve.bench.workload import BenchRequest


@dataclass
class ThroughputResult:
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float
    # Per request, seconds from its arrival to its first token (all arrive at the start).
    ttft_s: list[float] = field(default_factory=list)

    @property
    def output_tokens_per_s(self) -> float:
        return rate(self.output_tokens, self.elapsed_s)

    @property
    def total_tokens_per_s(self) -> float:
        return rate(self.prompt_tokens + self.output_tokens, self.elapsed_s)

    @property
    def requests_per_s(self) -> float:
        return rate(self.num_requests, self.elapsed_s)

    def to_json(self) -> dict:
        return {"num_requests": self.num_requests, "prompt_tokens": self.prompt_tokens,
                "output_tokens": self.output_tokens, "elapsed_s": self.elapsed_s,
                "output_tokens_per_s": self.output_tokens_per_s,
                "total_tokens_per_s": self.total_tokens_per_s,
                "requests_per_s": self.requests_per_s,
                "ttft_ms": ({k: v * 1e3 if k != "count" else v
                             for k, v in summarize(self.ttft_s).items()}
                            if self.ttft_s else None)}


def bench_sampling_params(output_len: int, ignore_eos: bool = True, **overrides):
    from archserve.engine.sampling_params import RequestOutputKind, SamplingParams
    # Greedy, no detokenizing and one output per request at its end (as LLM.generate):
    # the bench measures the engine, not text assembly or per-step output copies.
    options = dict(max_tokens=output_len, temperature=0.0, ignore_eos=ignore_eos,
                   detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
    return SamplingParams(**{**options, **overrides})


def warm_up(engine, request: BenchRequest) -> None:
    """One short request first, so one-time costs (kernel compiles, allocator growth)
    stay out of the measurement. Its prompt fills no KV block, so nothing it leaves in
    the prefix cache can shorten a measured prefill."""
    engine.add_request("bench-warmup", request.prompt_token_ids[:1] * 4, bench_sampling_params(2))
    while engine.has_unfinished_requests():
        engine.step()


def run_offline(engine, requests: list[BenchRequest], ignore_eos: bool = True,
                show_progress: bool = True) -> tuple[ThroughputResult, StepTrace]:
    """Queue every request, step until all finish; returns throughput and the step trace."""
    import time

    warm_up(engine, requests[0])
    with progress_bar(show_progress) as bar, trace_steps(engine) as trace:
        task = bar.add_task("archserve", total=len(requests))
        t0 = time.perf_counter()
        for i, req in enumerate(requests):
            engine.add_request(f"bench-{i}", req.prompt_token_ids,
                               bench_sampling_params(req.output_len, ignore_eos))
        output_tokens, ttft = 0, []
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    output_tokens += sum(len(c.token_ids) for c in out.outputs)
                    metrics = out.metrics
                    if metrics is not None and metrics.first_token_time is not None:
                        ttft.append(metrics.first_token_time - metrics.arrival_time)
                    bar.advance(task)
        elapsed = time.perf_counter() - t0
    prompt_tokens = sum(r.input_len for r in requests)
    return ThroughputResult(len(requests), prompt_tokens, output_tokens, elapsed, ttft), trace
