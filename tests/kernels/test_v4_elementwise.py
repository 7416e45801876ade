"""DeepSeek V4's elementwise kernels against their torch references: the hyper-connections
(before a block: the logits split over programs for a few tokens, one matmul for a prompt;
after a block; the final head) and the per-head RMSNorm + interleaved rope (weighted,
unweighted, none, and back), through the dispatch's forced Triton route.

On CPU the kernels run under Triton's interpreter in a child process (tiny sizes: 3 streams
of 48, 5 heads of 48 with 16 rope channels); they compile for SM80, SM90, SM100 and SM120 at
V4's sizes (4 streams of 4096, 64 heads of 512); on a GPU the gpu-marked test runs them at
V4's sizes in bf16.
"""

from __future__ import annotations

import pytest
import torch

from archserve.kernels.elementwise import (
    forced_fused_route,
    hyper_connection_head,
    hyper_connection_post,
    hyper_connection_pre,
    norm_rope_interleaved,
)
from archserve.kernels.rules import triton_interpreted

INTERPRETED = triton_interpreted()
INTERPRETER_TIMEOUT_S = 600
TARGETS = {"sm80": ("cuda", 80, 32), "sm90": ("cuda", 90, 32), "sm100": ("cuda", 100, 32),
           "sm120": ("cuda", 120, 32)}


def hc_case(tokens: int, n: int, hidden: int, dtype: torch.dtype, device: str = "cpu",
            seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    m = (2 + n) * n

    def randn(*shape, std=1.0, to=dtype):
        return (torch.randn(*shape, generator=gen) * std).to(to).to(device)

    return dict(x=randn(tokens, n, hidden), fn=randn(m, n * hidden, std=0.05, to=torch.float32),
                base=randn(m, std=0.5, to=torch.float32),
                scale=1 + randn(3, std=0.2, to=torch.float32),
                norm=1 + randn(hidden, std=0.1))


def run_both(fn, *args, **kwargs):
    """(the torch route's result, the Triton route's)."""
    with forced_fused_route("torch"):
        expected = fn(*args, **kwargs)
    with forced_fused_route("triton"):
        actual = fn(*args, **kwargs)
    return expected, actual


def assert_close(actual, expected, dtype):
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a.float(), e.float(), atol=tol, rtol=tol)


def check_hyper_connections(tokens: int, n: int, hidden: int, dtype: torch.dtype,
                            device: str = "cpu") -> None:
    c = hc_case(tokens, n, hidden, dtype, device)
    args = (c["x"], c["fn"], c["base"], c["scale"], 1e-6, 1e-6, 5, c["norm"], 1e-6)
    expected, actual = run_both(hyper_connection_pre, *args)
    assert_close(actual, expected, dtype)
    out = c["x"][:, 0] * 0.5
    post, comb = expected[1], expected[2]
    expected, actual = run_both(hyper_connection_post, c["x"], out, post, comb)
    assert_close([actual], [expected], dtype)
    head = (c["x"], c["fn"][:n], c["base"][:n], c["scale"][:1], 1e-6, 1e-6, c["norm"], 1e-6)
    expected, actual = run_both(hyper_connection_head, *head)
    assert_close([actual], [expected], dtype)


def check_norm_rope(tokens: int, heads: int, dim: int, rope: int, dtype: torch.dtype,
                    device: str = "cpu") -> None:
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(tokens, heads, dim, generator=gen) * 3).to(dtype).to(device)
    positions = torch.randint(0, 100000, (tokens,), generator=gen).to(device)
    inv_freq = (1.0 / 160000.0 ** (torch.arange(0, rope, 2) / rope)).to(device)
    weight = (1 + torch.randn(dim, generator=gen) * 0.1).to(dtype).to(device)
    for kwargs in (dict(eps=1e-6), dict(), dict(inverse=True)):
        expected, actual = run_both(norm_rope_interleaved, x, positions, inv_freq, **kwargs)
        assert_close([actual], [expected], dtype)
    # A [T, D] row with the layer's norm weight (V4's key), from a strided view.
    wide = x.reshape(tokens, heads * dim)
    expected, actual = run_both(norm_rope_interleaved, wide[:, :dim], positions, inv_freq,
                                weight, 1e-6)
    assert_close([actual], [expected], dtype)


if INTERPRETED:   # the rest runs under Triton's interpreter (tests/kernels/conftest.py)

    @pytest.mark.parametrize("tokens", [1, 3, 20])     # split logits; one matmul past 16
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_hyper_connections_match_reference(tokens, dtype):
        check_hyper_connections(tokens, 3, 48, dtype)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_norm_rope_matches_reference(dtype):
        check_norm_rope(7, 5, 48, 16, dtype)


@pytest.mark.skipif(INTERPRETED, reason="the interpreter does not compile")
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_v4_elementwise_kernels_compile(target):
    pytest.importorskip("triton")
    from triton_compile import compiled_launches
    c = hc_case(2, 4, 4096, torch.bfloat16)
    with compiled_launches(TARGETS[target]) as launches, forced_fused_route("triton"):
        _, post, comb = hyper_connection_pre(c["x"], c["fn"], c["base"], c["scale"], 1e-6,
                                             1e-6, 20, c["norm"], 1e-6)
        hyper_connection_post(c["x"], c["x"][:, 0], post, comb)
        x = torch.randn(2, 64, 512, dtype=torch.bfloat16)
        norm_rope_interleaved(x, torch.arange(2), torch.ones(32), eps=1e-6)
    assert [launch.kernel for launch in launches] == [
        "_hc_partial_kernel", "_hc_finalize_kernel", "_hc_post_kernel", "_norm_rope_kernel"]
    assert all(launch.code() for launch in launches)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 300])
def test_gpu_v4_elementwise_at_v4_sizes(tokens):
    check_hyper_connections(tokens, 4, 4096, torch.bfloat16, "cuda")
    check_norm_rope(tokens, 64, 512, 64, torch.bfloat16, "cuda")
