"""Turn the scheduler's decision into the flattened tensors one forward pass needs.

Work is per sequence (numpy slices), never per token in Python. Host arrays are
assembled first and copied to the device in one pinned, non-blocking transfer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from archserve.engine.block_pool import token_slot
from archserve.engine.sample_rows import sampler_rows
from archserve.engine.scheduler import ScheduledSeq
from archserve.engine.staging import StagingRing
from archserve.kernels.attention.decode_rows import decode_rows_metadata
from archserve.kernels.attention.interface import AttentionMetadata


@dataclass
class ModelBatch:
    input_ids: torch.Tensor           # long [T]
    positions: torch.Tensor           # long [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor      # long [R]: rows whose next token is sampled
    sampled_seqs: list                # the sequences that sample, in order
    prompt_logprob_rows: list[tuple[object, int, int, int]]  # (seq, row_start, row_end, first_pos)
    # The first input ids, still on their way from the step in flight (its sampled tokens,
    # in row order): a decode graph's replay reads them in its input kernel (``input_ids``
    # keeps its placeholders there), any other forward first copies them in
    # (``apply_fed_ids``).
    fed_ids: torch.Tensor | None = None
    # The sampler's R rows, in order (engine/sample_rows.py): a sequence's
    # own, or with drafts its k + 1 rows; None when that is sampled_seqs.
    sample_rows: list | None = None
    # The step's packed LoRA mapping (kernels/lora/interface.py), where the engine serves
    # adapters: it travels with the batch; the runner copies it where forwards read it.
    lora_mapping: torch.Tensor | None = None

    def apply_fed_ids(self) -> None:
        """Write ``fed_ids`` into the first rows of ``input_ids``."""
        if self.fed_ids is not None:
            self.input_ids[:self.fed_ids.shape[0]].copy_(self.fed_ids)
            self.fed_ids = None


def host_to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """One host array to the device: through pinned memory, without blocking, on CUDA."""
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


Upload = Callable[[list[np.ndarray]], list[torch.Tensor]]   # host arrays in, device views out


def _uploader(upload: Upload, also: list[np.ndarray], moved: list[torch.Tensor]) -> Upload:
    """An ``upload`` for AttentionMetadata.from_lengths that carries ``also`` (the batch's
    own arrays) in the same transfer; their device tensors are appended to ``moved``."""
    def upload_with(arrays: list[np.ndarray]) -> list[torch.Tensor]:
        tensors = upload([*arrays, *also])
        moved.extend(tensors[len(arrays):])
        return tensors[:len(arrays)]
    return upload_with


# A block table's width is rounded up to this many blocks: the staging ring makes a batch's
# views once per run of steps of the same shapes, and a width that grew with every block
# (each 16 tokens of a sequence) would make them every few steps. The padding is block 0,
# never read: a kernel reads a sequence's blocks below its length only.
TABLE_WIDTH_STEP = 16


def block_table_width(num_blocks: int) -> int:
    """The width of a block table whose longest row has ``num_blocks`` blocks: every table
    the engine builds (batches, warm-up probes, graphs' static ones) has such a width, so
    a kernel specialised on the row stride at warm-up meets the same one when serving."""
    return -(-max(1, num_blocks) // TABLE_WIDTH_STEP) * TABLE_WIDTH_STEP


def _block_table_matrix(tables: list[list[int]]) -> np.ndarray:
    width = block_table_width(max(map(len, tables)))
    return np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int32)


def build_decode_batch(chunks: list[ScheduledSeq], block_size: int, staging: StagingRing,
                       lora_mapping: np.ndarray | None = None) -> ModelBatch:
    """The common step of a busy server: one new token per sequence, every one sampled.

    Plain Python lists and one array per field: per-sequence numpy calls would cost
    more than the arithmetic they do.
    """
    seqs = [c.seq for c in chunks]
    positions = [s.num_computed_tokens for s in seqs]
    tables = [s.block_table for s in seqs]
    n = len(seqs)
    slot_mapping = [token_slot(t, s.ring, block_size, p)
                    for s, t, p in zip(seqs, tables, positions, strict=True)]
    own = [np.asarray([s.token_ids[p] for s, p in zip(seqs, positions, strict=True)],
                      dtype=np.int64),
           np.asarray(positions, dtype=np.int64), np.arange(n, dtype=np.int64)]
    if lora_mapping is not None:
        own.append(lora_mapping)
    moved: list[torch.Tensor] = []
    meta = AttentionMetadata.from_lengths(np.ones(n, dtype=np.int32),
                                          np.asarray(positions, dtype=np.int32) + 1,
                                          _block_table_matrix(tables),
                                          np.asarray(slot_mapping, dtype=np.int64),
                                          staging.device,
                                          upload=_uploader(staging.upload, own, moved))
    input_ids, positions_t, logits_indices = moved[:3]
    return ModelBatch(input_ids=input_ids, positions=positions_t, meta=meta,
                      logits_indices=logits_indices, sampled_seqs=seqs,
                      prompt_logprob_rows=[], lora_mapping=_lora_view(moved))


def _lora_view(moved: list[torch.Tensor]) -> torch.Tensor | None:
    """The LoRA mapping's device view, uploaded after the batch's own three arrays."""
    return moved[3] if len(moved) > 3 else None


@dataclass
class Span:
    """Consecutive inputs of one sequence: ``tokens`` at positions ``start``,
    ``start + 1``, ..., over its ``block_table`` (and its window ring: ``Sequence.ring``);
    its last ``sampled_rows`` rows are sampled (0: none)."""

    block_table: list[int]
    start: int
    tokens: list[int]
    sampled_rows: int = 0
    ring: tuple[int, int] | None = None


def build_span_batch(spans: list[Span], block_size: int, staging: StagingRing,
                     lora_mapping: np.ndarray | None = None, decode_rows: bool = False
                     ) -> ModelBatch:
    """The tensors of a forward over ``spans`` (each one sequence's inputs, in order),
    moved to the device in one transfer (``lora_mapping``, the step's packed LoRA
    mapping, in the same one); its rows are sampled as the spans say. ``decode_rows``:
    its metadata describe a decode step of one row a token, each row over its sequence's
    blocks with its own causal length (kernels/attention/decode_rows.py)."""
    num_tokens = sum(len(s.tokens) for s in spans)
    input_ids = np.empty(num_tokens, dtype=np.int64)
    positions = np.empty(num_tokens, dtype=np.int64)
    slot_mapping = np.empty(num_tokens, dtype=np.int64)
    query_lens = np.empty(len(spans), dtype=np.int32)
    seq_lens = np.empty(len(spans), dtype=np.int32)
    block_tables = _block_table_matrix([s.block_table for s in spans])
    logits_rows: list[int] = []
    row = 0
    for i, span in enumerate(spans):
        n = len(span.tokens)
        pos = np.arange(span.start, span.start + n, dtype=np.int64)
        input_ids[row:row + n] = span.tokens
        positions[row:row + n] = pos
        slot_mapping[row:row + n] = (
            block_tables[i, pos // block_size].astype(np.int64) * block_size + pos % block_size
            if span.ring is None else span.ring[0] + pos % span.ring[1])
        seq_lens[i] = span.start + n
        query_lens[i] = n
        logits_rows.extend(range(row + n - span.sampled_rows, row + n))
        row += n
    if decode_rows:
        query_lens, seq_lens, block_tables = decode_rows_metadata(query_lens, seq_lens,
                                                                  block_tables)
    moved: list[torch.Tensor] = []
    own = [input_ids, positions, np.asarray(logits_rows, dtype=np.int64)]
    if lora_mapping is not None:
        own.append(lora_mapping)
    meta = AttentionMetadata.from_lengths(query_lens, seq_lens, block_tables, slot_mapping,
                                          staging.device,
                                          upload=_uploader(staging.upload, own, moved))
    input_ids_t, positions_t, logits_indices = moved[:3]
    return ModelBatch(input_ids=input_ids_t, positions=positions_t, meta=meta,
                      logits_indices=logits_indices, sampled_seqs=[], prompt_logprob_rows=[],
                      lora_mapping=_lora_view(moved))


def build_batch(chunks: list[ScheduledSeq], block_size: int, staging: StagingRing,
                lora_mapping: np.ndarray | None = None, decode_rows: bool = False
                ) -> ModelBatch:
    """The step's tensors, moved to the device in one transfer through ``staging`` (the
    runner's: engine/staging.py); ``lora_mapping``: the step's packed LoRA mapping, which
    travels in the same transfer; ``decode_rows``: every token a decode row
    (``build_span_batch``)."""
    if all(c.num_new_tokens == 1 and c.samples for c in chunks):
        return build_decode_batch(chunks, block_size, staging, lora_mapping)
    spans: list[Span] = []
    sampled_seqs: list = []
    prompt_rows: list[tuple[object, int, int, int]] = []
    row = 0
    for chunk in chunks:
        seq = chunk.seq
        start = seq.num_computed_tokens
        end = start + chunk.num_new_tokens
        drafts = chunk.draft_token_ids
        # A chunk that samples reaches the newest token (and its drafts, each row
        # verifying the next): the model's output there is sampled.
        spans.append(Span(seq.block_table, start,
                          seq.token_ids_slice(start, end - len(drafts)) + drafts,
                          1 + len(drafts) if chunk.samples else 0, seq.ring))
        params = seq.sampling_params
        if params.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
            # Rows whose *next* token is a prompt token: their logits score that token.
            last = min(end, seq.num_prompt_tokens - 1)
            prompt_rows.append((seq, row, row + (last - start), start))
        if chunk.samples:
            sampled_seqs.append(seq)
        row += chunk.num_new_tokens
    batch = build_span_batch(spans, block_size, staging, lora_mapping, decode_rows)
    batch.sampled_seqs = sampled_seqs
    batch.prompt_logprob_rows = prompt_rows
    if any(c.draft_token_ids for c in chunks):
        batch.sample_rows = sampler_rows(sampled_seqs,
                                         [c.draft_token_ids for c in chunks if c.samples])
    return batch
