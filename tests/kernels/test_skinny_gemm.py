"""The Triton skinny GEMM (decode-sized rows) against a float64 reference, and the routine
that chooses it per shape against cuBLAS.

On CPU the kernel runs under Triton's interpreter in a child process (as the other
Triton test files do); on a GPU the ``gpu``-marked tests run it compiled at the real
shapes of Llama-3-8B and Qwen3-0.6B, inside a CUDA graph, and tune a routine on them.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn.functional as F

from archserve.kernels.elementwise.reference import rms_norm_reference, silu_and_mul_reference
from archserve.kernels.linear.skinny_choice import (
    _CACHE_VERSION,
    CUBLAS,
    FOLDED,
    LINEAR,
    MIN_GAIN,
    RESIDUAL,
    SILU_MUL,
    UNFUSED,
    ShapeTiming,
    SkinnyGemmRoutine,
    _key,
    decode_graph_scope,
    implementation,
    shape_key,
)
from archserve.kernels.linear.triton_skinny_gemm import (
    MAX_ROWS,
    SkinnyConfig,
    add_unsupported,
    candidate_configs,
    norm_unsupported,
    rms_norm_skinny_gemm,
    skinny_gemm,
    skinny_gemm_unsupported,
    widen_unsupported,
)
from archserve.kernels.rules import triton_interpreted

INTERPRETED = triton_interpreted()
INTERPRETER_TIMEOUT_S = 900
HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu


ULP = {torch.float32: 2.0 ** -20, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def operands(rows: int, n: int, k: int, dtype: torch.dtype, device: str, with_bias: bool,
             weight_dtype: torch.dtype | None = None):
    """x in ``dtype``; the weight and bias in ``weight_dtype`` (default: ``dtype``)."""
    torch.manual_seed(rows * 1000 + n + k)
    weight_dtype = weight_dtype or dtype
    x = torch.randn(rows, k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) / k ** 0.5).to(weight_dtype)
    b = torch.randn(n, device=device).to(weight_dtype) if with_bias else None
    return x, w, b


def check_against_float64(rows: int, n: int, k: int, dtype: torch.dtype, device: str,
                          config: SkinnyConfig, with_bias: bool = False) -> None:
    x, w, b = operands(rows, n, k, dtype, device, with_bias)
    expected = x.double() @ w.double().T + (b.double() if with_bias else 0)
    got = skinny_gemm(x, w, b, config)
    assert got.dtype == dtype and got.shape == (rows, n)
    # Exact fp32 sums in another order, then one rounding to the output dtype.
    scale = expected.abs().max().item()
    assert (got.double() - expected).abs().max().item() <= ULP[dtype] * scale + 1e-5 * scale


def check_16_bit_x_with_float32_weight(rows: int, n: int, k: int, dtype: torch.dtype,
                                       device: str, config: SkinnyConfig,
                                       silu_mul: bool = False) -> None:
    """A 16-bit x with a float32 weight (DeepSeek's router) against torch's F.linear of
    x.float(): float32 out, the same fp32 products summed in another order."""
    x, w, _ = operands(rows, 2 * n if silu_mul else n, k, dtype, device, False, torch.float32)
    expected = F.linear(x.float(), w)
    if silu_mul:
        expected = silu_and_mul_reference(expected)
    got = skinny_gemm(x, w, None, config, silu_mul=silu_mul)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    scale = expected.abs().max().item()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * scale)


def check_silu_mul_against_unfused(rows: int, n: int, k: int, dtype: torch.dtype, device: str,
                                   config: SkinnyConfig, with_bias: bool = False) -> None:
    """The fused epilogue against the GEMM then silu_and_mul: the same roundings, so they
    differ only where the GEMM's own sum order flips a rounding (a unit or two)."""
    x, w, b = operands(rows, 2 * n, k, dtype, device, with_bias)
    expected = silu_and_mul_reference(F.linear(x.double(), w.double(),
                                               b.double() if with_bias else None))
    got = skinny_gemm(x, w, b, config, silu_mul=True)
    assert got.dtype == dtype and got.shape == (rows, n)
    scale = expected.abs().max().item()
    assert (got.double() - expected).abs().max().item() <= 3 * ULP[dtype] * scale + 1e-5 * scale


def check_norm_prologue(rows: int, n: int, k: int, dtype: torch.dtype, device: str,
                        config: SkinnyConfig, with_residual: bool, silu_mul: bool,
                        weight_dtype: torch.dtype | None = None) -> None:
    """The norm in the GEMM's prologue against rms_norm's kernel-free reference, then the
    same GEMM. The prologue scales the sums by 1/rms at the end instead of rounding the
    normalised row to x's dtype before the products, so they differ by about that
    rounding (a unit or two of the output); the new residual is exact, and the normalised
    rows it keeps are the reference's to a unit where the two fp32 sums of squares round
    1/rms apart."""
    x, w, b = operands(rows, 2 * n if silu_mul else n, k, dtype, device, with_bias=True,
                       weight_dtype=weight_dtype)
    gen = torch.Generator().manual_seed(rows + k)
    residual = torch.randn(rows, k, generator=gen).to(device, dtype) if with_residual else None
    norm_weight = (1 + 0.2 * torch.randn(k, generator=gen)).to(device, dtype)
    normed, expected_residual = rms_norm_reference(x, norm_weight, 1e-6, residual)
    expected = skinny_gemm(normed, w, b, config, silu_mul=silu_mul)
    assert norm_unsupported(x, residual, norm_weight, w) is None
    got, new_residual, got_normed = rms_norm_skinny_gemm(
        x, residual, norm_weight, 1e-6, w, b, config, silu_mul=silu_mul, keep_normed=True)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.equal(new_residual, expected_residual), "one rounded add: exact"
    assert got_normed.dtype == normed.dtype
    assert (got_normed.double() - normed.double()).abs().max().item() <= \
        ULP[dtype] * normed.double().abs().max().item()
    scale = expected.double().abs().max().item()
    assert (got.double() - expected.double()).abs().max().item() <= \
        4 * ULP[dtype] * scale + 1e-5 * scale
    # Without keep_normed: the same two outputs, and no third.
    again = rms_norm_skinny_gemm(x, residual, norm_weight, 1e-6, w, b, config,
                                 silu_mul=silu_mul)
    assert len(again) == 2 and torch.equal(again[0], got)


def check_folded_norm_prologue(rows: int, n: int, k: int, dtype: torch.dtype, device: str,
                               config: SkinnyConfig) -> None:
    """A folded norm (norm_weight None: its weight already in W, RMSNorm.fold_into) gives
    what the prologue gives with a weight of ones, bit for bit, and keeps the rows
    rms_norm gives with ones."""
    x, w, b = operands(rows, n, k, dtype, device, with_bias=True)
    ones = torch.ones(k, device=device, dtype=dtype)
    expected, _, expected_normed = rms_norm_skinny_gemm(x, None, ones, 1e-6, w, b, config,
                                                        keep_normed=True)
    assert norm_unsupported(x, None, None, w) is None
    got, new_residual, normed = rms_norm_skinny_gemm(x, None, None, 1e-6, w, b, config,
                                                     keep_normed=True)
    assert torch.equal(got, expected) and torch.equal(normed, expected_normed)
    assert new_residual is x


def check_add_epilogue(rows: int, n: int, k: int, dtype: torch.dtype, device: str,
                       config: SkinnyConfig) -> None:
    """``add``: the GEMM's output rounded, plus ``add``, rounded again: the kernel's own
    output added to ``add`` by torch (to a unit of the output: the interpreter's own casts
    to 16 bits may round otherwise than the kernel's round_to_dtype; compiled, exact)."""
    x, w, b = operands(rows, n, k, dtype, device, with_bias=True)
    add = torch.randn(rows, n, device=device).to(dtype)
    expected = skinny_gemm(x, w, b, config) + add
    assert add_unsupported((rows, n), dtype, add) is None
    assert add_unsupported((rows, n + 1), dtype, add) is not None
    got = skinny_gemm(x, w, b, config, add=add)
    if device == "cuda":
        assert torch.equal(got, expected)
    else:
        scale = expected.abs().max().item()
        torch.testing.assert_close(got, expected, rtol=0, atol=ULP[dtype] * scale)


def check_widen_epilogue(rows: int, n: int, k: int, dtype: torch.dtype, device: str,
                         config: SkinnyConfig) -> None:
    """``widen``: the 16-bit product as float32, what ``.float()`` of it gives (to a unit
    of the output under the interpreter, whose casts may round otherwise; compiled,
    exact); into ``out`` when it suits, else a new tensor."""
    x, w, _ = operands(rows, n, k, dtype, device, False)
    expected = skinny_gemm(x, w, None, config).float()
    got = skinny_gemm(x, w, None, config, widen=True)
    out = torch.full((rows + 1, n), float("nan"), device=device)
    assert widen_unsupported(x, w, out[:rows]) is None
    into = skinny_gemm(x, w, None, config, widen=True, out=out[:rows])
    assert got.dtype == torch.float32 and into.data_ptr() == out.data_ptr()
    assert torch.equal(into, got) and out[rows].isnan().all()
    if device == "cuda":
        assert torch.equal(got, expected)
    else:
        scale = expected.abs().max().item()
        torch.testing.assert_close(got, expected, rtol=0, atol=ULP[dtype] * scale)


# ------------------------------------------------------------------- anywhere (no kernel)

def test_widening_takes_16_bit_products_into_float32_rows_of_their_shape():
    x, w = torch.randn(2, 16).bfloat16(), torch.randn(8, 16).bfloat16()
    assert widen_unsupported(x, w, None) is None
    assert widen_unsupported(x, w, torch.empty(2, 8)) is None
    assert "nothing to widen" in widen_unsupported(x.float(), w.float(), None)
    assert "nothing to widen" in widen_unsupported(x, w.float(), None)
    for out in (torch.empty(2, 9), torch.empty(2, 8).bfloat16(), torch.empty(8, 2).t()):
        assert "out" in widen_unsupported(x, w, out)


def test_configs_fit_the_accumulator_and_round_trip_their_keys():
    for rows in range(1, MAX_ROWS + 1):
        configs = candidate_configs(rows)
        assert configs, rows
        for c in configs:
            if c.mma:   # tl.dot's smallest tiles
                assert rows > 1 and c.block_n >= 16 and c.block_k >= 16, (rows, c)
            elif rows == 1:   # [BLOCK_N, BLOCK_K] fp32 sums
                assert c.block_n * c.block_k <= 8192
            else:   # BLOCK_K in whole 16-byte vectors a thread (_times_rows)
                assert c.block_k % (8 * 32 * c.num_warps) == 0, (rows, c)
            assert SkinnyConfig.from_key(c.key()) == c
    assert SkinnyConfig.from_key("n2_k1024_w4") == SkinnyConfig(2, 1024, 4)
    assert SkinnyConfig.from_key("n16_k128_w2_mma") == SkinnyConfig(16, 128, 2, mma=True)
    assert any(c.mma for c in candidate_configs(MAX_ROWS))


def test_unsupported_operands_are_named():
    w = torch.zeros(64, 32)
    assert skinny_gemm_unsupported(torch.zeros(1, 32), w, None) is None
    assert skinny_gemm_unsupported(torch.zeros(MAX_ROWS, 32), w, None) is None
    assert "17 rows" in skinny_gemm_unsupported(torch.zeros(17, 32), w, None)
    assert "operands" in skinny_gemm_unsupported(torch.zeros(1, 16), w, None)
    assert "bias" in skinny_gemm_unsupported(torch.zeros(1, 32), w, torch.zeros(3))
    assert "contiguous" in skinny_gemm_unsupported(torch.zeros(32, 2).T, w, None)


@pytest.mark.parametrize("x_dtype,w_dtype,supported", [
    (torch.bfloat16, torch.float32, True), (torch.float16, torch.float32, True),
    (torch.bfloat16, torch.bfloat16, True),
    (torch.float32, torch.bfloat16, False), (torch.float16, torch.bfloat16, False),
    (torch.bfloat16, torch.float16, False), (torch.float64, torch.float64, False),
    (torch.int8, torch.float32, False)], ids=str)
def test_mixed_dtypes_only_16_bit_x_with_a_float32_weight(x_dtype, w_dtype, supported):
    """The kernel widens a 16-bit x to a float32 weight (DeepSeek's router); any other pair
    of dtypes is refused, and named."""
    x, w = torch.zeros(1, 32, dtype=x_dtype), torch.zeros(64, 32, dtype=w_dtype)
    why = skinny_gemm_unsupported(x, w, None)
    assert (why is None) == supported, why
    if not supported:
        assert str(x_dtype) in why and str(w_dtype) in why


def test_norm_prologue_declines_a_norm_weight_or_residual_it_cannot_read():
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    norm_weight = torch.ones(32, dtype=torch.bfloat16)
    w = torch.zeros(64, 32, dtype=torch.bfloat16)
    assert norm_unsupported(x, x, norm_weight, w) is None
    # DeepSeek's float32 router after the norm: taken (no rounding to the weight's dtype)
    assert norm_unsupported(x, x, norm_weight, w.float()) is None
    why = norm_unsupported(x, x, norm_weight.float(), w)
    assert why is not None and "norm weight" in why
    why = norm_unsupported(x, torch.zeros(1, 32, dtype=torch.float16), norm_weight, w)
    assert why is not None and "residual" in why


def test_routine_is_torch_linear_outside_graph_scope_and_on_cpu():
    routine = SkinnyGemmRoutine()
    routine.choices[shape_key(LINEAR, 2, 8, 16, torch.float32)] = SkinnyConfig(4, 512, 4).key()
    routine.choices[shape_key(SILU_MUL, 2, 8, 16, torch.float32)] = SkinnyConfig(4, 512, 4).key()
    x, w, b = torch.randn(2, 16), torch.randn(8, 16), torch.randn(8)
    gated = silu_and_mul_reference(F.linear(x, w, b))
    torch.testing.assert_close(routine(x, w, b), F.linear(x, w, b), rtol=0, atol=0)
    torch.testing.assert_close(routine.linear_silu_mul(x, w, b), gated, rtol=0, atol=0)
    with decode_graph_scope():  # CPU tensors: still torch
        torch.testing.assert_close(routine(x, w, b), F.linear(x, w, b), rtol=0, atol=0)
        torch.testing.assert_close(routine.linear_silu_mul(x, w, b), gated, rtol=0, atol=0)


def test_routine_on_cpu_widens_a_16_bit_x_to_a_float32_weight():
    """cuBLAS's side of the routine (and torch's routine) with DeepSeek's router operands:
    the float32 logits of x.float(), bit for bit, in both kinds."""
    routine = SkinnyGemmRoutine()
    x = torch.randn(2, 16).to(torch.bfloat16)
    w = torch.randn(8, 16)
    expected = F.linear(x.float(), w)
    with decode_graph_scope():
        got = routine(x, w)
        gated = routine.linear_silu_mul(x, w)
    assert got.dtype == gated.dtype == torch.float32
    assert torch.equal(got, expected)
    assert torch.equal(gated, silu_and_mul_reference(expected))
    with pytest.raises(RuntimeError):   # a narrowing pair is still torch's error
        routine(x.float(), w.to(torch.bfloat16))


def test_tune_and_call_key_a_float32_weight_with_the_model_dtype(tmp_path):
    """A float32 router weight in a bf16 model: tuning keys it by (x bf16, weight fp32), as
    the call with bf16 x looks it up, apart from an fp32 x's key."""
    w = torch.randn(64, 32)
    groups = {(LINEAR, 64, 32, torch.float32): [w]}
    mixed = shape_key(LINEAR, 1, 64, 32, torch.bfloat16, torch.float32)
    assert mixed != shape_key(LINEAR, 1, 64, 32, torch.float32, torch.float32)
    assert shape_key(LINEAR, 1, 64, 32, torch.float32, torch.float32) == \
        shape_key(LINEAR, 1, 64, 32, torch.float32)   # a same-dtype key as before
    path = tmp_path / "decode_gemms.json"
    path.write_text(json.dumps({"version": _CACHE_VERSION, "shapes": {mixed: vars(ShapeTiming(
        cublas_us=5.0, triton_us={"n4_k512_w4": 3.0}, chosen="n4_k512_w4"))}}))
    routine = SkinnyGemmRoutine()
    report = routine.tune(groups, [1], str(path), activation_dtype=torch.bfloat16)
    assert report.from_cache and list(report.timings) == [mixed]
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    assert routine.choices[_key(LINEAR, x, w)] == "n4_k512_w4"
    assert _key(LINEAR, x.float(), w) not in routine.choices


def test_tune_reads_a_complete_cache_without_timing(tmp_path):
    """A second start finds every shape in the cache and times nothing (CPU weights here
    would fail any timing, which needs CUDA)."""
    groups = {(LINEAR, 8, 16, torch.float32): [torch.randn(8, 16)] * 3,
              (SILU_MUL, 16, 8, torch.float32): [torch.randn(16, 8)]}
    path = tmp_path / "decode_gemms.json"
    shapes = {shape_key(kind, r, n, k, torch.float32): ShapeTiming(
        cublas_us=5.0, triton_us={"n4_k512_w4": 3.0}, rows=r, calls=len(groups[kind, n, k, dt]),
        chosen="n4_k512_w4" if n == 8 else CUBLAS, fuse_norm=n == 8 and r == 1,
        norm_choice="n4_k512_w4" if n == 8 and r == 1 else "")
        for r in (1, 2) for (kind, n, k, dt) in groups}
    path.write_text(json.dumps({"version": _CACHE_VERSION, "shapes": {k: vars(v) for k, v in shapes.items()}}))
    routine = SkinnyGemmRoutine()
    report = routine.tune(groups, [1, 2, 32], str(path))   # 32 rows: beyond the kernel
    assert report.from_cache and len(report.timings) == 4
    assert routine.choices[shape_key(LINEAR, 1, 8, 16, torch.float32)] == "n4_k512_w4"
    assert routine.choices[shape_key(SILU_MUL, 2, 16, 8, torch.float32)] == CUBLAS
    assert routine.norm_choices == {shape_key(LINEAR, 1, 8, 16, torch.float32): "n4_k512_w4"}
    summary = report.summary()
    assert "Triton GEMV for 2 of 4" in summary and "cached" in summary
    assert "prologue for 1 of 2" in summary
    assert "0.006 ms at 1" in summary   # 3 layers x 2 µs


def tuned_from_cache(tmp_path, shapes: dict[str, ShapeTiming], groups) -> SkinnyGemmRoutine:
    """A routine tuned at one row from a cache that holds ``shapes`` (nothing timed)."""
    path = tmp_path / "decode_gemms.json"
    path.write_text(json.dumps({"version": _CACHE_VERSION,
                                "shapes": {k: vars(v) for k, v in shapes.items()}}))
    routine = SkinnyGemmRoutine()
    assert routine.tune(groups, [1], str(path)).from_cache
    return routine


def test_a_cached_prologue_runs_at_its_own_choice(tmp_path):
    """The prologue's fastest tile need not be the GEMV's: the routine keeps the one the
    cache names for it (norm_choice), and none for a shape whose prologue lost."""
    key = shape_key(LINEAR, 1, 8, 16, torch.float32)
    lost = shape_key(LINEAR, 1, 32, 16, torch.float32)
    shapes = {key: ShapeTiming(cublas_us=5.0, triton_us={"n4_k512_w4": 3.0, "n1_k2048_w4": 3.2},
                               chosen="n4_k512_w4", fuse_norm=True, norm_form=FOLDED,
                               norm_choice="n1_k2048_w4"),
              lost: ShapeTiming(cublas_us=5.0, triton_us={"n4_k512_w4": 3.0},
                                chosen="n4_k512_w4", norm_form=FOLDED,
                                norm_choice="n4_k512_w4")}
    routine = tuned_from_cache(tmp_path, shapes, {
        (LINEAR, 8, 16, torch.float32): [torch.randn(8, 16)],
        (LINEAR, 32, 16, torch.float32): [torch.randn(32, 16)]})
    assert routine.norm_choices == {key: "n1_k2048_w4"}
    assert routine.choices[key] == "n4_k512_w4"


def test_a_gate_up_weights_plain_product_runs_its_fastest_unfused_config(tmp_path):
    """A LoRA-serving gate/up layer computes gate and up without the activation: that
    LINEAR call of a SILU_MUL shape runs the fastest config the gated timing measured
    unfused (with its norm prologue where one was chosen), not cuBLAS; a shape whose
    unfused configs lost to cuBLAS then the SiLU kernel keeps cuBLAS."""
    won = shape_key(SILU_MUL, 1, 16, 8, torch.float32)
    lost = shape_key(SILU_MUL, 1, 64, 8, torch.float32)
    shapes = {won: ShapeTiming(cublas_us=5.0, chosen="n4_k512_w4", fuse_norm=True,
                               norm_form=FOLDED, norm_choice=UNFUSED + "n1_k2048_w4",
                               triton_us={"n4_k512_w4": 3.0, UNFUSED + "n4_k512_w4": 4.5,
                                          UNFUSED + "n1_k2048_w4": 4.0}),
              lost: ShapeTiming(cublas_us=5.0, chosen="n4_k512_w4", norm_form=FOLDED,
                                triton_us={"n4_k512_w4": 3.0, UNFUSED + "n4_k512_w4": 4.9})}
    routine = tuned_from_cache(tmp_path, shapes, {
        (SILU_MUL, 16, 8, torch.float32): [torch.randn(16, 8)],
        (SILU_MUL, 64, 8, torch.float32): [torch.randn(64, 8)]})
    plain = shape_key(LINEAR, 1, 16, 8, torch.float32)
    assert routine.choices[plain] == "n1_k2048_w4"
    assert routine.norm_choices[plain] == "n1_k2048_w4"
    assert routine.choices[won] == "n4_k512_w4"
    assert shape_key(LINEAR, 1, 64, 8, torch.float32) not in routine.choices


def test_a_prologue_timed_in_the_other_norm_form_is_not_read(tmp_path, monkeypatch):
    """fold_norm_weights decides which prologue form the tuner times (x alone, or with the
    residual and the norm's weight): a shape timed in the other form is timed again."""
    from archserve.kernels.linear.skinny_choice import _read_cache
    key = shape_key(LINEAR, 1, 8, 16, torch.float32)
    timing = ShapeTiming(cublas_us=5.0, triton_us={"n4_k512_w4": 3.0}, chosen="n4_k512_w4",
                         fuse_norm=True, norm_form=FOLDED)
    path = tmp_path / "decode_gemms.json"
    path.write_text(json.dumps({"version": _CACHE_VERSION, "shapes": {key: vars(timing)}}))
    assert key in _read_cache(str(path))
    monkeypatch.setenv("ARCHSERVE_DISABLE_FUSIONS", "fold_norm_weights")
    assert _read_cache(str(path)) == {}


@pytest.mark.skipif(HAS_CUDA, reason="the failure here is timing without CUDA")
def test_a_shape_that_cannot_be_timed_stays_on_cublas_and_is_not_cached(tmp_path):
    groups = {(LINEAR, 8, 16, torch.float32): [torch.randn(8, 16)]}
    path = tmp_path / "decode_gemms.json"
    routine = SkinnyGemmRoutine()
    report = routine.tune(groups, [1], str(path))
    timing = report.timings[shape_key(LINEAR, 1, 8, 16, torch.float32)]
    assert timing.chosen == CUBLAS and "timing failed" in timing.note
    assert json.loads(path.read_text())["shapes"] == {}
    assert not routine.tune(groups, [1], str(path)).from_cache   # retried next start


def test_an_unreadable_cache_is_ignored(tmp_path):
    from archserve.kernels.linear.skinny_choice import _read_cache
    path = tmp_path / "decode_gemms.json"
    path.write_text("{not json")
    assert _read_cache(str(path)) == {}
    path.write_text(json.dumps({"version": 0, "shapes": {}}))
    assert _read_cache(str(path)) == {}


@pytest.mark.skipif(INTERPRETED, reason="the interpreter does not compile")
def test_widen_epilogue_compiles_for_sm90():
    pytest.importorskip("triton")
    from triton_compile import compiled_launches
    x, w, _ = operands(1, 64, 512, torch.bfloat16, "cpu", False)
    with compiled_launches() as launches:
        skinny_gemm(x, w, None, SkinnyConfig(4, 256, 4), widen=True)
    (launch,) = launches
    assert launch.constexprs["WIDEN"]
    # Rounded to bf16 by hand (round_to_dtype keeps the top 16 bits), stored as float32.
    code = launch.code()
    assert "-65536;" in code and "st.global.b32" in code


# The LoRA epilogue's constants, off (tests/kernels/test_lora_kernels.py compiles it on).
LORA_OFF = {"LORA": False, "LORA_BLOCKS": 1, "LORA_SLOTS": 1, "LORA_SLOTS_POW2": 1, "LORA_RANK_POW2": 16,
            "LORA_SPLITS_POW2": 1, "LORA_ROUND_T": False}


@pytest.mark.skipif(INTERPRETED, reason="the interpreter does not compile")
@pytest.mark.parametrize("target,fp32_weight", [
    (("cuda", 80, 32), False), (("cuda", 90, 32), False), (("cuda", 70, 32), False),
    (("hip", "gfx942", 64), False), (("cuda", 90, 32), True)],
    ids=["sm80", "sm90", "sm70", "gfx942", "sm90-fp32-weight"])
@pytest.mark.parametrize("block_m", [1, 4])
def test_kernel_compiles_for_gpu_targets(target, fp32_weight, block_m):
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from archserve.kernels.linear.triton_skinny_gemm import _skinny_gemm_kernel
    act = "*fp16" if target[1] == 70 else "*bf16"
    # fp32_weight: DeepSeek's router, a float32 weight (and output) with 16-bit x.
    wide = "*fp32" if fp32_weight else act
    signature = {"x_ptr": act, "w_ptr": wide, "b_ptr": wide, "y_ptr": wide, "M": "i32", "N": "i32",
                 "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32",
                 "r_ptr": act, "norm_w_ptr": act, "new_r_ptr": act, "normed_ptr": act,
                 "eps": "fp32", "add_ptr": wide, "lora_b_ptr": act, "lora_t_ptr": "*fp32",
                 "lora_map_ptr": "*i32", "lora_rank": "i32", "lora_splits": "i32",
                 "lora_size0": "i32", "lora_size1": "i32",
                 **dict.fromkeys(["HAS_BIAS", "GATED", "BLOCK_M", "BLOCK_N", "BLOCK_K", "EVEN_K",
                                  "NORM", "HAS_RESIDUAL", "NORMED_OUT", "PDL", "NORM_WEIGHT",
                                  "ADD", "NORMED_SLICE", "WIDEN", "MMA", "DOT_PRECISION",
                                  *LORA_OFF],
                                 "constexpr")}
    # block_m 4 also compiles the norm prologue (with a residual, keeping the normalised
    # rows: a MoE router's form; a folded norm's, without a weight, on the fp32 weight);
    # block_m 1 without it, gated, and again with the residual add in the epilogue
    # (o_proj's form). SM90 compiles the programmatic-dependent-launch form (kernels/pdl.py).
    pdl = target[:2] == ("cuda", 90)
    norm = block_m > 1
    options = {"num_warps": 4, **({"launch_pdl": True} if pdl else {})}
    early_loads = {}
    forms = [(False, False), (True, False), (True, True)] if not norm else [(False, False)]
    for plain, add in forms:     # (not gated, the residual add in the epilogue)
        constexprs = {"HAS_BIAS": True, "GATED": not plain, "BLOCK_M": block_m, "BLOCK_N": 4,
                      "BLOCK_K": 256, "EVEN_K": False, "NORM": norm, "HAS_RESIDUAL": norm,
                      "NORMED_OUT": norm, "PDL": pdl, "NORM_WEIGHT": not fp32_weight,
                      "ADD": add, "NORMED_SLICE": 64 if norm else 0, "WIDEN": False,
                      "MMA": False, "DOT_PRECISION": "tf32", **LORA_OFF}
        compiled = triton.compile(ASTSource(_skinny_gemm_kernel, signature, constexprs),
                                  target=GPUTarget(*target), options=options)
        assert compiled.asm.get("cubin" if target[0] == "cuda" else "hsaco")
        if not pdl:
            continue
        # It waits for the kernel before it, then lets the next one launch.
        ptx = compiled.asm["ptx"]
        assert ptx.index("griddepcontrol.wait") < ptx.index("griddepcontrol.launch_dependents")
        assert compiled.metadata.launch_pdl
        # The first weight tile is requested before the wait (it streams while the kernel
        # before drains); nothing is stored before it.
        before_wait = ptx[:ptx.index("griddepcontrol.wait")]
        assert "ld.global" in before_wait and "st.global" not in before_wait
        early_loads[plain, add] = before_wait.count("ld.global")
    if pdl and not norm:   # the add's rows (the residual) are read after the wait
        assert early_loads[True, True] == early_loads[True, False]


def k_loop_conversions(ttgir: str) -> int:
    """Layout conversions inside the kernel's loops (each one a pass through shared memory,
    with barriers, every K step)."""
    return sum(body.count("convert_layout")
               for body in re.findall(r"scf\.for(.*?)scf\.yield", ttgir, re.S))


@pytest.mark.skipif(INTERPRETED, reason="the interpreter does not compile")
@pytest.mark.parametrize("capability", [80, 90, 100, 120], ids=lambda c: f"sm{c}")
def test_verification_rows_compile_for_each_target(capability):
    """A verification step's rows compile for each target in the heaviest form (gate/up
    after the norm prologue with the residual and the norm's weight, keeping the normalised
    rows): at 16 rows on the CUDA cores with no tile converted through shared memory in
    the K loop (the weight's and the rows' tiles are loaded in the product's layout), at 5
    on the tensor cores (padded to 16) to 16-bit MMA instructions; and a float32 weight's
    (a router's) tensor-core form to no TF32 instruction: its products stay fp32."""
    pytest.importorskip("triton")
    from triton_compile import compiled_launches
    cores = next(c for c in candidate_configs(16) if not c.mma)
    mma = next(c for c in candidate_configs(5) if c.mma)
    x16 = torch.zeros(16, 2048 + 64, dtype=torch.bfloat16)     # a partial last K tile
    x5 = x16[:5]
    norm_weight = torch.zeros(x16.shape[1], dtype=torch.bfloat16)
    gate_up = torch.zeros(128, x16.shape[1], dtype=torch.bfloat16)
    with compiled_launches(("cuda", capability, 32)) as launches:
        for x, config in ((x16, cores), (x5, mma)):
            rms_norm_skinny_gemm(x, x, norm_weight, 1e-6, gate_up, None, config, silu_mul=True,
                                 keep_normed=True)
        skinny_gemm(x5, torch.zeros(64, x16.shape[1]), None, mma)
    on_cores, on_mma, router = launches
    assert all(launch.asm.get("cubin") for launch in launches)
    assert on_cores.constexprs["BLOCK_M"] == 16 and not on_cores.constexprs["MMA"]
    assert k_loop_conversions(on_cores.asm["ttgir"]) == 0
    assert on_mma.constexprs["BLOCK_M"] == 16 and on_mma.constexprs["MMA"]
    assert re.search(r"\b(w?gmma|mma)\.[a-z.0-9]*bf16", on_mma.code()), "no bf16 MMA"
    assert "tf32" not in router.code()


# ---------------------------------------------------------------- CPU: the interpreter

if INTERPRETED:   # the rest runs under Triton's interpreter (tests/kernels/conftest.py)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
    @pytest.mark.parametrize("rows", [1, 2, 3, 4])
    @pytest.mark.parametrize("n,k", [(40, 256), (33, 520)])  # K a multiple of the tile, or not
    def test_matches_float64_reference(rows, n, k, dtype):
        for config in candidate_configs(rows)[:2]:
            check_against_float64(rows, n, k, dtype, "cpu", config)

    def test_bias_is_added():
        check_against_float64(3, 24, 96, torch.float16, "cpu", SkinnyConfig(8, 128, 4),
                              with_bias=True)

    def test_every_silu_mul_choice_computes_the_same():
        """cuBLAS then SiLU, the fused epilogue, and the GEMV then SiLU: one function each."""
        x, w, b = operands(2, 80, 520, torch.float16, "cpu", with_bias=True)
        expected = silu_and_mul_reference(F.linear(x, w, b))
        key = candidate_configs(2)[0].key()
        for choice in (CUBLAS, key, UNFUSED + key):
            got = implementation(SILU_MUL, choice)(x, w, b)
            torch.testing.assert_close(got.float(), expected.float(), rtol=2e-3, atol=2e-3)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
    @pytest.mark.parametrize("rows", [1, 3])
    @pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "bias"])
    def test_silu_mul_epilogue_matches_unfused(rows, dtype, with_bias):
        for config in candidate_configs(rows)[:2]:
            check_silu_mul_against_unfused(rows, 40, 520, dtype, "cpu", config, with_bias)


    @pytest.mark.parametrize("rows", [1, 2, 4])
    def test_16_bit_x_with_float32_weight_matches_torch(rows):
        # K 520: the last tile is partial.
        check_16_bit_x_with_float32_weight(rows, 33, 520, torch.bfloat16, "cpu",
                                           candidate_configs(rows)[0])

    def test_16_bit_x_with_float32_weight_silu_mul_and_fp16():
        check_16_bit_x_with_float32_weight(2, 16, 256, torch.float16, "cpu",
                                           candidate_configs(2)[1], silu_mul=True)

    @pytest.mark.parametrize("rows,dtype,with_residual,silu_mul", [
        (1, torch.bfloat16, True, False), (3, torch.float16, True, True),
        (2, torch.float32, False, False)],
        ids=["1-bf16-residual", "3-fp16-residual-silu", "2-fp32-first-layer"])
    def test_norm_prologue_matches_norm_then_gemm(rows, dtype, with_residual, silu_mul):
        # K 520: the last tile is partial, in the pass over K and the normed rows' store.
        check_norm_prologue(rows, 16, 520, dtype, "cpu", SkinnyConfig(8, 256, 4),
                            with_residual, silu_mul)

    @pytest.mark.parametrize("rows,dtype", [(1, torch.bfloat16), (3, torch.float32)], ids=str)
    def test_folded_norm_prologue_and_add_epilogue(rows, dtype):
        check_folded_norm_prologue(rows, 16, 520, dtype, "cpu", SkinnyConfig(8, 256, 4))
        check_add_epilogue(rows, 24, 520, dtype, "cpu", SkinnyConfig(8, 256, 4))

    @pytest.mark.parametrize("rows,mma", [(5, False), (16, False), (9, True)],
                             ids=["5", "16", "9-mma"])
    def test_verification_rows_in_every_form(rows, mma):
        """A verification step's rows (5: padded to 8; 16; 9 on the tensor cores, padded to
        16): the plain GEMV with a bias, gated, the norm prologue keeping the normalised
        rows, the folded norm, the residual add and the widened logits, over two K steps,
        the second partial."""
        config = [c for c in candidate_configs(rows) if c.mma == mma][-1]
        k = config.block_k + 72
        check_against_float64(rows, 12, k, torch.bfloat16, "cpu", config, with_bias=True)
        check_silu_mul_against_unfused(rows, 6, k, torch.float16, "cpu", config)
        check_norm_prologue(rows, 6, k, torch.bfloat16, "cpu", config, True, True)
        check_folded_norm_prologue(rows, 6, k, torch.float32, "cpu", config)
        check_add_epilogue(rows, 6, k, torch.bfloat16, "cpu", config)
        check_widen_epilogue(rows, 6, k, torch.bfloat16, "cpu", config)

    def test_verification_rows_with_a_float32_weight():
        # 9 rows (padded to 16), bf16 x: a float32 weight's runs are 4 values a thread, or
        # its fp32 product on the tensor cores.
        for config in (candidate_configs(9)[3], candidate_configs(9)[-1]):
            check_16_bit_x_with_float32_weight(9, 6, 600, torch.bfloat16, "cpu", config,
                                               silu_mul=True)

    @pytest.mark.parametrize("rows,dtype", [(1, torch.bfloat16), (3, torch.float16)], ids=str)
    def test_widen_epilogue(rows, dtype):
        check_widen_epilogue(rows, 24, 520, dtype, "cpu", SkinnyConfig(8, 256, 4))

    def test_norm_prologue_with_a_float32_weight():
        # DeepSeek's router after the post-attention norm: bf16 x, fp32 weight, fp32 out.
        check_norm_prologue(1, 24, 520, torch.bfloat16, "cpu", SkinnyConfig(4, 256, 4),
                            True, False, weight_dtype=torch.float32)


