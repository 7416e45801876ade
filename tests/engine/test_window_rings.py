"""Window rings in the block pool (DeepSeek V4's sliding-window keys, engine/window_rings.py):
a ring per admitted sequence, the ring snapshot that a cached prefix needs, the copies the
runner makes, a prompt's chunks cut at its last full block, and a step rolled back."""

from __future__ import annotations

from archserve.engine.block_pool import KVBlockPool, token_slot
from archserve.engine.scheduler import Scheduler, SchedulerConfig
from archserve.engine.sequence import Sequence

BLOCK, ROWS = 4, 6


def step(pool: KVBlockPool, seq: Sequence, num_tokens: int) -> None:
    """One scheduled and committed chunk of ``num_tokens`` of ``seq``."""
    if not seq.block_table and seq.ring is None:
        prefix = pool.find_cached_prefix(seq)
        assert pool.allocate(seq, num_tokens, prefix)
    else:
        assert pool.append_slots(seq, num_tokens)
    seq.num_computed_tokens += num_tokens
    pool.cache_full_blocks(seq)


def ring_of(seq: Sequence) -> int:
    return seq.ring[0] // ROWS


def test_a_sequence_holds_one_ring_and_its_slots_wrap_in_it():
    pool = KVBlockPool(16, BLOCK, enable_prefix_caching=False, num_rings=2, ring_rows=ROWS)
    a, b, c = (Sequence(r, list(range(9))) for r in "abc")
    assert pool.allocate(a, 9) and pool.allocate(b, 9)
    assert {ring_of(a), ring_of(b)} == {0, 1} and a.ring[1] == ROWS
    # Positions 0..8 wrap in the ring's 6 rows; blocks play no part.
    assert pool.slots_for(a, 0, 9) == [a.ring[0] + p % ROWS for p in range(9)]
    assert token_slot(a.block_table, None, BLOCK, 5) == a.block_table[1] * BLOCK + 1
    assert not pool.can_allocate(c, 9) and not pool.allocate(c, 9)   # every ring runs
    assert c.block_table == [] and c.ring is None
    pool.free(a)                                  # preempted or finished: the ring is free
    assert a.ring is None and pool.allocate(c, 9) and c.ring is not None


def test_a_cached_prefix_ends_at_a_ring_snapshot_which_the_next_sequence_copies():
    pool = KVBlockPool(16, BLOCK, num_rings=3, ring_rows=ROWS)
    prompt = list(range(14))                      # full blocks end at 4, 8 and 12
    first = Sequence("a", prompt)
    step(pool, first, 6)                          # ends mid-block: nothing to snapshot
    assert pool.rings.num_snapshots == 0 and pool.rings.drain_copies() == []
    step(pool, first, 2)                          # ends at 8: the ring holds [2, 8)
    assert pool.rings.num_snapshots == 1
    [(source, snapshot)] = pool.rings.drain_copies()
    assert source == ring_of(first) and snapshot != source
    step(pool, first, 6)                          # to 14: ends past 12, no snapshot there
    assert pool.rings.num_snapshots == 1
    # Blocks 0-2 are cached, but only the one ending at 8 has the window before its end.
    second = Sequence("b", prompt + [99])
    prefix = pool.find_cached_prefix(second)
    assert prefix.num_tokens == 8 and prefix.block_ids == tuple(first.block_table[:2])
    assert pool.allocate(second, 15 - 8, prefix)
    assert pool.rings.drain_copies() == [(snapshot, ring_of(second))]
    assert second.num_computed_tokens == 8


def test_prompt_chunks_are_cut_at_the_last_full_block():
    pool = KVBlockPool(16, BLOCK, num_rings=2, ring_rows=ROWS)
    seq = Sequence("a", list(range(11)))          # the last full block a hit can use ends at 8
    assert pool.chunk_limit(seq, 0, 11) == 8
    assert pool.chunk_limit(seq, 0, 5) == 5 and pool.chunk_limit(seq, 8, 3) == 3
    assert pool.chunk_limit(seq, 6, 4) == 2
    plain = KVBlockPool(16, BLOCK)                # no rings: nothing to keep, no cut
    assert plain.chunk_limit(seq, 0, 11) == 11
    off = KVBlockPool(16, BLOCK, enable_prefix_caching=False, num_rings=2, ring_rows=ROWS)
    assert off.chunk_limit(seq, 0, 11) == 11


def test_snapshots_give_way_to_sequences_and_leave_with_their_block():
    pool = KVBlockPool(6, BLOCK, num_rings=2, ring_rows=ROWS)
    first = Sequence("a", list(range(9)))
    step(pool, first, 8)
    assert pool.rings.num_snapshots == 1
    pool.free(first)                              # its blocks stay cached, the snapshot too
    pool.rings.drain_copies()
    # Two sequences of other tokens need both rings: the snapshot's goes (LRU).
    others = [Sequence(r, [50 + i] * 5) for i, r in enumerate("bc")]
    for seq in others:
        step(pool, seq, 5)
    assert pool.rings.num_snapshots == 0
    assert pool.find_cached_prefix(Sequence("d", list(range(9)))).num_tokens == 0
    for seq in others:
        pool.free(seq)
    # The same prompt again: no hit (no snapshot), its blocks duplicate the cached ones,
    # and its ring at 8 is kept for the cache's block; a snapshot whose block is evicted
    # goes with it.
    again = Sequence("e", list(range(9)))
    step(pool, again, 8)
    assert again.num_cached_tokens == 0 and pool.rings.num_snapshots == 1
    assert pool.find_cached_prefix(Sequence("g", list(range(9)))).num_tokens == 8
    pool.free(again)
    hog = Sequence("f", [77] * 23)                # takes every block, evicting the cached ones
    step(pool, hog, 23)
    assert pool.rings.num_snapshots == 0
    assert len(pool.rings._free) == 1             # the snapshot's ring is free again


def test_a_step_rolled_back_keeps_no_snapshot_nor_cached_block():
    """A step whose tokens never arrived (``Scheduler.uncommit``: the device failed) that
    ended at a block's end: the ring never held the window its commit named, so the
    snapshot, the copy queued for it and the blocks it cached go; the recomputed step
    keeps them again."""
    pool = KVBlockPool(16, BLOCK, num_rings=3, ring_rows=ROWS)
    sched = Scheduler(SchedulerConfig(4, 8, 64), pool, eos_token_ids=set())
    prompt = list(range(14))
    seq = Sequence("a", prompt)
    sched.add(seq)
    out = sched.schedule()
    assert out.scheduled[0].num_new_tokens == 8          # cut at the last full block
    sched.commit(out)
    assert pool.rings.num_snapshots == 1 and pool.num_cached_blocks == 2
    sched.uncommit(out)
    assert seq.num_computed_tokens == 0 and seq.block_hashes == []
    assert pool.rings.num_snapshots == 0 and pool.num_cached_blocks == 0
    assert pool.find_cached_prefix(Sequence("b", prompt)).num_tokens == 0
    again = sched.schedule()
    assert again.ring_copies == [] and again.scheduled[0].num_new_tokens == 8
    sched.commit(again)
    assert pool.rings.num_snapshots == 1 and pool.num_cached_blocks == 2
    assert pool.find_cached_prefix(Sequence("c", prompt)).num_tokens == 8
