"""The paged cache of one DeepSeek V4 layer: its compressed entries, the indexer's keys and its
compressor's running state, kept per block id, and its window's keys, kept per sequence in a
ring.

A V4 layer attends to the last ``window`` keys of its sequence (one key head that is also
the value) and, when it compresses (rate m), to entries that each summarise m consecutive
tokens (the softmax-gated sum of their projections: entry g covers tokens [g m, g m + m)).

The window's keys live in a ring of ``ring_rows`` (= window) rows per sequence: a token's
cache slot is ``ring * ring_rows + position % ring_rows`` (its sequence's ring, from the
block pool), so a sequence holds one window's keys however long its context, and a key
takes the row of the key one window before it. A step reads its window's cached keys
before it writes its own (the writes launch after the attention), so the ring holds no
more than the window.

Per block of ``block_size`` tokens (a multiple of m), the layer's block holds:

- entries: its block_size / m compressed entries (entry g in block g m // block_size);
- index keys (compressed sparse layers): the lightning indexer's compressed key of each entry;
- state: the compressor's fp32 accumulators of the group still being filled (a running
  maximum, sum of exponentials and exp-weighted sum per channel: merging them is exact
  online softmax). A compressed sparse layer's entry g also mixes in the first series of
  group g - 1 (its windows overlap), so its block keeps three: the open group's second
  series (its own entry) and first series (the next entry's), and the first series of the
  block's latest closed group. The indexer's compressor shares the groups, so its channels
  sit beside the main compressor's in the same accumulators.

Everything in a block is a function of the tokens up to its end once the block is full, but
the window's keys before a block's end are not in it (the ring moves on): the prefix cache
hands a cached prefix to another sequence only where it kept a snapshot of the ring at the
prefix's end, which the sequence's ring starts as a copy of (engine/window_rings.py).
Preemption recomputes (a re-admitted sequence takes a fresh ring), and chunked prefill may
end a step inside a group (the open accumulators carry it over) or anywhere in the ring.

Rows are in the model dtype; the block cache of one layer is uint8
``[1, num_blocks, block_size, 1, row_bytes]`` (the engine's 5-d form, with each token's
row ``row_bytes`` wide), addressed as one byte span per block; its ring cache is
``[1, num_rings, ring_rows, 1, head_dim]`` in the model dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# DeepSeek V4's attention layer kinds (config ``layer_types``).
SLIDING, CSA, HCA = ("sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention")
ALIGN = 16
# Accumulator slots of a compressed sparse (overlapping) layer, and their order.
OPEN_OWN, OPEN_NEXT, CLOSED_NEXT = 0, 1, 2
ACCUMULATOR_PARTS = 3          # running max, sum of exponentials, exp-weighted sum


def _align(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class CompressedCacheLayout:
    block_size: int
    head_dim: int
    window: int
    compress_rate: int            # 0: a sliding-window-only layer
    overlap: bool                 # compressed sparse attention: overlapping windows
    index_dim: int                # the indexer key's width (0: no indexer)
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.compress_rate and self.block_size % self.compress_rate:
            raise ValueError(f"KV block size {self.block_size} is not a multiple of the "
                             f"compress rate {self.compress_rate}: a compression group "
                             f"must not straddle two blocks")

    # ---- sizes --------------------------------------------------------------------------
    @property
    def elem(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def ring_rows(self) -> int:
        """Window keys a sequence's ring holds: a step reads its window's before it writes."""
        return self.window

    @property
    def ring_bytes(self) -> int:
        """One sequence's ring of this layer."""
        return self.ring_rows * self.head_dim * self.elem

    @property
    def entries_per_block(self) -> int:
        return self.block_size // self.compress_rate if self.compress_rate else 0

    @property
    def state_channels(self) -> int:
        """The accumulators' width: the main compressor's, then the indexer's."""
        return self.head_dim + self.index_dim if self.compress_rate else 0

    @property
    def state_slots(self) -> int:
        if not self.compress_rate:
            return 0
        return 3 if self.overlap else 1

    # ---- byte offsets within a block ------------------------------------------------------
    @property
    def entries_offset(self) -> int:
        return 0

    @property
    def index_offset(self) -> int:
        return _align(self.entries_offset + self.entries_per_block * self.head_dim * self.elem)

    @property
    def state_offset(self) -> int:
        return _align(self.index_offset + self.entries_per_block * self.index_dim * self.elem)

    @property
    def block_bytes(self) -> int:
        """At least ALIGN: a sliding-window-only layer keeps nothing per block, but its
        cache stays a tensor of the engine's form."""
        return max(ALIGN, _align(self.state_offset + 4 * self.state_slots * ACCUMULATOR_PARTS
                                 * self.state_channels))

    @property
    def row_bytes(self) -> int:
        """Bytes per token row of the cache tensor: the block's bytes over its tokens, so
        that every block starts 16-byte aligned."""
        step = ALIGN // math.gcd(self.block_size, ALIGN)
        return _align(-(-self.block_bytes // self.block_size), step)

    def read_bytes(self, context_len: int, new_tokens: int, topk: int) -> int:
        """What one sequence's step of ``new_tokens`` after ``context_len`` reads of this
        layer's cache (the roofline's floor): its window's keys, the index keys the indexer
        scores, and the entries attended (a decode query's top-k; a prompt step's, all)."""
        seen = context_len + new_tokens
        entries = seen // self.compress_rate if self.compress_rate else 0
        attended = min(entries, topk) if self.index_dim and new_tokens == 1 else entries
        rows = min(self.window, seen) + attended
        return (rows * self.head_dim + entries * self.index_dim) * self.elem

    def describe(self) -> str:
        """What a block keeps, e.g. "64 entries (1 per 4 tokens) + 64 index keys"."""
        parts = []
        if self.compress_rate:
            parts.append(f"{self.entries_per_block} entries (1 per {self.compress_rate} tokens)")
        if self.index_dim:
            parts.append(f"{self.entries_per_block} index keys")
        if self.state_slots:
            parts.append(f"{self.state_slots} fp32 accumulator{'s' * (self.state_slots > 1)}")
        return " + ".join(parts) or "nothing"

    # ---- views ----------------------------------------------------------------------------
    def block_span(self, cache: torch.Tensor) -> torch.Tensor:
        """The cache as [num_blocks, block_size * row_bytes] uint8 (a view)."""
        assert cache.is_contiguous(), "a V4 layer's cache is addressed as contiguous blocks"
        return cache.view(torch.uint8).reshape(cache.shape[1], -1)

    def _region(self, cache: torch.Tensor, offset: int, count: int, dtype: torch.dtype
                ) -> torch.Tensor:
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        return self.block_span(cache)[:, offset:offset + nbytes].view(dtype)

    def ring_view(self, ring_cache: torch.Tensor) -> torch.Tensor:
        """[num_rings * ring_rows, head_dim]: the rows a token's slot numbers."""
        return ring_cache.view(-1, self.head_dim)

    def entry_view(self, cache: torch.Tensor) -> torch.Tensor:
        """[num_blocks, entries_per_block, head_dim] in the model dtype."""
        n = self.entries_per_block
        return self._region(cache, self.entries_offset, n * self.head_dim, self.dtype).view(
            -1, n, self.head_dim)

    def index_view(self, cache: torch.Tensor) -> torch.Tensor:
        """[num_blocks, entries_per_block, index_dim] in the model dtype."""
        n = self.entries_per_block
        return self._region(cache, self.index_offset, n * self.index_dim, self.dtype).view(
            -1, n, self.index_dim)

    def state_view(self, cache: torch.Tensor) -> torch.Tensor:
        """[num_blocks, state_slots, ACCUMULATOR_PARTS, state_channels] fp32."""
        count = self.state_slots * ACCUMULATOR_PARTS * self.state_channels
        return self._region(cache, self.state_offset, count, torch.float32).view(
            -1, self.state_slots, ACCUMULATOR_PARTS, self.state_channels)

    def allocate(self, num_blocks: int, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.zeros(1, num_blocks, self.block_size, 1, self.row_bytes,
                           dtype=torch.uint8, device=device)

    def allocate_rings(self, num_rings: int, device: torch.device | str = "cpu"
                       ) -> torch.Tensor:
        return torch.zeros(1, num_rings, self.ring_rows, 1, self.head_dim, dtype=self.dtype,
                           device=device)


def ring_cache_index(num_layers: int, layer: int) -> int:
    """Where a layer's window rings sit in the engine's list of caches
    (engine/kv_cache.py's ``model_kv_caches``): after every layer's blocks."""
    return num_layers + layer


def layer_layouts(kinds: list[str] | tuple[str, ...], rates: dict[str, int], window: int,
                  head_dim: int, index_dim: int, dtype: torch.dtype, block_size: int
                  ) -> list[CompressedCacheLayout]:
    """Each layer's layout: ``kinds`` per layer, ``rates`` per compressed kind; the layers
    of compressed sparse attention overlap and keep index keys."""
    out = []
    for kind in kinds:
        sparse = kind == CSA
        out.append(CompressedCacheLayout(block_size, head_dim, window, rates.get(kind, 0),
                                         overlap=sparse, index_dim=index_dim if sparse else 0,
                                         dtype=dtype))
    return out
