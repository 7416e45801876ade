"""TORCH_SDPA: torch's scaled_dot_product_attention over K/V gathered from the paged cache.

The CPU default, so it avoids per-token Python: the one-query sequences of a batch (its
decodes) attend in one padded SDPA call, every longer query (a prompt chunk) in a call of
its own. A serving step mixes both (running streams beside a new prompt): one call per
sequence there cost a 16-stream step 30 SDPA calls and gathers per stream. Soft-capping and attention sinks have no SDPA form,
so those layers take an explicit fp32 math path; on a CPU without AMX a 16-bit layer
attends in float32 too (``widened_on_cpu``). Also home of the plain-torch cache writer and gather that the
FLEX_ATTENTION backend shares.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from archserve.kernels.attention.interface import (
    AttentionLayerParams,
    AttentionMetadata,
    DecodeRows,
    PagedAttentionImpl,
    decode_cache_rows,
)
from archserve.kernels.attention.reference import softmax_with_sinks
from archserve.kernels.step_memo import StepMemo
from archserve.platform.detect import device_info_for

FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class WrittenRows:
    """Where a cache write puts a step's keys and values, as an index into the cache tensor
    itself: each half (keys, values), then each row's block and offset in the block. An
    ``index_put_`` on the cache, not a copy into a flattened view of it: a traced step
    (``decode_in_graph``) functionalizes a write through a view into a copy of the whole
    cache, which inductor then made every step; eagerly the two cost the same."""

    halves: tuple[torch.Tensor, torch.Tensor]   # 0 and 1, as index tensors
    blocks: torch.Tensor                        # [W] long
    offsets: torch.Tensor                       # [W] long
    rows: torch.Tensor | None                   # [T] bool: the rows written; None: all

    @classmethod
    def of_slots(cls, slots: torch.Tensor, block_size: int,
                 rows: torch.Tensor | None = None) -> WrittenRows:
        """Rows written to ``slots`` (none -1: ``written_rows`` leaves those out)."""
        slots = slots.long()
        halves = (torch.tensor(0, device=slots.device), torch.tensor(1, device=slots.device))
        return cls(halves, slots // block_size, slots % block_size, rows)


def written_rows(slot_mapping: torch.Tensor, block_size: int) -> WrittenRows:
    """A step's cache write with slot -1 rows left out: one check of the step's slots,
    shared by its layers."""
    valid = slot_mapping >= 0
    if bool(valid.all()):
        return WrittenRows.of_slots(slot_mapping, block_size)
    return WrittenRows.of_slots(slot_mapping[valid], block_size, valid)


def write_kv_cache_torch(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                         written: WrittenRows, k_scale: float = 1.0, v_scale: float = 1.0
                         ) -> None:
    """Scatter key/value [T, Hkv, D] into the cache where ``written`` says."""
    fp8 = kv_cache.dtype in FP8_CACHE_DTYPES
    # Indexed writes into float8 are missing on CPU; the bytes are the same thing.
    target = kv_cache.view(torch.uint8) if fp8 else kv_cache
    for half, src, scale in zip(written.halves, (key, value), (k_scale, v_scale), strict=True):
        if written.rows is not None:
            src = src[written.rows]
        src = ((src.float() / scale).to(kv_cache.dtype).view(torch.uint8) if fp8
               else src.to(kv_cache.dtype))
        target.index_put_((half, written.blocks, written.offsets), src)


class TorchCacheWriter(PagedAttentionImpl):
    """The torch backends' cache write (SDPA, FLEX_ATTENTION), and the step's memo of what
    its layers derive alike (``StepMemo``)."""

    def __init__(self, device=None, spec=None) -> None:   # noqa: ANN001 - as the base's
        super().__init__(device, spec)
        self.step_memo = StepMemo()

    def forward(self, query: torch.Tensor, key: torch.Tensor | None,
                value: torch.Tensor | None, kv_cache: torch.Tensor, meta: AttentionMetadata,
                layer: AttentionLayerParams, k_scale: float = 1.0, v_scale: float = 1.0
                ) -> torch.Tensor:
        self.step_memo.begin(meta)
        return super().forward(query, key, value, kv_cache, meta, layer, k_scale, v_scale)

    def write_cache(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, k_scale: float, v_scale: float) -> None:
        block_size = kv_cache.shape[2]
        written = self.step_memo.get(("written", id(slot_mapping), block_size),
                                     lambda: written_rows(slot_mapping, block_size))
        write_kv_cache_torch(key, value, kv_cache, written, k_scale, v_scale)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache contents in the compute dtype; fp8 entries are multiplied back by their scale."""
    if x.dtype in FP8_CACHE_DTYPES:
        return (x.float() * scale).to(dtype)
    return x.to(dtype)


