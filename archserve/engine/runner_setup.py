"""Build a ready model runner from an EngineConfig: precision, weights, attention route,
GEMM tuning, KV pool, warm-up, CUDA graphs, self-check, and the report of every decision.

The engine process runs this itself at one rank; with tensor parallelism every worker
runs it on its own shard, and the ranks agree (``distributed.agreement``) on the route
and on the KV pool before they allocate it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
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
from archserve.engine.cuda_graphs import (
    decode_graph_sizes,
    default_graph_sizes,
    describe_demoted,
)
from archserve.engine.decode_gemms import (
    install_linear_route,
    install_lm_head_route,
    install_quantized_kernels,
    tune_mla_decode,
    tune_moe_decode,
    tune_quantized_decode,
)
from archserve.engine.kernel_cache import configure_kernel_caches
from archserve.engine.kv_cache import ring_bytes_per_sequence, ring_rows
from archserve.engine.lora.setup import setup_lora
from archserve.engine.mixed_graphs import (
    COMPUTE_BOUND_S,
    TOKEN_BUCKETS,
    host_bound_tokens,
    mixed_step_query_limit,
)
from archserve.engine.model_runner import ModelRunner
from archserve.engine.rank_memory import measure_rank_memory
from archserve.engine.sampler import Sampler
from archserve.engine.self_check import run_self_check
from archserve.engine.spec_decode.setup import (
    build_speculator,
    capture_draft_graphs,
    draft_runner,
    load_draft_network,
    plan_speculation,
)
from archserve.engine.speculative_config import parse_speculative_config
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
    decoding_token_budget_by_streams: tuple[int, ...] = ()  # with fewer decodes, if any
    # What a decode step reads of this rank's weights (the bench's roofline; with tensor
    # parallelism the engine process holds no model to count them from).
    step_weights: StepWeights | None = None
    speculator: object | None = None   # spec_decode.speculator.Speculator, when configured
    # DeepSeek V4: window rings of ring_rows rows, one per sequence and the prefix
    # cache's snapshots (engine/window_rings.py).
    num_rings: int = 0
    ring_rows: int = 0


def peek_model_config(model_path: str | None):
    """(the model's config, its GGUF file or None), without its weights."""
    from archserve.loader.loader import load_model_config, resolve_model_path
    return load_model_config(resolve_model_path(model_path))


def plan_mixed_step_graphs(compilation, graphs_off: str | None, selection, calibrate: bool,
                           max_batched: int, max_num_seqs: int = 1, rows_per_seq: int = 1
                           ) -> tuple[int, Decision | None, int | None]:
    """cudagraph_mode: (the largest step in tokens that mixed-step graphs will cover, 0 for
    none; the decision when that is already settled here, else None; the most query tokens
    a sequence of a captured step may bring, None for any). ``rows_per_seq``: 1 + the
    drafts a sequence verifies, where speculative decoding is configured."""
    requested = compilation.cudagraph_mode

    def decode_only(reason: str) -> tuple[int, Decision, None]:
        return 0, Decision("cudagraph_mode", requested, "FULL_DECODE_ONLY"
                           if graphs_off is None or calibrate else "NONE", reason), None

    if graphs_off is not None and not calibrate and (requested != "FULL"
                                                    or not compilation.mode_given):
        return 0, None, None              # graphs are off: cuda_graphs_off_reason says why
    if requested != "FULL":
        return decode_only("decode steps replay CUDA graphs; steps with prompt tokens run "
                           "eagerly (compilation_config cudagraph_mode FULL captures those "
                           "too)")
    if calibrate:
        return decode_only("calculate_kv_scales: the graphs are captured after the first "
                           "prefill, decode steps only")
    if graphs_off is not None:
        return decode_only(f"CUDA graphs are off ({graphs_off})")
    captured, query_limit = mixed_step_query_limit(selection.backend, rows_per_seq)
    if captured and query_limit is None:
        # An upper bound (the KV reserve is sized from it); capture_mixed_step_graphs stops
        # earlier where the steps turn compute-bound.
        return min(max_batched, TOKEN_BUCKETS[-1]), None, None
    if captured:
        # Verification steps: every sequence brings at most k + 1 tokens, each a decode row.
        return (min(max_batched, max_num_seqs * rows_per_seq, TOKEN_BUCKETS[-1]), None,
                query_limit)
    host_lengths = (f"{selection.name} reads per-sequence lengths on the host in steps with "
                    f"prompt tokens")
    rows = selection.backend.decode_rows_max_query_len
    if rows_per_seq > 1 and rows > 1:
        return decode_only(f"{host_lengths}, and runs a sequence of at most {rows} query "
                           f"tokens as decode rows; verifying {rows_per_seq - 1} drafts "
                           f"brings {rows_per_seq}, so only decode steps are captured")
    return decode_only(f"{host_lengths}, so only decode steps are captured"
                       + (" (with speculative decoding, verification steps too: each "
                          "token a decode row)" if rows > 1 else ""))


def capture_mixed_step_graphs(runner: ModelRunner, tokens: int, max_num_seqs: int,
                              agree: RankAgreement, rows_per_seq: int = 1,
                              max_query_len: int | None = None) -> Decision:
    """Capture the mixed-step graphs up to ``tokens`` (of steps whose sequences bring at
    most ``max_query_len`` tokens each, None: any) and check them; FULL, or why not.

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
        runner.capture_mixed_graphs(tokens, max_num_seqs, rows_per_seq, max_query_len)
    except Exception as exc:
        error = failure(exc)
    if (decision := settled(error, "capturing the mixed-step graphs failed",
                            "no mixed-step graph was captured on every rank")) is not None:
        return decision
    try:
        runner.replay_mixed_canary()
    except Exception as exc:
        error = failure(exc)
    if (decision := settled(error, "the mixed-step graphs' replay canary failed",
                            "no mixed-step graph survived capture and its replay canary")
            ) is not None:
        return decision
    captured = runner.mixed_graphs.set
    steps = ("steps with prompt tokens" if max_query_len is None else
             f"verification steps (every sequence at most {max_query_len} query tokens, each "
             f"run as a decode row of its own causal length; a longer prompt chunk runs "
             f"eagerly)")
    return Decision("cudagraph_mode", "FULL", "FULL",
                    f"{steps} replay graphs at token buckets "
                    f"{captured.sizes}; a larger step runs eagerly (buckets stop at "
                    f"{TOKEN_BUCKETS[-1]} tokens, at the step budget, and where a step's "
                    f"matmuls would take over {COMPUTE_BOUND_S * 1e3:g} ms: there the device, "
                    f"not the launches, sets its time)"
                    + (f"; not captured: {describe_demoted(captured.sizes, captured.demoted)}"
                       if captured.demoted else ""))


def build_runner(config: EngineConfig, agree: RankAgreement = SINGLE_RANK) -> RunnerSetup:
    """The start-up, phase by phase (each reads what the phases before it settled)."""
    build = _RunnerBuild(config, agree)
    build.decide_precision()
    build.select_attention()
    build.load_weights()
    build.decide_graphs()
    build.tune_decode_gemms()
    build.allocate_kv_pool()
    build.warm_up()
    build.capture_graphs()
    build.compile_cpu_steps()
    build.resolve_token_budget()
    build.report_decisions()
    build.self_check()
    build.arm_for_serving()
    return build.setup()


class _RunnerBuild:
    """The state one start-up builds; ``build_runner`` calls the phases in order."""

    def __init__(self, config: EngineConfig, agree: RankAgreement) -> None:
        from archserve.kernels import jit_watch
        jit_watch.starting()   # a second engine's start-up compiles are not serving-path misses
        self.config = config
        self.agree = agree
        self.compilation = parse_compilation_config(config.compilation_config)  # before loading
        self.speculative = parse_speculative_config(config.speculative_config)
        self.tp = get_tp()
        self.torch_device = startup.resolve_torch_device(config)
        # Unseeded requests draw from torch's global generator: make runs repeatable.
        torch.manual_seed(config.seed)
        self.device = startup.engine_device_info(self.torch_device, config.emulate_device)
        self.decisions: list[Decision] = []
        self.timings: dict[str, float] = {}
        self.cpu_threads = None
        self.speculator = None

    @contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.timings[name] = startup.elapsed(start)

    def decide_precision(self) -> None:
        """dtype, KV-cache dtype and the checkpoint's quantization (refused here, before any
        weight is read, when no kernel can run it); scheduling, PDL and CPU threads."""
        config, torch_device = self.config, self.torch_device
        self.probe_config, self.gguf_path = peek_model_config(config.model)
        self.dtype, self.kv_cache_dtype, decisions = startup.resolve_precision(
            self.device, config, self.probe_config)
        self.decisions += decisions
        if (emulated := startup.emulation_decision(self.device)) is not None:
            self.decisions.insert(0, emulated)
        self.quant_plan = startup.plan_checkpoint_quantization(
            self.device, config, self.probe_config, self.gguf_path, self.dtype)
        self.decisions += self.quant_plan.decisions
        if self.speculative is not None:   # refused here, before loading, when it cannot run
            self.speculative, spec_decision = plan_speculation(self.speculative,
                                                               self.probe_config, config.model)
            self.decisions.append(spec_decision)
        self.scheduling = startup.resolve_async_scheduling(config.async_scheduling,
                                                           torch_device)
        self.decisions.append(self.scheduling)
        if pdl_enabled(torch_device):   # said where it is on, so a row names its launch mode
            self.decisions.append(Decision(
                "programmatic dependent launch", "default (SM90+)", "on",
                "decode kernels that take it may start while the kernel before them drains "
                "(kernels/pdl.py; ARCHSERVE_PDL=0 turns it off)"))
        if self.tp.size == 1:   # tensor-parallel CPU ranks split the cores between them instead
            self.cpu_threads, threads_decision = cpu_thread_governor(torch_device)
            if threads_decision is not None:
                self.decisions.append(threads_decision)

    def select_attention(self) -> None:
        """The attention backend, each candidate through the numerics canary (on random
        data), the same on every rank; and the context length checked against the KV pool.
        Both before any weight is read: a start that cannot succeed fails fast."""
        config, probe_config = self.config, self.probe_config
        self.rank_mc = rank_model_config(probe_config, self.tp.size, self.tp.rank)  # its heads
        self.kernel_cache = configure_kernel_caches(self.device)
        with self._timed("select_and_canary_s"):
            self.selection, self.attn_impl, self.canary = startup.select_attention_with_canary(
                self.device, config, self.rank_mc, self.dtype, self.kv_cache_dtype,
                self.torch_device)
            self.agree.same("the attention backend", self.selection.name)
            self.block_size = startup.kv_block_size(config, self.selection.backend,
                                                    self.probe_config)
        self.kv_torch_dtype = startup.kv_dtype_of(self.kv_cache_dtype, self.dtype)
        model_max_len = probe_config.max_position_embeddings
        self.max_model_len, fitted = startup.fit_max_model_len(
            config.max_model_len, min(config.max_model_len or model_max_len, model_max_len),
            *startup.kv_capacity_before_load(
                config, self.rank_mc, self.attn_impl, self.kv_torch_dtype, self.block_size,
                self.torch_device,
                # A draft network's cache shares the blocks: known once it is loaded.
                blocks_shared=(self.speculative is not None
                               and self.speculative.method != "ngram")))
        self.decisions += [fitted] if fitted is not None else []

    def load_weights(self) -> None:
        """The weights and their quantized kernels, LoRA's slots and a draft network; then
        the tensor-parallel all-reduce (before graphs capture it)."""
        from archserve.loader.loader import load_model
        config = self.config
        with self._timed("load_s"):
            self.model, self.mc = load_model(config.model, dtype=self.dtype,
                                             device=self.torch_device,
                                             load_format=config.load_format,
                                             quantization=self.quant_plan.config)
            self.decisions += install_quantized_kernels(self.device, self.model,
                                                        self.quant_plan)
            # LoRA slots: before the KV pool is sized.
            self.lora = setup_lora(config, self.model, self.device, self.torch_device,
                                   self.dtype)
            self.network = None   # the draft network of a draft_model or mtp speculative config
            if self.speculative is not None and self.speculative.method != "ngram":
                self.network, self.network_mc = load_draft_network(
                    self.speculative, config.model, self.mc, self.dtype, self.torch_device,
                    config.load_format)
        if self.tp.size > 1 and self.torch_device.type == "cuda":
            from archserve.distributed.peer_all_reduce import install_peer_all_reduce
            self.decisions.append(install_peer_all_reduce(self.tp, self.dtype))

    def decide_graphs(self) -> None:
        """Whether decode steps replay CUDA graphs, and at which sizes."""
        config = self.config
        self.graphs_off = startup.cuda_graphs_off_reason(self.torch_device, config,
                                                         self.selection,
                                                         self.compilation.cudagraph_mode)
        if (self.lora is not None and self.graphs_off is None
                and self.torch_device.type == "cuda"):
            self.graphs_off = self.lora.graphs_off
        # A sequence verifying drafts brings 1 + k tokens, each a sampled row.
        self.rows_per_seq = 1 + (self.speculative.num_speculative_tokens
                                 if self.speculative else 0)
        # Verification steps run as decode rows where the backend's decode path takes them
        # (ModelRunner.runs_as_decode_rows), so the target's default ladder reaches k + 1
        # rows a sequence; the draft network's decode steps are one row a sequence.
        self.decode_rows_query_len = min(self.selection.backend.decode_rows_max_query_len,
                                         self.rows_per_seq)
        given = config.cuda_graph_sizes or list(self.compilation.capture_sizes)
        self.draft_graph_sizes = ((given or default_graph_sizes(config.max_num_seqs))
                                  if self.graphs_off is None else [])
        self.graph_sizes = ((given or decode_graph_sizes(config.max_num_seqs,
                                                         self.decode_rows_query_len))
                            if self.graphs_off is None else [])

    def tune_decode_gemms(self) -> None:
        """The dense, quantized, MoE and MLA decode kernels timed per graph size (rank 0
        first, so the others read its cache); every rank must choose the same."""
        device, dtype, sizes = self.device, self.dtype, self.graph_sizes
        # The draft network's GEMMs are tuned with the model's.
        tuned = (self.model if self.network is None
                 else nn.ModuleList([self.model, self.network]))

        def tune_gemms() -> list:
            return [d for d in (install_linear_route(device, tuned, dtype, sizes),
                                install_lm_head_route(device, tuned, dtype),
                                tune_quantized_decode(device, tuned, dtype, sizes),
                                tune_moe_decode(device, tuned, sizes),
                                tune_mla_decode(device, self.attn_impl, self.rank_mc, dtype,
                                                self.kv_cache_dtype, self.block_size, sizes,
                                                self.torch_device))
                    if d is not None]

        with self._timed("decode_gemm_tuning_s"):
            self.decisions += self.agree.rank0_first(tune_gemms)
        self.agree.same("the kernel choices", [(d.what, d.chosen) for d in self.decisions])

    def allocate_kv_pool(self) -> None:
        """The model runner and its KV pool: sized from what is left after a profiling
        step (and the mixed-step graphs' reserve), the smallest of every rank's; the
        context length fitted to it."""
        config, tp = self.config, self.tp
        self.runner = ModelRunner(self.model, self.rank_mc, self.torch_device, self.dtype,
                                  self.attn_impl, self.block_size, self.max_model_len,
                                  Sampler(set(self.mc.eos_token_ids)))
        max_batched = config.max_num_batched_tokens or DEFAULT_MAX_BATCHED_TOKENS
        if not config.enable_chunked_prefill:
            max_batched = max(max_batched, self.max_model_len)  # a whole prompt fits a step
        self.max_batched = max_batched
        if self.lora is not None:   # its mapping buffer holds the largest step any forward runs
            self.runner.lora = self.lora.step(
                max(max_batched, config.max_num_seqs, *self.graph_sizes), self.torch_device)
            self.decisions.append(self.lora.decision)
        kv_torch_dtype = self.kv_torch_dtype
        # DeepSeek V4 keeps its window's keys in a ring per sequence that may run, and the
        # prefix cache as many again: the snapshots of the windows before cached prefixes.
        self.ring_rows = ring_rows(self.rank_mc)
        self.num_rings = (config.max_num_seqs * (2 if config.enable_prefix_caching else 1)
                          if self.ring_rows else 0)
        self.runner.decode_rows_query_len = self.decode_rows_query_len
        self.drafts = None   # the draft network's runner: its cache in the target's blocks
        if self.network is not None:
            largest_step = (max(max_batched, TOKEN_BUCKETS[-1], *self.graph_sizes)
                            + config.max_num_seqs)
            self.drafts = draft_runner(self.network, self.network_mc, self.device, config,
                                       self.dtype, self.kv_cache_dtype, self.torch_device,
                                       self.block_size, self.max_model_len, largest_step,
                                       self.attn_impl if self.speculative.method == "mtp"
                                       else None)
            if self.speculative.method == "mtp":
                self.runner.keep_hidden_states(largest_step)
        self.calibrate = config.calculate_kv_scales and is_quantized_cache(self.kv_cache_dtype)
        self.mixed_tokens, self.mixed_decision, self.mixed_query_len = plan_mixed_step_graphs(
            self.compilation, self.graphs_off, self.selection, self.calibrate, max_batched,
            config.max_num_seqs, self.rows_per_seq)
        num_blocks, sizing = startup.size_kv_pool(config, self.runner, self.rank_mc,
                                                  kv_torch_dtype, max_batched,
                                                  self.max_model_len, config.max_num_seqs,
                                                  self.torch_device,
                                                  mixed_graph_tokens=self.mixed_tokens,
                                                  extra_bytes_per_block=(
                                                      self.drafts.kv_bytes_per_block(
                                                          kv_torch_dtype)
                                                      if self.drafts else 0),
                                                  rows_per_seq=self.rows_per_seq,
                                                  decode_graph_rows=max(
                                                      self.graph_sizes,
                                                      default=config.max_num_seqs),
                                                  ring_bytes=self.num_rings * ring_bytes_per_sequence(
                                                      self.rank_mc, kv_torch_dtype,
                                                      self.block_size))
        if tp.size > 1:
            own, num_blocks = num_blocks, self.agree.min(num_blocks)
            sizing += (f"; the smallest of {tp.size} ranks' pools (this rank: {own})"
                       if own != num_blocks else f"; every rank of {tp.size} fits it")
        # Exact now (a GPU's pool is what the weights and the activation peak left).
        self.max_model_len, fitted = startup.fit_max_model_len(
            config.max_model_len, self.max_model_len, num_blocks * self.block_size, sizing)
        if fitted is not None:
            self.decisions.append(fitted)
            for each in (self.runner, self.drafts):
                if each is not None:
                    each.limit_max_model_len(self.max_model_len)
        self.num_blocks, self.kv_sizing = num_blocks, sizing
        self.runner.allocate_kv_cache(num_blocks, kv_torch_dtype, self.kv_cache_dtype,
                                      max(self.num_rings, 1))
        if self.drafts is not None:
            self.drafts.allocate_kv_cache(num_blocks, kv_torch_dtype, self.kv_cache_dtype)

    def warm_up(self) -> None:
        """One eager prefill step per attention tune bucket: nothing is tuned or compiled on
        the serving path."""
        with self._timed("prefill_warm_up_s"):
            if self.torch_device.type == "cuda":  # JIT compilers run on GPUs only
                self.runner.warm_up_prefill(self.max_batched, self.config.max_num_seqs)
                if self.drafts is not None:
                    self.drafts.warm_up_prefill(self.max_batched, self.config.max_num_seqs)

    def capture_graphs(self) -> None:
        """Decode graphs and their replay canary, and under cudagraph_mode FULL the
        mixed-step graphs (and the draft network's); with calculate_kv_scales, deferred to
        the first prefill. Then the speculative decoding proposer, where one is configured."""
        self.deferred_graphs = self.graph_sizes if self.calibrate else []
        self.graphs = self.graphs_off is None and not self.calibrate
        if self.deferred_graphs:
            # A graph bakes the scales in: capture once the first prefill has measured them.
            self.graphs_off = ("captured after the first prefill, where calculate_kv_scales "
                               "measures the fp8 KV-cache scales")
        with self._timed("cuda_graphs_s"):
            if self.graphs:
                self.runner.capture_cuda_graphs(self.graph_sizes)
                self.agree.same("the captured CUDA graph sizes", self.runner.graphs.set.sizes)
                if self.mixed_tokens:
                    self.mixed_decision = capture_mixed_step_graphs(
                        self.runner, self.mixed_tokens, self.config.max_num_seqs, self.agree,
                        self.rows_per_seq, self.mixed_query_len)
            if self.mixed_decision is not None:
                self.decisions.append(self.mixed_decision)
            if self.graphs and self.drafts is not None:
                self.decisions.append(capture_draft_graphs(
                    self.drafts, self.draft_graph_sizes,
                    self.mixed_tokens if self.runner.mixed_graphs else 0,
                    self.config.max_num_seqs, self.mixed_query_len))
            if self.speculative is not None:
                self.speculator = build_speculator(self.speculative, self.max_model_len,
                                                   self.drafts)

    def compile_cpu_steps(self) -> None:
        """A CPU's decode steps compiled (engine/cpu_compiled_step.py) where the
        compilation level asks for it; the decision says at which batch sizes, or why not."""
        if self.torch_device.type != "cpu":
            return
        config = self.config
        reason = startup.compiled_steps_off_reason(config, self.compilation, self.lora,
                                                   self.calibrate,
                                                   self.runner.hidden_out is not None)
        requested = (f"compiled ({self.compilation.level_source()})"
                     if self.compilation.effective_level else "eager")
        chosen = "eager"
        if reason is None:
            sizes = [s for s in (config.cuda_graph_sizes or self.compilation.capture_sizes
                                 or [1]) if s <= config.max_num_seqs]
            with self._timed("compile_s"):
                result = self.runner.compile_cpu_decode_steps(sizes)
            if set(result.sizes) - result.from_cache:
                # A first start's wait, said where a terminal shows it (the CLI logs
                # warnings alone).
                log.warning("compiled the CPU decode steps in %.0fs; torch's caches keep "
                            "them, so later starts of this model load them (-O 0: eager "
                            "steps, no compile)", self.timings["compile_s"])
            chosen = (f"compiled at batch sizes {', '.join(map(str, result.sizes))}"
                      if result.sizes else "eager")
            cached = " (loaded from torch's caches)" if result.from_cache else ""
            reason = (f"inductor{cached}, {result.attention}; other batch sizes run eager"
                      + "".join(f"; batch {s}: {why}" for s, why in result.demoted.items()))
        self.decisions.append(Decision("decode steps", requested, chosen, reason))

    def resolve_token_budget(self) -> None:
        """The token budget of steps with decodes (after the warm-up: a timed step compiles
        nothing)."""
        config = self.config
        with self._timed("token_budget_s"):
            self.budget = resolve_token_budget(
                config.target_itl_ms, config.max_num_batched_tokens, self.max_batched,
                config.max_num_seqs, config.enable_chunked_prefill,
                lambda: runner_cost_model(self.runner, self.max_batched),
                mixed_graph_buckets_of(self.runner),
                share_stall=self.torch_device.type == "cpu")
            self.decisions.append(self.budget.decision)

    def report_decisions(self) -> None:
        runner, graphs = self.runner, self.graphs
        self.report = startup.StartupReport(
            device=self.device, torch_device=self.torch_device, dtype=self.dtype,
            kv_cache_dtype=self.kv_cache_dtype, decisions=self.decisions,
            attention=self.selection, block_size=self.block_size, canary=self.canary,
            num_blocks=self.num_blocks, max_model_len=self.max_model_len,
            graph_sizes=runner.graphs.set.sizes if graphs else [],
            graph_demoted=runner.graphs.set.demoted if graphs else {},
            graphs_off=self.graphs_off, kernel_cache=self.kernel_cache,
            kv_sizing=self.kv_sizing,
            routes=startup.model_routes(self.device, self.config, self.rank_mc, self.dtype,
                                        self.kv_cache_dtype, self.selection,
                                        is_gguf=self.gguf_path is not None)
            + ([self.lora.route] if self.lora is not None else []),
            timings=self.timings, token_budget=self.budget)

    def self_check(self) -> None:
        """The roofline self-check (on GPUs by default)."""
        config = self.config
        if config.self_check or (config.self_check is None
                                 and self.torch_device.type == "cuda"):
            with self._timed("self_check_s"):
                ceilings = load_or_measure(self.torch_device)
                self.report.self_check = run_self_check(self.runner,
                                                        ceilings.copy_bytes_per_s,
                                                        profile=config.self_check_profile)

    def arm_for_serving(self) -> None:
        """After every start-up forward: the first real prompt calibrates the KV scales
        (and captures the deferred graphs); from here a compile is a warm-up miss."""
        from archserve.kernels import jit_watch
        if self.calibrate:
            self.runner.calibrate_kv_scales_on_first_prefill(self.deferred_graphs)
        if self.torch_device.type == "cuda" and not self.calibrate:
            jit_watch.watch_after_startup()

    def setup(self) -> RunnerSetup:
        runner = self.runner
        kv_pool_bytes = sum(t.numel() * t.element_size() for t in runner.kv_caches)
        self.report.rank_memory = self.agree.every(
            measure_rank_memory(self.torch_device, kv_pool_bytes, self.model))
        return RunnerSetup(runner, self.model, self.mc, self.max_model_len, self.max_batched,
                           self.num_blocks, self.block_size,
                           self.scheduling.chosen == "async", self.report,
                           cpu_threads=self.cpu_threads,
                           decoding_token_budget=self.budget.decoding,
                           decoding_token_budget_by_streams=self.budget.decoding_by_streams,
                           step_weights=runner.step_weights, speculator=self.speculator,
                           num_rings=self.num_rings, ring_rows=self.ring_rows)
