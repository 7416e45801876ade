"""CUDA graphs for decode steps, captured after an eager warm-up (DESIGN principle 5).

One graph per batch size in a ladder; a decode batch of ``b`` sequences replays the
smallest captured size >= b with the tail padded (slot -1: nothing is written; the
padded rows' outputs are discarded). A size whose capture fails is demoted with its
reason recorded: its batches replay the next larger graph (eager only above the largest);
the other sizes keep their graphs.

The graphs end with the LM head: every decode row is sampled, and an eager LM head after
the replay cost the host 4-7 ms per batch-256 step on an H200 (``aten::mm`` blocked while
the graph ran). Each graph writes its output into one shared static buffer, so the sizes
do not each keep a [size, vocab] tensor alive.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from archserve.engine.batch import block_table_width
from archserve.kernels.attention.interface import AttentionMetadata

log = logging.getLogger(__name__)


# KV blocks the replay canary fills with random values (and restores after): a few suffice
# for rows to read different data.
CANARY_BLOCKS = 16


def weak_callback(fn: Callable) -> Callable:
    """``fn``, not keeping the object of a bound method alive. A model runner owns its graph
    runners and they call back into it: held strongly, that cycle leaves a dropped engine to
    the cyclic collector, which never sees an engine's frozen start-up heap (engine/heap.py)."""
    if not inspect.ismethod(fn):
        return fn
    method = weakref.WeakMethod(fn)
    return lambda *args, **kwargs: method()(*args, **kwargs)


def random_cache_values(shape: torch.Size, dtype: torch.dtype, generator: torch.Generator,
                        device: torch.device) -> torch.Tensor:
    """Random contents for cache blocks: normal values, or for a cache of bytes (sparse
    MLA's fp8 rows, kernels/sparse_mla/layout.py) bytes below 0x38, which read back finite
    as any part (an e4m3 value below 1, an fp32 or 16-bit float of small magnitude)."""
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator, device=device)
    return torch.randint(0, 0x38, shape, generator=generator, device=device, dtype=dtype)


# The default ladder's largest decode graph where verification steps run as decode rows
# (B x (k + 1) rows): each size's graph holds float32 logits of every row, and past a few
# hundred rows an 8B model's GEMMs near compute-bound, where a mixed-step bucket, which
# reads a sequence's keys once per query tile rather than once a row, costs no more.
DECODE_ROWS_GRAPH_LIMIT = 512


def decode_graph_sizes(max_num_seqs: int, rows_per_seq: int = 1) -> list[int]:
    """The default decode graph sizes: the ladder up to ``max_num_seqs``, or where
    verification steps run as decode rows (``rows_per_seq`` = k + 1 a sequence) up to
    that many rows a sequence, at most DECODE_ROWS_GRAPH_LIMIT, the largest such step
    itself included (a full batch verifying k drafts replays a graph, not a bucket)."""
    if rows_per_seq <= 1:
        return default_graph_sizes(max_num_seqs)
    rows = max(max_num_seqs, min(max_num_seqs * rows_per_seq, DECODE_ROWS_GRAPH_LIMIT))
    sizes = default_graph_sizes(rows)
    return sizes if sizes[-1] == rows else [*sizes, rows]


def default_graph_sizes(max_num_seqs: int) -> list[int]:
    ladder = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 1025, 32))
    return [s for s in ladder if s <= max_num_seqs] or [1]


def replay_mismatch(eager: torch.Tensor, replayed: torch.Tensor, tolerance: float,
                    what: str) -> str | None:
    """Why a replayed output differs from the eager one beyond ``tolerance`` (relative to
    the output's scale, at least 1), or None when it does not."""
    err = (eager - replayed).abs().max().item()
    scale = max(1.0, eager.abs().max().item())
    if not torch.isfinite(replayed).all() or err > tolerance * scale:
        return f"{what}: max error {err:.3g} against eager"
    return None


@dataclass
class GraphSet:
    sizes: list[int] = field(default_factory=list)         # captured, ascending
    demoted: dict[int, str] = field(default_factory=dict)  # size -> reason
    graphs: dict[int, torch.cuda.CUDAGraph] = field(default_factory=dict)


def load_block_tables(static: torch.Tensor, tables: torch.Tensor) -> None:
    """Copy a batch's block tables into the first rows and columns of a graph's ``static``
    ones (as wide as the longest table a sequence can have, rounded as a batch's is)."""
    static[:tables.shape[0], :tables.shape[1]].copy_(tables, non_blocking=True)


def describe_demoted(sizes: list[int], demoted: dict[int, str]) -> str:
    """What a demoted size's batches run: the next larger captured graph, else eager."""
    parts = []
    for size, reason in sorted(demoted.items()):
        larger = [s for s in sizes if s > size]
        runs = f"replays the size-{larger[0]} graph" if larger else "runs eager"
        parts.append(f"size {size} {runs} ({reason})")
    return "; ".join(parts)


