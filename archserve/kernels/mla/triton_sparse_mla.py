"""TRITON_MLA_SPARSE: DeepSeek sparse attention from archserve's Triton kernels (the MLA
decode kernel here, the sparse pieces below it in kernels/sparse_mla/).

Per layer and step:

1. this step's latents and indexer keys into the layer's cache rows (kernels/sparse_mla/triton_rows.py);
2. each query row's indexer scores over the keys it sees (sparse_mla/triton_indexer.py) and its
   top-k (sparse_mla/triton_topk.py): token positions that stay on the device;
3. the MLA decode kernel in its indexed form over those positions, for decode and prompt
   rows alike (kernels/mla/triton_mla_decode.py: absorbed query, head blocks, split-KV, the
   merge and W_UV in one kernel), reading only the selected latent rows through the block
   table.

A layer that shares an earlier layer's selection (GLM-5) skips 1's key and 2. A row that
sees no more than ``topk`` keys attends to all of them; a step where every row does (the
step's longest context, a host int, at most topk) is dense MLA and runs TRITON_MLA's path
over the latent: the absorbed decode kernel, and for prompts the expanded prefill (an
fp8_ds_mla latent, which that prefill cannot read, takes the indexed kernel over every
position instead). A decode step in a CUDA graph is sized by max_model_len: there it is
dense only for models whose max_model_len is at most topk.

A step whose sequences bring at most a few query tokens each (a speculative verification:
kernels/attention/decode_rows.py) takes every token as a decode row, from device lengths: the
indexer scores and selects per row with the row's causal length, as in a decode step, so
the mixed-step graphs that replay verification steps capture it (engine/mixed_graphs.py).

The indexer's score buffer holds fp32 rows of the longest context; rows are processed in
groups of at most triton_indexer's SCORES_BUDGET_BYTES of it.
"""

from __future__ import annotations

import numpy as np
import torch

from archserve.kernels.attention.decode_rows import all_decode_rows, host_decode_rows
from archserve.kernels.attention.interface import AttentionMetadata
from archserve.kernels.mla.interface import DECODE_ROWS_MAX_QUERY_LEN, absorb_query
from archserve.kernels.mla.triton_mla import TritonMlaImpl
from archserve.kernels.mla.triton_mla_decode import mla_decode
from archserve.kernels.sparse_mla.interface import IndexerInputs
from archserve.kernels.sparse_mla.layout import SparseMlaLayout
from archserve.kernels.sparse_mla.triton_indexer import IndexKeySource, select_top_keys
from archserve.kernels.sparse_mla.triton_rows import e4m3_read_as_bits, write_sparse_rows
from archserve.kernels.sparse_mla.triton_topk import select_topk_triton


