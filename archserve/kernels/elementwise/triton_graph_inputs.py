"""A decode step's inputs into its CUDA graph's static buffers, in one launch.

Before each replay the decode graph's static buffers take the step's input ids,
positions, slots, lengths and block tables, and rows the graph runs past the batch get no
cache write (slot -1), one key (length 1) and a zeroed table row. As tensor copies that is
five device-to-device copies at batch 1 (eight with padded rows), one after the other
between two graphs, where nothing overlaps them. Here one program per graph row does all of
its row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_COLS = 1024    # block-table columns a program copies per step


# One compiled variant whatever the batch and table widths (the staged inputs are 16-byte
# aligned, engine/staging.py): the replay canary compiles it at start-up, not a step.
@triton.jit(do_not_specialize=["batch", "fed_rows", "table_width", "src_row_stride",
                               "dst_row_stride", "static_width"])
def _graph_inputs_kernel(ids_src, ids_dst, pos_src, pos_dst, slot_src, slot_dst, len_src,
                         len_dst, table_src, table_dst, fed_src, batch, fed_rows, table_width,
                         src_row_stride, dst_row_stride, static_width,
                         BLOCK_COLS: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_COLS)
    if row < batch:
        if row < fed_rows:   # the step in flight's sampled token (ModelBatch.fed_ids)
            tl.store(ids_dst + row, tl.load(fed_src + row).to(ids_dst.dtype.element_ty))
        else:
            tl.store(ids_dst + row, tl.load(ids_src + row))
        tl.store(pos_dst + row, tl.load(pos_src + row))
        tl.store(slot_dst + row, tl.load(slot_src + row))
        tl.store(len_dst + row, tl.load(len_src + row).to(len_dst.dtype.element_ty))
        src = table_src + row.to(tl.int64) * src_row_stride
        dst = table_dst + row.to(tl.int64) * dst_row_stride
        for c0 in range(0, table_width, BLOCK_COLS):
            c = c0 + cols
            tl.store(dst + c, tl.load(src + c, mask=c < table_width), mask=c < table_width)
    else:   # a row past the batch: no cache write, one key, block 0
        tl.store(slot_dst + row, tl.full([], -1, slot_dst.dtype.element_ty))
        tl.store(len_dst + row, tl.full([], 1, len_dst.dtype.element_ty))
        dst = table_dst + row.to(tl.int64) * dst_row_stride
        for c0 in range(0, static_width, BLOCK_COLS):
            c = c0 + cols
            tl.store(dst + c, tl.zeros([BLOCK_COLS], table_dst.dtype.element_ty),
                     mask=c < static_width)


def graph_inputs_unsupported(size: int, static: tuple[torch.Tensor, ...],
                             step: tuple[torch.Tensor, ...],
                             fed_ids: torch.Tensor | None = None) -> str | None:
    """Why ``load_graph_inputs_triton`` cannot take these, or None."""
    if fed_ids is not None and (fed_ids.dim() != 1 or fed_ids.stride(0) != 1
                                or fed_ids.shape[0] > step[0].shape[0]
                                or fed_ids.device != static[0].device):
        return f"fed ids {tuple(fed_ids.shape)} for {step[0].shape[0]} input rows"
    tables, s_tables = static[4], step[4]
    batch, width = s_tables.shape
    if not batch <= size <= static[0].shape[0] or width > tables.shape[1]:
        return f"a batch of {batch} rows, {width} blocks wide, into {size} static rows"
    if s_tables.stride(1) != 1 or tables.stride(1) != 1 or any(
            t.dim() != 1 or t.stride(0) != 1 or t.shape[0] < batch for t in step[:4]):
        return "inputs not contiguous rows"
    if any(t.device != static[0].device for t in step):
        return "inputs on another device than the static buffers"
    return None


def load_graph_inputs_triton(size: int, static: tuple[torch.Tensor, ...],
                             step: tuple[torch.Tensor, ...],
                             fed_ids: torch.Tensor | None = None) -> None:
    """``static`` (input ids, positions, slots, lengths, block tables [rows, width]) take
    ``step``'s (the same, for its batch rows; its tables as wide as they are) in their
    first rows, the first input ids from ``fed_ids`` where given (ModelBatch.fed_ids); rows
    up to ``size`` past the batch are padded (check ``graph_inputs_unsupported`` first)."""
    ids, positions, slots, lengths, tables = static
    s_ids, s_positions, s_slots, s_lengths, s_tables = step
    batch, width = s_tables.shape
    _graph_inputs_kernel[(size,)](
        s_ids, ids, s_positions, positions, s_slots, slots, s_lengths, lengths, s_tables,
        tables, fed_ids if fed_ids is not None else s_ids, batch,
        fed_ids.shape[0] if fed_ids is not None else 0, width, s_tables.stride(0),
        tables.stride(0), tables.shape[1], BLOCK_COLS=BLOCK_COLS, num_warps=1)
