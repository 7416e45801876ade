"""One bench run from options to a result dict: the library behind `archserve bench`.

``run_bench(BenchOptions(...))`` returns the JSON-ready result; the CLI only parses
flags, prints and writes files.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field

from archserve.bench.workload import (
    BenchRequest,
    dataset_requests,
    random_requests,
    special_token_ids,
)

log = logging.getLogger("archserve.bench")


PEERS = ("transformers", "llama.cpp")


@dataclass
class BenchOptions:
    mode: str = "offline"                       # offline | serve
    model: str | None = None                    # None: the embedded default model
    load_format: str = "auto"
    dtype: str = "auto"
    quantization: str | None = None             # None: the checkpoint's own
    num_prompts: int = 100
    input_len: int = 128
    output_len: int = 128
    random_range: float = 0.0
    seed: int = 0
    dataset: str | None = None
    ignore_eos: bool = True
    max_model_len: int | None = None
    max_num_seqs: int = 256
    enforce_eager: bool = False
    compilation_config: str | None = None        # vLLM's JSON (engine/compilation_config.py)
    speculative_config: str | None = None        # vLLM's JSON (engine/speculative_config.py)
    tensor_parallel_size: int = 1
    max_num_batched_tokens: int | None = None    # None: the engine's default
    target_itl_ms: float | str | None = None     # offline: no ITL bound unless asked
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    distributed_executor_backend: str = "mp"
    async_scheduling: bool | None = None  # None: the engine's default for the device
    emulate_device: str | None = None     # a profile run on this GPU (platform/emulation.py)
    peer: str | None = None                     # None | one of PEERS
    url: str = "http://127.0.0.1:8000"
    api_key: str | None = None
    concurrency: list[int] = field(default_factory=list)
    request_rate: float = math.inf
    metrics_interval_s: float = 0.25
    plots_dir: str | None = None
    show_progress: bool = True

    def validate(self) -> None:
        if self.mode not in ("offline", "serve"):
            raise ValueError(f"mode must be offline or serve, got {self.mode!r}")
        if self.peer not in (None, *PEERS):
            raise ValueError(f"--peer is one of {', '.join(PEERS)}, got {self.peer!r}")
        if self.peer and self.mode != "offline":
            raise ValueError("--peer runs in the same process: use it with --mode offline")
        if any(c < 1 for c in self.concurrency):
            raise ValueError(f"concurrency levels must be >= 1, got {self.concurrency}")


def peer_gguf(options: BenchOptions, model_path: str) -> str | None:
    """The GGUF file llama.cpp reads (None for another peer); ValueError, before archserve
    runs, where llama.cpp cannot be the peer."""
    if options.peer != "llama.cpp":
        return None
    from archserve.bench.peer_llama_cpp import llama_cpp_available
    from archserve.loader.gguf_loader import find_gguf_file
    gguf_path = find_gguf_file(model_path)
    if gguf_path is None or options.load_format == "dummy":
        raise ValueError("--peer llama.cpp compares a GGUF model's real weights; "
                         f"{model_path} is not a GGUF file")
    reason = llama_cpp_available()
    if reason:
        raise ValueError(f"--peer llama.cpp: {reason}")
    return gguf_path


def build_requests(options: BenchOptions, tokenizer, vocab_size: int) -> list[BenchRequest]:
    if options.dataset:
        return dataset_requests(options.dataset, tokenizer, options.output_len,
                                options.num_prompts)
    return random_requests(options.num_prompts, options.input_len, options.output_len,
                           vocab_size, special_token_ids(tokenizer), options.random_range,
                           options.seed)


def check_fits(requests: list[BenchRequest], max_model_len: int) -> None:
    longest = max(r.input_len + r.output_len for r in requests)
    if longest > max_model_len:
        raise ValueError(f"a request needs {longest} tokens (prompt + output) but the context "
                         f"length is {max_model_len}; lower --input-len/--output-len or raise "
                         f"--max-model-len")


def _workload_json(options: BenchOptions, requests: list[BenchRequest]) -> dict:
    return {"num_requests": len(requests), "input_len": options.input_len,
            "output_len": options.output_len, "random_range": options.random_range,
            "seed": options.seed, "dataset": options.dataset, "ignore_eos": options.ignore_eos,
            "prompt_tokens_mean": sum(r.input_len for r in requests) / len(requests),
            "output_len_mean": sum(r.output_len for r in requests) / len(requests)}


def run_bench(options: BenchOptions) -> dict:
    options.validate()
    return run_offline_bench(options) if options.mode == "offline" else \
        run_serving_bench(options)


# -- offline ---------------------------------------------------------------------------
def run_offline_bench(options: BenchOptions) -> dict:
    from archserve.bench.offline import run_offline
    from archserve.bench.roofline import analyze_within_ceilings, model_facts
    from archserve.engine.ceilings import load_or_measure, store
    from archserve.engine.config import EngineConfig
    from archserve.engine.llm_engine import LLMEngine
    from archserve.kernels.jit_watch import compiled_after_startup, compiled_since
    from archserve.loader.loader import resolve_model_path
    from archserve.loader.tokenizer import dummy_without_tokenizer
    model_path = resolve_model_path(options.model)
    gguf_path = peer_gguf(options, model_path)
    no_tokenizer = dummy_without_tokenizer(model_path, options.load_format)
    engine = LLMEngine(EngineConfig(
        model=model_path, dtype=options.dtype, load_format=options.load_format,
        quantization=options.quantization,
        max_model_len=options.max_model_len, max_num_seqs=options.max_num_seqs,
        enforce_eager=options.enforce_eager, async_scheduling=options.async_scheduling,
        compilation_config=options.compilation_config,
        speculative_config=options.speculative_config,
        seed=options.seed, tensor_parallel_size=options.tensor_parallel_size,
        distributed_executor_backend=options.distributed_executor_backend,
        max_num_batched_tokens=options.max_num_batched_tokens,
        target_itl_ms=options.target_itl_ms,
        enable_prefix_caching=options.enable_prefix_caching,
        enable_chunked_prefill=options.enable_chunked_prefill,
        skip_tokenizer_init=no_tokenizer, emulate_device=options.emulate_device))
    vocab = engine.model_config.vocab_size
    if engine.tokenizer is not None:
        vocab = min(len(engine.tokenizer), vocab)
    requests = build_requests(options, engine.tokenizer, vocab)
    check_fits(requests, engine.max_model_len)
    device, dtype = engine.runner.device, engine.report.dtype
    ceilings = load_or_measure(device)
    compiled_before = compiled_after_startup()
    spec_before = spec_decode_counts(engine)
    throughput, trace = run_offline(engine, requests, options.ignore_eos,
                                    options.show_progress)
    spec = spec_decode_summary(spec_before, spec_decode_counts(engine))
    # Kernel variants the start-up did not compile: the run waited for them.
    compiled = compiled_since(compiled_before)
    if engine.cpu_threads is not None:
        # Re-measured ceilings and the peer run with torch's own thread count.
        engine.cpu_threads.restore()
    facts = model_facts(engine)

    def remeasure():  # noqa: ANN202 - Ceilings
        return load_or_measure(device, refresh=True)
    roofline, ceilings = analyze_within_ceilings(trace, facts, ceilings, remeasure)
    if ceilings.raised_by_run > 1:
        store(device, ceilings)        # the device reaches these rates: keep them
    result = {
        "mode": "offline", "model": options.model or os.path.basename(model_path),
        "load_format": options.load_format, "device": engine.report.device.describe(),
        "dtype": str(dtype).removeprefix("torch."),
        "attention_backend": engine.report.attention.name,
        "async_scheduling": engine.config.async_scheduling,
        # The step budget in force (the flag's value, or the engine's default).
        "max_num_batched_tokens": engine.scheduler.config.max_num_batched_tokens,
        "decoding_token_budget": engine.scheduler.config.budget_while_decoding,
        "enable_prefix_caching": engine.config.enable_prefix_caching,
        "enable_chunked_prefill": engine.config.enable_chunked_prefill,
        **_workload_json(options, requests),
        **throughput.to_json(),
        "roofline_efficiency": roofline.roofline_efficiency, "mbu": roofline.mbu,
        "roofline": roofline.to_json(), "ceilings": ceilings.to_json(),
        "ceilings_text": ceilings.describe(),
        "model_facts": vars(facts).copy(), "plots": [],
        "compiled_while_running": compiled,
        # Host time per decode step by phase, by the clock (bench/step_trace.py).
        "host_ms_per_decode_step": trace.host_ms_per_decode_step(),
        # What the start-up chose (routes, tiles, graphs, budgets): which code made the row.
        "decisions": {d.what: d.chosen for d in engine.report.decisions},
        "spec_decode": spec,
    }
    if options.plots_dir:
        result["plots"].append(_step_plot(trace, facts, ceilings, options.plots_dir))
    if options.peer == "transformers":
        del engine                     # the peer needs the memory the KV pool holds
        from archserve.engine.heap import free_dropped_engines
        free_dropped_engines(device.type)
        from archserve.bench.peer_transformers import run_peer
        peer, method = run_peer(model_path, options.load_format, dtype, device, requests,
                                options.ignore_eos, options.max_num_seqs, options.show_progress)
        result["peer"] = {"name": "transformers", "method": method, **peer.to_json()}
    if options.peer == "llama.cpp":
        eos = set(engine.eos_token_ids)
        del engine                     # the peer needs the cores, not archserve's threads
        from archserve.bench.peer_llama_cpp import run_llama_cpp_peer
        peer, method = run_llama_cpp_peer(gguf_path, requests, options.ignore_eos,
                                          options.max_num_seqs, eos,
                                          show_progress=options.show_progress)
        result["peer"] = {"name": "llama.cpp", "method": method, **peer.to_json()}
    if options.peer is not None:
        result["speedup_vs_peer"] = (throughput.output_tokens_per_s
                                     / peer.output_tokens_per_s)
    return result


def spec_decode_counts(engine) -> dict | None:
    """The engine's speculative decoding counters now (None when it does not speculate)."""
    speculator = getattr(engine, "speculator", None)
    return None if speculator is None else speculator.stats.as_dict()


