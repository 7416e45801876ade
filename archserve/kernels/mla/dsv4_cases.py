"""Random paged problems of DeepSeek V4's attention: the kernel tests' and the numerics canary's.

A case is a layer (random sinks, position biases, norm weights, rope) and a batch of
sequences, each (history, query_len): the reference (kernels/compressed_attention/
reference.py) first runs the history in two steps, the first ending inside a group, so the
cache holds what a real run leaves (entries, index keys, open and closed accumulators, on
shuffled blocks; each sequence's window keys in a ring of its own, the rings shuffled too);
the step under test then brings ``query_len`` tokens of random projections.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from archserve.kernels.attention.interface import AttentionMetadata
from archserve.kernels.compressed_attention import reference
from archserve.kernels.compressed_attention.interface import (
    CompressedLayerParams,
    CompressedStepInputs,
    CompressorParams,
)
from archserve.kernels.compressed_attention.layout import CompressedCacheLayout


@dataclass
class CompressedCase:
    layout: CompressedCacheLayout
    layer: CompressedLayerParams
    kv_cache: torch.Tensor          # after the history
    ring_cache: torch.Tensor        # after the history
    meta: AttentionMetadata         # the step under test
    inputs: CompressedStepInputs
    num_valid_tokens: int

    def run(self, impl) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """(the real rows' output [T, H, D], (the block cache, the rings) after the
        step)."""
        cache, rings = self.kv_cache.clone(), self.ring_cache.clone()
        out = impl.forward_compressed(self.layout, self.layer, self.inputs, cache, rings,
                                      self.meta)
        return out[:self.num_valid_tokens], (cache, rings)


class _Random:
    def __init__(self, seed: int, dtype: torch.dtype, device: str) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.dtype, self.device = dtype, device

    def __call__(self, *shape: int, std: float = 1.0, dtype: torch.dtype | None = None
                 ) -> torch.Tensor:
        x = torch.randn(*shape, generator=self.gen) * std
        return x.to(dtype or self.dtype).to(self.device)


def make_layer(layout: CompressedCacheLayout, num_heads: int, rope_dim: int, topk: int,
               rand: _Random) -> CompressedLayerParams:
    compressor = None
    if layout.compress_rate:
        series = 2 if layout.overlap else 1
        m, d, di = layout.compress_rate, layout.head_dim, layout.index_dim
        compressor = CompressorParams(
            m, layout.overlap, rand(m, series * d, dtype=torch.float32),
            1 + rand(d, std=0.1),
            rand(m, series * di, dtype=torch.float32) if di else None,
            1 + rand(di, std=0.1) if di else None)
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    return CompressedLayerParams(
        window=layout.window, head_dim=layout.head_dim, rope_dim=rope_dim,
        scale=layout.head_dim ** -0.5, sinks=rand(num_heads, dtype=torch.float32),
        eps=1e-6, inv_freq=inv_freq.to(rand.device), compressor=compressor,
        index_topk=topk if layout.index_dim else 0)


def step_inputs(layout: CompressedCacheLayout, layer: CompressedLayerParams, num_tokens: int,
                num_heads: int, index_heads: int, rand: _Random) -> CompressedStepInputs:
    d, di = layout.head_dim, layout.index_dim
    inputs = CompressedStepInputs(query=rand(num_tokens, num_heads, d),
                                  kv=rand(num_tokens, d))
    if layout.compress_rate:
        series = 2 if layout.overlap else 1
        inputs.compressor_kv = rand(num_tokens, series * d)
        inputs.compressor_gate = rand(num_tokens, series * d)
    if di:
        inputs.index_kv, inputs.index_gate = rand(num_tokens, 2 * di), rand(num_tokens, 2 * di)
        inputs.index_query = rand(num_tokens, index_heads, di)
        inputs.index_weights = rand(num_tokens, index_heads, std=(index_heads * di) ** -0.5,
                                    dtype=torch.float32)
    return inputs


def _metadata(tables: torch.Tensor, rings: list[int], ring_rows: int,
              spans: list[tuple[int, int]], device: str) -> AttentionMetadata:
    """The step of (start, end) positions per sequence (a sequence with start == end sits
    the step out: a graph's padding slot), sequence i's keys in ring ``rings[i]``."""
    query_lens = [end - start for start, end in spans]
    seq_lens = [end if end > start else 0 for start, end in spans]
    slots = [ring * ring_rows + p % ring_rows
             for ring, (start, end) in zip(rings, spans, strict=True) for p in range(start, end)]
    return AttentionMetadata.from_lengths(query_lens, seq_lens, tables,
                                          torch.tensor(slots, dtype=torch.int64), device)


def make_compressed_case(seqs: list[tuple[int, int]], *, num_heads: int = 16,
                         head_dim: int = 64, rope_dim: int = 16, window: int = 8,
                         compress_rate: int = 4, overlap: bool = True, index_dim: int = 16,
                         index_heads: int = 8, topk: int = 3, block_size: int = 16,
                         dtype: torch.dtype = torch.float32, device: str = "cpu",
                         seed: int = 0, run_history: bool = True) -> CompressedCase:
    """``seqs``: (history tokens, this step's tokens) per sequence; ``compress_rate`` 0 is a
    sliding-window-only layer; ``overlap`` with ``index_dim``: compressed sparse.
    ``run_history`` False leaves the history's cache as allocated, for callers that only
    compile the step's kernels (the reference's history at long contexts takes seconds)."""
    rand = _Random(seed, dtype, device)
    layout = CompressedCacheLayout(block_size, head_dim, window, compress_rate,
                                   overlap and bool(compress_rate),
                                   index_dim if overlap and compress_rate else 0, dtype)
    layer = make_layer(layout, num_heads, rope_dim, topk, rand)
    blocks = [-(-(h + q) // block_size) for h, q in seqs]
    physical = torch.randperm(sum(blocks) + 2, generator=rand.gen)
    tables = torch.zeros(len(seqs), max(blocks), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = physical[used:used + n].to(torch.int32)
        used += n
    cache = layout.allocate(sum(blocks) + 2, device)
    rings = torch.randperm(len(seqs) + 1, generator=rand.gen)[:len(seqs)].tolist()
    ring_cache = layout.allocate_rings(len(seqs) + 1, device)
    tables = tables.to(device)
    # The history in two steps, the first ending inside a group (and a window).
    cut = [h * 2 // 3 + 1 if h > 1 else h for h, _ in seqs]
    history = ([(0, c) for c in cut], [(c, h) for c, (h, _) in zip(cut, seqs, strict=True)])
    for spans in history if run_history else ():
        meta = _metadata(tables, rings, layout.ring_rows, spans, device)
        if meta.num_tokens:
            reference.forward_compressed(
                layout, layer, step_inputs(layout, layer, meta.num_tokens, num_heads,
                                           index_heads, rand), cache, ring_cache, meta)
    meta = _metadata(tables, rings, layout.ring_rows, [(h, h + q) for h, q in seqs], device)
    inputs = step_inputs(layout, layer, meta.num_tokens, num_heads, index_heads, rand)
    return CompressedCase(layout, layer, cache, ring_cache, meta, inputs, meta.num_tokens)


def with_padding(case: CompressedCase, extra_seqs: int) -> CompressedCase:
    """The case's decode step as a CUDA graph replays it: ``extra_seqs`` more sequences of
    one token each at position 0, slot -1 and block 0 (engine/cuda_graphs.py's padding),
    which must write nothing."""
    meta = case.meta
    tables = torch.cat((meta.block_tables, meta.block_tables.new_zeros(
        extra_seqs, meta.block_tables.shape[1])))
    total = meta.num_seqs + extra_seqs
    starts = torch.arange(total + 1, dtype=torch.int32, device=meta.seq_lens.device)
    seq_lens = torch.cat((meta.seq_lens, meta.seq_lens.new_ones(extra_seqs)))
    slots = torch.cat((meta.slot_mapping, meta.slot_mapping.new_full((extra_seqs,), -1)))
    padded = replace(meta, query_start_loc=starts, seq_lens=seq_lens, block_tables=tables,
                     slot_mapping=slots, num_seqs=total,
                     query_lens_cpu=meta.query_lens_cpu + [1] * extra_seqs,
                     seq_lens_cpu=meta.seq_lens_cpu + [1] * extra_seqs)
    inputs = CompressedStepInputs(*(
        None if t is None else torch.cat((t, t[:1].expand(extra_seqs, *t.shape[1:])))
        for t in (getattr(case.inputs, f.name) for f in fields(case.inputs))))
    return replace(case, meta=padded, inputs=inputs)


def compare_compressed_with_reference(case: CompressedCase, impl) -> str | None:  # noqa: ANN001
    """None if ``impl`` matches TORCH_REFERENCE's forward_compressed on ``case``."""
    from archserve.kernels.attention.cases import compare_runs, tolerance
    from archserve.kernels.mla.torch_mla import TorchMlaImpl
    return compare_runs(case, impl, TorchMlaImpl(), tolerance(case.inputs.query.dtype))
