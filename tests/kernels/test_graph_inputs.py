"""The decode graph's inputs in one launch (kernels/elementwise/triton_graph_inputs.py):
what the tensor copies of DecodeGraphRunner.replay leave in the static buffers.

Without a GPU one test re-runs this file under Triton's interpreter; on a GPU the
``gpu``-marked test runs the compiled kernel (the engine's graph tests replay through it).
"""

from __future__ import annotations

import pytest
import torch

from archserve.kernels.rules import triton_interpreted

INTERPRETED = triton_interpreted()
INTERPRETER_TIMEOUT_S = 600


def static_buffers(rows: int, width: int, device: str) -> tuple[torch.Tensor, ...]:
    """Static buffers holding a previous step's values (7s): what is not written stays."""
    return (torch.full((rows,), 7, dtype=torch.long, device=device),
            torch.full((rows,), 7, dtype=torch.long, device=device),
            torch.full((rows,), 7, dtype=torch.long, device=device),
            torch.full((rows,), 7, dtype=torch.int32, device=device),
            torch.full((rows, width), 7, dtype=torch.int32, device=device))


def check(device: str, batch: int, size: int, table_width: int, static_width: int,
          fed: int = 0) -> None:
    """``fed``: the first rows' ids come from a sampler's output (ModelBatch.fed_ids)."""
    from archserve.kernels.elementwise.triton_graph_inputs import (
        graph_inputs_unsupported,
        load_graph_inputs_triton,
    )
    static = static_buffers(8, static_width, device)
    gen = torch.Generator().manual_seed(batch * 100 + table_width)
    step = tuple(t.to(device) for t in (
        torch.randint(0, 1000, (batch,), generator=gen),
        torch.randint(0, 4000, (batch,), generator=gen),
        torch.randint(0, 9000, (batch,), generator=gen),
        torch.randint(1, 4000, (batch,), generator=gen, dtype=torch.int32),
        torch.randint(0, 500, (batch, table_width), generator=gen, dtype=torch.int32)))
    fed_ids = (torch.randint(1000, 2000, (fed,), generator=gen).to(device) if fed else None)
    assert graph_inputs_unsupported(size, static, step, fed_ids) is None
    load_graph_inputs_triton(size, static, step, fed_ids)
    ids, positions, slots, lengths, tables = (t.cpu() for t in static)
    s_ids, s_positions, s_slots, s_lengths, s_tables = (t.cpu() for t in step)
    if fed:
        s_ids = torch.cat([fed_ids.cpu(), s_ids[fed:]])
    assert torch.equal(ids[:batch], s_ids) and (ids[batch:] == 7).all()
    assert torch.equal(positions[:batch], s_positions) and (positions[batch:] == 7).all()
    assert torch.equal(slots[:batch], s_slots) and (slots[batch:size] == -1).all()
    assert torch.equal(lengths[:batch], s_lengths) and (lengths[batch:size] == 1).all()
    assert torch.equal(tables[:batch, :table_width], s_tables)
    assert (tables[:batch, table_width:] == 7).all()      # columns past the step's: unread
    assert (tables[batch:size] == 0).all()
    assert (slots[size:] == 7).all() and (lengths[size:] == 7).all() and (tables[size:] == 7).all()


def test_inputs_it_cannot_take_are_refused():
    pytest.importorskip("triton")
    from archserve.kernels.elementwise.triton_graph_inputs import graph_inputs_unsupported
    static = static_buffers(4, 8, "cpu")
    rows = torch.zeros(2, dtype=torch.long)
    step = (rows, rows, rows, rows.int(), torch.zeros(2, 3, dtype=torch.int32))
    assert graph_inputs_unsupported(4, static, step) is None
    assert "static rows" in graph_inputs_unsupported(1, static, step)        # batch > size
    assert "static rows" in graph_inputs_unsupported(
        4, static, step[:4] + (torch.zeros(2, 9, dtype=torch.int32),))       # too wide
    assert "contiguous" in graph_inputs_unsupported(
        4, static, (torch.zeros(4, dtype=torch.long)[::2],) + step[1:])
    assert "fed ids" in graph_inputs_unsupported(4, static, step, torch.zeros(3, dtype=torch.long))


if INTERPRETED:   # the rest runs under Triton's interpreter (tests/kernels/conftest.py)

    @pytest.mark.parametrize("batch, size, table_width, static_width, fed", [
        (1, 1, 3, 8, 0), (3, 4, 5, 8, 0), (2, 8, 8, 8, 0), (5, 5, 1, 2100, 0), (1, 1, 3, 8, 1),
        (3, 4, 5, 8, 2)])
    def test_inputs_land_as_the_copies_leave_them(batch, size, table_width, static_width, fed):
        # 2100 columns: the padded rows' zeroing and the copy loop over column blocks.
        check("cpu", batch, size, min(table_width, static_width), static_width, fed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_graph_inputs():
    for batch, size, width, static_width, fed in ((1, 1, 3, 8, 0), (3, 4, 5, 8, 0),
                                                  (5, 5, 1500, 2100, 0), (1, 1, 3, 8, 1),
                                                  (3, 4, 5, 8, 3)):
        check("cuda", batch, size, width, static_width, fed)
