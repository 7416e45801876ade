"""CUDA graphs for steps that carry prompt tokens (vLLM's ``cudagraph_mode`` FULL).

A step with a prompt chunk runs eagerly unless it is captured: on an H200 a Qwen3-0.6B
eager step cost 15-19 ms of host time at every length from 1 to 2,048 tokens (launching
~250 kernels; docs/benchmarks.md), while the device needed a few ms. A server's mixed
steps (running decodes plus a prompt chunk) pay that on every inter-token gap they hold.

One graph per token bucket ``T`` (a ladder of 1.5x and 2x steps up to 2,048, and no
further than a step whose matmuls would make it compute-bound: ``host_bound_tokens``;
beyond that a graph saves no time and its padding adds FLOPs). A step of ``t <= T`` tokens and
``s`` sequences replays the smallest bucket that fits, over static buffers padded so the
captured kernels see the same shapes every time:

- the step's rows fill the first ``t`` token slots and ``s`` sequence slots;
- the ``T - t`` padding tokens form one more sequence (slot ``s``) of that many tokens,
  whose context is only itself and whose table points at block 0: every row is attended
  and finite (a row left unwritten could hold NaNs, and a per-tensor activation scale
  reads every row); its slot mapping is -1, so it writes no KV. It can be longer than
  ``max_model_len`` (a 2,048 bucket over 600 tokens of a 512-token model), so its tokens
  sit at position 0 (rotary reads no row past the model's table) and the static block
  table is wide enough for a bucket (its kernel reads no column past the row);
- the remaining sequence slots have no tokens. The metadata is marked ``padded_bucket``,
  and the Triton varlen kernel then lays its programs over query tiles of all sequences
  (tokens / BLOCK_M + sequences) rather than max_query_len / BLOCK_M per slot: a 2,048-token
  bucket with 257 slots would otherwise launch ~16x more programs, nearly all empty.

Each bucket holds ``min(T, max_num_seqs) + 1`` sequence slots. The graph ends with the LM
head on the rows the step samples (``logits_rows``: ``min(T, max_num_seqs * rows_per_seq)
+ 1`` of them, padded with row 0; a sequence verifying k drafts samples k + 1 rows), so the
output is
those rows' logits in order. Attention backends that take their grid from host
maxima alone capture any such step (``mixed_graph_capturable``: TRITON_ATTN). A backend
that runs a sequence of a few query tokens as decode rows (``decode_rows_max_query_len``:
TRITON_MLA and TRITON_MLA_SPARSE, kernels/attention/decode_rows.py) captures the steps
whose every sequence brings at most ``max_query_len`` tokens (k + 1: speculative
decoding's verification steps); in a bucket it runs every token, the padding sequence's
too, as a decode row, and a step with a longer prompt chunk runs eagerly. A replay canary
compares one such step against the same step run eagerly.

A verification step whose rows fit a decode graph (B x (k + 1) of them) does not come
here: where the backend takes decode rows, it runs as a decode step of one row a token
(ModelRunner.runs_as_decode_rows), in the decode graph of that many rows, without a
bucket's 16-token minimum. The buckets take the larger ones.
"""

from __future__ import annotations

import torch

from archserve.engine.batch import block_table_width
from archserve.engine.cuda_graphs import (
    StaticGraphRunner,
    load_block_tables,
    replay_mismatch,
    weak_callback,
)
from archserve.kernels.attention.interface import AttentionMetadata

# Steps of 2x up to 32, then 1.5x and 1.33x: a step pads by less than half its bucket, and
# by at most a third from 48 tokens up (multiples of 16, so Triton compiles no variant for
# the odd ones).
TOKEN_BUCKETS = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
# A bucket is captured only while its step's matmuls take less than this at the device's
# matmul rate. Beyond it an eager step keeps the device busy while the host launches (it is
# compute-bound), and a graph would only add its padding's FLOPs. A prediction from the
# 15-19 ms of host time an eager 0.6B step took on an H200, not yet measured per model.
COMPUTE_BOUND_S = 0.015


def mixed_graph_buckets(max_tokens: int) -> list[int]:
    """The token buckets a step of at most ``max_tokens`` tokens can use."""
    buckets = [t for t in TOKEN_BUCKETS if t <= max_tokens]
    if max_tokens < TOKEN_BUCKETS[-1] and (not buckets or buckets[-1] < max_tokens):
        buckets.append(max_tokens)   # the largest step the engine builds still fits one
    return buckets


def host_bound_tokens(flops_per_token: float, matmul_flops_per_s: float,
                      limit: int = TOKEN_BUCKETS[-1]) -> int:
    """The largest bucket (at most ``limit``) whose step's matmuls take under
    ``COMPUTE_BOUND_S``: the steps a graph can speed up."""
    tokens = COMPUTE_BOUND_S * matmul_flops_per_s / max(flops_per_token, 1.0)
    fitting = [t for t in TOKEN_BUCKETS if t <= tokens] or [TOKEN_BUCKETS[0]]
    return min(limit, fitting[-1])


