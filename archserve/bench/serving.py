"""Serving benchmark against any OpenAI-compatible server (streaming /v1/completions).

Requests start at a fixed concurrency (a new one as soon as one finishes) or as a
Poisson process at ``request_rate`` per second (seeded), optionally also capped by
concurrency. Per request: TTFT (send -> first streamed chunk), inter-token latencies
(gaps between chunks), TPOT ((end - first chunk) / (output tokens - 1)) and end-to-end
latency. The server's /metrics is polled throughout (see ``server_metrics``).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field

import httpx

from archserve.bench.progress import progress_bar
from archserve.bench.server_metrics import MetricsPoller, summarize_samples
from archserve.bench.stats import rate, summarize
from archserve.bench.workload import BenchRequest


@dataclass
class RequestTiming:
    prompt_tokens: int
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class ServingResult:
    concurrency: int | None
    request_rate: float
    timings: list[RequestTiming]
    elapsed_s: float
    metrics: dict
    model: str | None = None    # the name the requests asked for (the server's, by default)

    def to_json(self) -> dict:
        ok = [t for t in self.timings if t.error is None]
        output = sum(t.output_tokens for t in ok)
        prompt = sum(t.prompt_tokens for t in ok)
        ms = lambda xs: {k: (v * 1000 if k != "count" else v)  # noqa: E731
                         for k, v in summarize(xs).items()}
        return {
            "model": self.model,
            "concurrency": self.concurrency,
            "request_rate": None if math.isinf(self.request_rate) else self.request_rate,
            "completed": len(ok), "failed": len(self.timings) - len(ok),
            "errors": sorted({t.error for t in self.timings if t.error})[:5],
            "elapsed_s": self.elapsed_s,
            "prompt_tokens": prompt, "output_tokens": output,
            "output_tokens_per_s": rate(output, self.elapsed_s),
            "total_tokens_per_s": rate(prompt + output, self.elapsed_s),
            "requests_per_s": rate(len(ok), self.elapsed_s),
            "ttft_ms": ms([t.ttft_s for t in ok if t.ttft_s is not None]),
            "tpot_ms": ms([t.tpot_s for t in ok if t.tpot_s is not None]),
            "itl_ms": ms([x for t in ok for x in t.itl_s]),
            "e2e_ms": ms([t.e2e_s for t in ok if t.e2e_s is not None]),
            "server": self.metrics,
        }


async def discover_model_name(client: httpx.AsyncClient, url: str) -> str | None:
    """The first model the server lists, which OpenAI-compatible servers accept.

    Raises ConnectionError when nothing answers at ``url``: a benchmark of a server that
    is not up is an error, not a run of failed requests.
    """
    try:
        response = await client.get(f"{url}/v1/models", timeout=10.0)
    except httpx.TransportError as exc:
        raise ConnectionError(f"no server answers at {url} ({type(exc).__name__}: {exc}); "
                              f"start one with `archserve serve` or pass --url") from None
    try:
        data = response.json().get("data") or []
        return data[0]["id"] if data else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


async def send_one(client: httpx.AsyncClient, url: str, model: str | None,
                   request: BenchRequest, ignore_eos: bool) -> RequestTiming:
    body = {"prompt": request.prompt_token_ids, "max_tokens": request.output_len,
            "temperature": 0.0, "stream": True, "ignore_eos": ignore_eos,
            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    timing = RequestTiming(prompt_tokens=request.input_len)
    chunks = 0
    t0 = last = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                timing.error = f"HTTP {response.status_code}: {response.text[:200]}"
                return timing
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                event = json.loads(payload)
                if "error" in event:
                    timing.error = str(event["error"])[:200]
                    return timing
                now = time.perf_counter()
                if event.get("choices"):
                    if timing.ttft_s is None:
                        timing.ttft_s = now - t0
                    else:
                        timing.itl_s.append(now - last)
                    last = now
                    chunks += 1
                usage = event.get("usage")
                if usage:
                    timing.output_tokens = int(usage.get("completion_tokens", 0))
    except (httpx.HTTPError, ValueError) as exc:
        timing.error = f"{type(exc).__name__}: {exc}"[:200]
        return timing
    timing.e2e_s = time.perf_counter() - t0
    if timing.output_tokens == 0:
        timing.output_tokens = chunks     # a server without usage: one chunk per token
    return timing


def arrival_gaps(num: int, request_rate: float, seed: int) -> list[float]:
    """Seconds to wait before each request: exponential gaps (Poisson), or all zero."""
    if math.isinf(request_rate):
        return [0.0] * num
    if request_rate <= 0:
        raise ValueError(f"request rate must be > 0, got {request_rate}")
    rng = random.Random(seed)
    return [rng.expovariate(request_rate) for _ in range(num)]


async def run_serving_async(url: str, requests: list[BenchRequest], concurrency: int | None,
                            request_rate: float = math.inf, ignore_eos: bool = True,
                            model: str | None = None, seed: int = 0,
                            metrics_interval_s: float = 0.25, api_key: str | None = None,
                            show_progress: bool = True) -> ServingResult:
    url = url.rstrip("/").removesuffix("/v1")
    if concurrency is None and math.isinf(request_rate):
        concurrency = len(requests)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=(concurrency or len(requests)) + 4)
    timeout = httpx.Timeout(600.0, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:
        listed = await discover_model_name(client, url)      # raises if nothing answers
        model = model or listed
        gate = asyncio.Semaphore(concurrency or len(requests))
        poller = MetricsPoller(client, url, metrics_interval_s)
        with progress_bar(show_progress) as bar:
            task = bar.add_task(f"serving (concurrency {concurrency or '-'})",
                                total=len(requests))

            async def one(req: BenchRequest) -> RequestTiming:
                async with gate:
                    timing = await send_one(client, url, model, req, ignore_eos)
                bar.advance(task)
                return timing

            t0 = time.perf_counter()
            poller.start(t0)
            pending = []
            for gap, req in zip(arrival_gaps(len(requests), request_rate, seed), requests, strict=True):
                if gap:
                    await asyncio.sleep(gap)
                pending.append(asyncio.create_task(one(req)))
            timings = await asyncio.gather(*pending)
            elapsed = time.perf_counter() - t0
            await poller.stop()
    return ServingResult(concurrency, request_rate, list(timings), elapsed,
                         summarize_samples(poller.samples), model)


def run_serving(url: str, requests: list[BenchRequest], concurrency: int | None,
                **kwargs) -> ServingResult:
    return asyncio.run(run_serving_async(url, requests, concurrency, **kwargs))
