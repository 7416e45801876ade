"""A step's host arrays to the device in one copy, through pinned memory the engine keeps.

A batch-1 decode step is short enough that its host work sets its pace (an H200 bench of
Qwen3-0.6B: 0.84 ms of host work a step against a 0.72 ms graph). Pinning fresh memory for
every upload costs an allocation, a copy into it and an event per dtype; here the pinned
bytes are allocated once and reused, and every array of an upload, of any dtype, travels
in a single ``cudaMemcpyAsync`` into a device region kept for the purpose.

Reuse is safe by order, not by luck:
- a host region is rewritten only after the copy out of it has finished (an event recorded
  behind that copy, waited on before the rewrite: with a few regions in turn, the wait
  finds it long done);
- a device region is rewritten by a copy queued on the same stream behind every kernel
  queued before it, so the kernels that read the earlier batch from it have run. Views
  this returns are therefore the batch of one step: read them on the stream that was
  current at the upload, before ``slots`` more uploads are queued.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

# Each view starts on a 16-byte boundary, as a tensor of its own would: Triton specialises
# pointers by that alignment, and a misaligned view would compile another variant of a
# kernel on the serving path.
ALIGN_BYTES = 16


class _Region:
    """One host region (pinned on CUDA) and its device twin, with the event of its last copy
    and the layout of its last upload."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        on_cuda = device.type == "cuda"
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=on_cuda)
        self.device = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.copied: torch.cuda.Event | None = None
        self.layout: _Layout | None = None

    @property
    def nbytes(self) -> int:
        return self.host.numel()


class _Layout:
    """Where each array of an upload goes in a region: its host view (numpy, to write) and
    its device view (a tensor, to return). Made once per region for a run of uploads of
    the same dtypes and shapes, as a server's decode steps are: making a tensor view costs
    ~2 µs of host time, and a batch has seven."""

    def __init__(self, region: _Region, key: tuple, arrays: list[np.ndarray]) -> None:
        self.key = key
        # By dtype, so that each dtype's device views come from one split.
        by_dtype: dict[np.dtype, list[int]] = {}
        for i, a in enumerate(arrays):
            by_dtype.setdefault(a.dtype, []).append(i)
        host_bytes = region.host.numpy()
        self.host_views: list[np.ndarray] = [None] * len(arrays)   # type: ignore[list-item]
        device_views: list[torch.Tensor | None] = [None] * len(arrays)
        end = 0
        for dtype, indices in by_dtype.items():
            pieces = []       # each array and the gap after it, in elements
            for i in indices:
                a = arrays[i]
                pieces += [a.size, (_padded_bytes(a) - a.nbytes) // dtype.itemsize]
            count = sum(pieces)
            host = host_bytes[end:end + count * dtype.itemsize].view(dtype)
            device = region.device[end:end + count * dtype.itemsize].view(_torch_dtype(dtype))
            start = 0
            for i, size, view, gap in zip(indices, pieces[::2], device.split_with_sizes(pieces)[::2],
                                          pieces[1::2], strict=True):
                shape = arrays[i].shape
                self.host_views[i] = host[start:start + size].reshape(shape)
                device_views[i] = view if len(shape) == 1 else view.view(shape)
                start += size + gap
            end += count * dtype.itemsize
        self.device_views = tuple(device_views)
        self.host_bytes = region.host[:end]
        self.device_bytes = region.device[:end]


def _padded_bytes(array: np.ndarray) -> int:
    """The bytes ``array`` takes in a region: its own, padded so the next starts aligned."""
    return -(-array.nbytes // ALIGN_BYTES) * ALIGN_BYTES


class StagingRing:
    """Uploads of host arrays, each one copy into the next of ``slots`` regions in turn."""

    def __init__(self, device: torch.device, slots: int = 4, initial_bytes: int = 64 << 10
                 ) -> None:
        self.device = torch.device(device)
        self.slots = slots
        self._initial_bytes = initial_bytes
        self._regions: list[_Region | None] = [None] * slots
        self._next = 0

    def _next_region(self, arrays: list[np.ndarray]) -> tuple[_Region, _Layout]:
        """The next region in turn, ready to be written, and its layout for ``arrays``."""
        i = self._next
        self._next = (i + 1) % self.slots
        region = self._regions[i]
        key = tuple((a.dtype, a.shape) for a in arrays)
        if region is not None and region.copied is not None:
            region.copied.synchronize()   # its previous copy out: done long ago in practice
        if region is not None and region.layout is not None and region.layout.key == key:
            return region, region.layout
        nbytes = max(sum(map(_padded_bytes, arrays)), ALIGN_BYTES)
        if region is None or region.nbytes < nbytes:
            # Grown by doubling, so a long prompt does not reallocate step after step. The
            # old region's memory stays safe: torch's allocators reuse freed device memory
            # in stream order only, and freed pinned memory once the copies out of it ran.
            size = max(nbytes, self._initial_bytes, 2 * (region.nbytes if region else 0))
            region = self._regions[i] = _Region(size, self.device)
        region.layout = _Layout(region, key, arrays)
        return region, region.layout

    def upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """``arrays`` on the device, in their shapes and order: views of one region, copied
        in one transfer (see the module's note for how long they stay valid)."""
        region, layout = self._next_region(arrays)
        for host, array in zip(layout.host_views, arrays, strict=True):
            host[...] = array
        on_cuda = self.device.type == "cuda"
        layout.device_bytes.copy_(layout.host_bytes, non_blocking=on_cuda)
        if on_cuda:
            region.copied = region.copied or torch.cuda.Event()
            region.copied.record(torch.cuda.current_stream(self.device))
        return list(layout.device_views)


@functools.cache
def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype
