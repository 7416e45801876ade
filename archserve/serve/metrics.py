"""Prometheus metrics of one server, in its own registry, named like vLLM's (``archserve:``).

Those vLLM also has are exported a second time under its own names (``vllm:``, with its
``model_name`` label: ``VLLM_ALIASES``), so a dashboard or autoscaler built for vLLM reads
archserve unchanged.

Counters and histograms are fed from the engine thread (``observe_step`` after every
step, ``observe_abort`` for requests ended early); gauges and the prefix-cache counters
are read from the engine when Prometheus scrapes, so they are never stale.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from archserve.engine.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
                    80.0, 160.0, 640.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                 1.0, 2.5, 5.0, 10.0)


class _EngineGauges:
    """A collector that reads the engine's queue and KV cache state at scrape time."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def collect(self):
        stats = self.engine.stats()
        pool = self.engine.block_pool
        for name, doc, value in (
            ("num_requests_running", "Requests in the running batch.", stats["num_running"]),
            ("num_requests_waiting", "Requests waiting to be scheduled.", stats["num_waiting"]),
            ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).",
             stats["kv_usage"]),
            ("kv_cache_used_blocks", "KV cache blocks held by requests.", stats["num_used_blocks"]),
            ("kv_cache_total_blocks", "KV cache blocks in the pool.", stats["num_blocks"]),
        ):
            yield GaugeMetricFamily(f"archserve:{name}", doc, value=value)
        yield from _device_memory_gauges(self.engine.runner.device)
        yield from _self_check_gauges(getattr(self.engine.report, "self_check", None))
        yield CounterMetricFamily("archserve:prefix_cache_queries",
                                  "Prompt tokens looked up in the prefix cache.",
                                  value=pool.prefix_cache_queries)
        yield CounterMetricFamily("archserve:prefix_cache_hits",
                                  "Prompt tokens found in the prefix cache.",
                                  value=pool.prefix_cache_hits)
        yield from _spec_decode_counters(getattr(self.engine, "speculator", None))
        yield from _lora_info(self.engine)


def _lora_info(engine):
    """vLLM's LoRA gauge, where the engine serves adapters: the adapters of running and of
    waiting requests (names, comma-separated) and max_lora as labels; the value is the time
    of the scrape, as vLLM's."""
    if getattr(engine, "lora", None) is None:
        return
    import time

    def names(seqs) -> str:
        return ",".join(sorted({s.lora.request.lora_name for s in list(seqs)
                                if s.lora is not None}))

    family = GaugeMetricFamily("archserve:lora_requests_info", "Running stats on LoRA requests.",
                               labels=["max_lora", "running_lora_adapters",
                                       "waiting_lora_adapters"])
    family.add_metric([str(engine.lora.max_loras), names(engine.scheduler.running),
                       names(engine.scheduler.waiting)], time.time())
    yield family


def _spec_decode_counters(speculator):
    """vLLM's speculative decoding counters, when the engine speculates. The mean
    acceptance length is 1 + accepted / drafts; position i's acceptance rate is
    accepted_per_pos{position=i} / drafts."""
    if speculator is None:
        return
    stats = speculator.stats
    for name, doc, value in (
        ("spec_decode_num_drafts", "Sequences whose drafts a step verified.", stats.num_drafts),
        ("spec_decode_num_draft_tokens", "Draft tokens verified.", stats.num_draft_tokens),
        ("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
         stats.num_accepted_tokens),
    ):
        yield CounterMetricFamily(f"archserve:{name}", doc, value=value)
    per_pos = CounterMetricFamily("archserve:spec_decode_num_accepted_tokens_per_pos",
                                  "Draft tokens accepted, by position in the draft.",
                                  labels=["position"])
    for position, count in enumerate(stats.accepted_per_pos):
        per_pos.add_metric([str(position)], count)
    yield per_pos


def _self_check_gauges(check):
    """The start-up roofline self-check (engine/self_check.py), when it ran."""
    if check is None:
        return
    for name, doc, value in (
        ("roofline_self_check_ratio", "Batch-1 decode step floor / measured time at start-up "
         "(1 = at the roofline).", check.ratio),
        ("roofline_self_check_step_seconds", "Measured batch-1 decode step at start-up.",
         check.step_ms / 1e3),
        ("roofline_self_check_floor_seconds", "Weight bytes of a decode step over the "
         "measured copy bandwidth.", check.floor_ms / 1e3),
        ("roofline_self_check_flagged", "1 when the step ran below half its floor's speed "
         "(likely a fallback path).", float(check.flagged)),
    ):
        yield GaugeMetricFamily(f"archserve:{name}", doc, value=value)