# ------------------------------------------------------------------ GPU: real shapes

REAL_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096),
               (4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)]


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", REAL_SHAPES, ids=[f"{n}x{k}" for n, k in REAL_SHAPES])
def test_gpu_real_shapes_every_candidate(n, k, rows):
    for config in candidate_configs(rows):
        check_against_float64(rows, n, k, torch.bfloat16, "cuda", config)


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [5, 8, 9, 16])
def test_gpu_verification_rows_llama_8b_shapes(rows):
    """A batch-1 verification step's rows (4, 7, 8 and 15 drafts; 5 and 9 run padded in
    the graphs of 8 and 16) at Llama-3-8B's shapes, every candidate: QKV and down against
    float64, gate/up with the SiLU epilogue, QKV after the norm prologue (with the residual)
    and O with the residual add in its epilogue."""
    for config in candidate_configs(rows):
        check_against_float64(rows, 6144, 4096, torch.bfloat16, "cuda", config)
        check_against_float64(rows, 4096, 14336, torch.bfloat16, "cuda", config)
        check_silu_mul_against_unfused(rows, 14336, 4096, torch.bfloat16, "cuda", config)
        check_norm_prologue(rows, 6144, 4096, torch.bfloat16, "cuda", config, True, False)
        check_add_epilogue(rows, 4096, 4096, torch.bfloat16, "cuda", config)


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_gpu_deepseek_router_shape_bf16_x_float32_weight(rows):
    """DeepSeek-V2-Lite's router (64 experts x 2048), bf16 x with its float32 weight."""
    for config in candidate_configs(rows):
        check_16_bit_x_with_float32_weight(rows, 64, 2048, torch.bfloat16, "cuda", config)


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_tune_times_the_router_as_it_runs_and_the_call_finds_it(tmp_path):
    """27 float32 router weights in a bf16 model: tuned with bf16 x (the kernel agrees with
    cuBLAS on x.float()), keyed as the bf16 call looks it up, the norm prologue timed too
    where the GEMV won; a decode graph with the kernel forced gives the fp32 logits of
    x.float()."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    weights = [torch.randn(64, 2048, device=dev) * 0.02 for _ in range(27)]
    routine = SkinnyGemmRoutine()
    report = routine.tune({(LINEAR, 64, 2048, torch.float32): weights}, [1, 2],
                          str(tmp_path / "decode_gemms.json"), torch.bfloat16)
    x = torch.randn(1, 2048, device=dev, dtype=torch.bfloat16)
    timing = report.timings[_key(LINEAR, x, weights[0])]
    assert timing.cublas_us > 0 and timing.triton_us, timing
    assert "disagrees" not in timing.note and "norm prologue" not in timing.note
    if timing.chosen != CUBLAS:
        assert timing.norm_fused_us > 0 and timing.norm_separate_us > 0, timing

    routine.choices[_key(LINEAR, x, weights[0])] = candidate_configs(1)[0].key()
    out = torch.empty(1, 64, device=dev)
    with decode_graph_scope():
        routine(x, weights[0])     # compiles the kernel before the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out.copy_(routine(x, weights[0]))
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        expected = F.linear(x.float(), weights[0])
        scale = expected.abs().max().item()
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-5 * scale)


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", [(14336, 4096), (3072, 1024)], ids=["8b", "0.6b"])
def test_gpu_silu_mul_epilogue_real_shapes(n, k, rows):
    for config in candidate_configs(rows):
        check_silu_mul_against_unfused(rows, n, k, torch.bfloat16, "cuda", config)


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 4])
def test_gpu_widen_epilogue_lm_head_shape(rows):
    # Qwen3-30B-A3B's LM head: 151936 x 2048.
    for config in candidate_configs(rows)[:2]:
        check_widen_epilogue(rows, 151936, 2048, torch.bfloat16, "cuda", config)


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_bias_fp16_and_uneven_k():
    check_against_float64(4, 1000, 1000, torch.float16, "cuda", SkinnyConfig(8, 128, 4),
                          with_bias=True)
    check_against_float64(1, 1000, 4100, torch.bfloat16, "cuda", SkinnyConfig(4, 512, 4),
                          with_bias=True)


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_pdl_chain_in_a_graph_matches_without(monkeypatch):
    """PDL (the default on SM90+): a decode-like chain (norm prologue + gate/up, down, a torch add, the
    next layer's norm prologue reading that add) captured in a CUDA graph and replayed gives
    the results of the same chain launched without PDL; each kernel reads what the one
    before it wrote, so a missing wait would show."""
    from archserve.kernels.pdl import PDL_ENV, pdl_enabled

    torch.manual_seed(0)
    dev = torch.device("cuda")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs SM90+")
    hidden, inter = 1024, 3072
    w_gate_up = torch.randn(2 * inter, hidden, device=dev, dtype=torch.bfloat16) * 0.02
    w_down = torch.randn(hidden, inter, device=dev, dtype=torch.bfloat16) * 0.02
    norm_w = torch.rand(hidden, device=dev, dtype=torch.bfloat16) + 0.5
    config_gu, config_down = candidate_configs(1)[0], candidate_configs(1)[1]
    x = torch.randn(1, hidden, device=dev, dtype=torch.bfloat16)
    residual = torch.randn(1, hidden, device=dev, dtype=torch.bfloat16)

    def chain() -> torch.Tensor:
        h, r = x, residual
        for _ in range(4):
            act, r = rms_norm_skinny_gemm(h, r, norm_w, 1e-6, w_gate_up, None, config_gu,
                                          silu_mul=True)
            h = skinny_gemm(act, w_down, None, config_down) * 0.5 + 0.1
        return torch.cat([h, r])

    monkeypatch.setenv(PDL_ENV, "0")
    expected = chain()
    monkeypatch.setenv(PDL_ENV, "1")
    assert pdl_enabled(dev)
    eager = chain()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(eager, expected, atol=0, rtol=0)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_tune_chooses_per_shape_caches_and_replays_in_a_graph(tmp_path):
    """Tuning times both ways on real weights, a second tune reads the cache, and a graph
    captured in the decode scope replays the chosen kernels with cuBLAS's results."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    groups = {(kind, n, k, torch.bfloat16): [
        torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(4)]
        for kind, n, k in [(LINEAR, 6144, 4096), (SILU_MUL, 2048, 2048)]}
    path = str(tmp_path / "decode_gemms.json")
    routine = SkinnyGemmRoutine()
    report = routine.tune(groups, [1, 2, 16], path)
    assert not report.from_cache and len(report.timings) == 6
    for key, timing in report.timings.items():
        assert timing.cublas_us > 0 and timing.triton_us, (key, timing)
        if timing.chosen != CUBLAS:
            assert timing.triton_us[timing.chosen] < timing.cublas_us
            # the norm's two forms were timed, and the prologue runs only where it won
            assert timing.norm_fused_us > 0 and timing.norm_separate_us > 0, (key, timing)
            assert timing.fuse_norm == \
                (timing.norm_fused_us < timing.norm_separate_us * (1 - MIN_GAIN))
            assert (key in routine.norm_choices) == timing.fuse_norm
            if timing.fuse_norm:   # the prologue's own fastest tile, among the timed ones
                assert routine.norm_choices[key] == timing.norm_choice in timing.triton_us
        if key.startswith(SILU_MUL):    # the plain product of the gate/up weight
            unfused = [us for c, us in timing.triton_us.items() if c.startswith(UNFUSED)]
            plain = LINEAR + key.removeprefix(SILU_MUL)
            assert (plain in routine.choices) == \
                (min(unfused) < timing.cublas_us * (1 - MIN_GAIN)), (key, timing)
    again = SkinnyGemmRoutine().tune(groups, [1, 2], path)
    assert again.from_cache and len(again.timings) == 4
    assert {k: t.chosen for k, t in again.timings.items()} == \
        {k: report.timings[k].chosen for k in again.timings}

    # Force the kernel for one shape so the graph path is exercised whatever was chosen.
    routine.choices[shape_key(LINEAR, 1, 6144, 4096, torch.bfloat16)] = \
        candidate_configs(1)[0].key()
    weight = groups[(LINEAR, 6144, 4096, torch.bfloat16)][0]
    gate_up = groups[(SILU_MUL, 2048, 2048, torch.bfloat16)][0]
    x = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
    h = torch.randn(1, 2048, device=dev, dtype=torch.bfloat16)
    static_out = torch.empty(1, 6144, device=dev, dtype=torch.bfloat16)
    static_act = torch.empty(1, 1024, device=dev, dtype=torch.bfloat16)
    for silu_choice in (candidate_configs(1)[1].key(), UNFUSED + candidate_configs(1)[0].key()):
        routine.choices[shape_key(SILU_MUL, 1, 2048, 2048, torch.bfloat16)] = silu_choice
        with decode_graph_scope():
            routine(x, weight)  # eager warm-up inside the scope compiles the kernels
            routine.linear_silu_mul(h, gate_up)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out.copy_(routine(x, weight))
                static_act.copy_(routine.linear_silu_mul(h, gate_up))
        for _ in range(3):
            x.copy_(torch.randn_like(x))
            h.copy_(torch.randn_like(h))
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(static_out.float(), F.linear(x, weight).float(),
                                       rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(static_act.float(),
                                       silu_and_mul_reference(F.linear(h, gate_up)).float(),
                                       rtol=2e-2, atol=2e-2)


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("n,k,silu_mul", [(4096, 1024, False), (3072, 1024, True),
                                          (6144, 4096, False), (14336, 4096, True)],
                         ids=["0.6b-qkv", "0.6b-gate-up", "8b-qkv", "8b-gate-up"])
def test_gpu_norm_prologue_real_shapes(n, k, silu_mul, rows):
    for config in candidate_configs(rows):
        check_norm_prologue(rows, n, k, torch.bfloat16, "cuda", config, True, silu_mul)
    check_norm_prologue(rows, n, k, torch.bfloat16, "cuda", candidate_configs(rows)[0],
                        False, silu_mul)


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n,k,weight_dtype", [(128, 2048, torch.bfloat16),
                                              (64, 2048, torch.float32),
                                              (3072, 2048, torch.bfloat16)],
                         ids=["qwen3-30b-router", "v2-lite-router-fp32", "v2-lite-q-proj"])
