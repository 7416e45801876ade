"""How a model splits over ranks, and the start-up agreement, without processes."""

import pytest

from archserve.distributed.agreement import RankAgreement
from archserve.distributed.layout import (
    head_split_problem,
    layout_problems,
    split_heads,
    vocab_part,
)


def test_kv_heads_split_when_at_least_as_many_as_ranks():
    parts = [split_heads(8, 4, 2, r) for r in range(2)]
    assert [(p.num_heads, p.num_kv_heads, p.first_head, p.first_kv_head) for p in parts] == \
        [(4, 2, 0, 0), (4, 2, 4, 2)]
    assert all(p.kv_replicas == 1 for p in parts)


def test_kv_heads_replicated_on_the_ranks_whose_queries_read_them():
    # 8 query heads, 2 KV heads (4 queries per KV head), 4 ranks of 2 query heads each.
    parts = [split_heads(8, 2, 4, r) for r in range(4)]
    assert [p.first_kv_head for p in parts] == [0, 0, 1, 1]
    for p in parts:
        assert p.num_kv_heads == 1 and p.kv_replicas == 2
        # every query head of the rank reads the rank's KV head
        assert {h // 4 for h in range(p.first_head, p.first_head + p.num_heads)} == \
            {p.first_kv_head}


def test_impossible_layouts_say_why():
    assert "attention heads" in head_split_problem(6, 2, 4)
    assert "KV heads" in head_split_problem(12, 6, 4)
    assert "replicated" in head_split_problem(12, 4, 6)
    assert head_split_problem(12, 3, 6) is None           # each KV head on 2 ranks
    assert head_split_problem(16, 3, 2) is not None      # 3 KV heads over 2 ranks

    class Config:
        num_heads, num_kv_heads, intermediate_size = 4, 2, 96

    assert layout_problems(Config, 2) == []
    assert any("attention heads" in p for p in layout_problems(Config, 3))


def test_vocab_parts_cover_the_vocabulary_once():
    vocab, size = 385, 2
    parts = [vocab_part(vocab, size, r) for r in range(size)]
    assert parts[0] == (0, 193, 193) and parts[1] == (193, 192, 193)
    assert sum(rows for _, rows, _ in parts) == vocab


def test_a_rank_that_disagrees_stops_the_start_with_a_message():
    values = {"attention": ["TRITON_ATTN", "TORCH_SDPA"]}
    agree = RankAgreement(lambda value: values["attention"])
    with pytest.raises(ValueError, match="disagree on the attention backend.*rank 1: 'TORCH_SDPA'"):
        agree.same("the attention backend", "TRITON_ATTN")
    RankAgreement(lambda value: [value, value]).same("the attention backend", "X")
    assert RankAgreement(lambda value: [4096, 4000]).min(4096) == 4000
