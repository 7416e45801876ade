"""A one-shot all-reduce over peer GPU memory for small messages, NCCL for the rest.

At decode, an all-reduce carries a few KiB (batch x hidden) and its latency, not its
bandwidth, is the cost: NCCL spends about 40 us eager (18 us in a graph) on 8 KiB between
two H200s. Here each rank copies its message into a buffer of torch symmetric memory
(peer-mapped over NVLink, no multicast) and every rank reads all peers' buffers and sums
them in one kernel (``symm_mem.one_shot_all_reduce``).

Which sizes go which way is measured at start-up, per power-of-two size, on this machine,
and the largest size where one-shot wins is agreed across ranks (the smallest rank's, so
every rank takes the same path for the same message, or the collectives would not pair).
Anything that fails on the way (no peer access, an old torch) leaves NCCL alone, with the
reason in the start-up decisions.
"""

from __future__ import annotations

import logging
import os

import torch

from archserve.distributed.parallel_state import TensorParallelGroup
from archserve.platform.decision import Decision

log = logging.getLogger("archserve")

MAX_BYTES = 8 << 20          # the buffer: larger messages always go to NCCL
_SIZES = [1 << k for k in range(12, 24)]    # 4 KiB .. 8 MiB


class PeerAllReduce:
    def __init__(self, group: TensorParallelGroup, dtype: torch.dtype) -> None:
        import torch.distributed._symmetric_memory as symm_mem
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")   # NVLS stays off
        self.group_name = group.group.group_name
        self.dtype = dtype
        device = torch.device("cuda", torch.cuda.current_device())
        self.buffer = symm_mem.empty(MAX_BYTES // dtype.itemsize, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)
        self.max_bytes = 0           # set by tune(): messages up to this size go one-shot

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        nbytes = x.numel() * x.element_size()
        if x.dtype != self.dtype or nbytes > self.max_bytes or not x.is_contiguous():
            return None
        staged = self.buffer[:x.numel()]
        staged.copy_(x.view(-1))
        out = torch.ops.symm_mem.one_shot_all_reduce(staged, "sum", self.group_name)
        return out.view(x.shape)

    def tune(self, group: TensorParallelGroup, iters: int = 50) -> dict[int, tuple[float, float]]:
        """Time NCCL and one-shot per size; keep one-shot up to the last size it wins."""
        import torch.distributed as dist
        times: dict[int, tuple[float, float]] = {}
        self.max_bytes = MAX_BYTES
        for size in _SIZES:
            x = torch.ones(size // self.dtype.itemsize, dtype=self.dtype, device="cuda")
            nccl = _time(lambda x=x: dist.all_reduce(x, group=group.group), iters)
            peer = _time(lambda x=x: self(x), iters)
            times[size] = (nccl, peer)
        wins = [size for size, (nccl, peer) in times.items() if peer < nccl]
        best = 0
        for size in _SIZES:            # the prefix of sizes where one-shot wins
            if size not in wins:
                break
            best = size
        agreed = torch.tensor([best], device="cuda")
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group.group)
        self.max_bytes = int(agreed.item())
        return times


def _time(fn, iters: int) -> float:
    """Microseconds per call (after 5 warm-up calls)."""
    from archserve.kernels.cuda_timing import mean_ms
    return 1000 * mean_ms(fn, iters, warmup=5)


def install_peer_all_reduce(group: TensorParallelGroup, dtype: torch.dtype) -> Decision:
    """Measure and install the one-shot path on ``group`` (CUDA ranks); the decision says
    which sizes it took, or why NCCL keeps everything."""
    try:
        peer = PeerAllReduce(group, dtype)
        times = peer.tune(group)
    except Exception as exc:   # noqa: BLE001 - any failure keeps NCCL
        log.warning("one-shot all-reduce unavailable, NCCL for every size: %s", exc)
        group.fast_all_reduce = None
        return Decision("all-reduce", "auto", "NCCL", f"one-shot over peer memory failed: {exc}")
    if peer.max_bytes == 0:
        group.fast_all_reduce = None
        return Decision("all-reduce", "auto", "NCCL", "one-shot won at no size: "
                        + _table(times))
    group.fast_all_reduce = peer
    return Decision("all-reduce", "auto",
                    f"one-shot (peer memory) up to {peer.max_bytes >> 10} KiB, NCCL above",
                    _table(times))


def _table(times: dict[int, tuple[float, float]]) -> str:
    return ", ".join(f"{size >> 10} KiB NCCL {nccl:.1f} us / one-shot {peer:.1f} us"
                     for size, (nccl, peer) in times.items())
