"""CPU_WEIGHT_ONLY (kernels/linear/cpu_weight_only.py): every storage format computes the
dequantized product within its rounding, the rules keep each format to the weights and
CPUs its kernel takes, and the timed choice is cached and read back."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_quant_gemm import int_group_weight

import archserve.kernels.linear.cpu_weight_only as cwo
from archserve.kernels.linear.cpu_weight_only import (
    BF16,
    FP32,
    INT4,
    INT8,
    CpuWeightOnlyLinear,
    cpu_linear,
    format_rule,
    to_format,
)
from archserve.kernels.linear.quantized_weights import IntGroupWeight, reference_linear
from archserve.platform.device import features_for
from archserve.platform.profiles import get_profile

CPU = get_profile("cpu")                     # AVX-512 BF16: every format allowed
NO_AVX2 = dataclasses.replace(CPU, features=features_for("cpu", None))
AVX2_ONLY = dataclasses.replace(CPU, features=features_for("cpu", None,
                                                           cpu_flags=frozenset({"avx2", "fma"})))
# Relative to the output's scale: fp32 is the expansion itself; the narrow formats round x
# (and the weight, or the int4 group's scale and zero) to bfloat16, 2**-9 relative each.
TOLERANCE = {FP32: 1e-5, BF16: 2e-2, INT4: 2e-2, INT8: 2e-2}


def symmetric_int8(n: int, k: int) -> IntGroupWeight:
    """Per-channel symmetric 8-bit weights: the only kind ``_weight_int8pack_mm`` takes."""
    w = int_group_weight(n, k, 8, k, asym=False, act_order=False, scale_dtype=torch.float32)
    assert w.offsets is None
    return w


@pytest.mark.parametrize("case", [
    dict(bits=4, group=32, asym=True, act_order=False),     # GGUF Q4_1, AWQ
    dict(bits=4, group=128, asym=False, act_order=False),   # GPTQ symmetric
    dict(bits=4, group=64, asym=False, act_order=True),     # act order: dense formats only
    dict(bits=8, group=32, asym=True, act_order=False),     # 8-bit groups: dense only
], ids=["q4_1-g32", "sym-g128", "act-order", "int8-g32"])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_every_allowed_format_computes_the_dequantized_product(case, rows):
    w = int_group_weight(64, 256, case["bits"], case["group"], case["asym"], case["act_order"],
                         scale_dtype=torch.float32)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(64)
    expected = reference_linear(x, w, bias)
    formats = CpuWeightOnlyLinear(CPU).formats_for(w)
    assert (INT4 in formats) == (case["bits"] == 4 and not case["act_order"])
    assert INT8 not in formats and {BF16, FP32} <= set(formats)
    scale = expected.abs().max()
    for fmt in formats:
        got = cpu_linear(x, to_format(w, fmt), bias)
        assert got.dtype == x.dtype and got.shape == expected.shape
        err = ((got - expected).abs().max() / scale).item()
        assert err < TOLERANCE[fmt], (fmt, err)


def test_int8_takes_symmetric_per_channel_weights():
    w = symmetric_int8(48, 128)
    assert CpuWeightOnlyLinear(CPU).formats_for(w) == [INT8, BF16, FP32]
    x = torch.randn(5, 128)
    expected = reference_linear(x, w)
    got = cpu_linear(x, to_format(w, INT8))
    assert ((got - expected).abs().max() / expected.abs().max()).item() < TOLERANCE[INT8]


def test_the_rules_follow_the_cpus_isa_and_the_weights_layout():
    q4 = int_group_weight(64, 256, 4, 32, True, False)
    # No AVX2: torch's int4/int8 kernels run scalar code, no native bf16: float32 only.
    assert CpuWeightOnlyLinear(NO_AVX2).formats_for(q4) == [FP32]
    assert "AVX2" in format_rule(INT4, NO_AVX2)
    # AVX2 without AVX-512 BF16 or AMX: bf16 products would be emulated.
    assert CpuWeightOnlyLinear(AVX2_ONLY).formats_for(q4) == [INT4, FP32]
    assert "AVX-512 BF16" in format_rule(BF16, AVX2_ONLY)
    narrow = int_group_weight(24, 256, 4, 32, True, False)      # 24 outputs: not 16k
    assert "multiples of 16" in format_rule(INT4, CPU, narrow)
    odd_group = int_group_weight(64, 256, 4, 16, True, False)
    assert "groups of 16" in format_rule(INT4, CPU, odd_group)


def test_the_timed_choice_is_cached_and_read_back(tmp_path, monkeypatch):
    weights = [int_group_weight(64, 256, 4, 32, True, False) for _ in range(2)]
    weights.append(int_group_weight(32, 64, 4, 32, False, False))
    path = str(tmp_path / "cpu_weight_formats.json")
    first = CpuWeightOnlyLinear(CPU)
    timings = first.tune_formats(weights, path)
    assert len(timings) == 2                       # two kinds: shape and group layout
    for timing in timings.values():
        assert timing.chosen == min(timing.ms, key=timing.ms.get)
        assert set(timing.ms) == {INT4, BF16, FP32}

    def no_timing(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("timed again despite the cache")

    monkeypatch.setattr(cwo, "time_formats", no_timing)
    second = CpuWeightOnlyLinear(CPU)
    assert second.tune_formats(weights, path) == timings
    assert second.choices == first.choices
    stored = second.prepare(weights[0], torch.float32)
    assert stored.format == timings[cwo.kind_key(weights[0])].chosen
    # A CPU where the cached choice is not allowed times anew among its own formats.
    monkeypatch.undo()
    plain = CpuWeightOnlyLinear(NO_AVX2)
    assert {t.chosen for t in plain.tune_formats(weights, path).values()} == {FP32}