def spec_decode_summary(before: dict | None, after: dict | None) -> dict | None:
    """vLLM's speculative decoding figures over a run, from the counters before and after
    it: drafts, draft and accepted tokens, the acceptance rate, the mean acceptance length
    (1 + accepted / drafts: tokens a verifying sequence got per step) and the acceptance
    rate by draft position."""
    if before is None or after is None:
        return None
    keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    delta = {k: after[k] - before[k] for k in keys}
    per_pos = [a - (before["accepted_per_pos"][i] if i < len(before["accepted_per_pos"]) else 0)
               for i, a in enumerate(after["accepted_per_pos"])]
    drafts = delta["num_drafts"]
    return {**delta,
            "acceptance_rate": (delta["num_accepted_tokens"] / delta["num_draft_tokens"]
                                if delta["num_draft_tokens"] else None),
            "mean_acceptance_length": 1 + delta["num_accepted_tokens"] / drafts if drafts else None,
            "acceptance_rate_per_pos": [n / drafts for n in per_pos] if drafts else []}


def _step_plot(trace, facts, ceilings, directory: str) -> str:
    from archserve.bench.plots import step_times
    from archserve.bench.roofline import step_floor_seconds
    os.makedirs(directory, exist_ok=True)
    return step_times([s.seconds for s in trace.steps],
                      [step_floor_seconds(facts, s.work, ceilings) for s in trace.steps],
                      os.path.join(directory, "step_time_vs_roofline.png"))