def gather_sequence_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``seq_len`` cached keys and values of one sequence, [seq_len, Hkv, D] each."""
    block_size = kv_cache.shape[2]
    blocks = block_table[: (seq_len + block_size - 1) // block_size].long()
    k = kv_cache[0, blocks].flatten(0, 1)[:seq_len]
    v = kv_cache[1, blocks].flatten(0, 1)[:seq_len]
    return k, v


def host_lengths(meta: AttentionMetadata) -> tuple[list[int], list[int]]:
    """(query_lens, seq_lens) as host lists; falls back to a device read if the runner gave none."""
    query_lens = meta.query_lens_cpu or torch.diff(meta.query_start_loc).tolist()
    seq_lens = meta.seq_lens_cpu or meta.seq_lens.tolist()
    return query_lens, seq_lens


def visibility_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None
                    ) -> torch.Tensor:
    """True where a query at q_pos may attend a key at k_pos (causal, optional window)."""
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed = allowed & (k_pos > q_pos - sliding_window)
    return allowed


def widened_on_cpu(q: torch.Tensor) -> bool:
    """Whether SDPA takes a 16-bit q/k/v as float32: on a CPU without AMX, torch's CPU
    flash-attention kernel multiplies 16-bit blocks through small oneDNN calls, 4-25x
    slower than its float32 path (measured on AVX-512 BF16 for decode of 1-16 sequences
    over 80-512 tokens); the widened copies cost little beside it. With AMX the kernel
    has a tile path of its own, so 16-bit stays."""
    return (q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16)
            and not device_info_for(q.device).features.amx)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           is_causal: bool, scale: float, soft_cap: float | None,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, Q, D], k/v [B, Hkv, L, D], mask broadcastable to [B, H, Q, L] -> [B, H, Q, D];
    ``sinks`` [H]: each head's sink logit in the softmax's denominator."""
    if not soft_cap and sinks is None:
        if widened_on_cpu(q):
            return F.scaled_dot_product_attention(
                q.float(), k.float(), v.float(), attn_mask=mask, is_causal=is_causal,
                scale=scale, enable_gqa=True).to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                              scale=scale, enable_gqa=True)
    # Soft-capping and sinks have no SDPA form: explicit fp32 scores.
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), k.transpose(-1, -2)) * scale
    if soft_cap:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    if is_causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(softmax_with_sinks(scores, sinks), v).to(q.dtype)


