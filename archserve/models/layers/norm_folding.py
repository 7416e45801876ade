"""Fold each decoder layer's RMSNorm weights into the GEMMs that read the norm's output.

At batch 1 a decode step's GEMVs read every weight once, and the norm before them is a
kernel of its own, or runs in the first GEMV's prologue (kernels/linear/
triton_skinny_gemm.py). In the prologue every program of the GEMV reads the whole input
row; with the residual and the norm's weight that is three rows, and on a wide GEMV (a
QKV's 1,280+ programs) those reads cost more than the norm kernel they replace. Two
changes leave the prologue one row, the one the GEMV reads anyway:

- the norm's weight g goes into its readers' matrices at load (``RMSNorm.fold_into``):
  W (g * n) = (W diag g) n, so the prologue scales by 1/rms only;
- a block's last GEMM (o_proj, down_proj) or MoE kernel adds the block's input back
  (``add_in_last_gemm``, ``FusedMoE.forward_add``), so the norm after it receives one
  row, the residual stream, instead of an output and a residual.

A norm is folded only where every reader of its output is a 16/32-bit matrix the layer
multiplies (``input_matrices``): a quantized reader, a norm with Gemma's (1 + weight), or
a block that reads its input another way keeps its norm as it is.
``ARCHSERVE_DISABLE_FUSIONS=fold_norm_weights`` turns both changes off.
"""

from __future__ import annotations

import torch
from torch import nn

from archserve.kernels.elementwise.dispatch import fusion_not_disabled

FUSION = "fold_norm_weights"
# What a reader's matrix may be to absorb a norm's weight: 16- and 32-bit floats (an fp8
# weight would need its scales recomputed).
FOLDABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def float_matrices(*modules: nn.Module | None) -> list[torch.Tensor] | None:
    """The weights of ``modules`` (those that are not None) as ``RMSNorm.fold_into`` takes
    them, or None where one cannot absorb a scale: quantized, not a 16/32-bit float, or not
    materialised."""
    matrices = []
    for module in modules:
        if module is None:
            continue
        weight = getattr(module, "weight", None)
        if (getattr(module, "quant", None) is not None or weight is None
                or weight.dtype not in FOLDABLE_DTYPES or weight.is_meta):
            return None
        matrices.append(weight)
    return matrices


def fold_norm_weights(model: nn.Module) -> int:
    """Fold every foldable (norm, block) pair of ``model``'s decoder layers; the number of
    norms folded. A layer names its pairs in ``norms_and_readers``; a block names the
    matrices that read its input in ``input_matrices`` (None: it cannot be folded)."""
    if not fusion_not_disabled(FUSION):
        return 0
    folded = 0
    for layer in model.modules():
        pairs = getattr(layer, "norms_and_readers", None)
        if pairs is None:
            continue
        for norm, block in pairs():
            reader = getattr(block, "input_matrices", None)
            matrices = reader() if reader is not None else None
            if (not getattr(norm, "foldable", False) or norm.folded or not matrices
                    or any(m.shape[-1] != norm.weight.shape[0] for m in matrices)):
                continue
            norm.fold_into(matrices)
            folded += 1
    return folded