def test_gpu_norm_prologue_router_and_mla_shapes(n, k, weight_dtype):
    """The MoE routers' and MLA's first projection's norm prologue, which also keeps the
    normalised rows (the experts' and kv_a's input)."""
    for config in candidate_configs(1):
        check_norm_prologue(1, n, k, torch.bfloat16, "cuda", config, True, False,
                            weight_dtype=weight_dtype)


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("n,k", [(5120, 2048), (2048, 4096), (128, 2048)],
                         ids=["qwen3-30b-qkv", "qwen3-30b-o", "qwen3-30b-router"])
def test_gpu_folded_norm_prologue_and_add_epilogue(n, k, rows):
    """The folded norm's prologue (the QKV and router after a folded norm) and the residual
    add in the epilogue (o_proj), at every candidate config."""
    for config in candidate_configs(rows):
        check_folded_norm_prologue(rows, n, k, torch.bfloat16, "cuda", config)
        check_add_epilogue(rows, n, k, torch.bfloat16, "cuda", config)


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_routine_fuses_the_norm_only_where_it_chose_the_kernel(monkeypatch):
    """rms_norm_linear: the fused kernel for a shape tuned to Triton (inside the graph
    scope), None for a cuBLAS shape or outside the scope (the caller then runs the norm);
    the prologue runs at its own timed choice, not the GEMV's."""
    from archserve.kernels.linear import skinny_choice
    ran = []

    def spy(kind, choice):
        ran.append(choice)
        return norm_prologue(kind, choice)
    norm_prologue = skinny_choice.norm_prologue
    monkeypatch.setattr(skinny_choice, "norm_prologue", spy)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    x = torch.randn(1, 1024, device=dev, dtype=dtype)
    residual = torch.randn_like(x)
    norm_weight = torch.rand(1024, device=dev, dtype=dtype) + 0.5
    w_triton = torch.randn(4096, 1024, device=dev, dtype=dtype) * 0.03
    w_cublas = torch.randn(2048, 1024, device=dev, dtype=dtype) * 0.03
    routine = SkinnyGemmRoutine()
    routine.norm_form = RESIDUAL     # timed with a residual and the norm's weight
    config = candidate_configs(1)[0]
    routine.choices[shape_key(LINEAR, 1, 4096, 1024, dtype)] = config.key()
    routine.choices[shape_key(LINEAR, 1, 2048, 1024, dtype)] = CUBLAS
    assert routine.rms_norm_linear(x, residual, norm_weight, 1e-6, w_triton) is None
    with decode_graph_scope():
        assert routine.rms_norm_linear(x, residual, norm_weight, 1e-6, w_cublas) is None
        # a Triton shape whose prologue timed slower than the norm kernel declines too
        assert routine.rms_norm_linear(x, residual, norm_weight, 1e-6, w_triton) is None
        prologue_config = candidate_configs(1)[-1]
        assert prologue_config != config
        routine.norm_choices[shape_key(LINEAR, 1, 4096, 1024, dtype)] = prologue_config.key()
        # timed in the folded form (x alone), it declines a call that brings more rows
        routine.norm_form = FOLDED
        assert routine.rms_norm_linear(x, residual, None, 1e-6, w_triton) is None
        assert routine.rms_norm_linear(x, None, None, 1e-6, w_triton) is not None
        routine.norm_form = RESIDUAL
        y, new_residual = routine.rms_norm_linear(x, residual, norm_weight, 1e-6, w_triton)
    assert ran == [prologue_config.key()] * 2
    normed, expected_residual = rms_norm_reference(x, norm_weight, 1e-6, residual)
    assert torch.equal(new_residual, expected_residual)
    torch.testing.assert_close(y, skinny_gemm(normed, w_triton, None, config), rtol=3e-2,
                               atol=3e-2 * y.abs().max().item())
