"""GGUF block types split into integer groups, against the gguf package's dequantizers."""

from __future__ import annotations

import numpy as np
import pytest

from archserve.quant.gguf_blocks import KEPT_QUANTIZED, split_blocks, widen

gguf = pytest.importorskip("gguf")

# Where each type keeps its fp16 fields (byte offsets in a block): random bytes there
# could be inf/NaN, so the test writes sane values.
FP16_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q4_K": [0, 2],
               "Q5_K": [0, 2], "Q6_K": [208]}


def random_tensor(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    qtype = gguf.GGMLQuantizationType[type_name]
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // block_elems, block_bytes),
                          dtype=np.uint8)
    for offset in FP16_FIELDS[type_name]:
        values = rng.uniform(-0.05, 0.05, size=blocks.shape[0]).astype(np.float16)
        blocks[:, offset:offset + 2] = values.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("type_name", KEPT_QUANTIZED)
def test_groups_dequantize_like_gguf(type_name: str) -> None:
    rows, cols = 4, 512
    data = random_tensor(type_name, rows, cols, seed=len(type_name))
    groups = split_blocks(type_name, data, rows, cols)
    assert groups.q.max() < 2 ** groups.bits and cols % groups.group == 0
    ours = (groups.q.astype(np.float32) * np.repeat(groups.scale, groups.group, 1)
            + np.repeat(groups.offset, groups.group, 1))
    theirs = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[type_name])
    np.testing.assert_allclose(ours, theirs.reshape(rows, cols), rtol=1e-6, atol=1e-7)


def test_widen_keeps_values() -> None:
    data = random_tensor("Q4_K", 2, 256, seed=3)
    groups = split_blocks("Q4_K", data, 2, 256)
    wide = widen(groups, 8, 16)
    values = (wide.q * np.repeat(wide.scale, 16, 1) + np.repeat(wide.offset, 16, 1))
    expected = (groups.q * np.repeat(groups.scale, 32, 1) + np.repeat(groups.offset, 32, 1))
    np.testing.assert_array_equal(values, expected)


def test_other_types_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="GGUF Q2_K is not kept quantized"):
        split_blocks("Q2_K", np.zeros((1, 84), np.uint8), 1, 256)