def _device_memory_gauges(device):
    """Memory held on the engine's device now, and its high-water mark since start.

    On CUDA: bytes reserved by torch's caching allocator (weights, KV cache, activations);
    on a CPU: the server process's resident set, so the gauges exist on every device.
    """
    import resource

    import torch

    if device.type == "cuda":
        used = torch.cuda.memory_reserved(device)
        peak = torch.cuda.max_memory_reserved(device)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux: KiB
        try:
            with open("/proc/self/statm") as f:
                used = int(f.read().split()[1]) * resource.getpagesize()
        except OSError:   # not Linux: the peak is the best figure there is
            used = peak
        peak = max(peak, used)   # two sources, sampled at slightly different times
    for name, doc, value in (
        ("device_memory_used_bytes", "Device memory held by the engine now.", used),
        ("device_memory_peak_bytes", "High-water mark of device memory held.", peak),
    ):
        family = GaugeMetricFamily(f"archserve:{name}", doc, labels=["device"])
        family.add_metric([str(device)], float(value))
        yield family


# archserve's metrics that vLLM exports with the same meaning -> vLLM's name for them. Our
# time_per_output_token_seconds observes one mean a request: vLLM's histogram of that is
# request_time_per_output_token_seconds (its time_per_output_token_seconds, one
# observation a token, has no counterpart here).
VLLM_ALIASES = {name: name for name in (
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
    "prefix_cache_queries", "prefix_cache_hits", "prompt_tokens", "generation_tokens",
    "request_success", "time_to_first_token_seconds", "e2e_request_latency_seconds",
    "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos",
    "lora_requests_info")}
VLLM_ALIASES["time_per_output_token_seconds"] = "request_time_per_output_token_seconds"


class _VllmAliases:
    """The ``VLLM_ALIASES`` families of ``source``, renamed ``vllm:...`` and labelled with
    the served model's name, as vLLM labels its own."""

    def __init__(self, source: CollectorRegistry, metrics: ServerMetrics) -> None:
        self.source, self.metrics = source, metrics

    def collect(self):
        for family in self.source.collect():
            base = family.name.removeprefix("archserve:")
            if base not in VLLM_ALIASES:
                continue
            name = f"vllm:{VLLM_ALIASES[base]}"
            alias = Metric(name, family.documentation, family.type)
            for sample in family.samples:
                alias.add_sample(name + sample.name.removeprefix(family.name),
                                 {**sample.labels, "model_name": self.metrics.model_name},
                                 sample.value, sample.timestamp)
            yield alias


class ServerMetrics:
    def __init__(self, engine) -> None:
        self.model_name = ""     # set by the serving context (the first served name)
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.prompt_tokens = Counter("archserve:prompt_tokens", "Prefill tokens processed.",
                                     registry=r)
        self.generation_tokens = Counter("archserve:generation_tokens",
                                         "Generated tokens.", registry=r)
        self.request_success = Counter("archserve:request_success",
                                       "Requests ended, by finish reason.",
                                       ["finished_reason"], registry=r)
        self.http_requests = Counter("archserve:http_requests", "HTTP responses, by status.",
                                     ["status"], registry=r)
        self.ttft = Histogram("archserve:time_to_first_token_seconds",
                              "Arrival to first generated token.", buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.tpot = Histogram("archserve:time_per_output_token_seconds",
                              "Mean time between output tokens of a request.",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("archserve:e2e_request_latency_seconds",
                             "Arrival to finish.", buckets=_LATENCY_BUCKETS, registry=r)
        r.register(_EngineGauges(engine))
        self.aliases = CollectorRegistry()
        self.aliases.register(_VllmAliases(r, self))
        self._seen_tokens: dict[str, int] = {}     # request id -> generated tokens counted
        self._lock = threading.Lock()

    def observe_step(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            for out in outputs:
                rid = out.request_id
                if rid not in self._seen_tokens:
                    self._seen_tokens[rid] = 0
                    self.prompt_tokens.inc(len(out.prompt_token_ids))
                total = sum(c.num_generated_tokens for c in out.outputs)
                self.generation_tokens.inc(max(0, total - self._seen_tokens[rid]))
                self._seen_tokens[rid] = total
                if out.finished:
                    del self._seen_tokens[rid]
                    self._observe_finished(out)

    def _observe_finished(self, out: RequestOutput) -> None:
        reason = next((c.finish_reason for c in out.outputs if c.finish_reason), "stop")
        self.request_success.labels(finished_reason=reason).inc()
        m = out.metrics
        if m is None or m.finished_time is None:
            return
        self.e2e.observe(max(0.0, m.finished_time - m.arrival_time))
        if m.first_token_time is not None:
            self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
            most = max((c.num_generated_tokens for c in out.outputs), default=0)
            if most > 1:
                self.tpot.observe(max(0.0, m.finished_time - m.first_token_time) / (most - 1))

    def observe_abort(self, request_id: str) -> None:
        with self._lock:
            self._seen_tokens.pop(request_id, None)
            self.request_success.labels(finished_reason="abort").inc()

    def observe_http(self, status: int) -> None:
        self.http_requests.labels(status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry) + generate_latest(self.aliases)
