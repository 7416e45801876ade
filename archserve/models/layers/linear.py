"""Dense linear layers, and the fused forms that merge several checkpoint matrices into one.

Every dense layer computes through ``apply_linear``, a module-level routine: a selected
linear backend installs its GEMM with ``set_linear_routine`` and every model picks it up
without knowing the backend. A quantized layer carries its own ``quant`` state instead
(archserve.quant.linear_state attaches it after the model is built): it owns the layer's
checkpoint tensors, repacks them after loading and runs the selected quantized kernel.
Fusing q/k/v (and gate/up) at load time turns three (two) GEMM launches per layer into one.

A layer serving LoRA adapters holds their slots in ``lora`` (engine/lora/ attaches them):
every forward path ends in ``add_lora``, the one hook through which the step's adapters add
their delta to the layer's output. Fused forms that cannot take the delta where they fuse
(an activation in the GEMM's epilogue) run unfused while the step carries adapters; the
gated activation then runs in the LoRA kernel where its backend can (``add_lora_silu_mul``).

Loaders talk to every linear layer through one protocol: ``shard_rows`` (the output rows
of each checkpoint matrix the layer fuses), ``checkpoint_params`` / ``shard_shape`` (what
the checkpoint must hold) and ``load_shard`` (copy one checkpoint tensor in).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from archserve.kernels.elementwise import fusion_enabled, silu_and_mul
from archserve.kernels.linear.torch_linear import torch_linear
from archserve.models.layers.forward_context import current_forward_context, op_region
from archserve.models.layers.norm import RMSNorm

LinearRoutine = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]

_routine: LinearRoutine = torch_linear
# While set (a quantized model is being built), dense weights are allocated on "meta":
# the quantizer gives each layer its checkpoint tensors instead, so a model that fits the
# device only quantized is never materialised dense first.
_defer_weights = False


def linear_weights_deferred() -> bool:
    """Whether the model being built is quantized (its weights come from the quantizer)."""
    return _defer_weights


@contextlib.contextmanager
def deferred_linear_weights() -> Iterator[None]:
    global _defer_weights
    previous, _defer_weights = _defer_weights, True
    try:
        yield
    finally:
        _defer_weights = previous


class LinearQuantState(Protocol):
    """What a quantized layer's ``quant`` provides (archserve.quant.linear_state)."""

    def checkpoint_params(self) -> list[str]: ...
    def optional(self, param: str) -> bool: ...
    def shard_shape(self, shard: int, param: str) -> tuple[int, ...]: ...
    def load_shard(self, shard: int, param: str, tensor: torch.Tensor) -> None: ...
    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...


def set_linear_routine(routine: LinearRoutine | None) -> None:
    """Install the GEMM every ``Linear`` uses; None restores ``torch_linear``."""
    global _routine
    _routine = routine if routine is not None else torch_linear


def apply_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """x W^T (+ b), x in the model dtype; a float32 weight (DeepSeek's router) gives float32
    (archserve.kernels.linear.torch_linear)."""
    return _routine(x, weight, bias)