class SdpaAttentionImpl(TorchCacheWriter):
    """AttentionImpl on torch SDPA; correct everywhere torch runs, fastest on CPU."""

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
               layer: AttentionLayerParams, out: torch.Tensor, k_scale: float,
               v_scale: float) -> None:
        query_lens, seq_lens = host_lengths(meta)
        starts = [0, *itertools.accumulate(query_lens)]
        single = [i for i, n in enumerate(query_lens) if n == 1]
        if single and (len(single) == meta.num_seqs or len(single) > 1):
            self._decode_batch(query, kv_cache, meta, layer, single, starts, seq_lens, out,
                               k_scale, v_scale)
            batched = set(single)
        else:
            batched = set()
        for i, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
            if query_len == 0 or i in batched:
                continue
            start = starts[i]
            k, v = gather_sequence_kv(kv_cache, meta.block_tables[i], seq_len)
            k = dequantize(k, k_scale, query.dtype).transpose(0, 1).unsqueeze(0)
            v = dequantize(v, v_scale, query.dtype).transpose(0, 1).unsqueeze(0)
            q = query[start:start + query_len].transpose(0, 1).unsqueeze(0)
            # SDPA's own causal flag aligns the diagonal top-left, which is only right
            # when there is no cached prefix; otherwise the mask says where the diagonal is.
            is_causal = query_len == seq_len and layer.sliding_window is None and query_len > 1
            mask = None
            if not is_causal and (query_len > 1 or layer.sliding_window is not None):
                q_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)[:, None]
                k_pos = torch.arange(seq_len, device=query.device)[None, :]
                mask = visibility_mask(q_pos, k_pos, layer.sliding_window)
            o = attend(q, k, v, mask, is_causal, layer.scale, layer.logit_soft_cap,
                       layer.sinks)
            out[start:start + query_len] = o[0].transpose(0, 1)

    def _decode_batch(self, query: torch.Tensor, kv_cache: torch.Tensor,
                      meta: AttentionMetadata, layer: AttentionLayerParams, seqs: list[int],
                      starts: list[int], seq_lens: list[int], out: torch.Tensor,
                      k_scale: float, v_scale: float) -> None:
        """The sequences ``seqs``, one query each (its row: ``starts``): every context
        padded to the longest, the padding masked; the cache rows to read and the mask are
        the step's (``StepMemo``)."""
        num_seqs, block_size = len(seqs), kv_cache.shape[2]
        lens = [seq_lens[i] for i in seqs]
        max_len = max(lens)
        # A decode step, or decodes ahead of prompt chunks (the scheduler's order): the
        # batch's first sequences and rows, sliced. Otherwise they are picked by index.
        # These memo keys name no sequences: ``seqs`` follows from the step's query lengths
        # alone (``attend``'s one-query sequences), so it is the same for every layer.
        leading = seqs[-1] == num_seqs - 1 and starts[num_seqs] == num_seqs
        picked = self.step_memo.get(("picked",), lambda: slice(0, num_seqs) if leading
                                    else torch.tensor(seqs, device=query.device))
        rows_q = picked if leading else self.step_memo.get(
            ("rows_q",), lambda: torch.tensor([starts[i] for i in seqs], device=query.device))
        rows = self.step_memo.get(("rows", block_size, max_len), lambda: decode_cache_rows(
            meta.block_tables[picked], block_size, max_len))                # [S * L]
        mask = self.step_memo.get(("mask", max_len, layer.sliding_window), lambda: decode_mask(
            meta.seq_lens[picked], lens, max_len, layer.sliding_window))
        o = padded_decode_attention(query[rows_q], kv_cache, rows, max_len, mask, layer,
                                    k_scale, v_scale)
        out[rows_q] = o.to(out.dtype)   # an index_put does not convert

    def decode_in_graph(self, query: torch.Tensor, key: torch.Tensor | None,
                        value: torch.Tensor | None, kv_cache: torch.Tensor, step: DecodeRows,
                        layer: AttentionLayerParams, k_scale: float, v_scale: float
                        ) -> torch.Tensor | None:
        """A decode step's cache write and attention (query [S, H, D], one query a
        sequence) as tensor ops only, for a traced step (engine/cpu_compiled_step.py): the
        step's slots, cache rows and lengths are tensors of ``step``, so nothing of them
        is fixed at trace time but the padded context's length being a graph size. None
        where this layer's cache has no in-graph form (float8: written through a byte
        view; no key: a fused kernel wrote it), which then attends through ``forward``."""
        if key is None or value is None or kv_cache.dtype in FP8_CACHE_DTYPES:
            return None
        # Every sequence writes: the compiled step refuses slot -1 before it runs.
        write_kv_cache_torch(key, value, kv_cache,
                             WrittenRows.of_slots(step.slots, kv_cache.shape[2]))
        max_len = step.rows.shape[1]
        mask = padded_decode_mask(step.seq_lens, max_len, layer.sliding_window)
        o = padded_decode_attention(query, kv_cache, step.rows.flatten(), max_len, mask, layer,
                                    k_scale, v_scale)
        return o.to(query.dtype)


def padded_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, rows: torch.Tensor,
                            max_len: int, mask: torch.Tensor | None,
                            layer: AttentionLayerParams, k_scale: float, v_scale: float
                            ) -> torch.Tensor:
    """One query a sequence (query [S, H, D]) over its context gathered from the cache
    (``rows`` [S * max_len], padding hidden by ``mask``) -> [S, H, D] in the dtype it was
    computed in (widened: float32, rounded once by the caller as it stores it)."""
    keys, values = kv_cache.view(2, -1, *kv_cache.shape[3:]).unbind(0)
    shape = (query.shape[0], max_len, *kv_cache.shape[3:])
    # Widened (``widened_on_cpu``): read straight into float32, one conversion a tensor.
    dtype = torch.float32 if widened_on_cpu(query) else query.dtype
    k = dequantize(keys.index_select(0, rows).view(shape), k_scale, dtype)  # [S, L, Hkv, D]
    v = dequantize(values.index_select(0, rows).view(shape), v_scale, dtype)
    q = query.unsqueeze(2).to(dtype)                                     # [S, H, 1, D]
    o = attend(q, k.transpose(1, 2), v.transpose(1, 2), mask, False, layer.scale,
               layer.logit_soft_cap, layer.sinks)
    return o.squeeze(2)


def decode_mask(seq_lens: torch.Tensor, host_seq_lens: list[int], max_len: int,
                sliding_window: int | None) -> torch.Tensor | None:
    """[S, 1, 1, max_len]: which padded keys each sequence's one query sees; None where it
    sees every one (each context is max_len long, none beyond a window)."""
    if all(n == max_len for n in host_seq_lens) and (sliding_window is None
                                                     or sliding_window >= max_len):
        return None
    return padded_decode_mask(seq_lens, max_len, sliding_window)


def padded_decode_mask(seq_lens: torch.Tensor, max_len: int, sliding_window: int | None
                       ) -> torch.Tensor:
    """[S, 1, 1, max_len]: which of ``max_len`` padded keys each sequence's one query sees."""
    k_pos = torch.arange(max_len, device=seq_lens.device)[None, :]
    mask = visibility_mask(seq_lens.long()[:, None] - 1, k_pos, sliding_window)
    return mask[:, None, None, :]
