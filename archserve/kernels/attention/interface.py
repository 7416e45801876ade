"""The contract between the engine's paged KV cache and every attention implementation.

Layout (owned by the engine, see DESIGN.md principle 4). One tensor per layer:

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_size]
              kv_cache[0] holds keys, kv_cache[1] values.

A token's *slot* is ``block_id * block_size + offset``; ``slot_mapping[t] == -1``
means "do not write" (padding, e.g. in a CUDA-graph batch larger than the real one).

A batch is flattened: ``query`` holds every scheduled token of every sequence back to
back, sequence ``i`` owning rows ``query_start_loc[i]:query_start_loc[i+1]``. Those
rows are the *last* ``query_len`` tokens of a context of ``seq_lens[i]`` tokens; the
earlier ``seq_lens[i] - query_len`` tokens are already in the cache (prefix caching,
chunked prefill, decode). Prefill, chunked prefill and decode are one case.

Every implementation does the same two things per layer:
  1. write this step's keys and values into the cache at ``slot_mapping``;
  2. attend each query token causally over its sequence's cached context
     (optionally limited to a sliding window, with logit soft-capping, and with a learned
     sink logit per query head that joins the softmax's denominator and no value).

A traced decode step (engine/cpu_compiled_step.py) hands its attention the same facts as
tensors, ``DecodeRows``: nothing of a step's lengths is fixed when the graph is made.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """Per-step batch description, built once by the model runner and shared by all layers."""

    query_start_loc: torch.Tensor      # int32 [num_seqs + 1], on device
    seq_lens: torch.Tensor             # int32 [num_seqs], context length incl. this step
    block_tables: torch.Tensor         # int32 [num_seqs, max_blocks_per_seq], -1/0 padded
    slot_mapping: torch.Tensor         # int64 [num_tokens]
    max_query_len: int                 # host ints, so kernels can choose grids without syncs
    max_seq_len: int
    num_seqs: int
    # Host copies (lists) of the same facts, for backends that loop or build masks on the host.
    query_lens_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)
    # The step is laid out in a captured bucket's slots (engine/mixed_graphs.py): a padding
    # sequence and empty sequence slots, so kernels should not launch work per slot.
    padded_bucket: bool = False

    @classmethod
    def from_lengths(cls, query_lens: Sequence[int] | np.ndarray,
                     seq_lens: Sequence[int] | np.ndarray,
                     block_tables: torch.Tensor | np.ndarray,
                     slot_mapping: torch.Tensor | np.ndarray, device: torch.device | str,
                     upload: Callable[[list[np.ndarray]], list[torch.Tensor]] | None = None
                     ) -> AttentionMetadata:
        """The one builder of a batch's metadata from its per-sequence lengths: the query
        offsets, the host maxima and the host copies all follow from them, so no caller
        can let them disagree. Host arrays go to ``device`` together through ``upload``
        (the engine's pinned, non-blocking copy: arrays in, their device tensors out, in
        order) or by plain copies; tensors are moved as given. (The CUDA-graph runners'
        metadata are the exception: views of their static buffers.)
        """
        q = np.asarray(query_lens, dtype=np.int32)
        s = np.asarray(seq_lens, dtype=np.int32)
        starts = np.zeros(len(q) + 1, dtype=np.int32)
        np.cumsum(q, out=starts[1:])
        fields = [starts, s, block_tables, slot_mapping]
        host = [i for i, x in enumerate(fields) if not isinstance(x, torch.Tensor)]
        if upload is not None:
            moved = upload([fields[i] for i in host])
        else:
            moved = [torch.from_numpy(fields[i]).to(device) for i in host]
        for i, tensor in zip(host, moved, strict=True):
            fields[i] = tensor
        starts_t, s_t, tables_t, slots_t = (x.to(device) for x in fields)
        return cls(query_start_loc=starts_t, seq_lens=s_t,
                   block_tables=tables_t, slot_mapping=slots_t,
                   max_query_len=int(q.max()) if len(q) else 0,
                   max_seq_len=int(s.max()) if len(s) else 0, num_seqs=len(s),
                   query_lens_cpu=q.tolist(), seq_lens_cpu=s.tolist())

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


@dataclass(frozen=True)
class AttentionLayerParams:
    """Per-layer constants an implementation needs."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: int | None = None  # attend to the last `sliding_window` keys (incl. self)
    logit_soft_cap: float | None = None
    kv_cache_dtype: str = "auto"       # "auto" | "fp8_e4m3" | "fp8_e5m2"
    # Attention sinks (gpt-oss): [num_heads] logits, one per query head of this rank, in the
    # units of the scaled scores. Each softmax row then reads
    # exp(s_j) / (exp(sink) + sum_j exp(s_j)): the sink takes probability and gives no value.
    sinks: torch.Tensor | None = field(default=None, compare=False)