class StaticGraphRunner:
    """Graphs captured over static input buffers, one per size of a ladder, all writing one
    shared output buffer. A subclass owns the buffers and says what one size runs."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.set = GraphSet()
        self.pool = None
        self.output: torch.Tensor | None = None  # rows of the largest size, written by every graph

    def _forward_at(self, size: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The step of ``size`` over the static buffers (eager; captured by ``capture``);
        ``out``: the shared output buffer, whose first rows it may write its output into
        (the result says whether it did)."""
        raise NotImplementedError

    def _before_capture(self, size: int) -> None:
        """Fill the static buffers with a step worth warming up and tuning on (default:
        leave them as they are)."""

    def capture(self, sizes: list[int]) -> GraphSet:
        for size in sorted(sizes, reverse=True):  # largest first: later graphs reuse its pool
            graph = None
            try:
                self._before_capture(size)
                # Warm this exact shape eagerly first, so lazy initialisation (cuBLAS
                # workspaces, Triton compilation) happens outside the capture.
                warm = self._forward_at(size)
                if self.output is None:  # the largest size comes first
                    self.output = torch.empty_like(warm)
                del warm
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    out = self._forward_at(size, self.output)
                    target = self.output[:out.shape[0]]
                    if (out.data_ptr(), out.stride()) != (target.data_ptr(), target.stride()):
                        target.copy_(out)       # not written in place
                    del out
                if self.pool is None:
                    self.pool = graph.pool()
                self.set.graphs[size] = graph
            except Exception as exc:  # demote this size only
                reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                self.set.demoted[size] = reason
                log.warning("%s capture for size %d failed (%s); its steps replay the next "
                            "larger graph, or run eager above the largest",
                            type(self).__name__, size, reason)
                del graph   # with its private pool: blocks cached there are freed only by
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()   # this, and the next capture may need them
        self.set.sizes = sorted(self.set.graphs)
        return self.set

    def size_for(self, n: int) -> int | None:
        for size in self.set.sizes:
            if size >= n:
                return size
        return None

    def replay_canary(self, kv_caches: list[torch.Tensor] | tuple = (),
                      tolerance: float = 2e-2) -> str | None:
        """Replay the smallest and the largest graph against the same step run eagerly
        (``_canary_at``: a step unlike the capture's).

        A kernel that bakes a host-side value into the capture replays a stale value; then
        every graph is dropped (its steps run eager) with the reason. The caller runs this
        in the scope the graphs were captured in (ModelRunner.graph_scope), so the eager
        step launches the kernels the graph replays; and it runs at the graph's bound
        (max_seq_len = max_model_len), as a replay does, with the true per-sequence
        lengths: kernels that choose their path or splits from that bound (a sparse MLA
        that attends densely below top-k keys, a split count) then run the same path both
        ways, and only a baked value differs. Otherwise a last-bit difference from another
        kernel's summation order can grow past the bound: with FP8 activations quantized on
        the fly it moves a value to the next e4m3 step. The step reads KV
        blocks filled with random values, with host-side lengths unlike the capture's: on
        an all-zero cache every wrong length gives the same zero output, and the check
        could not fail. The blocks are restored after: graphs captured mid-run (after
        ``calculate_kv_scales``' first prefill) must not overwrite live sequences' KV.
        """
        if not self.set.sizes:
            return None
        # [2, blocks, block_size, Hkv, D] per layer: only the blocks the canary's tables use.
        touched = [kv[:, :self._canary_blocks()] for kv in kv_caches]
        saved = [blocks.clone() for blocks in touched]
        generator = torch.Generator(device=self.device).manual_seed(0)
        for blocks in touched:
            blocks.copy_(random_cache_values(blocks.shape, blocks.dtype, generator, self.device))
        try:
            for size in sorted({self.set.sizes[0], self.set.sizes[-1]}):
                reason = self._canary_at(size, tolerance)
                if reason is not None:
                    self.drop_all(reason)
                    return reason
            return None
        finally:
            for blocks, before in zip(touched, saved, strict=True):
                blocks.copy_(before)

    def _canary_blocks(self) -> int:
        """How many KV blocks the canary's rows use (row r reads block r mod this): no more
        than one sequence's, which the pool always holds."""
        return min(CANARY_BLOCKS, self.max_blocks_per_seq)

    def _canary_at(self, size: int, tolerance: float) -> str | None:
        """None when the graph of ``size`` replays a step as it runs eagerly, else why not."""
        raise NotImplementedError

    def keep_only(self, sizes: list[int], reason: str) -> None:
        """The graphs of other sizes go (their steps replay a larger one, or run eager),
        with the reason recorded per size: e.g. sizes some other rank lacks."""
        for size in [s for s in self.set.sizes if s not in sizes]:
            self.set.demoted[size] = reason
            del self.set.graphs[size]
        self.set.sizes = sorted(self.set.graphs)

    def drop_all(self, reason: str) -> None:
        """Every graph goes (its steps run eager), with the reason recorded per size."""
        for s in list(self.set.sizes):
            self.set.demoted[s] = reason
        self.set.graphs.clear()
        self.set.sizes = []
        log.warning("%s: CUDA graphs disabled: %s", type(self).__name__, reason)


