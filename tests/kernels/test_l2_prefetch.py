"""The L2 prefetch of the output projection's weight during attention (kernels/l2_prefetch.py)."""

from __future__ import annotations

import pytest
import torch

from archserve.kernels import l2_prefetch
from archserve.kernels.pdl import triton_interpreted
from archserve.models.layers.linear import PREFETCH_MAX_ROWS, prefetch_weight_during_attention
from archserve.models.layers.parallel_linear import RowParallelLinear


def test_nothing_runs_where_the_bulk_prefetch_does_not_exist():
    """CPU tensors (and the interpreter, ROCm, pre-SM90 GPUs): no launch, 0 bytes asked."""
    assert not l2_prefetch.l2_prefetch_supported(torch.device("cpu"))
    assert l2_prefetch.prefetch_into_l2(torch.ones(64, 64)) == 0
    prefetch_weight_during_attention(RowParallelLinear(64, 64), 1)   # a no-op on CPU


@pytest.mark.skipif(triton_interpreted(), reason="the interpreter does not compile")
def test_the_kernel_asks_for_every_piece_after_the_wait(monkeypatch):
    """Compiled for SM90 as the wrapper launches it: one bulk L2 prefetch per lane, after
    PDL's wait (asking before it would share DRAM with the GEMV still streaming), no loads
    or stores; one program per PIECES x PIECE bytes, capped at the byte limit."""
    from triton_compile import compiled_launches

    monkeypatch.setattr(l2_prefetch, "l2_prefetch_supported", lambda device: True)
    monkeypatch.setattr(l2_prefetch, "pdl_enabled", lambda device: True)
    monkeypatch.setattr(l2_prefetch, "l2_bytes", lambda device: 1 << 20)
    weight = torch.zeros(1024, 1024, dtype=torch.bfloat16)          # 2 MiB
    with compiled_launches(("cuda", 90, 32)) as launches:
        asked = l2_prefetch.prefetch_into_l2(weight)
        assert l2_prefetch.prefetch_into_l2(weight, max_bytes=100) == 96     # whole 16 B
        assert l2_prefetch.prefetch_into_l2(weight.t()) == 0          # not contiguous
        assert l2_prefetch.prefetch_into_l2(weight.view(-1)[1:]) == 0  # unaligned
    assert asked == 1 << 19                                           # half the L2
    assert [launch.kernel for launch in launches] == ["_l2_prefetch_kernel"] * 2
    ptx = launches[0].code()
    wait = ptx.index("griddepcontrol.wait")
    assert wait < ptx.index("griddepcontrol.launch_dependents") < ptx.index(
        "cp.async.bulk.prefetch.L2.global")
    assert ptx.count("cp.async.bulk.prefetch.L2.global") == 1   # one lane, one piece
    assert "ld.global" not in ptx and "st.global" not in ptx


def test_only_decode_batches_prefetch(monkeypatch):
    """The output projection's weight is asked for at PREFETCH_MAX_ROWS rows or fewer, and
    only while the fusion is enabled."""
    asked = []
    monkeypatch.setattr(l2_prefetch, "prefetch_into_l2", asked.append)
    enabled = {"l2_prefetch_o_proj"}
    monkeypatch.setattr("archserve.models.layers.linear.fusion_enabled",
                        lambda name, device: name in enabled)
    linear = RowParallelLinear(64, 64)
    prefetch_weight_during_attention(linear, PREFETCH_MAX_ROWS)
    prefetch_weight_during_attention(linear, PREFETCH_MAX_ROWS + 1)
    assert len(asked) == 1 and asked[0] is linear.weight
    enabled.clear()
    prefetch_weight_during_attention(linear, 1)
    assert len(asked) == 1


@pytest.mark.gpu
def test_gpu_prefetch_runs_and_changes_nothing():
    """On the GPU: the launch asks for the bytes it says (half the L2 at most) and the
    tensor and a GEMM that reads it after are unchanged."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the bulk L2 prefetch is SM90's")
    weight = torch.randn(4096, 2048, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(1, 2048, dtype=torch.bfloat16, device="cuda")
    before = weight.clone()
    expected = x @ weight.t()
    asked = l2_prefetch.prefetch_into_l2(weight)
    torch.cuda.synchronize()
    whole = weight.numel() * 2
    assert asked == min(whole, l2_prefetch.l2_bytes(weight.device) // 2)
    assert torch.equal(weight, before)
    assert torch.equal(x @ weight.t(), expected)
