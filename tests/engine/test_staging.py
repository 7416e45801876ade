"""The staging ring: a step's host arrays reach the device as views of one region, copied
once, in regions reused in turn (engine/staging.py)."""

import numpy as np
import pytest
import torch

from archserve.engine.staging import StagingRing

ARRAYS = [np.arange(3, dtype=np.int32), np.arange(5, dtype=np.int64) - 2,
          np.arange(6, dtype=np.int32).reshape(2, 3), np.zeros(0, dtype=np.int64),
          np.arange(7, dtype=np.int64) * 3, np.array([True, False, True]),
          np.linspace(0, 1, 5, dtype=np.float32)]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def check_upload(ring: StagingRing) -> list[torch.Tensor]:
    tensors = ring.upload(ARRAYS)
    for array, tensor in zip(ARRAYS, tensors, strict=True):
        assert tensor.device.type == ring.device.type
        assert tensor.shape == array.shape and tensor.dtype == torch.from_numpy(array).dtype
        assert tensor.cpu().numpy().tolist() == array.tolist()
        # Triton specialises pointers by 16-byte alignment: a view must keep it.
        assert tensor.data_ptr() % 16 == 0
    assert len({_storage(t) for t in tensors}) == 1     # one region: one transfer
    return tensors


def test_arrays_of_every_dtype_travel_in_one_region_as_aligned_views():
    check_upload(StagingRing(torch.device("cpu")))


def test_regions_are_reused_in_turn_and_grow_when_an_upload_needs_more():
    ring = StagingRing(torch.device("cpu"), slots=2, initial_bytes=64)
    first = check_upload(ring)          # grows past 64 bytes on its first use
    second = check_upload(ring)
    assert _storage(first[0]) != _storage(second[0])
    third = check_upload(ring)
    assert _storage(third[0]) == _storage(first[0])     # the first region, in turn
    big = np.arange(10_000, dtype=np.int64)
    (grown,) = ring.upload([big])
    assert torch.equal(grown, torch.from_numpy(big))
    # The views of an upload before the growth keep their region alive and their values.
    assert second[4].tolist() == ARRAYS[4].tolist()


def test_an_upload_of_nothing_but_empty_arrays():
    ring = StagingRing(torch.device("cpu"))
    (empty,) = ring.upload([np.zeros(0, dtype=np.int32)])
    assert empty.shape == (0,) and empty.dtype == torch.int32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_ring_on_cuda_copies_from_pinned_memory_behind_the_stream():
    ring = StagingRing(torch.device("cuda"), slots=2)
    for _ in range(5):      # every region used twice: each rewrite waits for its last copy
        check_upload(ring)
    region = ring._regions[0]
    assert region.host.is_pinned() and region.device.is_cuda
    # A kernel queued before a region is reused reads the values of its own upload.
    first = ring.upload([np.full(1 << 16, 7, dtype=np.int64)])[0]
    total = first.sum()
    ring.upload([np.zeros(1 << 16, dtype=np.int64)])
    ring.upload([np.zeros(1 << 16, dtype=np.int64)])     # reuses the region of ``first``
    assert int(total) == 7 << 16
