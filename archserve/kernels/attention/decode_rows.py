"""A step's query tokens as decode rows: each token one row of a paged decode kernel, over
its sequence's block table, seeing its own causal length.

A sequence that brings q query tokens over a context of n (this step's included) is q
decode rows: row i (0-based) sees the first n - q + i + 1 keys. Every key a row sees is in
the cache before the kernel reads it (a layer writes the step's keys and values first), so
a decode kernel serves a speculative verification step (k + 1 tokens a sequence)
unchanged, as vLLM's MLA backends flatten spec-decode queries into decode rows. A sliding
window or attention sinks are applied per row as for any decode row: the window ends at
the row's own length.

Three forms, one rule (``host_decode_rows``):

- ``decode_rows_metadata``: a whole step's host lengths and block tables turned into a
  decode step of one row a token, before anything reaches the device (the engine's batch
  builder, engine/batch.py): the step then replays the decode CUDA graph of that many rows,
  GEMMs and LM head included, as a decode batch of that size would;
- ``host_decode_rows`` alone, for the sequences an eager step names (MLA's mixed step);
- ``device_decode_rows``, from the metadata's device tensors alone (what a captured
  mixed-step bucket replays: engine/mixed_graphs.py), with no host value but the token count.
"""

from __future__ import annotations

import numpy as np
import torch

from archserve.kernels.attention.interface import AttentionMetadata


def all_decode_rows(meta: AttentionMetadata, max_query_len: int) -> bool:
    """Whether a step with more than one query token somewhere runs every token as a decode
    row, for a backend that runs a sequence of at most ``max_query_len`` tokens so: a
    captured bucket's step (engine/mixed_graphs.py replays only steps whose every sequence
    fits, and its padding sequence's rows are not used), or an eager step whose every
    sequence fits: the same rows."""
    return meta.padded_bucket or meta.max_query_len <= max_query_len


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


def decode_rows_metadata(query_lens: np.ndarray, seq_lens: np.ndarray,
                         block_tables: np.ndarray
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A step's host (query lengths, context lengths, block tables [sequences, width]) as
    a decode step of one row a token, in token order: (int32 ones, int32 keys each row
    sees, int32 [tokens, width] its sequence's table). The step's token-indexed arrays
    (ids, positions, slots, sampled rows) stay as they are."""
    _, row_seq, row_len = host_decode_rows(query_lens, seq_lens)
    return (np.ones(len(row_seq), dtype=np.int32), row_len.astype(np.int32),
            np.ascontiguousarray(block_tables[row_seq]))


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
