"""Start-up agreement between tensor-parallel ranks.

Every rank decides its own route (attention backend, kernels, graph sizes) and sizes its
own KV pool from its own free memory. A step only works if the ranks run the same
collectives in the same order with the same pool, so the decisions are compared: a
rank that differs stops the start with a message naming the ranks and their values, and
the KV block count is the smallest any rank can hold.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class RankAgreement:
    def __init__(self, gather: Callable[[Any], list[Any]], rank: int = 0,
                 barrier: Callable[[], None] | None = None) -> None:
        self._gather = gather          # value of this rank -> every rank's value, in order
        self.rank = rank
        self._barrier = barrier or (lambda: None)

    def same(self, what: str, value: Any) -> None:
        """Raise ValueError (on every rank alike) unless every rank has ``value``."""
        values = self._gather(value)
        differing = [(rank, v) for rank, v in enumerate(values) if v != values[0]]
        if differing:
            others = "; ".join(f"rank {rank}: {v!r}" for rank, v in differing)
            raise ValueError(f"tensor-parallel ranks disagree on {what} (rank 0: "
                             f"{values[0]!r}; {others}); every rank must run the same route")

    def min(self, value: int) -> int:
        return min(self._gather(value))

    def every(self, value: T) -> list[T]:
        """Every rank's ``value``, in rank order (what each rank reports of itself)."""
        return self._gather(value)

    def rank0_first(self, work: Callable[[], T]) -> T:
        """Run ``work`` on rank 0, then on the other ranks: what rank 0 tunes and caches on
        disk, the others read instead of racing it for the same file."""
        if self.rank == 0:
            result = work()
            self._barrier()
            return result
        self._barrier()
        return work()


SINGLE_RANK = RankAgreement(lambda value: [value])


def group_agreement(group) -> RankAgreement:
    """The agreement of a joined TensorParallelGroup (``all_gather_object`` over it)."""
    if group.size == 1:
        return SINGLE_RANK
    import torch.distributed as dist

    def gather(value: Any) -> list[Any]:
        out: list[Any] = [None] * group.size
        dist.all_gather_object(out, value, group=group.group)
        return out

    return RankAgreement(gather, group.rank, lambda: dist.barrier(group=group.group))
