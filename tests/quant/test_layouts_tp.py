"""What a tensor-parallel rank keeps of a quantized checkpoint tensor (quant/layouts.py), and
an expert matrix's part (quant/checkpoint_matrix.py): whole packed words, groups and blocks,
or a reason."""

from __future__ import annotations

import torch

from archserve.kernels.linear.formats import FP8_BLOCK, WNA16
from archserve.kernels.linear.quantized_weights import ACT_DYNAMIC_GROUP, ACT_NONE
from archserve.quant.checkpoint_matrix import QuantizedMatrix
from archserve.quant.config import AWQ, CT_FLOAT, GPTQ, LayerQuant
from archserve.quant.layouts import (
    channels_part,
    channels_split_problem,
    rows_part,
    rows_split_problem,
    tensor_layouts,
)

GPTQ_G32 = LayerQuant(GPTQ, WNA16, 4, "group", ACT_NONE, group_size=32)
AWQ_G64 = LayerQuant(AWQ, WNA16, 4, "group", ACT_NONE, group_size=64)
BLOCK_FP8 = LayerQuant(CT_FLOAT, FP8_BLOCK, 8, "block", ACT_DYNAMIC_GROUP, block=(128, 128))


def test_gptq_parts_are_packed_words_and_groups_of_the_rank():
    layouts = {t.name: t for t in tensor_layouts(GPTQ_G32, 256)}
    qweight = torch.arange(256 // 8 * 64).reshape(32, 64)      # [K / 8, N]
    scales = torch.arange(8 * 64).reshape(8, 64)               # [K / 32, N]
    # Column-parallel rank 1 of 2: output columns 32..63 of every row.
    assert torch.equal(rows_part(layouts["qweight"], qweight, 32, 32, 64), qweight[:, 32:])
    qzeros = torch.arange(8 * 8).reshape(8, 8)                 # [K / 32, N / 8]
    assert torch.equal(rows_part(layouts["qzeros"], qzeros, 32, 32, 64), qzeros[:, 4:])
    # Row-parallel rank 1 of 2: input channels 128..255 = packed rows 16.., groups 4..
    assert torch.equal(channels_part(layouts["qweight"], qweight, 128, 128, 256), qweight[16:])
    assert torch.equal(channels_part(layouts["scales"], scales, 128, 128, 256), scales[4:])
    assert channels_split_problem(GPTQ_G32, 256, 128, 128) is None
    # 48 channels a rank: the second rank's part would start inside a group of 32.
    assert "32 input channels" in channels_split_problem(GPTQ_G32, 96, 48, 48)
    act_order = LayerQuant(GPTQ, WNA16, 4, "group", ACT_NONE, group_size=32, act_order=True)
    assert "act order" in channels_split_problem(act_order, 256, 128, 128)


def test_awq_packs_eight_output_columns_a_word():
    assert rows_split_problem(AWQ_G64, 128, 64, 64, 128) is None
    assert "8 output rows" in rows_split_problem(AWQ_G64, 128, 4, 4, 8)


def test_block_scales_split_only_on_block_edges_and_the_last_block_may_be_partial():
    assert rows_split_problem(BLOCK_FP8, 256, 128, 128, 256) is None
    assert "128 output rows" in rows_split_problem(BLOCK_FP8, 256, 64, 64, 128)
    # 320 rows over 2 ranks would cut at 160; over ranks of 256 + 64 the tail block is
    # the last rank's alone.
    assert rows_split_problem(BLOCK_FP8, 256, 256, 64, 320) is None
    layouts = {t.name: t for t in tensor_layouts(BLOCK_FP8, 256)}
    scale = torch.arange(3 * 2).reshape(3, 2).float()           # ceil(320 / 128) x K / 128
    assert torch.equal(rows_part(layouts["weight_scale"], scale, 256, 64, 320), scale[2:])


def test_an_expert_matrix_keeps_its_part_and_answers_with_the_whole_shape():
    # Down of an expert with 256 intermediate channels, rank 1 of 2 (channels 128..255).
    down = QuantizedMatrix(AWQ_G64, 64, 128, torch.device("cpu"), split_channels=(128, 256))
    assert down.split_problem() is None
    assert down.checkpoint_shape("qweight") == (256, 64 // 8)
    assert down.checkpoint_shape("scales") == (256 // 64, 64)
    whole = torch.arange(256 * 8, dtype=torch.int32).reshape(256, 8)
    down.load_checkpoint("qweight", whole)
    assert torch.equal(down.qweight, whole[128:])
    # Gate of an expert whose 64-row part cannot hold whole 128-row scale blocks.
    gate = QuantizedMatrix(BLOCK_FP8, 64, 128, torch.device("cpu"), split_rows=(64, 128))
    assert "128 output rows" in gate.split_problem()


def test_a_parallel_linear_says_why_its_format_cannot_split():
    """The loader asks each parallel linear (``split_problem``) before any weight is read:
    GGUF never splits, AWQ splits where its groups do, and one rank never asks."""
    from archserve.distributed.parallel_state import TensorParallelGroup, tensor_parallel
    from archserve.models.layers.parallel_linear import GateUpParallelLinear, RowParallelLinear
    from archserve.quant.config import GGUF

    gguf = LayerQuant(GGUF, WNA16, 0, "group")
    with tensor_parallel(TensorParallelGroup(rank=1, size=2)):
        down = RowParallelLinear(256, 64)
        gate_up = GateUpParallelLinear(64, 256)
    for layer in (down, gate_up):
        assert "GGUF" in layer.split_problem(gguf)
    assert down.split_problem(AWQ_G64) is None                  # 128 channels: two groups
    with tensor_parallel(TensorParallelGroup(rank=1, size=2)):
        narrow = RowParallelLinear(96, 64)                       # 48 channels a rank
    assert "64 input channels" in narrow.split_problem(AWQ_G64)
    assert RowParallelLinear(96, 64).split_problem(gguf) is None   # one rank: no split
