"""KVBlockPool: allocation, reference counts, prefix cache hits, LRU eviction, no leaks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from archserve.engine.block_pool import KVBlockPool
from archserve.engine.sequence import Sequence


def seq_of(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, tokens)


def compute_all(pool: KVBlockPool, seq: Sequence) -> None:
    """Pretend the model wrote KV for every pending token, as the scheduler's postprocess does."""
    seq.num_computed_tokens = seq.num_tokens
    pool.cache_full_blocks(seq)


def admit(pool: KVBlockPool, seq: Sequence) -> None:
    prefix = pool.find_cached_prefix(seq)
    assert pool.allocate(seq, seq.num_tokens - prefix.num_tokens, prefix)
    compute_all(pool, seq)


def test_allocate_covers_tokens_and_free_returns_blocks():
    pool = KVBlockPool(num_blocks=8, block_size=4)
    seq = seq_of(list(range(10)))                 # 10 tokens -> 3 blocks
    assert pool.can_allocate(seq, 10)
    assert pool.allocate(seq, 10)
    assert len(seq.block_table) == 3
    assert len(set(seq.block_table)) == 3
    assert pool.num_used_blocks == 3 and pool.num_free_blocks == 5
    assert pool.usage == pytest.approx(3 / 8)
    assert all(pool.ref_count(b) == 1 for b in seq.block_table)
    pool.free(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert pool.num_used_blocks == 0


def test_allocate_refuses_without_partial_effects():
    pool = KVBlockPool(num_blocks=2, block_size=4)
    seq = seq_of(list(range(9)))                  # needs 3 blocks
    assert not pool.can_allocate(seq, 9)
    assert not pool.allocate(seq, 9)
    assert seq.block_table == [] and pool.num_used_blocks == 0


def test_append_slots_grows_only_at_block_boundaries():
    pool = KVBlockPool(num_blocks=4, block_size=4)
    seq = seq_of([1, 2, 3])
    admit(pool, seq)
    assert len(seq.block_table) == 1
    seq.append_token(4)                            # position 3 still in block 0
    assert pool.append_slots(seq, 1) and len(seq.block_table) == 1
    compute_all(pool, seq)
    seq.append_token(5)                            # position 4 opens block 1
    assert pool.append_slots(seq, 1) and len(seq.block_table) == 2


def test_shared_prefix_reuses_full_blocks_and_counts_hits():
    pool = KVBlockPool(num_blocks=16, block_size=4)
    first = seq_of(list(range(10)))
    admit(pool, first)
    second = seq_of(list(range(8)) + [99, 98, 97])
    prefix = pool.find_cached_prefix(second)
    assert prefix.num_tokens == 8
    assert list(prefix.block_ids) == first.block_table[:2]
    assert pool.allocate(second, second.num_tokens - 8, prefix)
    assert second.num_computed_tokens == 8 and second.num_cached_tokens == 8
    assert second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] != first.block_table[2]
    assert pool.ref_count(first.block_table[0]) == 2
    assert pool.prefix_cache_queries == 10 + 11
    assert pool.prefix_cache_hits == 8


def test_hit_never_covers_the_last_token():
    pool = KVBlockPool(num_blocks=8, block_size=4)
    admit(pool, seq_of(list(range(8))))
    again = seq_of(list(range(8)))                 # block-aligned identical prompt
    assert pool.find_cached_prefix(again).num_tokens == 4


def test_different_earlier_block_breaks_the_chain():
    pool = KVBlockPool(num_blocks=8, block_size=2)
    admit(pool, seq_of([1, 2, 3, 4, 5]))
    # Block 1 has the same tokens, but its prefix differs, so nothing is reused.
    assert pool.find_cached_prefix(seq_of([9, 9, 3, 4, 5])).num_tokens == 0


def test_freed_cached_blocks_are_found_again():
    pool = KVBlockPool(num_blocks=8, block_size=4)
    first = seq_of(list(range(9)))
    admit(pool, first)
    blocks = list(first.block_table)
    pool.free(first)
    assert pool.num_used_blocks == 0
    again = seq_of(list(range(9)))
    admit(pool, again)
    assert again.num_cached_tokens == 8
    assert again.block_table[:2] == blocks[:2]


