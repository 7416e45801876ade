"""Joining the tensor-parallel process group from inside a worker process."""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch

from archserve.distributed.parallel_state import TensorParallelGroup, set_tp


@dataclass(frozen=True)
class RankPlace:
    """Where one rank runs: its place in the group and its torch device."""

    rank: int
    size: int
    device: str            # "cpu" or "cuda:N" as this process numbers its GPUs
    init_method: str       # tcp://host:port of rank 0's rendezvous

    @property
    def backend(self) -> str:
        return "nccl" if self.device.startswith("cuda") else "gloo"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def node_ip() -> str:
    """An address of this machine that other machines of a cluster can reach."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))   # no packet is sent; picks the outgoing route
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def cpu_threads_per_rank(size: int) -> int:
    """CPU ranks share the machine's cores: each takes its share (at least one)."""
    return max(1, (os.cpu_count() or 1) // size)


def join_group(place: RankPlace, timeout_s: float = 600.0) -> TensorParallelGroup:
    """init_process_group for this rank and make it the group parallel layers use."""
    import torch.distributed as dist

    if place.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(place.device))
    else:
        torch.set_num_threads(cpu_threads_per_rank(place.size))
    kwargs = {}
    if place.backend == "nccl":
        kwargs["device_id"] = torch.device(place.device)
    dist.init_process_group(place.backend, init_method=place.init_method, rank=place.rank,
                            world_size=place.size,
                            timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    group = TensorParallelGroup(place.rank, place.size, dist.group.WORLD, place.backend)
    set_tp(group)
    return group


def leave_group() -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