def apply_linear_float(x: torch.Tensor, weight: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """``apply_linear(x, weight).float()``: the product rounded to x's dtype, as float32
    (an LM head's logits). A routine that can widen in its GEMM's epilogue provides
    ``linear_float``, which writes into ``out`` (float32 [rows, N]) where it can: a CUDA
    graph's output buffer, sparing the conversion and the copy. The result is ``out``
    only then; callers check."""
    fused = getattr(_routine, "linear_float", None)
    if fused is not None and fusion_enabled("lm_head_float", x.device):
        y = fused(x, weight, out)
        if y is not None:
            return y
    return _routine(x, weight, None).float()


def apply_linear_silu_mul(x: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up of x times a gate-then-up weight [2I, K] -> [.., I].

    A routine that can fuse the activation into its GEMM provides ``linear_silu_mul``;
    otherwise this is the GEMM, then the SiLU kernel.
    """
    fused = getattr(_routine, "linear_silu_mul", None)
    if fused is not None:
        return fused(x, weight, bias)
    return silu_and_mul(_routine(x, weight, bias))


def apply_linear_add(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     add: torch.Tensor) -> torch.Tensor | None:
    """x W^T (+ b) + ``add`` with the add in the GEMM's epilogue, where the routine can
    (``linear_add``) and the fusion ``fold_norm_weights`` is on; None otherwise."""
    fused = getattr(_routine, "linear_add", None)
    if fused is None or not fusion_enabled("fold_norm_weights", x.device):
        return None
    return fused(x, weight, bias, add)


def apply_linear_lora(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      add: torch.Tensor | None, lora_epilogue: Callable[[], Any]
                      ) -> torch.Tensor | None:
    """x W^T (+ b) (+ ``add``) plus each token's adapter delta added in the GEMM's epilogue
    (``lora_epilogue`` launches the adapters' shrink first and returns what the epilogue
    reads), where the routine can (``linear_lora``; with ``add``, as ``apply_linear_add``,
    while the fusion ``fold_norm_weights`` is on); None, launching nothing, otherwise."""
    fused = getattr(_routine, "linear_lora", None)
    if fused is None or (add is not None
                         and not fusion_enabled("fold_norm_weights", x.device)):
        return None
    return fused(x, weight, bias, add, lora_epilogue)


def add_in_last_gemm(linear: Linear, x: torch.Tensor, residual: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The (output, residual) pair a decoder block returns from its last GEMM: (linear(x)
    + residual, None) with the add in the GEMM where it can (``Linear.forward_add``), else
    (linear(x), residual); the norm after the block adds what is left (norm_folding.py)."""
    if residual is not None:
        out = linear.forward_add(x, residual)
        if out is not None:
            return out, None
    return linear(x), residual


def _norm_prologue_routine(x: torch.Tensor, norm: RMSNorm) -> Callable | None:
    """The routine's ``rms_norm_linear`` where it can compute ``norm`` in its prologue
    (fusion ``rms_norm_gemm`` on, not Gemma's offset weight), else None."""
    fused = getattr(_routine, "rms_norm_linear", None)
    if (fused is not None and norm.identity_weight == RMSNorm.identity_weight
            and fusion_enabled("rms_norm_gemm", x.device)):
        return fused
    return None


def apply_rms_norm_linear_lora(x: torch.Tensor, residual: torch.Tensor | None,
                               norm: RMSNorm, weight: torch.Tensor, bias: torch.Tensor | None,
                               silu_mul: bool, keep_normed: bool,
                               lora_epilogue: Callable[[Any], Any]
                               ) -> tuple[torch.Tensor, ...] | None:
    """``apply_rms_norm_linear`` with each token's adapter delta added in the GEMM's
    epilogue (to gate and up before the activation with ``silu_mul``), where the routine
    takes the norm in its prologue; ``lora_epilogue(shrink_norm)`` launches the adapters'
    shrink of the normalised input first. None, launching nothing, otherwise."""
    from archserve.kernels.lora.interface import ShrinkNorm
    fused = _norm_prologue_routine(x, norm)
    if fused is None:
        return None
    norm_weight = None if norm.folded else norm.weight
    shrink_norm = ShrinkNorm(residual, norm_weight, norm.eps)
    return fused(x, residual, norm_weight, norm.eps, weight, bias, silu_mul, keep_normed,
                 lambda: lora_epilogue(shrink_norm))


def apply_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                          weight: torch.Tensor, bias: torch.Tensor | None = None,
                          silu_mul: bool = False, keep_normed: bool = False
                          ) -> tuple[torch.Tensor, ...]:
    """(the GEMM, or with ``silu_mul`` the gated activation, of norm(x, residual)'s output;
    the new residual; with ``keep_normed`` that normalised output too, for the layer's
    other readers of it). A routine that can fuse the norm into its GEMM provides
    ``rms_norm_linear`` (fusion ``rms_norm_gemm``); otherwise, where it declines the shape,
    or for a norm its prologue does not compute (Gemma's weight offset from one), this is
    the norm's kernel, then the GEMM."""
    fused = _norm_prologue_routine(x, norm)
    if fused is not None:
        out = fused(x, residual, None if norm.folded else norm.weight, norm.eps, weight, bias,
                    silu_mul, keep_normed)
        if out is not None:
            return out
    normed, new_residual = norm(x, residual)
    if silu_mul:
        y = apply_linear_silu_mul(normed, weight, bias)
    else:
        y = apply_linear(normed, weight, bias)
    return (y, new_residual, normed) if keep_normed else (y, new_residual)


class WeightOnly(nn.Module):
    """One [rows, cols] weight, no bias, uninitialised on purpose (a loader fills it): the
    storage of modules that are not ``Linear`` (embeddings, MoE routers)."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols, dtype=dtype), requires_grad=False)


class DenseMatrix(WeightOnly):
    """A matrix its layer reads itself instead of multiplying through a linear kernel (MLA
    absorbs kv_b_proj into q and the output), so it is always in the model dtype: online
    quantization leaves it alone, and a checkpoint that quantizes it is dequantized at load
    (archserve.quant.checkpoint_matrix).

    ``split_rows`` (first, whole): a tensor-parallel rank holds rows [first, first + rows)
    of the checkpoint's ``whole`` (MLA's per-head rows); it answers the loader with the
    whole shape and keeps its rows, as the vocabulary-parallel layers do."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype | None = None,
                 split_rows: tuple[int, int] | None = None) -> None:
        super().__init__(rows, cols, dtype)
        self.split_rows = split_rows

    def checkpoint_shape(self, param: str) -> tuple[int, ...]:
        rows = self.split_rows[1] if self.split_rows else self.weight.shape[0]
        return (rows, self.weight.shape[1])

    @torch.no_grad()
    def load_checkpoint(self, param: str, tensor: torch.Tensor) -> None:
        first = self.split_rows[0] if self.split_rows else 0
        self.weight.copy_(tensor.narrow(0, first, self.weight.shape[0]))