def test_uncached_free_blocks_are_used_before_evicting_cached_ones():
    pool = KVBlockPool(num_blocks=4, block_size=2)
    cached = seq_of([1, 2, 3, 4])                  # 2 full blocks, both hashed
    admit(pool, cached)
    cached_blocks = set(cached.block_table)
    pool.free(cached)
    filler = seq_of([7, 8, 9])                     # needs 2 blocks: must take the uncached two
    assert pool.allocate(filler, 3)
    assert not set(filler.block_table) & cached_blocks
    assert pool.find_cached_prefix(seq_of([1, 2, 3, 4, 5])).num_tokens == 4


def test_lru_evicts_least_recently_freed_and_tail_first():
    pool = KVBlockPool(num_blocks=4, block_size=2)
    old = seq_of([1, 2, 3, 4])
    new = seq_of([5, 6, 7, 8])
    admit(pool, old)
    admit(pool, new)
    pool.free(old)                                 # freed first: evicted first
    pool.free(new)
    taker = seq_of([0, 0])                         # one fresh block: evicts old's tail block
    assert pool.allocate(taker, 2)
    assert pool.find_cached_prefix(seq_of([1, 2, 3, 4, 0])).num_tokens == 2
    assert pool.find_cached_prefix(seq_of([5, 6, 7, 8, 0])).num_tokens == 4
    taker2 = seq_of([0, 1])                        # next victim: old's head block
    assert pool.allocate(taker2, 2)
    assert pool.find_cached_prefix(seq_of([1, 2, 3, 4, 0])).num_tokens == 0
    assert pool.find_cached_prefix(seq_of([5, 6, 7, 8, 0])).num_tokens == 4


def test_hit_on_free_cached_block_counts_against_free_space():
    pool = KVBlockPool(num_blocks=3, block_size=2)
    first = seq_of([1, 2, 3, 4, 5])
    admit(pool, first)
    pool.free(first)                               # 2 hashed blocks free but findable
    big = seq_of([1, 2, 3, 4, 5, 6, 7])            # hits 2 blocks, needs 2 fresh: 2 > 3 - 2
    prefix = pool.find_cached_prefix(big)
    assert prefix.num_tokens == 4
    assert not pool.can_allocate(big, 3, prefix)
    assert not pool.allocate(big, 3, prefix)
    assert pool.num_used_blocks == 0
    small = seq_of([1, 2, 3, 4, 5])                # hits 2 blocks, needs 1 fresh: fits
    assert pool.allocate(small, 1)
    assert small.num_cached_tokens == 4 and pool.num_used_blocks == 3


def test_identical_prompts_in_one_step_keep_their_own_blocks():
    pool = KVBlockPool(num_blocks=8, block_size=2)
    a, b = seq_of([1, 2, 3, 4, 5]), seq_of([1, 2, 3, 4, 5])
    assert pool.allocate(a, 5) and pool.allocate(b, 5)   # neither computed yet: no hits
    compute_all(pool, a)
    compute_all(pool, b)                           # duplicate hashes: first owner kept
    assert a.block_hashes == b.block_hashes
    pool.free(a)
    pool.free(b)
    assert pool.num_used_blocks == 0
    assert pool.num_cached_blocks == 2


def test_reset_prefix_cache_forgets_everything():
    pool = KVBlockPool(num_blocks=4, block_size=2)
    seq = seq_of([1, 2, 3, 4, 5])
    admit(pool, seq)
    pool.free(seq)
    assert pool.reset_prefix_cache() == 2
    assert pool.num_cached_blocks == 0
    assert pool.find_cached_prefix(seq_of([1, 2, 3, 4, 5])).num_tokens == 0
    assert pool.num_free_blocks == 4


