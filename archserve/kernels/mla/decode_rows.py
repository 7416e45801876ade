"""A step's query tokens as decode rows: each token one row of the MLA decode kernel, over its
sequence's block table, seeing its own causal length.

A sequence that brings q query tokens over a context of n (this step's included) is q
decode rows: row i (0-based) sees the first n - q + i + 1 keys. The absorbed decode kernel
then serves a speculative verification step (k + 1 tokens a sequence) unchanged, as vLLM's
MLA backends flatten spec-decode queries into decode rows; its grid is rows x splits, host
ints, and every length is a device value, so such a step is captured in CUDA graphs.

Two forms, one rule: ``host_decode_rows`` from the host lengths of an eager step (for the
sequences it names), ``device_decode_rows`` from the metadata's device tensors alone (what a
captured bucket replays: engine/mixed_graphs.py), with no host value but the token count.
"""

from __future__ import annotations

import numpy as np
import torch

from archserve.kernels.attention.interface import AttentionMetadata
from archserve.kernels.mla.interface import DECODE_ROWS_MAX_QUERY_LEN


def all_decode_rows(meta: AttentionMetadata) -> bool:
    """Whether a step with more than one query token somewhere runs every token as a decode
    row: a captured bucket's step (engine/mixed_graphs.py replays only steps whose every
    sequence fits, and its padding sequence's rows are not used), or an eager step whose
    every sequence brings at most DECODE_ROWS_MAX_QUERY_LEN tokens: the same rows."""
    return meta.padded_bucket or meta.max_query_len <= DECODE_ROWS_MAX_QUERY_LEN


def host_decode_rows(query_lens: np.ndarray, seq_lens: np.ndarray,
                     seqs: np.ndarray | None = None
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the step's token index of each row, its sequence, the keys it sees), int64, for the
    tokens of sequences ``seqs`` (None: every sequence), in token order."""
    query_lens = np.asarray(query_lens, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    if seqs is None:
        seqs = np.arange(len(query_lens), dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(query_lens)])
    counts = query_lens[seqs]
    row_seq = np.repeat(seqs, counts)
    offset = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    tokens = starts[row_seq] + offset
    row_len = seq_lens[row_seq] - query_lens[row_seq] + offset + 1
    return tokens, row_seq, row_len


def device_decode_rows(meta: AttentionMetadata, num_tokens: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 [num_tokens] sequence of each token, int32 [num_tokens] keys it sees), from
    ``query_start_loc`` and ``seq_lens`` on the device: no sync, so a graph replays it for
    any lengths. A token past the last sequence's rows (padding) reads that sequence's
    context, no further than its length; its output is not used."""
    starts = meta.query_start_loc
    device = starts.device
    tokens = torch.arange(num_tokens, dtype=starts.dtype, device=device)
    ends = starts[1:meta.num_seqs + 1].contiguous()
    # Sequence s owns [starts[s], ends[s]): the ends at or before a token are the sequences
    # before its own (empty slots included, each ending where the next begins).
    row_seq = torch.searchsorted(ends, tokens, right=True, out_int32=True)
    row_seq = row_seq.clamp_(max=max(meta.num_seqs - 1, 0))
    seq_len = meta.seq_lens[row_seq]
    row_len = seq_len - ends[row_seq] + tokens + 1
    return row_seq, torch.minimum(row_len, seq_len).to(torch.int32)