# -- serving ---------------------------------------------------------------------------
def run_serving_bench(options: BenchOptions) -> dict:
    from archserve.bench.serving import run_serving
    from archserve.loader.loader import resolve_model_path
    from archserve.loader.tokenizer import load_tokenizer

    # The prompts are token ids, so the bench needs the served model's tokenizer.
    tokenizer = load_tokenizer(resolve_model_path(options.model))
    requests = build_requests(options, tokenizer, len(tokenizer))
    levels: list[int | None] = list(options.concurrency) or [None]
    runs, raw = [], {"ttft": [], "tpot": [], "itl": [], "e2e": []}
    for level in levels:
        result = run_serving(options.url, requests, level, request_rate=options.request_rate,
                             ignore_eos=options.ignore_eos, seed=options.seed,
                             metrics_interval_s=options.metrics_interval_s,
                             api_key=options.api_key, show_progress=options.show_progress)
        runs.append(result.to_json())
        ok = [t for t in result.timings if t.error is None]
        if result.timings and not ok:
            first = next(t.error for t in result.timings)
            raise ValueError(f"every one of the {len(result.timings)} requests failed at "
                             f"{options.url}; the first: {first}")
        raw["ttft"].append([t.ttft_s * 1000 for t in ok if t.ttft_s is not None])
        raw["tpot"].append([t.tpot_s * 1000 for t in ok if t.tpot_s is not None])
        raw["itl"].append([x * 1000 for t in ok for x in t.itl_s])
        raw["e2e"].append([t.e2e_s * 1000 for t in ok if t.e2e_s is not None])
    headline = runs[-1]
    result = {
        # The name the server answered to (--model is the tokenizer's path here).
        "mode": "serve", "url": options.url, "model": headline["model"],
        **_workload_json(options, requests),
        **{k: headline[k] for k in ("output_tokens_per_s", "total_tokens_per_s",
                                    "requests_per_s", "ttft_ms", "tpot_ms", "itl_ms",
                                    "e2e_ms", "completed", "failed", "server")},
        # The floor needs the engine's per-step trace, which a remote server does not expose.
        "roofline_efficiency": None,
        "roofline_note": "per-step roofline needs the engine in process: use --mode offline",
        "runs": runs, "plots": [],
    }
    if options.plots_dir:
        from archserve.bench.plots import serving_plots
        result["plots"] = serving_plots(runs, raw, options.plots_dir)
    return result
