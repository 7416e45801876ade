"""ModelRunner: one forward pass per step over flattened tokens, then sampling on the device.

It owns the KV cache tensors, the selected attention implementation, the decode CUDA
graphs and the sampler. It knows nothing of requests beyond the sequences it is handed.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Iterator

import numpy as np
import torch

from archserve.engine.batch import ModelBatch, block_table_width, build_batch, host_to_device
from archserve.engine.cuda_graphs import DecodeGraphRunner, describe_demoted
from archserve.engine.kv_cache import (
    cache_bytes_per_block,
    cache_row_format,
    model_kv_caches,
    ring_rows,
)
from archserve.engine.launched_step import LaunchedStep
from archserve.engine.mixed_graphs import MixedGraphRunner, mixed_graph_buckets
from archserve.engine.phases import phase
from archserve.engine.scheduler import ScheduledSeq
from archserve.engine.staging import StagingRing
from archserve.kernels.attention.interface import AttentionMetadata
from archserve.kernels.linear.skinny_choice import decode_graph_scope
from archserve.models.layers.forward_context import ForwardContext, set_forward_context

log = logging.getLogger(__name__)


def profile_sequence_lengths(num_tokens: int, max_num_seqs: int, max_model_len: int
                             ) -> list[int]:
    """The largest step the scheduler can build: up to ``num_tokens`` tokens in at most
    ``max_num_seqs`` sequences, none longer than ``max_model_len``."""
    num_tokens = min(num_tokens, max_num_seqs * max_model_len)
    full, rest = divmod(num_tokens, max_model_len)
    return [max_model_len] * full + ([rest] if rest else [])


def prefill_warm_up_lengths(limit: int) -> list[int]:
    """Prompt lengths that reach every prefill attention tune bucket up to ``limit`` at its
    shortest and at its longest, each as a multiple of 16 and as a length that is not:
    Triton compiles one variant per divisibility of its integer arguments, and a model's
    route can change with the length inside a bucket (a sparse-MLA layer attends densely up
    to its top-k, 2048 keys in DeepSeek-V3.2, where the last bucket's longest prompts are
    sparse: its dense prefill was tuned mid-request on an H100)."""
    from archserve.kernels.attention.triton_prefill import TUNE_BUCKET_BOUNDS
    lengths: list[int] = []
    low = 2  # one query token is a decode step, not a prefill
    for high in (*TUNE_BUCKET_BOUNDS, limit):
        high = min(high, limit)
        if low > high:
            break
        top = max(low, high // 16 * 16)
        bottom = min(top, -(-low // 16) * 16)
        lengths += sorted({n for n in (bottom - 3, bottom, top - 3, top) if n >= low})
        low = high + 1
    return lengths


def prefill_warm_up_batches(max_model_len: int, max_num_batched_tokens: int,
                            max_num_seqs: int) -> list[list[int]]:
    """The prompt batches (lengths of the prompts of one step) the warm-up runs, so that a
    first request compiles nothing:
    - one prompt of each length ``prefill_warm_up_lengths`` gives;
    - 3 and 16 two-token prompts in one step: Triton compiles a variant per specialisation
      of an integer argument (equal to 1, divisible by 16), so the per-batch counts of a
      batched prefill (sequences, query offsets) can reach variants one prompt never does;
    - the largest step the scheduler can build, where it holds more tokens than one prompt
      can: kernels chosen by token count (the MoE tiles) reach their largest class.
    Each within max_model_len, max_num_batched_tokens and max_num_seqs."""
    longest = min(max_model_len, max_num_batched_tokens)
    batches = [[n] for n in prefill_warm_up_lengths(longest)]
    for seqs in (3, 16):
        if seqs <= max_num_seqs and 2 * seqs <= max_num_batched_tokens and max_model_len >= 2:
            batches.append([2] * seqs)
    largest = profile_sequence_lengths(max_num_batched_tokens, max_num_seqs, max_model_len)
    if sum(largest) > longest:
        batches.append(largest)
    return batches


class ModelRunner:
    def __init__(self, model: torch.nn.Module, model_config, device: torch.device,
                 dtype: torch.dtype, attn_impl, block_size: int, max_model_len: int,
                 sampler) -> None:
        self.model = model
        self.model_config = model_config
        self.device = device
        self.dtype = dtype
        self.attn_impl = attn_impl
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = (max_model_len + block_size - 1) // block_size
        self.sampler = sampler
        self.staging = StagingRing(device)   # each step's batch reaches the device through it
        self.kv_caches: list[torch.Tensor] = []
        self.kv_cache_dtype = "auto"
        self.graphs: DecodeGraphRunner | None = None
        # On a CPU, decode steps compiled per batch size (engine/cpu_compiled_step.py).
        self.compiled_steps = None
        self.mixed_graphs: MixedGraphRunner | None = None   # cudagraph_mode FULL only
        # calculate_kv_scales: the next prefill measures each layer's fp8 KV scales, then
        # the decode graphs (which bake the scales in) are captured at these sizes.
        self.kv_calibration_pending = False
        self.graph_sizes_after_calibration: list[int] = []
        # LoRA adapters (engine/lora/step.py), where the engine serves them; the forward
        # adds their deltas while ``lora_active`` (a step with adapters, graph captures
        # and warm-ups, so the kernels are in every graph and compiled before serving).
        self.lora = None
        self.lora_active = False
        # Every forward's final hidden states, in a buffer of their own (graphs write it
        # too): what an MTP drafter reads after the step. None: not kept.
        self.hidden_out: torch.Tensor | None = None
        # A step whose every sequence brings at most this many query tokens (speculative
        # decoding's verification steps, k + 1) runs as a decode step of one row a token
        # (kernels/attention/decode_rows.py), where the attention backend's decode path
        # takes such rows (``decode_rows_max_query_len``); 1: never.
        self.decode_rows_query_len = 1

    def limit_max_model_len(self, max_model_len: int) -> None:
        """Lower the context length (to what the KV pool holds) before graphs are captured."""
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = (max_model_len + self.block_size - 1) // self.block_size

    # -- memory -------------------------------------------------------------------
    def kv_cache_format(self, kv_dtype: torch.dtype) -> tuple[torch.dtype, int]:
        """(element dtype, head size) of this runner's cache rows (``cache_row_format``)."""
        return cache_row_format(self.model_config, self.attn_impl, kv_dtype)

    def kv_bytes_per_block(self, kv_dtype: torch.dtype) -> int:
        """The bytes one KV block of this runner's cache takes."""
        return cache_bytes_per_block(self.model_config, self.attn_impl, kv_dtype,
                                     self.block_size)

    def keep_hidden_states(self, max_tokens: int) -> None:
        """Keep every forward's final hidden states (``hidden_out``), up to ``max_tokens``
        rows: before any graph is captured, so the graphs write them too."""
        self.hidden_out = torch.empty((max_tokens, self.model_config.hidden_size),
                                      dtype=self.dtype, device=self.device)

    def allocate_kv_cache(self, num_blocks: int, kv_dtype: torch.dtype, kv_cache_dtype: str = "auto",
                          num_rings: int = 1) -> None:
        """``num_rings``: the window rings of a model that keeps them (a sequence each)."""
        cfg = self.model_config
        self.kv_cache_dtype = kv_cache_dtype
        dtype, head_size = self.kv_cache_format(kv_dtype)
        self.kv_caches = model_kv_caches(cfg, num_blocks, self.block_size, dtype, self.device,
                                         head_size, num_rings)

    def copy_rings(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole window rings (source ring, target ring), in order, in every layer
        (engine/window_rings.py: a prefix's snapshot, a ring restored from one), queued
        before the step's forward."""
        rings = self.kv_caches[self.model_config.num_layers:]
        for source, target in copies:
            for ring in rings:
                ring[:, target].copy_(ring[:, source])

    @functools.cached_property
    def step_weights(self):  # noqa: ANN201 - a StepWeights (engine/step_weights.py)
        """What one decode step reads (weights by kind), computed once: the self-check,
        the step budget and the bench's roofline all use it."""
        from archserve.engine.step_weights import step_weights
        return step_weights(self.model, self.model_config)

    @torch.inference_mode()
    def profile_peak_activation_bytes(self, num_tokens: int, max_num_seqs: int = 256,
                                      sampled_rows: int | None = None) -> int:
        """Run one prefill step of ``num_tokens`` tokens (as many sequences of at most
        max_model_len tokens as that takes, like the largest real step) through the LM
        head of ``sampled_rows`` rows (default: one a sequence) and return the activation
        peak in bytes."""
        cfg = self.model_config
        dev = self.device
        lens = profile_sequence_lengths(num_tokens, max_num_seqs, self.max_model_len)
        blocks_per_seq = -(-max(lens) // self.block_size)
        row_dtype, head_size = self.kv_cache_format(self.dtype)
        caches = model_kv_caches(cfg, blocks_per_seq * len(lens), self.block_size, row_dtype,
                                 dev, head_size, num_rings=len(lens))
        tables = torch.arange(blocks_per_seq * len(lens), dtype=torch.int32,
                              device=dev).view(len(lens), blocks_per_seq)
        positions = torch.cat([torch.arange(n, device=dev) for n in lens])
        seq_index = torch.repeat_interleave(torch.arange(len(lens), device=dev),
                                            torch.tensor(lens, device=dev))
        rows = ring_rows(cfg)
        slots = (seq_index * rows + positions % rows if rows else
                 tables[seq_index, positions // self.block_size].long() * self.block_size
                 + positions % self.block_size)
        meta = AttentionMetadata.from_lengths(lens, lens, tables, slots, dev)
        ids = torch.zeros(sum(lens), dtype=torch.long, device=dev)
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        with set_forward_context(ForwardContext(meta, caches, self.attn_impl)):
            hidden = self.model(ids, positions)
            # The sampler's logits: one row per sequence (the largest decode batch), or a
            # row per draft too.
            self.model.compute_logits(hidden[:min(sum(lens), sampled_rows or max_num_seqs)])
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
        del caches, hidden
        torch.cuda.empty_cache()
        return int(peak)

    # -- forward ------------------------------------------------------------------
    def _context(self, meta: AttentionMetadata, num_tokens: int,
                 calibrate_kv_scales: bool = False) -> ForwardContext:
        """The forward context of a step of ``num_tokens`` tokens described by ``meta``."""
        lora = self.lora
        return ForwardContext(meta, self.kv_caches, self.attn_impl,
                              kv_cache_dtype=self.kv_cache_dtype,
                              calibrate_kv_scales=calibrate_kv_scales,
                              lora_mapping=(lora.mapping(num_tokens)
                                            if lora is not None and self.lora_active else None),
                              lora_impl=lora.impl if lora is not None else None)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata, calibrate_kv_scales: bool = False) -> torch.Tensor:
        ctx = self._context(meta, input_ids.shape[0], calibrate_kv_scales)
        with set_forward_context(ctx):
            hidden = self.model(input_ids, positions)
        if self.hidden_out is not None:
            self.hidden_out[:hidden.shape[0]].copy_(hidden)
        return hidden

    @contextlib.contextmanager
    def with_lora_kernels(self) -> Iterator[None]:
        """Forwards in this scope run the LoRA kernels (over the mapping the buffer holds)
        whatever the step: graphs captured here contain them, warm-ups compile them."""
        previous, self.lora_active = self.lora_active, self.lora is not None
        try:
            yield
        finally:
            self.lora_active = previous

    @contextlib.contextmanager
    def graph_scope(self) -> Iterator[None]:
        """What a captured graph's forwards run in: inference mode, the linear routines'
        graph-only kernels (``decode_graph_scope``: the tuned Triton GEMVs, cuBLAS
        outside it) and the LoRA kernels. A replay canary's eager step runs in it too, so
        that it launches the kernels the graph replays and differs from the replay only by
        what the replay gets wrong. Outside it the eager step takes cuBLAS where the graph
        has the Triton GEMV, and where activations are quantized to e4m3 on the fly or a
        top-k picks among near-ties, such a last-bit difference can grow past the canary's
        bound (the suspected reason DeepSeek V4's FP8 release lost its graphs, 0.152 on an
        H100, and GLM-5's canary failed once)."""
        with torch.inference_mode(), decode_graph_scope(), self.with_lora_kernels():
            yield

    @torch.inference_mode()
    def warm_up_prefill(self, max_num_batched_tokens: int, max_num_seqs: int = 256
                        ) -> list[list[int]]:
        """Run one eager step per prefill shape class before serving, so no kernel is
        compiled or autotuned on the serving path (a first 128-token prompt on an H200
        otherwise paid 0.74 s to tune the prefill attention bucket it falls in).

        Nothing is written to the cache (slot -1); the outputs are discarded. Returns the
        batches run (``prefill_warm_up_batches``).
        """
        batches = prefill_warm_up_batches(self.max_model_len, max_num_batched_tokens,
                                          max_num_seqs)
        logits = None
        with self.with_lora_kernels():
            for lengths in batches:
                logits = self.run_prefill_probe(lengths)
        if self.device.type == "cuda":
            if logits is not None:   # the greedy argmax kernel, on logits as steps give them
                from archserve.engine.sampler import greedy_argmax
                greedy_argmax(logits)
            torch.cuda.synchronize(self.device)
        return batches

    @torch.inference_mode()
    def run_prefill_probe(self, num_tokens: int | list[int]) -> torch.Tensor:
        """One step of a ``num_tokens``-token prompt (or of prompts of these lengths)
        through each one's sampled row's logits (returned), writing nothing to the cache
        (slot -1): for warm-up and for timing a step. It replays a mixed-step graph where
        one fits (as the step would run when serving), else it runs eagerly."""
        lens = [num_tokens] if isinstance(num_tokens, int) else list(num_tokens)
        dev = self.device
        width = block_table_width(-(-max(lens) // self.block_size))
        meta = AttentionMetadata.from_lengths(
            lens, lens, torch.zeros((len(lens), width), dtype=torch.int32, device=dev),
            torch.full((sum(lens),), -1, dtype=torch.long, device=dev), dev)
        ids = torch.zeros(sum(lens), dtype=torch.long, device=dev)
        positions = torch.cat([torch.arange(n, device=dev) for n in lens])
        last_rows = torch.tensor(lens, device=dev).cumsum(0) - 1
        # Timed for the step budget: a step that a mixed graph would run, runs it here too.
        bucket = (self.mixed_graphs.bucket_for(sum(lens), len(lens), query_len=max(lens))
                  if self.mixed_graphs else None)
        if bucket is not None:
            return self.mixed_graphs.replay(bucket, ids, positions, meta, last_rows)
        return self._forward_rows(ids, positions, meta, last_rows)

    def _forward_rows(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      meta: AttentionMetadata, rows: torch.Tensor,
                      out: torch.Tensor | None = None) -> torch.Tensor:
        """A step through the LM head of ``rows`` only: float32 logits (what mixed graphs
        run), in ``out`` where the LM head can write them there."""
        return self.model.compute_logits(self._forward(input_ids, positions, meta)[rows], out)

    def _forward_logits(self, input_ids: torch.Tensor, positions: torch.Tensor,
                        meta: AttentionMetadata, out: torch.Tensor | None = None
                        ) -> torch.Tensor:
        """A decode step through the LM head: float32 logits of every row (what graphs run),
        in ``out`` where the LM head can write them there."""
        return self.model.compute_logits(self._forward(input_ids, positions, meta), out)

    def capture_cuda_graphs(self, sizes: list[int]) -> None:
        self.graphs = DecodeGraphRunner(self._forward_logits, self.device, max(sizes),
                                        self.max_blocks_per_seq, self.max_model_len)
        start = time.perf_counter()
        with self.graph_scope():
            result = self.graphs.capture(sizes)
            self.graphs.replay_canary(self.kv_caches)
        log.info("captured CUDA graphs for %d decode batch sizes in %.1fs%s", len(result.sizes),
                 time.perf_counter() - start,
                 f"; not captured: {describe_demoted(result.sizes, result.demoted)}"
                 if result.demoted else "")

    def compile_cpu_decode_steps(self, sizes: list[int]):  # noqa: ANN201 - CompiledSteps
        """A compiled decode step per batch size of ``sizes`` (a CPU's counterpart of decode
        graphs: engine/cpu_compiled_step.py), each checked against the eager step; the
        result says which sizes compiled and why others did not."""
        from archserve.engine.cpu_compiled_step import compile_decode_steps
        # Compiled and eager steps round alike; 16-bit: room for a last-bit difference. The
        # canary's steps write their keys and values, which a 16-bit graph's fused rotary
        # rounds up to one ulp off eager's; read back they move a tiny model's logits by up
        # to 1.5 ulps (1.2e-2 of their scale), hence 2e-2.
        tolerance = 2e-3 if self.dtype == torch.float32 else 2e-2
        self.compiled_steps = compile_decode_steps(
            self.model, lambda meta: self._context(meta, meta.num_tokens), self.kv_caches,
            sizes, self.device, tolerance, ring_rows(self.model_config))
        return self.compiled_steps

    def run_compiled_step(self, batch: ModelBatch) -> torch.Tensor | None:
        """Logits of every row from a compiled decode step, or None when none fits."""
        meta = batch.meta
        if (self.compiled_steps is None or not meta.is_pure_decode
                or batch.prompt_logprob_rows):
            return None
        step = self.compiled_steps.steps.get(meta.num_seqs)
        if step is None:
            return None
        batch.apply_fed_ids()
        with set_forward_context(self._context(meta, meta.num_tokens)):
            return step(batch.input_ids, batch.positions)

    def capture_mixed_graphs(self, max_tokens: int, max_num_seqs: int, rows_per_seq: int = 1,
                             max_query_len: int | None = None) -> None:
        """Graphs for steps that carry prompt tokens (or drafts to verify: ``rows_per_seq``
        sampled rows a sequence; ``max_query_len``: only steps whose sequences bring at
        most that many tokens, None: any), at the token buckets up to ``max_tokens``
        (engine/mixed_graphs.py); their replay canary is the caller's to run, once every
        rank holds the same buckets."""
        buckets = mixed_graph_buckets(max_tokens)
        self.mixed_graphs = MixedGraphRunner(self._forward_rows, self.device, max(buckets),
                                             max_num_seqs, self.max_blocks_per_seq,
                                             self.max_model_len, self.block_size, rows_per_seq,
                                             max_query_len)
        start = time.perf_counter()
        with self.graph_scope():
            result = self.mixed_graphs.capture(buckets)
        log.info("captured CUDA graphs for mixed steps at %d token buckets in %.1fs%s",
                 len(result.sizes), time.perf_counter() - start,
                 f"; not captured: {describe_demoted(result.sizes, result.demoted)}"
                 if result.demoted else "")

    def replay_mixed_canary(self) -> str | None:
        """The mixed-step graphs' replay canary, in the scope they were captured in
        (``graph_scope``); run once every rank holds the same buckets."""
        with self.graph_scope():
            return self.mixed_graphs.replay_canary(self.kv_caches)

    def calibrate_kv_scales_on_first_prefill(self, graph_sizes: list[int]) -> None:
        """Measure the fp8 KV scales on the next step that has prompt tokens; then capture
        decode graphs at ``graph_sizes`` (none: decode stays as it is)."""
        self.kv_calibration_pending = True
        self.graph_sizes_after_calibration = list(graph_sizes)

    def _forward_step(self, batch: ModelBatch) -> torch.Tensor:
        """The eager forward of a step; the first one with prompt tokens calibrates the
        KV scales when that is pending."""
        calibrate = self.kv_calibration_pending and not batch.meta.is_pure_decode
        hidden = self._forward(batch.input_ids, batch.positions, batch.meta, calibrate)
        if calibrate:
            self.kv_calibration_pending = False
            log.info("calculate_kv_scales: fp8 KV-cache scales measured on a prefill of %d "
                     "tokens", batch.input_ids.shape[0])
        return hidden

    def _capture_after_calibration(self) -> None:
        if self.graph_sizes_after_calibration and not self.kv_calibration_pending:
            sizes, self.graph_sizes_after_calibration = self.graph_sizes_after_calibration, []
            self.capture_cuda_graphs(sizes)

    def replay_decode_graph(self, batch: ModelBatch) -> torch.Tensor | None:
        """Logits of every row from a captured graph, or None when none fits this batch."""
        meta = batch.meta
        if self.graphs is None or not meta.is_pure_decode or batch.prompt_logprob_rows:
            return None
        size = self.graphs.size_for(meta.num_seqs)
        if size is None:
            return None
        return self.graphs.replay(size, batch.input_ids, batch.positions, meta,
                                  fed_ids=batch.fed_ids)

    def replay_mixed_graph(self, batch: ModelBatch) -> torch.Tensor | None:
        """Logits of the sampled rows from a captured mixed-step graph, or None (eager)."""
        if (self.mixed_graphs is None or batch.prompt_logprob_rows
                or self.kv_calibration_pending):
            return None
        bucket = self.mixed_graphs.bucket_for(batch.input_ids.shape[0], batch.meta.num_seqs,
                                              batch.logits_indices.shape[0],
                                              batch.meta.max_query_len)
        if bucket is None:
            return None
        return self.mixed_graphs.replay(bucket, batch.input_ids, batch.positions, batch.meta,
                                        batch.logits_indices)

    def forward(self, batch: ModelBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A step's forward through the LM head of its sampled rows (``logits_indices``):
        (their float32 logits, None when it samples none; the hidden states of every row
        where it ran eagerly, else None). A captured graph replays where one fits."""
        with phase("forward"):
            row_logits = self.replay_decode_graph(batch)
            if row_logits is None:
                row_logits = self.run_compiled_step(batch)
            if row_logits is None:
                batch.apply_fed_ids()
            sampled_logits = None if row_logits is not None else self.replay_mixed_graph(batch)
            hidden = None
            if row_logits is None and sampled_logits is None:
                hidden = self._forward_step(batch)
        rows = batch.logits_indices.shape[0]
        if rows == 0:
            return None, hidden
        with phase("logits"):
            if sampled_logits is not None:
                logits = sampled_logits   # the graph's LM head ran on the sampled rows only
            elif row_logits is None:
                logits = self.model.compute_logits(hidden[batch.logits_indices])
            elif rows == batch.meta.num_seqs:
                logits = row_logits  # every row sampled, in row order (a decode batch)
            else:
                logits = row_logits[batch.logits_indices]
        return logits, hidden

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledSeq], previous: LaunchedStep | None = None
                ) -> LaunchedStep:
        """One step: forward every scheduled token, sample where a sequence reached its end.

        Returns without waiting for the device. ``previous`` is the step still in flight,
        if any: input tokens that are its placeholders are taken from its device output.
        """
        self._capture_after_calibration()
        with phase("build_batch"):
            lora_packed = None
            if self.lora is not None:
                lora_packed, self.lora_active = self.lora.pack(
                    [c.seq for c in chunks], [c.num_new_tokens for c in chunks])
            batch = build_batch(chunks, self.block_size, self.staging, lora_packed,
                                decode_rows=self.runs_as_decode_rows(chunks))
            if self.lora is not None:
                self.lora.load(batch.lora_mapping)
            if previous is not None:
                previous.feed_pending_inputs(batch, chunks, self.staging)
        logits, hidden = self.forward(batch)
        prompt_logprobs = [] if hidden is None else self._prompt_logprobs(batch, hidden)
        if logits is None:
            return LaunchedStep([], None, prompt_logprobs)
        if self.sampler is None:   # a tensor-parallel rank other than 0: it computes, 0 samples
            return LaunchedStep([], None, prompt_logprobs)
        with phase("sample"):
            result = self.sampler.sample(logits, batch.sample_rows or batch.sampled_seqs,
                                         previous and previous.token_of)
        return LaunchedStep.start_copy(batch.sampled_seqs, result, prompt_logprobs,
                                       batch.sample_rows)

    def runs_as_decode_rows(self, chunks: list[ScheduledSeq]) -> bool:
        """Whether a step with several query tokens in a sequence runs each token as a decode
        row (kernels/attention/decode_rows.py): every sequence brings at most
        ``decode_rows_query_len`` tokens, and a captured decode graph holds that many rows
        (without graphs the rows run eagerly; a larger step keeps its mixed-step bucket,
        whose 16-row minimum a few rows would otherwise pay). A verification step then
        costs what a decode batch of B x (k + 1) rows does: its GEMMs at that many rows
        (the skinny GEMV up to 16) and the decode kernel, not a bucket's padded GEMMs and
        the varlen kernel."""
        if self.decode_rows_query_len <= 1 or self.kv_calibration_pending or not chunks:
            return False
        most = max(c.num_new_tokens for c in chunks)
        if not 1 < most <= self.decode_rows_query_len:
            return False
        return (self.graphs is None
                or self.graphs.size_for(sum(c.num_new_tokens for c in chunks)) is not None)

    def _prompt_logprobs(self, batch: ModelBatch, hidden: torch.Tensor):
        """For sequences that asked: logprob of each prompt token given the ones before it."""
        out = []
        for seq, row_start, row_end, first_pos in batch.prompt_logprob_rows:
            logits = self.model.compute_logits(hidden[row_start:row_end])
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            # Pinned and non-blocking: a pageable copy would wait for the queued step.
            targets = host_to_device(np.asarray(seq.token_ids_slice(
                first_pos + 1, first_pos + 1 + row_end - row_start), dtype=np.int64),
                logprobs.device)
            out.append((seq, first_pos, logprobs, targets))
        return out
