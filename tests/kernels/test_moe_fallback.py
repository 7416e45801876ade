"""TORCH_MOE against a dense reference (every expert on every token, masked by the routing)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from archserve.kernels.catalog import select_moe_backend
from archserve.kernels.moe.torch_moe import TorchMoEImpl, route
from archserve.kernels.specs import MoESpec
from archserve.platform import get_profile


def dense_reference(hidden, router_logits, w13, w2, top_k, renormalize):
    weights, experts = route(router_logits, top_k, renormalize)
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    for e in range(w13.shape[0]):
        gate, up = F.linear(hidden.float(), w13[e].float()).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e].float())
        weight = (weights * (experts == e)).sum(dim=-1, keepdim=True)
        out += weight * y
    return out


@pytest.mark.parametrize("tokens, experts, top_k, renormalize", [
    (1, 4, 2, True), (13, 8, 2, False), (64, 16, 4, True), (5, 8, 8, True),
])
def test_torch_moe_matches_dense_reference(tokens, experts, top_k, renormalize):
    gen = torch.Generator().manual_seed(tokens * 31 + experts)
    hidden_size, inter = 32, 48
    hidden = torch.randn(tokens, hidden_size, generator=gen)
    logits = torch.randn(tokens, experts, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden_size, generator=gen) * 0.1
    w2 = torch.randn(experts, hidden_size, inter, generator=gen) * 0.1
    got = TorchMoEImpl().forward(hidden, logits, w13, w2, top_k, renormalize)
    torch.testing.assert_close(got, dense_reference(hidden, logits, w13, w2, top_k,
                                                    renormalize), atol=1e-5, rtol=1e-5)


def test_the_selected_fallback_builds_a_working_impl():
    sel = select_moe_backend(get_profile("cpu"), MoESpec(dtype=torch.float32))
    assert sel.name == "TORCH_MOE"
    impl = sel.backend.make_impl(get_profile("cpu"), MoESpec())
    out = impl.forward(torch.ones(2, 4), torch.zeros(2, 2), torch.ones(2, 6, 4),
                       torch.ones(2, 4, 3), top_k=1)
    assert out.shape == (2, 4) and torch.isfinite(out).all()
