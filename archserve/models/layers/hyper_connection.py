"""DeepSeek V4's manifold-constrained hyper-connections: the residual stream as ``hc_mult``
streams, collapsed into each block's input and mixed with its output (the arithmetic:
kernels/elementwise/hyper_connection_reference.py). The weights are fp32, as transformers
keeps them (``_keep_in_fp32_modules_strict``)."""

from __future__ import annotations

import torch
from torch import nn

from archserve.kernels.elementwise import (
    hyper_connection_head,
    hyper_connection_post,
    hyper_connection_pre,
)
from archserve.models.layers.norm import RMSNorm


def _fp32(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=torch.float32), requires_grad=False)


class HyperConnection(nn.Module):
    """One block's mixing: ``fn`` [(2 + n) n, n H], ``base`` [(2 + n) n], ``scale`` [3]
    (pre, post, comb)."""

    def __init__(self, hidden_size: int, hc_mult: int, sinkhorn_iters: int, hc_eps: float,
                 norm_eps: float) -> None:
        super().__init__()
        n = hc_mult
        self.fn = _fp32((2 + n) * n, n * hidden_size)
        self.base = _fp32((2 + n) * n)
        self.scale = _fp32(3)
        self.sinkhorn_iters, self.hc_eps, self.norm_eps = sinkhorn_iters, hc_eps, norm_eps

    def pre(self, streams: torch.Tensor, norm: RMSNorm
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, n, H] -> (the block's input: their collapse through ``norm`` [T, H],
        post [T, n], comb [T, n, n])."""
        return hyper_connection_pre(streams, self.fn, self.base, self.scale, self.norm_eps,
                                    self.hc_eps, self.sinkhorn_iters, norm.weight, norm.eps)

    @staticmethod
    def post(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor,
             comb: torch.Tensor) -> torch.Tensor:
        """The streams after the block whose output is ``out`` [T, H]."""
        return hyper_connection_post(streams, out, post, comb)


class HyperHead(nn.Module):
    """The final collapse of the streams before the model's last norm."""

    def __init__(self, hidden_size: int, hc_mult: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_fn = _fp32(hc_mult, hc_mult * hidden_size)
        self.hc_base = _fp32(hc_mult)
        self.hc_scale = _fp32(1)
        self.hc_eps, self.norm_eps = hc_eps, norm_eps

    def forward(self, streams: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """The streams' collapse through the model's last ``norm``: [T, H]."""
        return hyper_connection_head(streams, self.hc_fn, self.hc_base, self.hc_scale,
                                     self.norm_eps, self.hc_eps, norm.weight, norm.eps)