class Linear(nn.Module):
    """y = x W^T + b with W stored [out_features, in_features] like a checkpoint."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        # Uninitialised on purpose: a loader (real or dummy) always fills it.
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, device="meta" if _defer_weights else None),
            requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features), requires_grad=False)
                     if bias else None)
        self.quant: Any = None          # a LinearQuantState when the layer is quantized
        self.lora: Any = None           # LoRASlots (kernels/lora) when it serves adapters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.add_lora(x, self.quant(x, self.bias))
        fused = self.lora_in_epilogue(x, None)
        if fused is not None:
            return fused
        return self.add_lora(x, apply_linear(x, self.weight, self.bias))

    def takes_lora(self) -> bool:
        """Whether this forward's tokens may take adapters here (slots, and a step that
        carries adapters)."""
        if self.lora is None:
            return False
        ctx = current_forward_context()
        return ctx is not None and ctx.lora_mapping is not None

    def add_lora(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The hook: y (this layer's output of x) plus the delta of each token's adapter,
        added in place; y itself where the step carries none."""
        if self.takes_lora():
            ctx = current_forward_context()
            with op_region("lora"):
                ctx.lora_impl.add_lora(y, x, self.lora, ctx.lora_mapping)
        return y

    def lora_shrink(self, x: torch.Tensor) -> Callable[..., Any] | None:
        """(norm=None) -> the LoRA backend's ``expand_epilogue`` of x for this layer: the
        shrink launched, then what the base GEMM's epilogue reads to add the step's deltas
        (no expand launch); None where the step carries no adapters or the backend has no
        such form."""
        if not self.takes_lora():
            return None
        ctx = current_forward_context()
        shrink = getattr(ctx.lora_impl, "expand_epilogue", None)
        if shrink is None:
            return None

        def shrunk(norm=None):  # noqa: ANN001, ANN202 - a ShrinkNorm; the operands or None
            with op_region("lora"):
                return shrink(x, self.lora, ctx.lora_mapping, norm)
        return shrunk

    def lora_in_epilogue(self, x: torch.Tensor, add: torch.Tensor | None
                         ) -> torch.Tensor | None:
        """self(x) (+ ``add``) with the step's adapter deltas added in the GEMM's epilogue
        (``lora_shrink``), or None, launching nothing, where the backend or the routine
        cannot."""
        shrunk = self.lora_shrink(x)
        return None if shrunk is None else apply_linear_lora(x, self.weight, self.bias, add,
                                                             shrunk)

    def lora_after_norm_in_epilogue(self, x: torch.Tensor, residual: torch.Tensor | None,
                                    norm: RMSNorm, silu_mul: bool = False,
                                    keep_normed: bool = False
                                    ) -> tuple[torch.Tensor, ...] | None:
        """``apply_rms_norm_linear`` of this layer with the step's adapter deltas in the
        GEMM's epilogue, the shrink normalising its input itself; None, launching nothing,
        where the backend or the routine cannot."""
        shrunk = self.lora_shrink(x)
        if shrunk is None:
            return None
        return apply_rms_norm_linear_lora(x, residual, norm, self.weight, self.bias, silu_mul,
                                          keep_normed, shrunk)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor | None:
        """self(x) + residual with the add in the GEMM's epilogue (``apply_linear_add``),
        or None where it cannot: quantized, or the routine declines."""
        if self.quant is not None:
            return None
        fused = self.lora_in_epilogue(x, residual)
        if fused is not None:
            return fused
        out = apply_linear_add(x, self.weight, self.bias, residual)
        return None if out is None else self.add_lora(x, out)

    def forward_after_norm(self, x: torch.Tensor, residual: torch.Tensor | None,
                           norm: RMSNorm, keep_normed: bool = False
                           ) -> tuple[torch.Tensor, ...]:
        """(this layer of norm(x, residual)'s output, the new residual, and with
        ``keep_normed`` that output), the norm fused into the GEMM where the routine can
        (``apply_rms_norm_linear``)."""
        if self.quant is not None:
            hidden, residual = norm(x, residual)
            return (self(hidden), residual) + ((hidden,) if keep_normed else ())
        if not self.takes_lora():
            return apply_rms_norm_linear(x, residual, norm, self.weight, self.bias,
                                         keep_normed=keep_normed)
        fused = self.lora_after_norm_in_epilogue(x, residual, norm, keep_normed=keep_normed)
        if fused is not None:
            return fused
        y, residual, normed = apply_rms_norm_linear(x, residual, norm, self.weight,
                                                    self.bias, keep_normed=True)
        y = self.add_lora(normed, y)
        return (y, residual, normed) if keep_normed else (y, residual)

    # ---- the loader protocol ------------------------------------------------------------
    @property
    def shard_names(self) -> list[str | None]:
        return [None]

    def shard_rows(self) -> list[int]:
        return [self.out_features]

    def checkpoint_params(self) -> list[str]:
        """The tensor names (``weight``, ``bias``, ``weight_scale``...) one shard stores."""
        names = self.quant.checkpoint_params() if self.quant is not None else ["weight"]
        return names + (["bias"] if self.bias is not None else [])

    def shard_shape(self, shard: str | None, param: str) -> tuple[int, ...]:
        """The shape the checkpoint stores (a tensor-parallel layer holds a part of it)."""
        return self.local_shard_shape(shard, param)

    def local_shard_shape(self, shard: str | None, param: str) -> tuple[int, ...]:
        """The shape of what this layer holds of one checkpoint tensor."""
        rows = self.shard_rows()[self.shard_names.index(shard)]
        if param == "bias":
            return (rows,)
        if self.quant is not None:
            return self.quant.shard_shape(self.shard_names.index(shard), param)
        return (rows, self.in_features)

    def _row_slice(self, shard: str | None) -> slice:
        i = self.shard_names.index(shard)
        start = sum(self.shard_rows()[:i])
        return slice(start, start + self.shard_rows()[i])

    def load_shard(self, shard: str | None, param: str, tensor: torch.Tensor) -> None:
        """Copy one checkpoint tensor (of one fused shard) into the layer."""
        if param != "bias" and self.quant is not None:
            self.quant.load_shard(self.shard_names.index(shard), param, tensor)
            return
        target = getattr(self, param, None)
        expected = self.local_shard_shape(shard, param)
        if target is None or tuple(tensor.shape) != expected:
            got = "a tensor" if target is None else f"shape {tuple(tensor.shape)}"
            raise ValueError(f"{shard or 'linear'} {param}: expected shape {expected}, got {got}")
        with torch.no_grad():
            target[self._row_slice(shard)].copy_(tensor)


