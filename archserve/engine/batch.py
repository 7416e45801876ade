"""Turn the scheduler's decision into the flattened tensors one forward pass needs.

Work is per sequence (numpy slices), never per token in Python. Host arrays are
assembled first and copied to the device in one pinned, non-blocking transfer each.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from archserve.engine.scheduler import ScheduledSeq
from archserve.kernels.attention.interface import AttentionMetadata


@dataclass
class ModelBatch:
    input_ids: torch.Tensor           # long [T]
    positions: torch.Tensor           # long [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor      # long [N]: rows whose next token is sampled
    sampled_seqs: list                # the N sequences, same order
    prompt_logprob_rows: list[tuple[object, int, int, int]]  # (seq, row_start, row_end, first_pos)


def host_to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """One host array to the device: through pinned memory, without blocking, on CUDA."""
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def _block_table_matrix(tables: list[list[int]]) -> np.ndarray:
    width = max(1, max(map(len, tables)))
    return np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int32)


def build_decode_batch(chunks: list[ScheduledSeq], block_size: int, device: torch.device
                       ) -> ModelBatch:
    """The common step of a busy server: one new token per sequence, every one sampled.

    Plain Python lists and one array per field: per-sequence numpy calls would cost
    more than the arithmetic they do.
    """
    seqs = [c.seq for c in chunks]
    positions = [s.num_computed_tokens for s in seqs]
    tables = [s.block_table for s in seqs]
    n = len(seqs)
    slot_mapping = [t[p // block_size] * block_size + p % block_size
                    for t, p in zip(tables, positions, strict=True)]
    meta = AttentionMetadata.from_lengths(np.ones(n, dtype=np.int32),
                                          np.asarray(positions, dtype=np.int32) + 1,
                                          _block_table_matrix(tables),
                                          np.asarray(slot_mapping, dtype=np.int64), device,
                                          upload=lambda a: host_to_device(a, device))
    return ModelBatch(
        input_ids=host_to_device(np.asarray([s.token_ids[p] for s, p in zip(seqs, positions,
                                                                      strict=True)],
                                        dtype=np.int64), device),
        positions=host_to_device(np.asarray(positions, dtype=np.int64), device),
        meta=meta,
        logits_indices=host_to_device(np.arange(n, dtype=np.int64), device),
        sampled_seqs=seqs,
        prompt_logprob_rows=[],
    )


def build_batch(chunks: list[ScheduledSeq], block_size: int, device: torch.device
                ) -> ModelBatch:
    if all(c.num_new_tokens == 1 and c.samples for c in chunks):
        return build_decode_batch(chunks, block_size, device)
    num_tokens = sum(c.num_new_tokens for c in chunks)
    num_seqs = len(chunks)
    input_ids = np.empty(num_tokens, dtype=np.int64)
    positions = np.empty(num_tokens, dtype=np.int64)
    slot_mapping = np.empty(num_tokens, dtype=np.int64)
    query_lens = np.empty(num_seqs, dtype=np.int32)
    seq_lens = np.empty(num_seqs, dtype=np.int32)
    block_tables = _block_table_matrix([c.seq.block_table for c in chunks])
    logits_rows: list[int] = []
    sampled_seqs: list = []
    prompt_rows: list[tuple[object, int, int, int]] = []

    row = 0
    for i, chunk in enumerate(chunks):
        seq = chunk.seq
        start = seq.num_computed_tokens
        end = start + chunk.num_new_tokens
        tokens = seq.token_ids_slice(start, end)
        pos = np.arange(start, end, dtype=np.int64)
        input_ids[row:row + chunk.num_new_tokens] = tokens
        positions[row:row + chunk.num_new_tokens] = pos
        slot_mapping[row:row + chunk.num_new_tokens] = (
            block_tables[i, pos // block_size].astype(np.int64) * block_size + pos % block_size)
        seq_lens[i] = end
        query_lens[i] = chunk.num_new_tokens
        params = seq.sampling_params
        if params.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
            # Rows whose *next* token is a prompt token: their logits score that token.
            last = min(end, seq.num_prompt_tokens - 1)
            prompt_rows.append((seq, row, row + (last - start), start))
        if chunk.samples:
            # This chunk reaches the newest token: the model's output here is sampled.
            logits_rows.append(row + chunk.num_new_tokens - 1)
            sampled_seqs.append(seq)
        row += chunk.num_new_tokens

    meta = AttentionMetadata.from_lengths(query_lens, seq_lens, block_tables, slot_mapping,
                                          device, upload=lambda a: host_to_device(a, device))
    return ModelBatch(
        input_ids=host_to_device(input_ids, device),
        positions=host_to_device(positions, device),
        meta=meta,
        logits_indices=host_to_device(np.asarray(logits_rows, dtype=np.int64), device),
        sampled_seqs=sampled_seqs,
        prompt_logprob_rows=prompt_rows,
    )
