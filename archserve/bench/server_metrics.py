"""Polling a server's Prometheus /metrics during a run: KV cache usage, running
requests and device memory over time.

Names are matched by suffix after the namespace, so archserve (``archserve:``) and
vLLM-style servers (``vllm:``) both work; a metric a server lacks stays None.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

# our field -> metric names after the "namespace:" prefix, first found wins
_WANTED = {
    "kv_cache_usage": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    "num_running": ("num_requests_running",),
    "num_waiting": ("num_requests_waiting",),
    "memory_used_bytes": ("device_memory_used_bytes", "gpu_memory_used_bytes"),
    "memory_peak_bytes": ("device_memory_peak_bytes", "gpu_memory_peak_bytes"),
    "spec_decode_num_drafts": ("spec_decode_num_drafts_total",),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens_total",),
    "spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens_total",),
}


@dataclass(frozen=True)
class MetricsSample:
    t: float                         # seconds since the run started
    kv_cache_usage: float | None     # 0..1
    num_running: float | None
    num_waiting: float | None
    memory_used_bytes: float | None
    memory_peak_bytes: float | None
    spec_decode_num_drafts: float | None = None          # counters since the server started
    spec_decode_num_draft_tokens: float | None = None
    spec_decode_num_accepted_tokens: float | None = None


def parse_metrics(text: str) -> dict[str, float]:
    """Metric name after its namespace -> value (labelled series summed).

    A server may export one metric under two namespaces (archserve exports its
    ``archserve:`` families and vLLM's ``vllm:`` aliases of them): the first namespace
    seen is read, the other is the same figure again and is not added to it."""
    values: dict[str, float] = {}
    namespace_of: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            namespace, _, short = sample.name.rpartition(":")
            if namespace_of.setdefault(short, namespace) != namespace:
                continue
            values[short] = values.get(short, 0.0) + float(sample.value)
    return values


def sample_from(values: dict[str, float], t: float) -> MetricsSample:
    picked = {}
    for field_name, names in _WANTED.items():
        picked[field_name] = next((values[n] for n in names if n in values), None)
    return MetricsSample(t=t, **picked)


class MetricsPoller:
    """Scrapes ``{url}/metrics`` every ``interval_s`` until stopped; failures are skipped."""

    def __init__(self, client: httpx.AsyncClient, url: str, interval_s: float = 0.25) -> None:
        self.client, self.url, self.interval_s = client, url.rstrip("/") + "/metrics", interval_s
        self.samples: list[MetricsSample] = []
        self._task: asyncio.Task | None = None
        self._t0 = 0.0

    async def poll_once(self) -> None:
        try:
            response = await self.client.get(self.url, timeout=5.0)
            if response.status_code == 200:
                self.samples.append(sample_from(parse_metrics(response.text),
                                                time.perf_counter() - self._t0))
        except (httpx.HTTPError, ValueError):
            pass

    async def _loop(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.interval_s)

    def start(self, t0: float) -> None:
        self._t0 = t0
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self.poll_once()       # one last sample after the run


def summarize_samples(samples: list[MetricsSample]) -> dict:
    def values(name: str) -> list[float]:
        return [v for s in samples if (v := getattr(s, name)) is not None]

    kv, used, peak = values("kv_cache_usage"), values("memory_used_bytes"), \
        values("memory_peak_bytes")
    return {
        "num_samples": len(samples),
        "kv_cache_usage_max": max(kv) if kv else None,
        "kv_cache_usage_mean": sum(kv) / len(kv) if kv else None,
        "memory_peak_bytes": max(peak + used) if peak or used else None,
        "spec_decode": _spec_decode_over(samples),
        "timeline": [asdict(s) for s in samples],
    }


def _spec_decode_over(samples: list[MetricsSample]) -> dict | None:
    """The speculative decoding figures of the run, from the counters' first and last
    samples (None when the server does not speculate)."""
    counted = [s for s in samples if s.spec_decode_num_drafts is not None]
    if not counted:
        return None
    first, last = counted[0], counted[-1]
    drafts = last.spec_decode_num_drafts - first.spec_decode_num_drafts
    draft_tokens = last.spec_decode_num_draft_tokens - first.spec_decode_num_draft_tokens
    accepted = last.spec_decode_num_accepted_tokens - first.spec_decode_num_accepted_tokens
    return {"num_drafts": drafts, "num_draft_tokens": draft_tokens,
            "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "acceptance_rate_per_pos": []}
