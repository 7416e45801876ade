"""What a rank's memory after start-up says of its KV pool."""

import pytest

from archserve.engine.rank_memory import RankMemory, describe_rank_memory

GIB = 1 << 30


def test_the_share_left_unused_after_start_up():
    fitted = RankMemory(kv_pool_bytes=95 * GIB, weight_bytes=17 * GIB, total_bytes=140 * GIB,
                        free_bytes=15 * GIB)
    assert fitted.budget_left_bytes(0.9) == pytest.approx(GIB, abs=1)   # 126 - 125 GiB
    over = RankMemory(95 * GIB, 17 * GIB, 140 * GIB, 10 * GIB)
    assert over.budget_left_bytes(0.9) < 0
    cpu = RankMemory(kv_pool_bytes=4 << 20, weight_bytes=1 << 20)
    assert cpu.budget_left_bytes(0.9) is None
    text = describe_rank_memory([fitted, cpu], 0.9)
    assert text.startswith("rank 0: KV pool 95.00 GiB, weights 17.00 GiB, 15.00 GiB free of "
                           "140.00 GiB (+1.00 GiB of the 0.9 share unused)")
    assert text.endswith("rank 1: KV pool 4.0 MiB, weights 1.0 MiB")
