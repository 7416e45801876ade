"""TRITON_MLA_SPARSE_DSV4: DeepSeek V4's attention from archserve's Triton kernels.

Per layer and step (the contract: kernels/compressed_attention/interface.py):

1. compressed layers: the compressor's emit and carry launches
   (kernels/compressed_attention/triton_compressor.py): the entries (and index keys) of the
   groups the step completes, the accumulators it leaves;
2. compressed sparse layers: each query row's indexer scores over the entries complete at
   its position (sparse MLA's scoring kernel, over V4's entry rows) and its top-k (sparse
   MLA's radix select); a row that sees no more than top-k takes them all;
3. the attention kernel over each row's window (its sequence's ring), its entries and the
   sinks (kernels/compressed_attention/triton_attention.py), then the step's keys into the
   ring.

A decode step's per-row inputs come from the step's device tensors with torch ops (what a
CUDA graph replays), a prompt step's from its host lengths.
"""

from __future__ import annotations

import numpy as np
import torch

from archserve.kernels.attention.interface import AttentionMetadata
from archserve.kernels.compressed_attention.interface import (
    CompressedLayerParams,
    CompressedStepInputs,
)
from archserve.kernels.compressed_attention.layout import CompressedCacheLayout
from archserve.kernels.compressed_attention.triton_attention import (
    RowInputs,
    attention_triton,
    write_window_triton,
)
from archserve.kernels.compressed_attention.triton_compressor import compress_triton
from archserve.kernels.sparse_mla.triton_indexer import IndexKeySource, select_top_keys
from archserve.platform.detect import device_info_for


class TritonDsv4Impl:
    graph_capturable = True

    def __init__(self, device=None, spec=None) -> None:  # noqa: ANN001
        self.device = device
        self.spec = spec
        self.num_sms = (getattr(device, "multiprocessor_count", None) or 0) if device else 0
        # The step's per-row inputs and per-(window, rate) key counts, made by its first
        # layer and read by the others (a decode graph records them once): (the step's
        # metadata, its rows, the counts).
        self._step: tuple[AttentionMetadata, RowInputs, dict] | None = None

    def _sm_count(self, tensor: torch.Tensor) -> int:
        if self.num_sms == 0:
            self.num_sms = device_info_for(tensor.device).multiprocessor_count or 0
        return self.num_sms

    def _rows(self, meta: AttentionMetadata, num_rows: int) -> tuple[RowInputs, dict]:
        if self._step is None or self._step[0] is not meta:
            self._step = (meta, step_rows(meta, num_rows), {})
        return self._step[1], self._step[2]

    def forward_compressed(self, layout: CompressedCacheLayout, layer: CompressedLayerParams,
                           inputs: CompressedStepInputs, kv_cache: torch.Tensor,
                           ring_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The CompressedAttentionImpl contract (kernels/compressed_attention/interface.py)."""
        if layer.compressor is not None:
            compress_triton(layout, layer, inputs.compressor_kv, inputs.compressor_gate,
                            inputs.index_kv, inputs.index_gate, kv_cache, meta)
        rows, counts = self._rows(meta, inputs.query.shape[0])
        rate, window = layout.compress_rate, layout.window
        key = (window, rate)
        if key not in counts:
            n_window = torch.clamp(rows.position + 1, min=0, max=window)
            visible = (torch.div(rows.position + 1, rate, rounding_mode="floor").clamp(min=0)
                       if rate else torch.zeros_like(n_window))
            counts[key] = (n_window, visible.to(torch.int32),
                           (n_window + visible).to(torch.int32))
        n_window, visible, key_counts = counts[key]
        ring_key = ("ring", layout.ring_rows)
        if ring_key not in counts:
            counts[ring_key] = rows.ring_starts(meta.slot_mapping, layout.ring_rows)
        longest = meta.max_seq_len // rate if rate else 0
        indices, max_entries = None, longest
        if layout.index_dim:
            indices, selected = self._select(layout, layer, inputs, kv_cache, meta, rows,
                                             visible, longest)
            key_counts = (n_window + selected).to(torch.int32)
            max_entries = min(longest, layer.index_topk)
        out = attention_triton(layout, inputs.query, inputs.kv, kv_cache, ring_cache,
                               meta.block_tables, layer.sinks, layer.scale, rows,
                               counts[ring_key], key_counts, indices,
                               min(window, meta.max_seq_len) + max_entries,
                               self._sm_count(inputs.kv))
        write_window_triton(layout, inputs.kv, ring_cache, meta, meta.num_seqs,
                            meta.max_query_len)
        return out

    def _select(self, layout: CompressedCacheLayout, layer: CompressedLayerParams,
                inputs: CompressedStepInputs, kv_cache: torch.Tensor, meta: AttentionMetadata,
                rows: RowInputs, visible: torch.Tensor, longest: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(int32 [R, topk] entries, -1 padded; int32 [R] how many) of the step's rows:
        sparse MLA's selection over the layer's index keys (an entry's key in its block's
        index rows)."""
        keys = IndexKeySource(layout.block_span(kv_cache), layout.block_size * layout.row_bytes,
                              layout.index_dim * layout.elem, layout.entries_per_block,
                              layout.index_offset)
        decode = meta.max_query_len <= 1
        return select_top_keys(keys, meta.block_tables, inputs.index_query,
                               inputs.index_weights, rows.seq, visible, longest,
                               layer.index_topk, None if decode else meta.query_lens_cpu,
                               self._sm_count(visible))


def step_rows(meta: AttentionMetadata, num_rows: int) -> RowInputs:
    """Each query row's sequence, position, step start and the row of that start: from the
    step's device tensors for a decode step (row i is sequence i), else from host lengths."""
    device = meta.seq_lens.device
    index = torch.arange(num_rows + 1, dtype=torch.int32, device=device)
    if meta.max_query_len <= 1:
        seq = index[:num_rows]
        position = (meta.seq_lens[:num_rows] - 1).to(torch.int32)
        return RowInputs(seq, position, position, meta.query_start_loc[:num_rows], index)
    query_lens = np.asarray(meta.query_lens_cpu, dtype=np.int64)
    seq_lens = np.asarray(meta.seq_lens_cpu, dtype=np.int64)
    firsts = np.cumsum(query_lens) - query_lens
    seq = np.repeat(np.arange(len(query_lens)), query_lens)
    start = np.repeat(seq_lens - query_lens, query_lens)
    fresh = np.repeat(firsts, query_lens)
    position = start + np.arange(len(seq)) - fresh
    pad = num_rows - len(seq)        # rows past the sequences' (padding): no keys
    arrays = [np.concatenate((a, np.full(pad, fill, dtype=np.int64)))
              for a, fill in ((seq, 0), (position, -1), (start, 0), (fresh, 0))]
    seq_t, position_t, start_t, fresh_t = (torch.from_numpy(a.astype(np.int32)).to(device)
                                           for a in arrays)
    return RowInputs(seq_t, position_t, start_t, fresh_t, index)
