"""The Triton skinny GEMM (decode-sized rows) against a float64 reference, and the routine
that chooses it per shape against cuBLAS.

On CPU the kernel runs under Triton's interpreter in a child process (as the other
Triton test files do); on a GPU the ``gpu``-marked tests run it compiled at the real
shapes of Llama-3-8B and Qwen3-0.6B, inside a CUDA graph, and tune a routine on them.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from archserve.kernels.elementwise.reference import rms_norm_reference, silu_and_mul_reference
from archserve.kernels.linear.skinny_choice import (
    CUBLAS,
    LINEAR,
    MIN_GAIN,
    SILU_MUL,
    UNFUSED,
    ShapeTiming,
    SkinnyGemmRoutine,
    decode_graph_scope,
    implementation,
    shape_key,
)
from archserve.kernels.linear.triton_skinny_gemm import (
    MAX_ROWS,
    SkinnyConfig,
    candidate_configs,
    rms_norm_skinny_gemm,
    skinny_gemm,
    skinny_gemm_unsupported,
)
from archserve.kernels.rules import triton_interpreted

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # tests/ (triton_interpreter)
INTERPRETED = triton_interpreted()
HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu


ULP = {torch.float32: 2.0 ** -20, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def operands(rows: int, n: int, k: int, dtype: torch.dtype, device: str, with_bias: bool):
    torch.manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) / k ** 0.5).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if with_bias else None
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
                        config: SkinnyConfig, with_residual: bool, silu_mul: bool) -> None:
    """The norm in the GEMM's prologue against rms_norm's kernel-free reference, then the
    same GEMM: the normalised row rounds as the reference rounds it, so the products
    differ only where the two fp32 sums of squares round 1/rms apart (a unit or two)."""
    x, w, b = operands(rows, 2 * n if silu_mul else n, k, dtype, device, with_bias=True)
    gen = torch.Generator().manual_seed(rows + k)
    residual = torch.randn(rows, k, generator=gen).to(device, dtype) if with_residual else None
    norm_weight = (1 + 0.2 * torch.randn(k, generator=gen)).to(device, dtype)
    normed, expected_residual = rms_norm_reference(x, norm_weight, 1e-6, residual)
    expected = skinny_gemm(normed, w, b, config, silu_mul=silu_mul)
    got, new_residual = rms_norm_skinny_gemm(x, residual, norm_weight, 1e-6, w, b, config,
                                             silu_mul=silu_mul)
    assert got.dtype == dtype and got.shape == expected.shape
    assert torch.equal(new_residual, expected_residual), "one rounded add: exact"
    scale = expected.double().abs().max().item()
    assert (got.double() - expected.double()).abs().max().item() <= \
        4 * ULP[dtype] * scale + 1e-5 * scale


# ------------------------------------------------------------------- anywhere (no kernel)

def test_configs_fit_the_accumulator_and_round_trip_their_keys():
    for rows in range(1, MAX_ROWS + 1):
        configs = candidate_configs(rows)
        assert configs, rows
        block_m = 1 << (rows - 1).bit_length()
        for c in configs:
            assert c.block_n * c.block_k * block_m <= 8192
            assert SkinnyConfig.from_key(c.key()) == c


def test_unsupported_operands_are_named():
    w = torch.zeros(64, 32)
    assert skinny_gemm_unsupported(torch.zeros(1, 32), w, None) is None
    assert "9 rows" in skinny_gemm_unsupported(torch.zeros(9, 32), w, None)
    assert "operands" in skinny_gemm_unsupported(torch.zeros(1, 16), w, None)
    assert "bfloat16" in skinny_gemm_unsupported(torch.zeros(1, 32, dtype=torch.bfloat16), w, None)
    assert "bias" in skinny_gemm_unsupported(torch.zeros(1, 32), w, torch.zeros(3))
    assert "contiguous" in skinny_gemm_unsupported(torch.zeros(32, 2).T, w, None)


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


def test_tune_reads_a_complete_cache_without_timing(tmp_path):
    """A second start finds every shape in the cache and times nothing (CPU weights here
    would fail any timing, which needs CUDA)."""
    groups = {(LINEAR, 8, 16, torch.float32): [torch.randn(8, 16)] * 3,
              (SILU_MUL, 16, 8, torch.float32): [torch.randn(16, 8)]}
    path = tmp_path / "decode_gemms.json"
    shapes = {shape_key(kind, r, n, k, torch.float32): ShapeTiming(
        cublas_us=5.0, triton_us={"n4_k512_w4": 3.0}, rows=r, calls=len(groups[kind, n, k, dt]),
        chosen="n4_k512_w4" if n == 8 else CUBLAS, fuse_norm=n == 8 and r == 1)
        for r in (1, 2) for (kind, n, k, dt) in groups}
    path.write_text(json.dumps({"version": 4, "shapes": {k: vars(v) for k, v in shapes.items()}}))
    routine = SkinnyGemmRoutine()
    report = routine.tune(groups, [1, 2, 16], str(path))   # 16 rows: beyond the kernel
    assert report.from_cache and len(report.timings) == 4
    assert routine.choices[shape_key(LINEAR, 1, 8, 16, torch.float32)] == "n4_k512_w4"
    assert routine.choices[shape_key(SILU_MUL, 2, 16, 8, torch.float32)] == CUBLAS
    assert routine.fuse_norm == {shape_key(LINEAR, 1, 8, 16, torch.float32)}
    summary = report.summary()
    assert "Triton GEMV for 2 of 4" in summary and "cached" in summary
    assert "prologue for 1 of 2" in summary
    assert "0.006 ms at 1" in summary   # 3 layers x 2 µs


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
@pytest.mark.parametrize("target", [("cuda", 80, 32), ("cuda", 90, 32), ("cuda", 70, 32),
                                    ("hip", "gfx942", 64)], ids=["sm80", "sm90", "sm70", "gfx942"])
@pytest.mark.parametrize("block_m", [1, 4])
def test_kernel_compiles_for_gpu_targets(target, block_m):
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from archserve.kernels.linear.triton_skinny_gemm import _skinny_gemm_kernel
    act = "*fp16" if target[1] == 70 else "*bf16"
    signature = {"x_ptr": act, "w_ptr": act, "b_ptr": act, "y_ptr": act, "M": "i32", "N": "i32",
                 "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32",
                 "r_ptr": act, "norm_w_ptr": act, "new_r_ptr": act, "eps": "fp32",
                 **dict.fromkeys(["HAS_BIAS", "GATED", "BLOCK_M", "BLOCK_N", "BLOCK_K", "EVEN_K",
                                  "NORM", "HAS_RESIDUAL", "PDL"], "constexpr")}
    # block_m 4 also compiles the norm prologue (with a residual); block_m 1 without it.
    # SM90 compiles the programmatic-dependent-launch form (kernels/pdl.py).
    pdl = target[:2] == ("cuda", 90)
    constexprs = {"HAS_BIAS": True, "GATED": True, "BLOCK_M": block_m, "BLOCK_N": 4,
                  "BLOCK_K": 256, "EVEN_K": False, "NORM": block_m > 1,
                  "HAS_RESIDUAL": block_m > 1, "PDL": pdl}
    options = {"num_warps": 4, **({"launch_pdl": True} if pdl else {})}
    compiled = triton.compile(ASTSource(_skinny_gemm_kernel, signature, constexprs),
                              target=GPUTarget(*target), options=options)
    assert compiled.asm.get("cubin" if target[0] == "cuda" else "hsaco")
    if pdl:    # it waits for the kernel before it, then lets the next one launch
        ptx = compiled.asm["ptx"]
        assert ptx.index("griddepcontrol.wait") < ptx.index("griddepcontrol.launch_dependents")
        assert compiled.metadata.launch_pdl
        # The first weight tile is requested before the wait (it streams while the kernel
        # before drains); nothing is stored before it.
        before_wait = ptx[:ptx.index("griddepcontrol.wait")]
        assert "ld.global" in before_wait and "st.global" not in before_wait


# ---------------------------------------------------------------- CPU: the interpreter

if not INTERPRETED:

    @pytest.mark.skipif(HAS_CUDA, reason="on a GPU the compiled kernel is tested at real sizes")
    def test_skinny_gemm_under_interpreter():
        from triton_interpreter import assert_passes_under_interpreter
        assert_passes_under_interpreter(__file__, timeout=900)

else:

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


    @pytest.mark.parametrize("rows,dtype,with_residual,silu_mul", [
        (1, torch.bfloat16, True, False), (3, torch.float16, True, True),
        (2, torch.float32, False, False)],
        ids=["1-bf16-residual", "3-fp16-residual-silu", "2-fp32-first-layer"])
    def test_norm_prologue_matches_norm_then_gemm(rows, dtype, with_residual, silu_mul):
        # K 520: the last tile is partial, in both passes over K.
        check_norm_prologue(rows, 16, 520, dtype, "cpu", SkinnyConfig(8, 256, 4),
                            with_residual, silu_mul)


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
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", [(14336, 4096), (3072, 1024)], ids=["8b", "0.6b"])
def test_gpu_silu_mul_epilogue_real_shapes(n, k, rows):
    for config in candidate_configs(rows):
        check_silu_mul_against_unfused(rows, n, k, torch.bfloat16, "cuda", config)


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
    assert not report.from_cache and len(report.timings) == 4
    for key, timing in report.timings.items():
        assert timing.cublas_us > 0 and timing.triton_us, (key, timing)
        if timing.chosen != CUBLAS:
            assert timing.triton_us[timing.chosen] < timing.cublas_us
            # the norm's two forms were timed, and the prologue runs only where it won
            assert timing.norm_fused_us > 0 and timing.norm_separate_us > 0, (key, timing)
            assert timing.fuse_norm == \
                (timing.norm_fused_us < timing.norm_separate_us * (1 - MIN_GAIN))
            assert (key in routine.fuse_norm) == timing.fuse_norm
    again = SkinnyGemmRoutine().tune(groups, [1, 2], path)
    assert again.from_cache
    assert {k: t.chosen for k, t in again.timings.items()} == \
        {k: t.chosen for k, t in report.timings.items()}

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
def test_gpu_routine_fuses_the_norm_only_where_it_chose_the_kernel():
    """rms_norm_linear: the fused kernel for a shape tuned to Triton (inside the graph
    scope), None for a cuBLAS shape or outside the scope (the caller then runs the norm)."""
    dev, dtype = torch.device("cuda"), torch.bfloat16
    x = torch.randn(1, 1024, device=dev, dtype=dtype)
    residual = torch.randn_like(x)
    norm_weight = torch.rand(1024, device=dev, dtype=dtype) + 0.5
    w_triton = torch.randn(4096, 1024, device=dev, dtype=dtype) * 0.03
    w_cublas = torch.randn(2048, 1024, device=dev, dtype=dtype) * 0.03
    routine = SkinnyGemmRoutine()
    config = candidate_configs(1)[0]
    routine.choices[shape_key(LINEAR, 1, 4096, 1024, dtype)] = config.key()
    routine.choices[shape_key(LINEAR, 1, 2048, 1024, dtype)] = CUBLAS
    assert routine.rms_norm_linear(x, residual, norm_weight, 1e-6, w_triton) is None
    with decode_graph_scope():
        assert routine.rms_norm_linear(x, residual, norm_weight, 1e-6, w_cublas) is None
        # a Triton shape whose prologue timed slower than the norm kernel declines too
        assert routine.rms_norm_linear(x, residual, norm_weight, 1e-6, w_triton) is None
        routine.fuse_norm.add(shape_key(LINEAR, 1, 4096, 1024, dtype))
        y, new_residual = routine.rms_norm_linear(x, residual, norm_weight, 1e-6, w_triton)
    normed, expected_residual = rms_norm_reference(x, norm_weight, 1e-6, residual)
    assert torch.equal(new_residual, expected_residual)
    torch.testing.assert_close(y, skinny_gemm(normed, w_triton, None, config), rtol=3e-2,
                               atol=3e-2 * y.abs().max().item())
