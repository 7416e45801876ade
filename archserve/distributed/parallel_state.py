"""The tensor-parallel group this process belongs to, and its two collectives.

Parallel layers read ``get_tp()`` when they are built (their shapes) and when they run
(their all-reduce and all-gather). A process that never joins a group is rank 0 of 1,
where both collectives return their input untouched: a single-GPU model is the same
code with no communication.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

AllReduce = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class TensorParallelGroup:
    rank: int = 0
    size: int = 1
    group: object | None = None          # torch.distributed ProcessGroup; None when size 1
    backend: str = "none"                # "gloo" | "nccl" | "none"
    # A faster all-reduce for some message sizes (distributed.peer_all_reduce on GPUs):
    # returns None for a message it does not take, which then goes to the process group.
    fast_all_reduce: Callable[[torch.Tensor], torch.Tensor | None] | None = field(
        default=None, repr=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of ``x`` (in place where the backend allows)."""
        if self.size == 1:
            return x
        if self.fast_all_reduce is not None:
            out = self.fast_all_reduce(x)
            if out is not None:
                return out
        import torch.distributed as dist
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Rank-ordered concatenation of every rank's ``x`` along the last dimension."""
        if self.size == 1:
            return x
        import torch.distributed as dist
        x = x.contiguous()
        if self.backend == "nccl":
            out = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x, group=self.group)
            parts = out.unbind(0)
        else:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)


_tp = TensorParallelGroup()


def get_tp() -> TensorParallelGroup:
    return _tp


def set_tp(group: TensorParallelGroup) -> None:
    global _tp
    _tp = group


@contextlib.contextmanager
def tensor_parallel(group: TensorParallelGroup) -> Iterator[TensorParallelGroup]:
    """Build or run a model as one rank of ``group`` (tests build ranks side by side)."""
    previous = get_tp()
    set_tp(group)
    try:
        yield group
    finally:
        set_tp(previous)