class MergedLinear(Linear):
    """Several linears sharing one input, stored as row blocks of one weight.

    ``shard_names`` name the blocks in checkpoint order (e.g. q, k, v) so a loader can
    copy each checkpoint matrix into its block with ``load_shard``.
    """

    def __init__(self, in_features: int, output_sizes: Sequence[int], shard_names: Sequence[str],
                 bias: bool = False) -> None:
        if len(output_sizes) != len(shard_names):
            raise ValueError("output_sizes and shard_names differ in length")
        super().__init__(in_features, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)
        self._shard_names = list(shard_names)

    @property
    def shard_names(self) -> list[str | None]:
        return list(self._shard_names)

    def shard_rows(self) -> list[int]:
        return list(self.output_sizes)

    def split(self, y: torch.Tensor) -> list[torch.Tensor]:
        """Split a merged output [.., sum(sizes)] into the per-shard outputs."""
        return list(y.split(self.output_sizes, dim=-1))


class QKVLinear(MergedLinear):
    def __init__(self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False) -> None:
        super().__init__(hidden_size,
                         [num_heads * head_size, num_kv_heads * head_size,
                          num_kv_heads * head_size],
                         ["q", "k", "v"], bias)


class GateUpLinear(MergedLinear):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__(hidden_size, [intermediate_size, intermediate_size], ["gate", "up"], bias)

    def forward_silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up [.., intermediate_size]: the gated MLP's activation, fused into
        the GEMM where the routine can (not while adapters add to gate and up first: then
        into the LoRA kernel where it can, ``silu_mul_with_lora``)."""
        if self.quant is not None:
            return self.silu_mul_with_lora(x, self.quant(x, self.bias))
        if self.takes_lora():
            return self.silu_mul_with_lora(x, apply_linear(x, self.weight, self.bias))
        return apply_linear_silu_mul(x, self.weight, self.bias)

    def silu_mul_with_lora(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of y (this layer's output of x) after each token's adapter adds
        its delta to gate and up: the activation in the LoRA kernel where the backend
        provides ``add_lora_silu_mul`` and it applies, else the delta added in place, then
        the SiLU kernel."""
        if self.takes_lora():
            ctx = current_forward_context()
            fused = getattr(ctx.lora_impl, "add_lora_silu_mul", None)
            with op_region("lora"):
                out = None if fused is None else fused(y, x, self.lora, ctx.lora_mapping)
            if out is not None:
                return out
        return silu_and_mul(self.add_lora(x, y))

    def forward_silu_mul_after_norm(self, x: torch.Tensor, residual: torch.Tensor | None,
                                    norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward_silu_mul`` of norm(x, residual)'s output, and the new residual."""
        if self.quant is not None:
            hidden, residual = norm(x, residual)
            return self.forward_silu_mul(hidden), residual
        if self.takes_lora():
            fused = self.lora_after_norm_in_epilogue(x, residual, norm, silu_mul=True)
            if fused is not None:
                return fused
            y, residual, normed = apply_rms_norm_linear(x, residual, norm, self.weight,
                                                        self.bias, keep_normed=True)
            return self.silu_mul_with_lora(normed, y), residual
        return apply_rms_norm_linear(x, residual, norm, self.weight, self.bias, silu_mul=True)
