"""`matrix` against seed 000 §5.3: every definite cell (✓/✗) agrees, except documented deviations.

The seed's table is the oracle, typed here once; `?` marks ✓(?)/✗(?) cells and `-` the
seed's "not applicable": neither is checked.
"""

from __future__ import annotations

import pytest

from archserve.platform.profiles import get_profile
from archserve.routing.matrix import build_matrix

SEED_COLUMNS = ("sm70", "sm75", "sm80", "sm89", "sm90", "sm100", "sm120", "sm121")

# name -> cells for SM70 SM75 SM80 SM89 SM90 SM100 SM120 SM121 (Y, N, ? or -).
SEED_TABLE = {
    "FP32": "YYYYYYYY",
    "FP16": "YYYYYYYY",
    "BF16": "NNYYYYYY",
    "FP8 (E4M3)": "NNNYYYYY",
    "NVFP4": "NNNNNYYY",
    "MXFP8": "NNNNNY??",
    "FlashAttention": "NNYYYYYY",
    "FlashInfer": "NYYYYYYY",
    "Triton Attn": "YYYYYYYY",
    "FlexAttention": "YYYYYYYY",
    "FlashAttn MLA": "NNNNYNNN",
    "FlashMLA": "NNNYNYNN",
    "CUTLASS MLA": "NNNNNYNN",
    "FlashInfer MLA": "NNNNNYNN",
    "Triton MLA": "YYYYYYYY",
    "INT8 W8A8": "NYYYYYYY",
    "FP8 W8A8": "NNNYYYYY",
    "Block-wise FP8": "NNNNYY??",
    "W4A8 mixed precision": "NNNNYY??",
    "NVFP4 GEMM": "NNNNNYY?",
    "2:4 Sparse": "NNNNYY??",
    "Grouped GEMM": "NNNNYY??",
    "Triton fused_moe": "YYYYYYYY",
    "CUTLASS MoE FP8": "NNNNYYY?",
    "TRTLLM MoE FP8": "NNNNNYNN",
    "TRTLLM MoE NVFP4": "NNNNNYNN",
    "DeepGEMM MoE": "NNNNY?NN",
    "Marlin MoE": "NYYYYYYY",
    "GGUF": "NNYYYYYY",
    "GPTQ": "NNYYYYYY",
    "BitsAndBytes": "YYYYYYYY",
    "AWQ": "NYYYYYYY",
    "GPTQ-Marlin": "NYYYYYYY",
    "FP8 (Marlin path)": "NYYY----",
    "FP8 (native)": "NNNYYYYY",
    "FBGEMM FP8": "NNYYYYYY",
    "ModelOpt FP8": "NNNYYYYY",
    "ModelOpt MXFP8": "NNNNNY??",
    "NVFP4 quantization": "NNNNNYY?",
}

# (row, SM column) where archserve follows today's vLLM, not the seed (docs/deviations.md).
DEVIATIONS = {
    ("FlashInfer", "sm75"),        # FlashInfer is broken on Turing; vLLM requires SM80+
    ("FlashMLA", "sm89"),          # FlashMLA needs Hopper+ (major 9 or 10)
    ("FlashMLA", "sm90"),          # ... and runs on Hopper
    ("FlashMLA", "sm100"),         # dense FlashMLA is Hopper only in vLLM 0.33
    ("GGUF", "sm70"),              # vLLM min capability 60; our loader dequantizes at load
    ("GGUF", "sm75"),
    ("GPTQ", "sm70"),              # vLLM min capability 60 (the seed's own §5.1 and §8.1)
    ("GPTQ", "sm75"),
    ("AWQ", "sm70"),               # vLLM min capability 75; archserve's weight-only kernel: SM70
    ("GPTQ-Marlin", "sm70"),       # loads as GPTQ: the same weight-only kernel from SM70
    ("FP8 (Marlin path)", "sm70"),  # the weight-only path here is that kernel, from SM70
    # vLLM 0.33 runs both weight-only through Marlin from SM80 (today's vLLM wins over the seed)
    ("ModelOpt FP8", "sm80"),
    ("ModelOpt MXFP8", "sm80"),
    ("ModelOpt MXFP8", "sm89"),
    ("ModelOpt MXFP8", "sm90"),
    ("CUTLASS MoE FP8", "sm120"),  # vLLM 0.33 cutlass_group_gemm_supported: 90 <= SM < 110
    ("DeepGEMM MoE", "sm120"),     # vLLM 0.33 support_deep_gemm: SM90, SM100 and SM120 families
    ("DeepGEMM MoE", "sm121"),
    ("W4A8 mixed precision", "sm100"),  # vLLM 0.33 CutlassW4A8LinearKernel: SM90 only
    ("Triton MLA", "sm75"),        # archserve's decode tile for a 512 latent: 68 KiB > T4's 64
}


@pytest.fixture(scope="module")
def matrix() -> dict:
    return build_matrix([get_profile(c) for c in SEED_COLUMNS])


def _definite_cells():
    for name, cells in SEED_TABLE.items():
        for column, cell in zip(SEED_COLUMNS, cells, strict=True):
            if cell in "YN":
                yield name, column, cell == "Y"


def test_every_seed_row_is_in_the_matrix(matrix: dict) -> None:
    names = {f["name"] for f in matrix["features"]}
    assert set(SEED_TABLE) <= names


@pytest.mark.parametrize("name,column,expected", list(_definite_cells()))
def test_definite_cell_matches_seed_or_is_a_documented_deviation(
        matrix: dict, name: str, column: str, expected: bool) -> None:
    row = next(f for f in matrix["features"] if f["name"] == name)
    got = row["support"][get_profile(column).id]
    if (name, column) in DEVIATIONS:
        assert got != expected, f"{name}/{column} is listed as a deviation but matches the seed"
    else:
        assert got == expected, f"{name} on {column}: matrix {got}, seed {expected}"


def test_flash_attention_cells_carry_the_fa_version(matrix: dict) -> None:
    row = next(f for f in matrix["features"] if f["name"] == "FlashAttention")
    versions = {c: row["notes"].get(get_profile(c).id) for c in SEED_COLUMNS}
    assert versions == {"sm70": None, "sm75": None, "sm80": "FA2", "sm89": "FA2",
                        "sm90": "FA3", "sm100": "FA4", "sm120": "FA2", "sm121": "FA2"}


def test_deviations_are_documented() -> None:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "deviations.md").read_text()
    for name, column in DEVIATIONS:
        assert name in text and column.upper() in text, (name, column)
