"""``apply_rms_norm_linear``: where the norm before a GEMM runs in the GEMM's kernel (the
linear routine's ``rms_norm_linear``) and where it runs on its own first (the routine
declines, or the norm is one its prologue does not compute: Gemma's offset weight)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from archserve.kernels.linear.torch_linear import torch_linear
from archserve.models.layers import linear as linear_layers
from archserve.models.layers.moe import Router
from archserve.models.layers.norm import GemmaRMSNorm, RMSNorm


class RecordingRoutine:
    """torch_linear, with an ``rms_norm_linear`` that records its calls and returns
    ``fused_result`` (None: it declines)."""

    def __init__(self, fused_result):
        self.calls = []
        self.fused_result = fused_result

    def __call__(self, x, weight, bias=None):
        return torch_linear(x, weight, bias)

    def rms_norm_linear(self, x, residual, norm_weight, eps, weight, bias, silu_mul,
                        keep_normed):
        self.calls.append((norm_weight, eps, silu_mul, keep_normed))
        return self.fused_result


@pytest.fixture
def operands():
    gen = torch.Generator().manual_seed(0)
    x, residual = torch.randn(2, 16, generator=gen), torch.randn(2, 16, generator=gen)
    return x, residual, torch.randn(8, 16, generator=gen)


@pytest.fixture(autouse=True)
def fusion_on(monkeypatch):
    """The fusion as on a GPU (there the fused kernels' route is Triton); the norm modules
    still run their torch reference here. The linear routine is restored after."""
    monkeypatch.setattr(linear_layers, "fusion_enabled", lambda name, device: True)
    yield
    linear_layers.set_linear_routine(None)


def test_a_plain_norm_runs_in_the_routines_kernel(operands):
    x, residual, weight = operands
    norm = RMSNorm(16, 1e-5)
    marker = (torch.zeros(1), torch.zeros(1), torch.zeros(1))
    routine = RecordingRoutine(marker)
    linear_layers.set_linear_routine(routine)
    out = linear_layers.apply_rms_norm_linear(x, residual, norm, weight, keep_normed=True)
    assert out is marker
    assert routine.calls == [(norm.weight, 1e-5, False, True)]


@pytest.mark.parametrize("norm", [GemmaRMSNorm(16, 1e-5), RMSNorm(16, 1e-5)],
                         ids=["gemma-offset-weight", "declined"])
def test_otherwise_the_norm_runs_first(operands, norm):
    """Gemma's norm never reaches the routine; a plain one it declines (None) falls back.
    Either way: the norm module's own output, then the GEMM, and the normalised rows."""
    x, residual, weight = operands
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    routine = RecordingRoutine(None)
    linear_layers.set_linear_routine(routine)
    y, new_residual, normed = linear_layers.apply_rms_norm_linear(
        x, residual, norm, weight, keep_normed=True)
    expected_normed, expected_residual = norm(x, residual)
    assert torch.equal(normed, expected_normed) and torch.equal(new_residual, expected_residual)
    assert torch.equal(y, F.linear(expected_normed, weight))
    assert routine.calls == ([] if isinstance(norm, GemmaRMSNorm) else [(norm.weight, 1e-5,
                                                                         False, True)])


def test_a_router_after_a_gemma_norm_gives_its_logits_residual_and_rows(operands):
    x, residual, weight = operands
    norm = GemmaRMSNorm(16, 1e-5)
    router = Router(8, 16)
    with torch.no_grad():
        router.weight.copy_(weight)
        norm.weight.uniform_(-0.5, 0.5)
    routine = RecordingRoutine((torch.zeros(1),) * 3)
    linear_layers.set_linear_routine(routine)
    logits, new_residual, normed = router.forward_after_norm(x, residual, norm)
    expected_normed, expected_residual = norm(x, residual)
    assert routine.calls == []
    assert torch.equal(normed, expected_normed) and torch.equal(new_residual, expected_residual)
    assert torch.equal(logits, F.linear(expected_normed, weight))
