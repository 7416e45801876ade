"""KVBlockPool: fixed-size KV cache blocks, reference counts and the prefix cache.

Bookkeeping only: the engine's KV tensors are indexed by the block ids handed out here
(see ``kernels/attention/interface.py`` for the layout). A sequence's blocks live in
``Sequence.block_table``.

Prefix caching: every *full* block a sequence has computed gets a chained hash,
``sha256(previous block's hash + this block's tokens)``, so a hash names the whole
prefix up to and including that block. A new sequence walks its prompt block by block
through ``_cached`` (hash -> block id) and reuses what it finds (reference count + 1).
Full blocks are never written again, so sharing needs no copy-on-write.

A hit is verified, not trusted to the hash: the found block must hold this block's
tokens, and its parent must be the block the walk matched just before it (the same
block id, registered at the same time). So even a hash collision cannot serve KV that
was computed after another prefix; the walk stops there instead.

A sequence that runs with a LoRA adapter computes other KV for the same tokens: its chain
starts from the adapter's ``cache_key`` instead of the common seed (``chain_root``), and
each cached block records the root of its chain, which a hit must match too.

Freed blocks whose hash is known stay findable: they wait in ``_free_cached`` in the
order they were freed, and are evicted (hash forgotten) least recently freed first,
only when no never-cached free block is left. Blocks of one sequence are freed tail
first, so a prompt's head outlives its tail.

A model that keeps its window's keys in a ring per sequence (DeepSeek V4: ``num_rings`` rings
of ``ring_rows`` rows, engine/window_rings.py) takes one at admission and returns it with its
blocks. No block keeps the window's keys, so the prefix cache serves a prefix only up to a
block whose ring snapshot it holds (taken when a step ends at that block's end: a prompt's
chunks are cut at its last full block, ``chunk_limit``), and the admitted sequence's ring
starts as a copy of it.

Sampling with ``n > 1`` needs no fork: the ``n`` sequences are ordinary sequences with
the same prompt. Once one of them has computed a full prompt block, the others find it
here; sequences admitted in the same step compute their blocks side by side and the
first to register a hash owns the cache entry (the duplicate block is simply freed).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass

from archserve.engine.sequence import Sequence
from archserve.engine.window_rings import WindowRings

_NO_PARENT = b"archserve-prefix-v1"   # seed of every hash chain
_ROOT = (-1, -1)                       # the "parent" of a sequence's first block


def chain_hash(parent_hash: bytes | None, block_tokens: tuple[int, ...]) -> bytes:
    """SHA-256 of a full block chained to the hash of the block before it (None: first of
    a sequence without an adapter; its ``chain_root``: first of one with)."""
    digest = hashlib.sha256(_NO_PARENT if parent_hash is None else parent_hash)
    digest.update(array("q", block_tokens).tobytes())
    return digest.digest()


def token_slot(block_table: list[int], ring: tuple[int, int] | None, block_size: int,
               position: int) -> int:
    """Where the token at ``position`` writes its key: its block's row, or where the
    sequence has a ring (``Sequence.ring``: first row, rows) its ring's row."""
    if ring is not None:
        return ring[0] + position % ring[1]
    return block_table[position // block_size] * block_size + position % block_size


def chain_root(seq: Sequence) -> bytes | None:
    """What a sequence's first block chains to: its LoRA adapter's cache key (None: the
    base model's seed)."""
    return None if seq.lora is None else seq.lora.cache_key


@dataclass(frozen=True)
class CachedPrefix:
    """The longest cached run of full blocks at the start of a sequence."""

    block_ids: tuple[int, ...] = ()
    block_hashes: tuple[bytes, ...] = ()
    num_tokens: int = 0


class KVBlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_rings: int = 0, ring_rows: int = 0) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.rings = WindowRings(num_rings, ring_rows) if ring_rows else None
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_count = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._block_root: list[bytes | None] = [None] * num_blocks   # its chain's root
        # Per cached block: (its parent's block id, the parent's registration number), and
        # its own registration number, which changes whenever the block id is re-registered.
        self._block_parent: list[tuple[int, int]] = [_ROOT] * num_blocks
        self._registration = [0] * num_blocks
        self._registrations = 0
        self._cached: dict[bytes, int] = {}                  # hash -> block id
        self._free_uncached: deque[int] = deque(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # LRU: oldest first
        # Prefix cache counters in tokens, for metrics (hit rate = hits / queries).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # -- stats --------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (cached free blocks count: they are evictable)."""
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently findable by hash, in use or free."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_count[block_id]

    # -- prefix lookup ------------------------------------------------------------
    def find_cached_prefix(self, seq: Sequence) -> CachedPrefix:
        """Longest run of cached full blocks at the start of ``seq``; pure lookup.

        The hit never covers the last token: it must be computed to give logits.
        """
        if not self.enable_prefix_caching or seq.sampling_params.prompt_logprobs is not None:
            # Prompt logprobs need the logits of every prompt position: compute them all.
            return CachedPrefix()
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        tokens = seq.token_ids
        ids: list[int] = []
        hashes: list[bytes] = []
        root = parent = chain_root(seq)
        for i in range(max_blocks):
            block_tokens = tuple(tokens[i * bs:(i + 1) * bs])
            h = seq.block_hashes[i] if i < len(seq.block_hashes) else chain_hash(parent, block_tokens)
            block_id = self._cached.get(h)
            if (block_id is None or self._block_tokens[block_id] != block_tokens
                    or self._block_root[block_id] != root
                    or self._block_parent[block_id] != self._identity(ids[-1] if ids else None)):
                break
            ids.append(block_id)
            hashes.append(h)
            parent = h
        if self.rings is not None:   # a hit ends where the window before it was kept
            while ids and not self.rings.has_snapshot(ids[-1]):
                ids.pop()
                hashes.pop()
        return CachedPrefix(tuple(ids), tuple(hashes), len(ids) * bs)

    def chunk_limit(self, seq: Sequence, start: int, num_new_tokens: int) -> int:
        """How many of ``num_new_tokens`` from position ``start`` a chunk of ``seq`` may
        take: with window rings and the prefix cache, a chunk that would run past the
        prompt's last full block (the longest prefix another prompt could reuse) ends
        there, so that block's ring snapshot can be kept."""
        if self.rings is None or not self.enable_prefix_caching:
            return num_new_tokens
        last = (seq.num_prompt_tokens - 1) // self.block_size * self.block_size
        return last - start if start < last < start + num_new_tokens else num_new_tokens

    # -- allocation ---------------------------------------------------------------
    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Fresh blocks that covering ``num_computed_tokens + num_new_tokens`` would take."""
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int,
                     prefix: CachedPrefix | None = None) -> bool:
        """Whether ``allocate(seq, num_new_tokens, prefix)`` would succeed."""
        if seq.block_table:
            return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks
        if self.rings is not None and not self.rings.can_take():
            return False
        prefix = self.find_cached_prefix(seq) if prefix is None else prefix
        return self._fresh_blocks_for_admission(prefix, num_new_tokens) <= self._free_after_taking(prefix)

    def allocate(self, seq: Sequence, num_new_tokens: int,
                 prefix: CachedPrefix | None = None) -> bool:
        """Admit ``seq``: take its cached prefix, then blocks for ``num_new_tokens`` more.

        Sets ``num_computed_tokens`` and ``num_cached_tokens`` to the prefix hit.
        ``num_new_tokens`` counts tokens after the hit (pass the ``prefix`` you sized it
        from, so the lookup is not repeated). Returns False and changes nothing if the
        pool is short of blocks. A sequence that already holds blocks just grows.
        """
        if seq.block_table:
            return self.append_slots(seq, num_new_tokens)
        prefix = self.find_cached_prefix(seq) if prefix is None else prefix
        fresh = self._fresh_blocks_for_admission(prefix, num_new_tokens)
        if fresh > self._free_after_taking(prefix) or (self.rings is not None
                                                       and not self.rings.can_take()):
            return False
        if self.rings is not None:
            self.rings.take(seq, prefix.block_ids[-1] if prefix.block_ids else None)
        for block_id in prefix.block_ids:
            self._take(block_id)
        seq.block_table = list(prefix.block_ids)
        seq.block_hashes = list(prefix.block_hashes)
        seq.num_computed_tokens = prefix.num_tokens
        seq.num_cached_tokens = prefix.num_tokens
        seq.block_table.extend(self._pop_free() for _ in range(fresh))
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += prefix.num_tokens
        return True

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow ``seq``'s block table to hold ``num_new_tokens`` more tokens; False if short."""
        fresh = self.blocks_needed(seq, num_new_tokens)
        if fresh > self.num_free_blocks:
            return False
        seq.block_table.extend(self._pop_free() for _ in range(fresh))
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that became full and computed since the last call."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        root = chain_root(seq)
        parent = seq.block_hashes[-1] if seq.block_hashes else root
        for i in range(len(seq.block_hashes), num_full):
            block_tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(parent, block_tokens)
            seq.block_hashes.append(h)
            parent = h
            block_id = seq.block_table[i]
            # This block's KV was computed after the sequence's own previous block: it
            # is findable only behind that block, so that block must be the cache's entry
            # (not a duplicate computed beside another sequence's).
            parent_id = seq.block_table[i - 1] if i else None
            if parent_id is not None and self._block_hash[parent_id] != seq.block_hashes[i - 1]:
                continue
            if h not in self._cached and self._block_hash[block_id] is None:
                self._cached[h] = block_id
                self._block_hash[block_id] = h
                self._block_tokens[block_id] = block_tokens
                self._block_root[block_id] = root
                self._block_parent[block_id] = self._identity(parent_id)
                self._registrations += 1
                self._registration[block_id] = self._registrations
        if self.rings is not None and num_full and num_full * bs == seq.num_computed_tokens \
                <= seq.num_prompt_tokens:
            # The step just committed ended at this block's end: the ring holds the window
            # before it (copied before any later step writes the ring), kept for the
            # cache's entry of the block (this one, or the same prefix's computed earlier).
            entry = self._cached.get(seq.block_hashes[num_full - 1])
            if entry is not None and self._block_tokens[entry] == tuple(
                    seq.token_ids[(num_full - 1) * bs:num_full * bs]):
                self.rings.snapshot(entry, seq)

    def uncache_uncomputed(self, seq: Sequence) -> None:
        """``seq`` was rolled back (its ``num_computed_tokens`` lowered: a step whose tokens
        never arrived, or a verification that rejected a draft over a model whose cache it
        rewinds): the blocks it registered past what it now counts as computed leave the
        prefix cache, and so do the ring snapshots at their ends (kept after a step that
        did not stand: the ring will not hold that window)."""
        keep = seq.num_computed_tokens // self.block_size
        for i in range(keep, len(seq.block_hashes)):
            entry = self._cached.get(seq.block_hashes[i])
            if entry is None:
                continue
            if self.rings is not None:
                self.rings.forget(entry)
            if entry == seq.block_table[i]:
                del self._cached[seq.block_hashes[i]]
                self._block_hash[entry] = None
                self._block_tokens[entry] = None
        del seq.block_hashes[keep:]

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks, tail first, and clear its KV state."""
        for block_id in reversed(seq.block_table):
            self._ref_count[block_id] -= 1
            if self._ref_count[block_id] == 0:
                if self._block_hash[block_id] is None:
                    self._free_uncached.append(block_id)
                else:
                    self._free_cached[block_id] = None
        if self.rings is not None:
            self.rings.give_back(seq)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (e.g. after new weights); returns how many were dropped."""
        dropped = len(self._cached)
        for block_id in self._cached.values():
            self._block_hash[block_id] = None
            self._block_tokens[block_id] = None
        self._cached.clear()
        if self.rings is not None:
            self.rings.forget_all()
        self._free_uncached.extend(self._free_cached)
        self._free_cached.clear()
        return dropped

    # -- slots --------------------------------------------------------------------
    def slots_for(self, seq: Sequence, start: int, end: int) -> list[int]:
        """KV cache slots of token positions [start, end): ``block_id * block_size +
        offset``, or in the sequence's ring (``token_slot``)."""
        return [token_slot(seq.block_table, seq.ring, self.block_size, p)
                for p in range(start, end)]

    # -- internals ----------------------------------------------------------------
    def _identity(self, block_id: int | None) -> tuple[int, int]:
        """What a child records of its parent: the block id and when it was registered."""
        return _ROOT if block_id is None else (block_id, self._registration[block_id])

    def _fresh_blocks_for_admission(self, prefix: CachedPrefix, num_new_tokens: int) -> int:
        total = -(-(prefix.num_tokens + num_new_tokens) // self.block_size)
        return max(0, total - len(prefix.block_ids))

    def _free_after_taking(self, prefix: CachedPrefix) -> int:
        # Hit blocks that sit in the free list stop being free once taken.
        idle_hits = sum(1 for b in prefix.block_ids if self._ref_count[b] == 0)
        return self.num_free_blocks - idle_hits

    def _take(self, block_id: int) -> None:
        if self._ref_count[block_id] == 0:
            del self._free_cached[block_id]
        self._ref_count[block_id] += 1

    def _pop_free(self) -> int:
        if self._free_uncached:
            block_id = self._free_uncached.popleft()
        else:
            block_id, _ = self._free_cached.popitem(last=False)  # least recently freed
            del self._cached[self._block_hash[block_id]]
            if self.rings is not None:
                self.rings.forget(block_id)
            self._block_hash[block_id] = None
            self._block_tokens[block_id] = None
        self._ref_count[block_id] = 1
        return block_id
