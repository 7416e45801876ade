"""TRITON_MLA: the MlaImpl built from archserve's Triton kernels over the latent paged cache.

A pure-decode step (one query token per sequence) runs absorbed: W_UK folded into the
query, the MLA decode kernel over the latent (triton_mla_decode.py), W_UV after. A sequence
that brings a few query tokens (at most ``DECODE_ROWS_MAX_QUERY_LEN``: a speculative
verification's k + 1, a short prompt chunk) runs the same way, each token a decode row of
its own causal length (kernels/attention/decode_rows.py). A longer prompt chunk takes the
expanded form through the Triton prefill kernel (expanded_prefill.py), which costs fewer FLOPs per
query-key pair once a sequence brings many query rows.

CUDA graphs: decode steps, and the steps a mixed-step bucket replays for this backend
(engine/mixed_graphs.py: every sequence at most k + 1 query tokens, the verification
steps of speculative decoding), run as decode rows from device lengths alone. Eagerly the
same steps take the same rows, so a replay and an eager run differ only where the split
count does.
"""

from __future__ import annotations

import numpy as np
import torch

from archserve.kernels.attention.decode_rows import (
    all_decode_rows,
    device_decode_rows,
    host_decode_rows,
)
from archserve.kernels.attention.interface import AttentionMetadata
from archserve.kernels.attention.triton_cache_write import write_kv_cache
from archserve.kernels.mla.expanded_prefill import expanded_prefill
from archserve.kernels.mla.interface import DECODE_ROWS_MAX_QUERY_LEN, absorb_query
from archserve.kernels.mla.triton_mla_decode import mla_decode
from archserve.kernels.mla.triton_mla_decode_inputs import (
    mla_decode_inputs,
    mla_decode_inputs_unsupported,
)
from archserve.kernels.step_memo import StepMemo
from archserve.platform.detect import device_info_for