@dataclass(frozen=True)
class DecodeRows:
    """What a decode step's attention reads and writes, as tensors: the graph inputs of a
    traced decode step (``SdpaAttentionImpl.decode_in_graph``), made once a step."""

    slots: torch.Tensor      # [S] long: where each sequence's new key and value go
    rows: torch.Tensor       # [S, L] long: each context's cache rows, padded to L (masked)
    seq_lens: torch.Tensor   # [S]: context lengths, this step's token included

    @classmethod
    def of_step(cls, meta: AttentionMetadata, block_size: int) -> DecodeRows:
        # Two rows at least: a traced graph's padded length is a symbol, which tracing
        # assumes is not 1 (a decode's context is its prompt and its new token anyway).
        max_len = max(meta.max_seq_len, 2)
        rows = decode_cache_rows(meta.block_tables, block_size, max_len)
        return cls(meta.slot_mapping, rows.view(meta.num_seqs, max_len), meta.seq_lens)


def decode_cache_rows(block_tables: torch.Tensor, block_size: int, max_len: int
                      ) -> torch.Tensor:
    """The flattened cache rows (block * block_size + offset) of each sequence's first
    ``max_len`` tokens, [S * max_len] long; rows past a sequence's length (and its -1
    table padding, read as block 0) are for the reader to mask (TORCH_SDPA's
    ``decode_mask``)."""
    num_blocks = (max_len + block_size - 1) // block_size
    blocks = block_tables[:, :num_blocks].long().clamp_min(0)
    offsets = torch.arange(block_size, device=block_tables.device)
    return (blocks[:, :, None] * block_size + offsets).flatten(1)[:, :max_len].reshape(-1)


class AttentionImpl(Protocol):
    """What a selected attention backend returns from ``make_impl``."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                layer: AttentionLayerParams, k_scale: float = 1.0, v_scale: float = 1.0
                ) -> torch.Tensor:
        """query [T, H, D], key/value [T, Hkv, D] -> output [T, H, D] (query's dtype)."""
        ...


class PagedAttentionImpl:
    """What every attention implementation over the paged cache does the same way: write
    this step's keys and values to their slots (None: nothing new, e.g. a fused kernel
    wrote them already), allocate the output, then attend. Subclasses give the two steps:
    ``write_cache`` and ``attend``, which fills ``out`` [T, H, D]."""

    def __init__(self, device=None, spec=None) -> None:   # noqa: ANN001 - DeviceInfo, spec
        self.device = device
        self.spec = spec

    def forward(self, query: torch.Tensor, key: torch.Tensor | None,
                value: torch.Tensor | None, kv_cache: torch.Tensor, meta: AttentionMetadata,
                layer: AttentionLayerParams, k_scale: float = 1.0, v_scale: float = 1.0
                ) -> torch.Tensor:
        """query [T, H, D], key/value [T, Hkv, D] -> output [T, H, D] (query's dtype)."""
        if key is not None and value is not None:
            self.write_cache(key, value, kv_cache, meta.slot_mapping, k_scale, v_scale)
        out = torch.empty_like(query)
        self.attend(query, kv_cache, meta, layer, out, k_scale, v_scale)
        return out

    def write_cache(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, k_scale: float, v_scale: float) -> None:
        raise NotImplementedError

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
               layer: AttentionLayerParams, out: torch.Tensor, k_scale: float,
               v_scale: float) -> None:
        raise NotImplementedError


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
                   ) -> tuple[int, int, int, int, int]:
    return (2, num_blocks, block_size, num_kv_heads, head_size)
