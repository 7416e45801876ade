"""Build a ready model runner from an EngineConfig: precision, weights, attention route,
GEMM tuning, KV pool, warm-up, CUDA graphs, self-check, and the report of every decision.

The engine process runs this itself at one rank; with tensor parallelism every worker
runs it on its own shard, and the ranks agree (``distributed.agreement``) on the route
and on the KV pool before they allocate it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from archserve.distributed.agreement import SINGLE_RANK, RankAgreement
from archserve.distributed.layout import rank_model_config
from archserve.distributed.parallel_state import get_tp
from archserve.engine import startup
from archserve.engine.ceilings import load_or_measure
from archserve.engine.compilation_config import parse_compilation_config
from archserve.engine.config import EngineConfig
from archserve.engine.cpu_threads import cpu_thread_governor
from archserve.engine.cuda_graphs import default_graph_sizes, describe_demoted
from archserve.engine.decode_gemms import (
    install_linear_route,
    install_quantized_kernels,
    tune_mla_decode,
    tune_moe_decode,
    tune_quantized_decode,
)
from archserve.engine.kernel_cache import configure_kernel_caches
from archserve.engine.lora.setup import setup_lora
from archserve.engine.mixed_graphs import COMPUTE_BOUND_S, TOKEN_BUCKETS, host_bound_tokens
from archserve.engine.model_runner import ModelRunner
from archserve.engine.rank_memory import measure_rank_memory
from archserve.engine.sampler import Sampler
from archserve.engine.self_check import run_self_check
from archserve.engine.spec_decode.config import parse_speculative_config
from archserve.engine.spec_decode.setup import (
    build_speculator,
    capture_draft_graphs,
    draft_runner,
    load_draft_network,
    plan_speculation,
)
from archserve.engine.step_budget import (
    mixed_graph_buckets_of,
    resolve_token_budget,
    runner_cost_model,
)
from archserve.engine.step_weights import StepWeights
from archserve.kernels.pdl import pdl_enabled
from archserve.models.layers.kv_scales import is_quantized_cache
from archserve.platform.decision import Decision

log = logging.getLogger("archserve")

DEFAULT_MAX_BATCHED_TOKENS = 8192


@dataclass
class RunnerSetup:
    runner: ModelRunner
    model: nn.Module
    model_config: object               # the whole model's ModelConfig
    max_model_len: int
    max_num_batched_tokens: int
    num_blocks: int
    block_size: int
    async_scheduling: bool
    report: startup.StartupReport
    cpu_threads: object | None = None  # the CPU thread governor, where one runs
    decoding_token_budget: int | None = None  # a step with running decodes (step_budget.py)
    # What a decode step reads of this rank's weights (the bench's roofline; with tensor
    # parallelism the engine process holds no model to count them from).
    step_weights: StepWeights | None = None
    speculator: object | None = None   # spec_decode.speculator.Speculator, when configured


def peek_model_config(model_path: str | None):
    """(the model's config, its GGUF file or None), without its weights."""
    from archserve.loader.loader import load_model_config, resolve_model_path
    return load_model_config(resolve_model_path(model_path))


def plan_mixed_step_graphs(compilation, graphs_off: str | None, selection, calibrate: bool,
                           max_batched: int) -> tuple[int, Decision | None]:
    """cudagraph_mode: (the largest step in tokens that mixed-step graphs will cover, 0 for
    none; the decision when that is already settled here, else None)."""
    requested = compilation.cudagraph_mode

    def decode_only(reason: str) -> tuple[int, Decision]:
        return 0, Decision("cudagraph_mode", requested, "FULL_DECODE_ONLY"
                           if graphs_off is None or calibrate else "NONE", reason)

    if graphs_off is not None and not calibrate and (requested != "FULL"
                                                    or not compilation.mode_given):
        return 0, None                    # graphs are off: cuda_graphs_off_reason says why
    if requested != "FULL":
        return decode_only("decode steps replay CUDA graphs; steps with prompt tokens run "
                           "eagerly (compilation_config cudagraph_mode FULL captures those "
                           "too)")
    if calibrate:
        return decode_only("calculate_kv_scales: the graphs are captured after the first "
                           "prefill, decode steps only")
    if graphs_off is not None:
        return decode_only(f"CUDA graphs are off ({graphs_off})")
    if not selection.backend.mixed_graph_capturable:
        return decode_only(f"{selection.name} reads per-sequence lengths on the host in steps "
                           f"with prompt tokens, so only decode steps are captured")
    # An upper bound (the KV reserve is sized from it); capture_mixed_step_graphs stops
    # earlier where the steps turn compute-bound.
    return min(max_batched, TOKEN_BUCKETS[-1]), None


def capture_mixed_step_graphs(runner: ModelRunner, tokens: int, max_num_seqs: int,
                              agree: RankAgreement, rows_per_seq: int = 1) -> Decision:
    """Capture the mixed-step graphs up to ``tokens`` and check them; FULL, or why not.

    Ranks keep only the buckets every rank has, after the capture (before the canaries run
    collectives of a bucket's size) and after the canary: a capture or canary that fails
    on one rank (its memory, its kernels) takes those buckets from all, instead of
    stopping the start. Every rank passes the same three agreements on every path."""
    def decode_only(reason: str) -> Decision:
        runner.mixed_graphs = None
        return Decision("cudagraph_mode", "FULL", "FULL_DECODE_ONLY", reason)

    def failure(exc: Exception) -> str:
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        log.warning("mixed-step CUDA graphs failed (%s: %s); steps with prompt tokens run "
                    "eagerly", type(exc).__name__, first_line)
        return f"{type(exc).__name__}: {first_line}"

    def on_every_rank(sizes: list[int]) -> list[int]:
        common = set(sizes)
        for other in agree.every(sizes):
            common &= set(other)
        if runner.mixed_graphs is not None:
            runner.mixed_graphs.keep_only(sorted(common), "not captured on every rank")
        return sorted(common)

    def settled(error: str | None, failed: str, none_left: str) -> Decision | None:
        """None while some bucket is left on every rank, else the decode-only decision."""
        if on_every_rank(runner.mixed_graphs.set.sizes if error is None else []):
            return None
        if error is not None:
            return decode_only(f"{failed} ({error}); steps with prompt tokens run eagerly")
        return decode_only(f"{none_left}: "
                           + describe_demoted([], runner.mixed_graphs.set.demoted))

    flops_per_token = 2.0 * runner.step_weights.active_params_per_token
    # Each rank measured its own matmul rate (on its own node, or racing for a cold cache):
    # near a bucket edge their limits differ, so they take the smallest.
    tokens = agree.min(host_bound_tokens(flops_per_token,
                                         load_or_measure(runner.device).matmul_flops_per_s,
                                         tokens))

    error = None
    try:   # a failed capture of one bucket is demoted inside; this catches the rest
        runner.capture_mixed_graphs(tokens, max_num_seqs, rows_per_seq)
    except Exception as exc:
        error = failure(exc)
    if (decision := settled(error, "capturing the mixed-step graphs failed",
                            "no mixed-step graph was captured on every rank")) is not None:
        return decision
    try:
        runner.mixed_graphs.replay_canary(runner.kv_caches)
    except Exception as exc:
        error = failure(exc)
    if (decision := settled(error, "the mixed-step graphs' replay canary failed",
                            "no mixed-step graph survived capture and its replay canary")
            ) is not None:
        return decision
    captured = runner.mixed_graphs.set
    return Decision("cudagraph_mode", "FULL", "FULL",
                    f"steps with prompt tokens replay graphs at token buckets "
                    f"{captured.sizes}; a larger step runs eagerly (buckets stop at "
                    f"{TOKEN_BUCKETS[-1]} tokens, at the step budget, and where a step's "
                    f"matmuls would take over {COMPUTE_BOUND_S * 1e3:g} ms: there the device, "
                    f"not the launches, sets its time)"
                    + (f"; not captured: {describe_demoted(captured.sizes, captured.demoted)}"
                       if captured.demoted else ""))


def build_runner(config: EngineConfig, agree: RankAgreement = SINGLE_RANK) -> RunnerSetup:
    from archserve.kernels import jit_watch
    from archserve.loader.loader import load_model
    jit_watch.starting()   # a second engine's start-up compiles are not serving-path misses
    compilation = parse_compilation_config(config.compilation_config)   # refused before loading
    speculative = parse_speculative_config(config.speculative_config)
    tp = get_tp()
    torch_device = startup.resolve_torch_device(config)
    # Unseeded requests draw from torch's global generator: make runs repeatable.
    torch.manual_seed(config.seed)
    device = startup.engine_device_info(torch_device, config.emulate_device)
    probe_config, gguf_path = peek_model_config(config.model)
    dtype, kv_cache_dtype, decisions = startup.resolve_precision(device, config, probe_config)
    if (emulated := startup.emulation_decision(device)) is not None:
        decisions.insert(0, emulated)
    # Refused here, before any weight is read, when no kernel can run the checkpoint.
    quant_plan = startup.plan_checkpoint_quantization(device, config, probe_config,
                                                      gguf_path, dtype)
    decisions += quant_plan.decisions
    if speculative is not None:   # refused here, before loading, when it cannot run
        speculative, spec_decision = plan_speculation(speculative, probe_config, config.model)
        decisions.append(spec_decision)
    scheduling = startup.resolve_async_scheduling(config.async_scheduling, torch_device)
    decisions.append(scheduling)
    if pdl_enabled(torch_device):    # said where it is on, so that a row names its launch mode
        decisions.append(Decision("programmatic dependent launch", "default (SM90+)", "on",
                                  "decode kernels that take it may start while the kernel "
                                  "before them drains (kernels/pdl.py; ARCHSERVE_PDL=0 "
                                  "turns it off)"))
    cpu_threads = None
    if tp.size == 1:   # tensor-parallel CPU ranks split the cores between them instead
        cpu_threads, threads_decision = cpu_thread_governor(torch_device)
        if threads_decision is not None:
            decisions.append(threads_decision)
    rank_mc = rank_model_config(probe_config, tp.size, tp.rank)      # this rank's heads
    kernel_cache = configure_kernel_caches(device)
    # Attention is chosen (its canary runs on random data) and the context length checked
    # against the KV pool before any weight is read: a start that cannot succeed fails fast.
    t_select = time.perf_counter()
    selection, attn_impl, canary = startup.select_attention_with_canary(
        device, config, rank_mc, dtype, kv_cache_dtype, torch_device)
    agree.same("the attention backend", selection.name)
    block_size = startup.kv_block_size(config, selection.backend, probe_config)
    select_s = startup.elapsed(t_select)
    kv_torch_dtype = startup.kv_dtype_of(kv_cache_dtype, dtype)
    model_max_len = probe_config.max_position_embeddings
    max_model_len, fitted = startup.fit_max_model_len(
        config.max_model_len, min(config.max_model_len or model_max_len, model_max_len),
        *startup.kv_capacity_before_load(
            config, rank_mc, attn_impl, kv_torch_dtype, block_size, torch_device,
            # A draft network's cache shares the blocks: known once it is loaded.
            blocks_shared=speculative is not None and speculative.method != "ngram"))
    decisions += [fitted] if fitted is not None else []

    t_load = time.perf_counter()
    model, mc = load_model(config.model, dtype=dtype, device=torch_device,
                           load_format=config.load_format, quantization=quant_plan.config)
    decisions += install_quantized_kernels(device, model, quant_plan)
    lora = setup_lora(config, model, device, torch_device, dtype)   # slots: before KV sizing
    network = None   # the draft network of a draft_model or mtp speculative config
    if speculative is not None and speculative.method != "ngram":
        network, network_mc = load_draft_network(speculative, config.model, mc, dtype,
                                                 torch_device, config.load_format)
    load_s = startup.elapsed(t_load)

    if tp.size > 1 and torch_device.type == "cuda":   # before graphs capture the all-reduces
        from archserve.distributed.peer_all_reduce import install_peer_all_reduce
        decisions.append(install_peer_all_reduce(tp, dtype))
    graphs_off = startup.cuda_graphs_off_reason(torch_device, config, selection,
                                                compilation.cudagraph_mode)
    if lora is not None and graphs_off is None and torch_device.type == "cuda":
        graphs_off = lora.graphs_off
    graph_sizes = (config.cuda_graph_sizes or list(compilation.capture_sizes)
                   or default_graph_sizes(config.max_num_seqs) if graphs_off is None else [])
    t_gemms = time.perf_counter()

    tuned = model if network is None else torch.nn.ModuleList([model, network])

    def tune_gemms() -> list:
        return [d for d in (install_linear_route(device, tuned, dtype, graph_sizes),
                            tune_quantized_decode(device, tuned, dtype, graph_sizes),
                            tune_moe_decode(device, tuned, graph_sizes),
                            tune_mla_decode(device, attn_impl, rank_mc, dtype, kv_cache_dtype,
                                            block_size, graph_sizes, torch_device))
                if d is not None]

    decisions += agree.rank0_first(tune_gemms)
    gemm_tune_s = startup.elapsed(t_gemms)
    agree.same("the kernel choices", [(d.what, d.chosen) for d in decisions])
    runner = ModelRunner(model, rank_mc, torch_device, dtype, attn_impl, block_size,
                         max_model_len, Sampler(set(mc.eos_token_ids)))
    max_batched = config.max_num_batched_tokens or DEFAULT_MAX_BATCHED_TOKENS
    if not config.enable_chunked_prefill:
        max_batched = max(max_batched, max_model_len)  # a whole prompt fits one step
    if lora is not None:   # its mapping buffer holds the largest step any forward runs
        runner.lora = lora.step(max(max_batched, config.max_num_seqs, *graph_sizes),
                                torch_device)
        decisions.append(lora.decision)
    # A sequence verifying drafts samples a row for each: the LM head's buffers have room.
    rows_per_seq = 1 + (speculative.num_speculative_tokens if speculative else 0)
    drafts = None   # the draft network's runner: its cache in the target's blocks
    if network is not None:
        largest_step = max(max_batched, TOKEN_BUCKETS[-1], *graph_sizes) + config.max_num_seqs
        drafts = draft_runner(network, network_mc, device, config, dtype, kv_cache_dtype,
                              torch_device, block_size, max_model_len, largest_step,
                              attn_impl if speculative.method == "mtp" else None)
        if speculative.method == "mtp":
            runner.keep_hidden_states(largest_step)
    calibrate = config.calculate_kv_scales and is_quantized_cache(kv_cache_dtype)
    mixed_tokens, mixed_decision = plan_mixed_step_graphs(compilation, graphs_off, selection,
                                                          calibrate, max_batched)
    num_blocks, sizing = startup.size_kv_pool(config, runner, rank_mc, kv_torch_dtype,
                                              max_batched, max_model_len,
                                              config.max_num_seqs, torch_device,
                                              mixed_graph_tokens=mixed_tokens,
                                              extra_bytes_per_block=drafts.kv_bytes_per_block(
                                                  kv_torch_dtype) if drafts else 0,
                                              rows_per_seq=rows_per_seq)
    if tp.size > 1:
        own, num_blocks = num_blocks, agree.min(num_blocks)
        sizing += (f"; the smallest of {tp.size} ranks' pools (this rank: {own})"
                   if own != num_blocks else f"; every rank of {tp.size} fits it")
    # Exact now (a GPU's pool is what the weights and the activation peak left).
    max_model_len, fitted = startup.fit_max_model_len(config.max_model_len, max_model_len,
                                                      num_blocks * block_size, sizing)
    if fitted is not None:
        decisions.append(fitted)
        for each in (runner, drafts):
            if each is not None:
                each.limit_max_model_len(max_model_len)
    runner.allocate_kv_cache(num_blocks, kv_torch_dtype, kv_cache_dtype)
    if drafts is not None:
        drafts.allocate_kv_cache(num_blocks, kv_torch_dtype, kv_cache_dtype)
    t_warm = time.perf_counter()
    if torch_device.type == "cuda":  # JIT compilers run on GPUs only
        runner.warm_up_prefill(max_batched, config.max_num_seqs)
        if drafts is not None:
            drafts.warm_up_prefill(max_batched, config.max_num_seqs)
    warm_up_s = startup.elapsed(t_warm)
    deferred_graphs = graph_sizes if calibrate else []
    graphs = graphs_off is None and not calibrate
    if deferred_graphs:
        # A graph bakes the scales in: capture once the first prefill has measured them.
        graphs_off = ("captured after the first prefill, where calculate_kv_scales measures "
                      "the fp8 KV-cache scales")
    t_graphs = time.perf_counter()
    if graphs:
        runner.capture_cuda_graphs(graph_sizes)
        agree.same("the captured CUDA graph sizes", runner.graphs.set.sizes)
        if mixed_tokens:
            mixed_decision = capture_mixed_step_graphs(runner, mixed_tokens,
                                                       config.max_num_seqs, agree, rows_per_seq)
    if mixed_decision is not None:
        decisions.append(mixed_decision)
    if graphs and drafts is not None:
        decisions.append(capture_draft_graphs(drafts, graph_sizes,
                                              mixed_tokens if runner.mixed_graphs else 0,
                                              config.max_num_seqs))
    speculator = (build_speculator(speculative, max_model_len, drafts)
                  if speculative is not None else None)
    graphs_s = startup.elapsed(t_graphs)
    t_budget = time.perf_counter()   # after the warm-up: a timed step compiles nothing
    budget = resolve_token_budget(config.target_itl_ms, config.max_num_batched_tokens,
                                  max_batched, config.max_num_seqs,
                                  config.enable_chunked_prefill,
                                  lambda: runner_cost_model(runner, max_batched),
                                  mixed_graph_buckets_of(runner))
    decisions.append(budget.decision)
    budget_s = startup.elapsed(t_budget)
    report = startup.StartupReport(
        device=device, torch_device=torch_device, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
        decisions=decisions, attention=selection, block_size=block_size, canary=canary,
        num_blocks=num_blocks, max_model_len=max_model_len,
        graph_sizes=runner.graphs.set.sizes if graphs else [],
        graph_demoted=runner.graphs.set.demoted if graphs else {},
        graphs_off=graphs_off, kernel_cache=kernel_cache, kv_sizing=sizing,
        routes=startup.model_routes(device, config, rank_mc, dtype, kv_cache_dtype, selection,
                                    is_gguf=gguf_path is not None)
        + ([lora.route] if lora is not None else []),
        timings={"load_s": load_s, "select_and_canary_s": select_s,
                 "decode_gemm_tuning_s": gemm_tune_s, "prefill_warm_up_s": warm_up_s,
                 "cuda_graphs_s": graphs_s, "token_budget_s": budget_s},
        token_budget=budget)
    if config.self_check or (config.self_check is None and torch_device.type == "cuda"):
        t_check = time.perf_counter()
        ceilings = load_or_measure(torch_device)
        report.self_check = run_self_check(runner, ceilings.copy_bytes_per_s,
                                           profile=config.self_check_profile)
        report.timings["self_check_s"] = startup.elapsed(t_check)
    if calibrate:   # after every start-up forward: only a real prompt calibrates
        runner.calibrate_kv_scales_on_first_prefill(deferred_graphs)
    if torch_device.type == "cuda" and not calibrate:   # from here a compile is a warm-up miss
        jit_watch.watch_after_startup()
    kv_pool_bytes = sum(t.numel() * t.element_size() for t in runner.kv_caches)
    report.rank_memory = agree.every(measure_rank_memory(torch_device, kv_pool_bytes, model))
    return RunnerSetup(runner, model, mc, max_model_len, max_batched, num_blocks, block_size,
                       scheduling.chosen == "async", report, cpu_threads=cpu_threads,
                       decoding_token_budget=budget.decoding,
                       step_weights=runner.step_weights, speculator=speculator)