class TritonMlaImpl:
    graph_capturable = True

    def __init__(self, device=None, spec=None, fp8_bytes: bool | None = None) -> None:  # noqa: ANN001
        self.device = device
        self.spec = spec
        # Whether an e4m3 latent is written and read as bytes (GPUs without e4m3); None:
        # decided per GPU by the kernels' wrappers.
        self.fp8_bytes = fp8_bytes
        self.num_sms = (getattr(device, "multiprocessor_count", None) or 0) if device else 0
        # The decode kernel's tiles, when the start-up timing chose other than the rule's
        # (kernels/mla/tuning.py); None: mla_decode_tiles.
        self.tiles: tuple | None = None
        # A step's decode rows (their block tables and lengths), worked out by its first
        # layer and reused by the rest.
        self.step_memo = StepMemo()

    def _sm_count(self, tensor: torch.Tensor) -> int:
        if self.num_sms == 0:
            self.num_sms = device_info_for(tensor.device).multiprocessor_count or 0
        return self.num_sms

    def _e4m3_bits(self, kv_cache: torch.Tensor) -> bool | None:
        if self.fp8_bytes is None:
            return None
        return self.fp8_bytes and kv_cache.dtype == torch.float8_e4m3fn

    def decode(self, query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
               seq_lens: torch.Tensor, query_start_loc: torch.Tensor, num_seqs: int,
               max_seq_len: int, scale: float, w_uv: torch.Tensor, k_scale: float
               ) -> torch.Tensor:
        """Absorbed query [T, H, L+R], one row per sequence -> the heads' values [T, H, v]
        (W_UV [H, v, L] applied in the split merge's kernel)."""
        kv_lora_rank = w_uv.shape[-1]
        out = torch.empty(*query.shape[:2], kv_lora_rank, dtype=query.dtype, device=query.device)
        return mla_decode(query, kv_cache, block_tables, seq_lens, query_start_loc, out,
                          num_seqs=num_seqs, max_seq_len=max_seq_len, scale=scale,
                          k_scale=k_scale, num_sms=self._sm_count(query), tiles=self.tiles,
                          e4m3_bits=self._e4m3_bits(kv_cache), w_uv=w_uv)

    def decode_from_projections(self, q: torch.Tensor, kv_a: torch.Tensor,
                                positions: torch.Tensor, cos_cache: torch.Tensor,
                                sin_cache: torch.Tensor, kv_norm_weight: torch.Tensor,
                                kv_norm_eps: float, interleaved: bool, kv_cache: torch.Tensor,
                                meta: AttentionMetadata, w_uk: torch.Tensor, w_uv: torch.Tensor,
                                scale: float) -> torch.Tensor | None:
        """A pure-decode step straight from the layer's projections (q [T, H (nope + rope)],
        kv_a [T, L + rope]): the absorbed query and the latent write in one kernel
        (triton_mla_decode_inputs.py), then the decode kernel and W_UV -> [T, H, v]. None
        where that kernel cannot take the operands (an fp8 latent, a step with prompt
        tokens): the layer then takes the MlaImpl contract's ``forward``."""
        if meta.max_query_len > 1 or mla_decode_inputs_unsupported(
                q, kv_a, w_uk, cos_cache, kv_cache) is not None:
            return None
        query = mla_decode_inputs(q, kv_a, positions, cos_cache, sin_cache, kv_norm_weight,
                                  kv_norm_eps, w_uk, kv_cache, meta.slot_mapping, interleaved)
        return self.decode(query, kv_cache, meta.block_tables, meta.seq_lens,
                           meta.query_start_loc, meta.num_seqs, meta.max_seq_len, scale, w_uv,
                           1.0)

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, w_uk: torch.Tensor,
                w_uv: torch.Tensor, scale: float, k_scale: float = 1.0) -> torch.Tensor:
        """The MlaImpl contract (kernels/mla/interface.py)."""
        e4m3 = self._e4m3_bits(kv_cache)
        write_kv_cache(latent[:, None], None, kv_cache, meta.slot_mapping, k_scale,
                       e4m3_bits=e4m3, e5m2_bits=None if self.fp8_bytes is None else False)
        return self.attend(q_nope, q_pe, kv_cache, meta, w_uk, w_uv, scale, k_scale)

    def attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
               meta: AttentionMetadata, w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float,
               k_scale: float) -> torch.Tensor:
        """The step's attention over the latent cache (its rows written) -> [T, H, v]."""
        # max_query_len is a host int: choosing the path costs no device sync.
        if meta.max_query_len <= 1:
            return self.decode(absorb_query(q_nope, q_pe, w_uk), kv_cache, meta.block_tables,
                               meta.seq_lens, meta.query_start_loc, meta.num_seqs,
                               meta.max_seq_len, scale, w_uv, k_scale)
        if all_decode_rows(meta, DECODE_ROWS_MAX_QUERY_LEN):
            return self._decode_rows(q_nope, q_pe, kv_cache, meta, w_uk, w_uv, scale, k_scale)
        return self._mixed_step(q_nope, q_pe, kv_cache, meta, w_uk, w_uv, scale, k_scale)

    def step_rows(self, meta: AttentionMetadata, num_tokens: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the sequence, the keys seen) of each token of a step run as decode rows
        (decode_rows.py), once a step: from device lengths, as a captured bucket needs.
        Every use of the step's memo passes here first, so this begins it."""
        self.step_memo.begin(meta)
        return self.step_memo.get(("rows", num_tokens),
                                  lambda: device_decode_rows(meta, num_tokens))

    def _decode_rows(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                     meta: AttentionMetadata, w_uk: torch.Tensor, w_uv: torch.Tensor,
                     scale: float, k_scale: float) -> torch.Tensor:
        """Every token of the step a decode row of its own causal length. The rows' block
        tables are gathered once a step (a row's is its sequence's) rather than read through
        the row's sequence in the kernel: the decode kernel and its compiled variants stay
        as they are, for a copy of a few KiB a row."""
        rows = q_nope.shape[0]
        row_seq, row_len = self.step_rows(meta, rows)   # begins the step's memo
        # The decode kernel reads its metadata before PDL's wait (kernels/pdl.py): it is
        # gathered before the absorbed query, the kernel launched right before the decode.
        tables, lens, starts = self.step_memo.get(("decode rows", rows), lambda: (
            meta.block_tables[row_seq], row_len,
            torch.arange(rows + 1, dtype=torch.int32, device=row_len.device)))
        return self.decode(absorb_query(q_nope, q_pe, w_uk), kv_cache, tables, lens, starts,
                           rows, meta.max_seq_len, scale, w_uv, k_scale)

    def _mixed_step(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, w_uk: torch.Tensor, w_uv: torch.Tensor,
                    scale: float, k_scale: float) -> torch.Tensor:
        """An eager step with a long prompt chunk: the sequences with at most
        DECODE_ROWS_MAX_QUERY_LEN query tokens as decode rows, the others expanded."""
        query_lens = np.asarray(meta.query_lens_cpu or
                                np.diff(meta.query_start_loc.tolist()), dtype=np.int64)
        seq_lens = np.asarray(meta.seq_lens_cpu or meta.seq_lens.tolist(), dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(query_lens)])
        device = q_nope.device
        out = torch.zeros(*q_nope.shape[:2], w_uv.shape[1], dtype=q_nope.dtype, device=device)
        decoding = np.flatnonzero((query_lens >= 1) & (query_lens <= DECODE_ROWS_MAX_QUERY_LEN))
        if len(decoding):
            tokens, row_seq, row_len = host_decode_rows(query_lens, seq_lens, decoding)
            rows = torch.from_numpy(tokens).to(device)
            n = len(tokens)
            # The decode kernel reads its metadata before PDL's wait (kernels/pdl.py), while
            # the kernel launched right before it may still run: the metadata is gathered
            # first, so that kernel is the absorbed query's.
            tables = meta.block_tables[torch.from_numpy(row_seq).to(device)]
            lens = torch.from_numpy(row_len.astype(np.int32)).to(device)
            query_starts = torch.arange(n + 1, dtype=torch.int32, device=device)
            out[rows] = self.decode(
                absorb_query(q_nope[rows], q_pe[rows], w_uk), kv_cache, tables, lens,
                query_starts, n, int(row_len.max()), scale, w_uv, k_scale)
        prefilling = np.flatnonzero(query_lens > DECODE_ROWS_MAX_QUERY_LEN)
        if len(prefilling):
            rows = torch.from_numpy(np.concatenate(
                [np.arange(starts[i], starts[i + 1]) for i in prefilling])).to(device)
            out[rows] = expanded_prefill(
                q_nope[rows], q_pe[rows], kv_cache,
                meta.block_tables[torch.from_numpy(prefilling).to(device)],
                query_lens[prefilling].tolist(), seq_lens[prefilling].tolist(), w_uk, w_uv,
                scale, k_scale)
        return out