def mixed_step_query_limit(backend, rows_per_seq: int = 1) -> tuple[bool, int | None]:
    """Which steps with more than one query token a sequence the mixed-step graphs over the
    attention ``backend`` (a registry backend) capture, with ``rows_per_seq`` (1 + the
    drafts a sequence verifies; 1 without speculative decoding): (whether any are, the most
    query tokens a sequence of such a step may bring, None for any)."""
    if backend.mixed_graph_capturable:
        return True, None
    if 1 < rows_per_seq <= backend.decode_rows_max_query_len:
        return True, rows_per_seq         # verification steps, every token a decode row
    return False, None


class MixedGraphRunner(StaticGraphRunner):
    """Static buffers and captured graphs of steps that carry prompt tokens."""

    def __init__(self, forward_rows, device: torch.device, max_tokens: int,
                 max_num_seqs: int, max_blocks_per_seq: int, max_model_len: int,
                 block_size: int, rows_per_seq: int = 1, max_query_len: int | None = None
                 ) -> None:
        super().__init__(device)
        # The most query tokens a sequence of a replayed step may bring (None: any).
        self.max_query_len = max_query_len
        # callable(input_ids, positions, meta, rows, out) -> float32 logits of ``rows``
        # [R, V], in ``out`` where the LM head writes them there
        self.forward_rows = weak_callback(forward_rows)
        self.max_num_seqs = max_num_seqs
        self.max_rows = max_num_seqs * rows_per_seq
        self.max_model_len = max_model_len
        self.block_size = block_size
        seqs = self.seq_slots(max_tokens)
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(seqs, dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(seqs + 1, dtype=torch.int32, device=device)
        self.max_blocks_per_seq = max_blocks_per_seq
        # The padding sequence's context is up to a whole bucket of tokens.
        width = block_table_width(max(max_blocks_per_seq, -(-max_tokens // block_size)))
        self.block_tables = torch.zeros((seqs, width), dtype=torch.int32, device=device)
        self.logits_rows = torch.zeros(self.row_slots(max_tokens), dtype=torch.long,
                                       device=device)

    def row_slots(self, tokens: int) -> int:
        """Sampled rows the bucket of ``tokens`` tokens takes through the LM head."""
        return min(tokens, self.max_rows) + 1

    def seq_slots(self, tokens: int) -> int:
        """Sequence slots of the bucket of ``tokens`` tokens: its sequences and the padding one."""
        return min(tokens, self.max_num_seqs) + 1

    def _meta(self, tokens: int) -> AttentionMetadata:
        seqs = self.seq_slots(tokens)
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[:seqs + 1], seq_lens=self.seq_lens[:seqs],
            block_tables=self.block_tables[:seqs], slot_mapping=self.slot_mapping[:tokens],
            max_query_len=tokens, max_seq_len=self.max_model_len, num_seqs=seqs,
            padded_bucket=True)

    def _before_capture(self, tokens: int) -> None:
        """A step of padding alone (one sequence of the bucket's tokens): the warm-up before
        the capture then runs, and the autotuner times, real work rather than programs that
        all exit at once (empty buffers)."""
        empty = torch.empty(0, dtype=torch.long, device=self.device)
        meta = AttentionMetadata.from_lengths(
            [], [], torch.zeros((0, 1), dtype=torch.int32, device=self.device), empty,
            self.device)
        self.load(tokens, empty, empty, meta, empty)

    def _forward_at(self, tokens: int, out: torch.Tensor | None = None) -> torch.Tensor:
        slots = self.row_slots(tokens)
        return self.forward_rows(self.input_ids[:tokens], self.positions[:tokens],
                                 self._meta(tokens), self.logits_rows[:slots],
                                 None if out is None else out[:slots])

    def bucket_for(self, num_tokens: int, num_seqs: int, num_rows: int = 0,
                   query_len: int = 1) -> int | None:
        """The captured bucket a step of these sizes (``num_rows`` sampled rows, at most
        ``query_len`` query tokens a sequence) replays, or None (it runs eager)."""
        bucket = self.size_for(num_tokens)
        if (bucket is None or num_seqs + 1 > self.seq_slots(bucket)
                or num_rows > self.row_slots(bucket)
                or (self.max_query_len is not None and query_len > self.max_query_len)):
            return None
        return bucket

    def load(self, bucket: int, input_ids: torch.Tensor, positions: torch.Tensor,
             meta: AttentionMetadata, logits_indices: torch.Tensor) -> None:
        """Copy a step into the static buffers of ``bucket``, padded as the module says."""
        t, s = input_ids.shape[0], meta.num_seqs
        pad, seqs = bucket - t, self.seq_slots(bucket)
        self.input_ids[:t].copy_(input_ids, non_blocking=True)
        self.input_ids[t:bucket].zero_()
        self.positions[:t].copy_(positions, non_blocking=True)
        self.positions[t:bucket].zero_()
        self.slot_mapping[:t].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[t:bucket].fill_(-1)
        self.query_start_loc[:s + 1].copy_(meta.query_start_loc, non_blocking=True)
        self.query_start_loc[s + 1:seqs + 1].fill_(bucket)
        self.seq_lens[:s].copy_(meta.seq_lens, non_blocking=True)
        self.seq_lens[s:s + 1].fill_(pad)
        self.seq_lens[s + 1:seqs].zero_()
        load_block_tables(self.block_tables, meta.block_tables)
        self.block_tables[s:seqs].zero_()
        n = logits_indices.shape[0]
        self.logits_rows[:n].copy_(logits_indices, non_blocking=True)
        self.logits_rows[n:self.row_slots(bucket)].zero_()

    def replay(self, bucket: int, input_ids: torch.Tensor, positions: torch.Tensor,
               meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """Logits of the step's sampled rows ([len(logits_indices), vocab], in order)."""
        self.load(bucket, input_ids, positions, meta, logits_indices)
        self.set.graphs[bucket].replay()
        return self.output[:logits_indices.shape[0]]

    def canary_step(self, bucket: int, blocks: int
                    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """A mixed step that fits ``bucket`` with padding: two decodes beside a prompt
        chunk over a cached prefix, reading KV blocks below ``blocks``, writing none.
        Returns (input_ids, positions, meta, sampled rows)."""
        prefix = 5                                          # cached tokens before the chunk
        if self.max_query_len is not None:
            query_lens, seq_lens = self._verification_lengths(bucket, prefix)
            return self._canary_of(query_lens, seq_lens, blocks, every_row=True)
        chunk = max(2, min(bucket - 2, 3 * bucket // 4, self.max_model_len - prefix))
        decodes = max(0, min(2, bucket - chunk, self.seq_slots(bucket) - 2))
        query_lens = [1] * decodes + [chunk]
        seq_lens = [4 + 3 * i for i in range(decodes)] + [prefix + chunk]
        return self._canary_of(query_lens, seq_lens, blocks, every_row=False)

    def _verification_lengths(self, bucket: int, prefix: int) -> tuple[list[int], list[int]]:
        """(query, context lengths) of a step this runner replays with at most
        ``max_query_len`` tokens a sequence: a decode beside sequences of the most tokens
        (over cached prefixes of differing lengths), about 3/4 of the bucket, padded."""
        most = max(1, min(self.max_query_len, self.max_model_len - prefix - 8))
        query_lens = [1]
        while (len(query_lens) + 2 <= self.seq_slots(bucket)
               and sum(query_lens) + most <= max(2, 3 * bucket // 4)):
            query_lens.append(most)
        seq_lens = [min(self.max_model_len, prefix + 3 * i + q)
                    for i, q in enumerate(query_lens)]
        return query_lens, seq_lens

    def _canary_of(self, query_lens: list[int], seq_lens: list[int], blocks: int,
                   every_row: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """A canary step of these lengths, reading blocks below ``blocks``, writing none;
        it samples each sequence's last row, or (``every_row``, as a verification does)
        every row where the bucket's LM head has room for them."""
        width = -(-max(seq_lens) // self.block_size)
        tables = torch.tensor([[(r + j) % blocks for j in range(width)]
                               for r in range(len(seq_lens))], dtype=torch.int32)
        t = sum(query_lens)
        meta = AttentionMetadata.from_lengths(
            query_lens, seq_lens, tables.to(self.device),
            torch.full((t,), -1, dtype=torch.long, device=self.device), self.device)
        meta.max_seq_len = self.max_model_len      # the graph's bound (replay_canary)
        positions = torch.cat([torch.arange(n - q, n) for q, n in zip(query_lens, seq_lens,
                                                                     strict=True)])
        ids = (7 + torch.arange(t, device=self.device) % 13).long()
        rows = (torch.arange(t) if every_row and t < self.row_slots(t)
                else torch.tensor(query_lens).cumsum(0) - 1)
        return ids, positions.to(self.device), meta, rows.to(self.device)

    def _canary_at(self, bucket: int, tolerance: float) -> str | None:
        ids, positions, meta, rows = self.canary_step(bucket, self._canary_blocks())
        with torch.inference_mode():
            eager = self.forward_rows(ids, positions, meta, rows).float()
            replayed = self.replay(bucket, ids, positions, meta, rows).float()
        return replay_mismatch(eager, replayed, tolerance, f"mixed-step graph replay canary "
                               f"(bucket {bucket}, {ids.shape[0]} tokens)")
