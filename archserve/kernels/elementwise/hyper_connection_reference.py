"""Manifold-constrained hyper-connections (DeepSeek V4) in plain PyTorch: the oracle of the
Triton kernels and the CPU path.

The residual stream is ``n`` streams [T, n, H]. Before a block, a one-layer perceptron of the
flattened, RMS-normalised streams gives per token three sets of weights:

- pre [n]: sigmoid + eps, collapses the streams into the block's input (sum of pre_i x_i);
- post [n]: 2 sigmoid, spreads the block's output back over the streams;
- comb [n, n]: softmax rows + eps, made (nearly) doubly stochastic by Sinkhorn-Knopp
  iterations, mixes the streams: stream i after the block is post_i * out + sum_j comb[j, i]
  x_j (comb transposed: its rows sum the inputs).

The weights are fp32; the streams and the block's output stay in the model dtype.
"""

from __future__ import annotations

import torch


def hc_mixes(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """The perceptron's logits [T, m]: fn [m, n H] (fp32) times the RMS-normalised flattened
    streams x [T, n, H], in fp32."""
    flat = x.reshape(x.shape[0], -1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return flat @ fn.float().t()


def hc_weights(mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int,
               hc_eps: float, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre [T, n], post [T, n], comb [T, n, n]) fp32 from the logits [T, (2 + n) n]."""
    base, scale = base.float(), scale.float()
    pre = torch.sigmoid(mixes[:, :n] * scale[0] + base[:n]) + hc_eps
    post = 2 * torch.sigmoid(mixes[:, n:2 * n] * scale[1] + base[n:2 * n])
    comb = mixes[:, 2 * n:].view(-1, n, n) * scale[2] + base[2 * n:].view(n, n)
    comb = torch.softmax(comb, dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """sum_i pre_i x_i [T, H] in x's dtype (the products and the sum in fp32)."""
    return (pre[..., None] * x.float()).sum(dim=1).to(x.dtype)


def hc_pre_reference(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor,
                     scale: torch.Tensor, norm_eps: float, hc_eps: float, iters: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the block's input [T, H] in x's dtype, post [T, n], comb [T, n, n] fp32)."""
    n = x.shape[1]
    pre, post, comb = hc_weights(hc_mixes(x, fn, norm_eps), base, scale, n, hc_eps, iters)
    return hc_collapse(x, pre), post, comb


def hc_post_reference(x: torch.Tensor, out: torch.Tensor, post: torch.Tensor,
                      comb: torch.Tensor) -> torch.Tensor:
    """The streams after a block [T, n, H]: post_i * out + sum_j comb[j, i] x_j, with the
    weights rounded to x's dtype first and the products in it, as transformers does."""
    dtype = x.dtype
    return (post.to(dtype)[..., None] * out[:, None, :]
            + torch.matmul(comb.to(dtype).transpose(-1, -2), x))


def hc_head_reference(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor,
                      scale: torch.Tensor, norm_eps: float, hc_eps: float) -> torch.Tensor:
    """The final collapse of the streams [T, n, H] -> [T, H]: pre weights alone (fn [n, nH],
    base [n], one scale)."""
    mixes = hc_mixes(x, fn, norm_eps)
    pre = torch.sigmoid(mixes * scale.float() + base.float()) + hc_eps
    return hc_collapse(x, pre)