def test_prefix_caching_disabled_never_hits():
    pool = KVBlockPool(num_blocks=8, block_size=2, enable_prefix_caching=False)
    admit(pool, seq_of([1, 2, 3, 4, 5]))
    assert pool.find_cached_prefix(seq_of([1, 2, 3, 4, 5])).num_tokens == 0
    assert pool.num_cached_blocks == 0


def test_slots_for_maps_positions_through_the_block_table():
    pool = KVBlockPool(num_blocks=8, block_size=4)
    seq = seq_of(list(range(6)))
    seq.block_table = [5, 2]
    assert pool.slots_for(seq, 2, 6) == [22, 23, 8, 9]


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "grow", "free"]),
                              st.integers(0, 5), st.integers(1, 9)), max_size=40))
def test_invariants_under_random_operations(ops):
    """Refcounts equal table references; free + used = total; freeing all leaks nothing."""
    pool = KVBlockPool(num_blocks=12, block_size=3)
    live: list[Sequence] = []
    for op, pick, length in ops:
        if op == "add":
            # Prompts from a tiny alphabet share prefixes often.
            seq = seq_of([(pick + i // 4) % 3 for i in range(length)])
            prefix = pool.find_cached_prefix(seq)
            if pool.allocate(seq, seq.num_tokens - prefix.num_tokens, prefix):
                compute_all(pool, seq)
                live.append(seq)
        elif op == "grow" and live:
            seq = live[pick % len(live)]
            seq.append_token(pick % 3)
            if pool.append_slots(seq, 1):
                compute_all(pool, seq)
            else:
                seq.token_ids.pop()
                seq.output_token_ids.pop()
        elif op == "free" and live:
            pool.free(live.pop(pick % len(live)))

        refs = [0] * pool.num_blocks
        for seq in live:
            assert len(seq.block_table) == -(-seq.num_tokens // pool.block_size)
            for b in seq.block_table:
                refs[b] += 1
        assert refs == [pool.ref_count(b) for b in range(pool.num_blocks)]
        assert pool.num_used_blocks == sum(1 for r in refs if r > 0)
        # Every table's computed full blocks, if cached, hold exactly that prefix.
        for seq in live:
            for i, b in enumerate(seq.block_table[:seq.num_computed_tokens // pool.block_size]):
                stored = pool._block_tokens[b]
                if stored is not None:
                    assert list(stored) == seq.token_ids[i * 3:(i + 1) * 3]
    for seq in live:
        pool.free(seq)
    assert pool.num_used_blocks == 0
    assert pool.num_free_blocks == pool.num_blocks


def test_chain_hash_is_sha256_of_the_chain():
    from archserve.engine.block_pool import chain_hash
    first = chain_hash(None, (1, 2, 3, 4))
    assert isinstance(first, bytes) and len(first) == 32
    assert chain_hash(first, (5, 6, 7, 8)) != chain_hash(chain_hash(None, (0, 2, 3, 4)),
                                                         (5, 6, 7, 8))


def test_a_forced_hash_collision_never_serves_another_prefixs_kv(monkeypatch):
    """With a hash that ignores the parent (every block with the same tokens collides), the
    block computed after prompt A's first block must not be served behind prompt C's."""
    import hashlib

    import archserve.engine.block_pool as block_pool
    monkeypatch.setattr(block_pool, "chain_hash",
                        lambda parent, tokens: hashlib.sha256(bytes(tokens)).digest())
    pool = KVBlockPool(num_blocks=16, block_size=4)
    common = [9, 9, 9, 9]
    a = seq_of([1, 1, 1, 1] + common + [0], "a")
    admit(pool, a)                       # owns hash(common), computed after [1, 1, 1, 1]
    c = seq_of([2, 2, 2, 2] + common + [0], "c")
    admit(pool, c)                       # its common block collides: A's entry stays
    b = seq_of([2, 2, 2, 2] + common + [0], "b")
    hit = pool.find_cached_prefix(b)
    assert hit.block_ids == (c.block_table[0],)      # its first block; A's second is refused
    assert a.block_table[1] not in hit.block_ids

