"""An MLA step laid out as a captured mixed-step bucket replays it (engine/mixed_graphs.py):
the step's rows first, then one padding sequence of the bucket's remaining tokens, then
empty sequence slots; the metadata is the static buffers' views, with no host lengths. The
MLA kernel tests run an implementation over it and over the step as it is, for verification
steps (at most k + 1 query tokens a sequence), which an MLA target's graphs capture.
"""

from __future__ import annotations

import torch

from archserve.engine.mixed_graphs import MixedGraphRunner
from archserve.kernels.attention.interface import AttentionMetadata

MAX_MODEL_LEN = 256


def bucket_layout(meta: AttentionMetadata, bucket: int, block_size: int, max_query_len: int
                  ) -> AttentionMetadata:
    """``meta``'s step in ``bucket``'s static buffers (no host lengths, ``padded_bucket``)."""
    mixed = MixedGraphRunner(None, torch.device("cpu"), bucket, 8,
                             MAX_MODEL_LEN // block_size, MAX_MODEL_LEN, block_size,
                             rows_per_seq=max_query_len, max_query_len=max_query_len)
    tokens = meta.num_tokens
    assert mixed.bucket_for(tokens, meta.num_seqs, 0, meta.max_query_len) == bucket or \
        not mixed.set.sizes   # (nothing is captured on a CPU: the layout is the point)
    positions = torch.zeros(tokens, dtype=torch.long)
    mixed.load(bucket, positions, positions, meta, torch.zeros(0, dtype=torch.long))
    padded = mixed._meta(bucket)
    assert padded.padded_bucket and not padded.query_lens_cpu and not padded.seq_lens_cpu
    return padded


def padded_rows(x: torch.Tensor, bucket: int) -> torch.Tensor:
    """``x`` [T, ...] with zero rows up to ``bucket`` (the padding sequence's inputs)."""
    pad = torch.zeros(bucket - x.shape[0], *x.shape[1:], dtype=x.dtype)
    return torch.cat([x, pad]).contiguous()
