"""A step whose tokens' KV is written to real slots, for the child processes that run a
model's step as it is and laid out in a mixed-step bucket (test_mixed_graphs.py,
test_mla_verification_graphs.py). Imported there by path: those children run outside
pytest."""

from __future__ import annotations

import torch

from archserve.kernels.attention.interface import AttentionMetadata


def written_step(query_lens: list[int], seq_lens: list[int], block_size: int,
                 every_row: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """(input ids, positions, metadata, sampled rows) of a step of these lengths (at most
    three blocks a sequence), every token's KV written to its slot; it samples each
    sequence's last row, or every row. Sequence i owns blocks 3i + 1 .. 3i + 3 (a small
    pool holds them; block 0 is left to a bucket's padding sequence, which reads it)."""
    tables = [[3 * i + j + 1 for j in range(3)] for i in range(len(query_lens))]
    slots, positions = [], []
    for q, n, table in zip(query_lens, seq_lens, tables, strict=True):
        for p in range(n - q, n):
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
    meta = AttentionMetadata.from_lengths(query_lens, seq_lens,
                                          torch.tensor(tables, dtype=torch.int32),
                                          torch.tensor(slots), "cpu")
    ids = torch.arange(len(slots)) % 50 + 3
    rows = (torch.arange(len(slots)) if every_row
            else torch.tensor(query_lens).cumsum(0) - 1)
    return ids, torch.tensor(positions), meta, rows
