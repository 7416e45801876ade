"""Where split-KV decode merges its partials: in a second kernel, or in the decode kernel by
the split that finishes last (``ARCHSERVE_SPLIT_MERGE_IN_KERNEL=1``, opt-in until measured on
a GPU; kernels/attention/triton_decode.py). Free of Triton, so that the engine's start-up
can report the choice on any machine."""

from __future__ import annotations

import os

MERGE_IN_KERNEL_ENV = "ARCHSERVE_SPLIT_MERGE_IN_KERNEL"
# Counters of the in-kernel merge, one per (sequence, KV head) of a split launch: splits run
# only while sequences x KV heads leave SMs idle, so a few thousand cover every GPU.
MERGE_COUNTERS = 4096


def merge_in_kernel(counters: int = 0) -> bool:
    """Whether split programs merge their partials themselves: asked for, and ``counters``
    (sequences x KV heads of the launch) within the counter buffer."""
    return os.environ.get(MERGE_IN_KERNEL_ENV) == "1" and counters <= MERGE_COUNTERS