class DecodeGraphRunner(StaticGraphRunner):
    """Owns the static input buffers and the captured decode graphs of one model runner."""

    def __init__(self, forward, device: torch.device, max_size: int, max_blocks_per_seq: int,
                 max_model_len: int) -> None:
        super().__init__(device)
        # callable(input_ids, positions, meta, out) -> [T, ...] output (``_forward_at``)
        self.forward = weak_callback(forward)
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = max_blocks_per_seq
        n = max_size
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((n, block_table_width(max_blocks_per_seq)),
                                        dtype=torch.int32, device=device)

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size], slot_mapping=self.slot_mapping[:size],
            max_query_len=1, max_seq_len=self.max_model_len, num_seqs=size,
            query_lens_cpu=[1] * size, seq_lens_cpu=[self.max_model_len] * size)

    def _forward_at(self, size: int, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.forward(self.input_ids[:size], self.positions[:size], self._meta(size),
                            None if out is None else out[:size])

    def _canary_at(self, size: int, tolerance: float) -> str | None:
        rows = torch.arange(size, dtype=torch.long, device=self.device)
        positions = 3 + rows % 7
        lengths = [3 + r % 7 + 1 for r in range(size)]
        meta = self._meta(size)
        meta.seq_lens = (positions + 1).to(torch.int32)
        meta.seq_lens_cpu = lengths    # max_seq_len: the graph's bound (replay_canary)
        meta.slot_mapping = torch.full((size,), -1, dtype=torch.long, device=self.device)
        meta.block_tables = (rows % self._canary_blocks()).to(torch.int32)[:, None]
        ids = 5 + rows % 11
        with torch.inference_mode():
            eager = self.forward(ids, positions, meta).float()
            replayed = self.replay(size, ids, positions, meta).float()
        return replay_mismatch(eager, replayed, tolerance, f"graph replay canary (batch {size})")

    def replay(self, size: int, input_ids: torch.Tensor, positions: torch.Tensor,
               meta: AttentionMetadata, fed_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``fed_ids``: the first input ids, in place of ``input_ids``' (ModelBatch.fed_ids)."""
        b = meta.num_seqs
        static = (self.input_ids, self.positions, self.slot_mapping, self.seq_lens,
                  self.block_tables)
        step = (input_ids, positions, meta.slot_mapping, meta.seq_lens, meta.block_tables)
        if not _load_in_one_kernel(size, static, step, fed_ids):
            self.input_ids[:b].copy_(input_ids, non_blocking=True)
            if fed_ids is not None:
                self.input_ids[:fed_ids.shape[0]].copy_(fed_ids)
            self.positions[:b].copy_(positions, non_blocking=True)
            self.slot_mapping[:b].copy_(meta.slot_mapping, non_blocking=True)
            self.seq_lens[:b].copy_(meta.seq_lens, non_blocking=True)
            load_block_tables(self.block_tables, meta.block_tables)
            if b < size:   # rows the graph runs past the batch: no cache write, one key each
                self.slot_mapping[b:size].fill_(-1)
                self.seq_lens[b:size].fill_(1)
                self.block_tables[b:size].zero_()
        self.set.graphs[size].replay()
        return self.output[:b]


def _load_in_one_kernel(size: int, static: tuple[torch.Tensor, ...],
                        step: tuple[torch.Tensor, ...], fed_ids: torch.Tensor | None) -> bool:
    """The step's inputs into the static buffers by one Triton launch
    (kernels/elementwise/triton_graph_inputs.py) where the fusion "graph_inputs" is on and
    the inputs suit it: False, nothing done, elsewhere."""
    from archserve.kernels.elementwise import fusion_enabled
    if not fusion_enabled("graph_inputs", static[0].device):
        return False
    from archserve.kernels.elementwise.triton_graph_inputs import (
        graph_inputs_unsupported,
        load_graph_inputs_triton,
    )
    if graph_inputs_unsupported(size, static, step, fed_ids) is not None:
        return False
    load_graph_inputs_triton(size, static, step, fed_ids)
    return True