class TritonSparseMlaImpl(TritonMlaImpl):
    graph_capturable = True

    def __init__(self, device=None, spec=None, layout: SparseMlaLayout | None = None,  # noqa: ANN001
                 fp8_bytes: bool | None = None) -> None:
        super().__init__(device, spec, fp8_bytes)
        self.layout = layout if layout is not None else SparseMlaLayout.for_spec(spec)
        # The indexed decode kernel's tiles when the start-up timing chose other than the
        # rule's (kernels/mla/tuning.py); None: the rule's.
        self.sparse_tiles: tuple | None = None

    def _bits(self, device: torch.device) -> bool:
        return self.fp8_bytes if self.fp8_bytes is not None else e4m3_read_as_bits(device)

    def forward_sparse(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                       kv_cache: torch.Tensor, meta: AttentionMetadata, w_uk: torch.Tensor,
                       w_uv: torch.Tensor, scale: float, topk: int,
                       indexer: IndexerInputs | None = None,
                       shared_indices: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The SparseMlaImpl contract (kernels/sparse_mla/interface.py). The selection is
        None where the step is dense (a sharing layer's step is then dense too)."""
        layout = self.layout
        write_sparse_rows(layout, kv_cache, meta.slot_mapping, latent,
                          indexer.key if indexer is not None else None)
        if meta.max_seq_len <= topk and not layout.latent_fp8:
            return self._dense(q_nope, q_pe, kv_cache, meta, w_uk, w_uv, scale), None
        row_seq, row_len = self._rows(meta, q_nope.shape[0])
        rows = row_seq.shape[0]
        # The indexed decode reads its metadata before PDL's wait (kernels/pdl.py): none of
        # it may come from the kernel launched right before it (the absorbed query's).
        starts = torch.arange(rows + 1, dtype=torch.int32, device=row_seq.device)
        if indexer is not None:
            indices, counts = self._select(indexer, kv_cache, meta, row_seq, row_len, topk)
        elif shared_indices is not None:
            indices, counts = shared_indices, row_len.clamp(max=topk)
        else:   # a sharing layer after a dense step (an fp8_ds_mla latent): every key
            indices, counts = select_topk_triton(row_len.new_empty(row_len.shape[0], 0),
                                                 row_len, topk)
        out = torch.empty(*q_nope.shape[:2], w_uv.shape[-1], dtype=q_nope.dtype,
                          device=q_nope.device)
        query = absorb_query(q_nope, q_pe, w_uk)
        values = mla_decode(query, kv_cache, meta.block_tables, counts, starts, out,
                            num_seqs=rows, max_seq_len=min(topk, max(meta.max_seq_len, 1)),
                            scale=scale, num_sms=self._sm_count(query), tiles=self.sparse_tiles,
                            e4m3_bits=self._bits(query.device) if layout.latent_fp8 else None,
                            w_uv=w_uv, indices=indices, row_seq=row_seq, layout=layout)
        return values, indices

    def _dense(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
               meta: AttentionMetadata, w_uk: torch.Tensor, w_uv: torch.Tensor,
               scale: float) -> torch.Tensor:
        """Every row sees at most topk keys: TRITON_MLA over the latent (its rows written)."""
        return self.attend(q_nope, q_pe, self.layout.latent_view(kv_cache), meta, w_uk, w_uv,
                           scale, 1.0)

    def _rows(self, meta: AttentionMetadata, num_tokens: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the block-table row, the keys seen) of each query row: for a decode step the
        step's own device tensors (what a CUDA graph replays), for a step of decode rows
        (``all_decode_rows``) the same from the device lengths (decode_rows.py), else from
        host lengths."""
        device = meta.seq_lens.device
        if meta.max_query_len <= 1:   # row i is sequence i (tokens past them are padding)
            return (torch.arange(meta.num_seqs, dtype=torch.int32, device=device),
                    meta.seq_lens)
        if all_decode_rows(meta, DECODE_ROWS_MAX_QUERY_LEN):
            return self.step_rows(meta, num_tokens)
        _, row_seq, row_len = host_decode_rows(meta.query_lens_cpu, meta.seq_lens_cpu)
        return (torch.from_numpy(row_seq.astype(np.int32)).to(device),
                torch.from_numpy(row_len.astype(np.int32)).to(device))

    def _select(self, indexer: IndexerInputs, kv_cache: torch.Tensor, meta: AttentionMetadata,
                row_seq: torch.Tensor, row_len: torch.Tensor, topk: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(int32 [T, topk] positions, int32 [T] valid entries) of the step's rows."""
        # Decode rows score one row a program, as a CUDA graph replays them; a prompt's rows
        # share their key tiles.
        one_row_each = (meta.max_query_len <= 1
                        or all_decode_rows(meta, DECODE_ROWS_MAX_QUERY_LEN))
        return select_top_keys(IndexKeySource.of_sparse_mla(self.layout, kv_cache),
                               meta.block_tables, indexer.query, indexer.weights, row_seq,
                               row_len, meta.max_seq_len, topk,
                               None if one_row_each else meta.query_lens_cpu,
                               self._sm_count(row_len), self._bits(row_len.device))

