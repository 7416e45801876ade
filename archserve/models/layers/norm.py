"""RMSNorm with fp32 statistics and an optional fused residual add.

The arithmetic lives in archserve.kernels.elementwise (a fused Triton kernel on GPUs,
the torch reference elsewhere); this module holds the weight and the layer API.
"""

from __future__ import annotations

import torch
from torch import nn

from archserve.kernels.elementwise import rms_norm


class RMSNorm(nn.Module):
    identity_weight = 1.0   # the weight value that leaves a normalised row unchanged
    foldable = True         # fold_into can move the weight into the GEMMs that read the output

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.folded = False     # the weight is ones, multiplied into its readers' matrices
        # The weight before folding (float32), for what reads the normalised row after load
        # and must absorb it too: a LoRA adapter's down-projection (engine/lora/).
        self.folded_weight: torch.Tensor | None = None

    @torch.no_grad()
    def fold_into(self, matrices: list[torch.Tensor]) -> None:
        """Multiply this norm's weight g into ``matrices`` (each [..., width]: every matrix
        that reads the normalised row, along its last dimension), then make g ones:
        W (g * n) = (W diag g) n, so each reader gets the same product from the plain
        normalised row n, and a GEMM with the norm in its prologue reads no weight
        (``folded``). Products in fp32, rounded to the matrix's dtype: so a 16-bit model
        rounds W g where the unfolded one rounds n g, and its outputs differ from the
        unfolded ones by about that rounding. A few thousand rows at a time (a stacked
        [E, N, K] tensor one expert at a time), so the fp32 copies stay small."""
        g = self.folded_weight = self.weight.float().clone()
        for matrix in matrices:
            for part in (matrix if matrix.dim() > 2 else (matrix,)):
                for rows in part.split(4096):
                    rows.copy_(rows.float() * g)
        self.weight.fill_(1.0)
        self.folded = True

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (normed, new_residual); with ``residual``, normalise x + residual.

        The new residual is the un-normalised input (x itself when no residual was given),
        which is what the next block adds its output to: a decoder layer can write
        ``h, residual = norm(h, residual)`` for both its first and later layers.
        """
        return rms_norm(x, self.weight, self.eps, residual)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the row is scaled by (1 + weight), in fp32, so a zero weight is
    the identity (checkpoints store the offset from one)."""

    identity_weight = 0.0
    foldable = False        # (1 + weight): not folded, its rows stay as Gemma computes them

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        with torch.no_grad():
            self.weight.zero_()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(x, self.weight, self.eps, residual, unit_offset=True)
