"""One builder for attention metadata: every fact derived from the lengths in one place."""

from pathlib import Path

import numpy as np
import torch

import archserve
from archserve.kernels.attention.interface import AttentionMetadata


def test_metadata_follows_from_the_lengths():
    tables = np.array([[3, 4], [7, 0], [9, 1]], dtype=np.int32)
    slots = np.arange(6, dtype=np.int64)
    meta = AttentionMetadata.from_lengths([3, 1, 2], [10, 5, 2], tables, slots, "cpu")
    assert meta.query_start_loc.tolist() == [0, 3, 4, 6]
    assert meta.query_start_loc.dtype == meta.seq_lens.dtype == torch.int32
    assert meta.seq_lens.tolist() == meta.seq_lens_cpu == [10, 5, 2]
    assert meta.query_lens_cpu == [3, 1, 2]
    assert (meta.max_query_len, meta.max_seq_len, meta.num_seqs) == (3, 10, 3)
    assert meta.num_tokens == 6 and not meta.is_pure_decode
    assert meta.block_tables.tolist() == tables.tolist()
    empty = AttentionMetadata.from_lengths([], [], np.zeros((0, 1), np.int32),
                                           np.zeros(0, np.int64), "cpu")
    assert (empty.num_seqs, empty.max_query_len, empty.query_start_loc.tolist()) == (0, 0, [0])


def test_metadata_built_through_an_upload_equals_the_plain_one():
    from archserve.engine.staging import StagingRing
    tables = np.array([[3, 4], [7, 0], [9, 1]], dtype=np.int32)
    slots = np.arange(6, dtype=np.int64)
    plain = AttentionMetadata.from_lengths([3, 1, 2], [10, 5, 2], tables, slots, "cpu")
    packed = AttentionMetadata.from_lengths([3, 1, 2], [10, 5, 2], tables, slots, "cpu",
                                            upload=StagingRing(torch.device("cpu")).upload)
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        assert torch.equal(getattr(plain, name), getattr(packed, name)), name


def test_only_the_graph_runners_build_metadata_by_hand():
    """Their metadata are views of the capture's static buffers (decode graphs, and the
    mixed-step graphs of cudagraph_mode FULL); every other batch comes from
    ``from_lengths``."""
    root = Path(archserve.__file__).parent
    by_hand = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                     if "AttentionMetadata(" in p.read_text())
    assert by_hand == ["engine/cuda_graphs.py", "engine/mixed_graphs.py"]
