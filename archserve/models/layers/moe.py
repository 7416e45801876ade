"""Mixture-of-experts layers: the router, the experts of one layer, the sparse MLP block.

The experts of a layer live in two stacked tensors, the layout every MoE kernel reads:
``w13`` [E, 2I, H] (each expert's gate rows, then its up rows) and ``w2`` [E, H, I]. The
checkpoint stores one matrix per expert and projection (``experts.3.gate_proj.weight``
or Mixtral's ``experts.3.w1.weight``); each is registered as a parameter that is a view
into the stacked tensor, so the loaders (safetensors, dummy) fill the kernel layout by
copying into checkpoint-named parameters, with no repacking pass and no second copy.

The layer computes through the ``moe`` backend the registry selects for its device and
dtype (ARCHSERVE_MOE_BACKEND overrides it); it never names a backend itself.

Quantized experts (archserve.quant.expert_state attaches them before loading): the
stacked tensors are never allocated dense; each expert's matrices hold the checkpoint's
own tensors until the loader repacks them into ``quantized`` (kernels/moe/
quantized_experts.py), which the selected backend then ``prepare``s once.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from archserve.distributed.layout import split_evenly
from archserve.distributed.parallel_state import get_tp
from archserve.kernels.moe.expert_activation import (
    DEFAULT_ACTIVATION,
    SILU_CLAMPED,
    ExpertBiases,
    GatedActivation,
)
from archserve.models.layers import linear as _linear
from archserve.models.layers.linear import WeightOnly
from archserve.models.layers.norm import RMSNorm
from archserve.models.layers.norm_folding import float_matrices
from archserve.models.layers.parallel_linear import GateUpParallelLinear, RowParallelLinear
from archserve.platform.detect import device_info_for

# (gate, up, down) names of one expert's matrices in the two checkpoint conventions.
HF_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERT_NAMES = ("w1", "w3", "w2")


class Router(WeightOnly):
    """logits = x W^T (+ b: gpt-oss's router has a bias) in the model dtype, as transformers
    computes them. Not a ``Linear``:
    a quantized checkpoint never quantizes the router (vLLM builds it with
    quant_config=None), and online quantization must not either. Its GEMM goes through
    the linear routine all the same (the decode tuner times it as any other shape: on an
    H200, cuBLAS took 5 µs for Qwen3-30B-A3B's 128 x 2048 router at batch 1, 48 times a
    step)."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype | None = None,
                 bias: bool = False) -> None:
        super().__init__(rows, cols, dtype)
        self.bias = (nn.Parameter(torch.empty(rows, dtype=dtype), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear.apply_linear(x, self.weight, self.bias)

    def forward_after_norm(self, x: torch.Tensor, residual: torch.Tensor | None,
                           norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the logits of norm(x, residual)'s output, the new residual, that output: the
        experts' input), the norm fused into the router's GEMM where the routine can."""
        return _linear.apply_rms_norm_linear(x, residual, norm, self.weight, self.bias,
                                             keep_normed=True)


class _Matrix(nn.Module):
    """One expert matrix: a view into the stacked weights. Under tensor parallelism it holds
    ``length`` of the checkpoint's intermediate channels from ``first`` on: rows of gate and
    up (``split_dim`` 0), columns of down (1). It answers the loader with the checkpoint's
    whole shape and keeps its part, as the vocabulary-parallel layers do."""

    def __init__(self, view: torch.Tensor, split_dim: int, first: int, whole: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(view, requires_grad=False)
        self.split_dim, self.first, self.whole = split_dim, first, whole

    def checkpoint_shape(self, param: str) -> tuple[int, ...]:
        shape = list(self.weight.shape)
        shape[self.split_dim] = self.whole
        return tuple(shape)

    @torch.no_grad()
    def load_checkpoint(self, param: str, tensor: torch.Tensor) -> None:
        length = self.weight.shape[self.split_dim]
        self.weight.copy_(tensor.narrow(self.split_dim, self.first, length))


class _Expert(nn.Module):
    """One expert's checkpoint matrices, each a view into the layer's stacked weights."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                 names: tuple[str, str, str], first: int, whole: int) -> None:
        super().__init__()
        for name, view, dim in zip(names, (gate, up, down), (0, 0, 1), strict=True):
            self.add_module(name, _Matrix(view, dim, first, whole))


class FusedMoE(nn.Module):
    """The routed experts of one layer: hidden [T, H] and router logits [T, E] -> [T, H].

    Tensor parallelism splits every expert's intermediate channels evenly over the ranks
    (each rank holds all experts, gate/up rows and down columns of its channels): each rank
    routes the same tokens to the same experts, computes a partial sum, and the ranks
    all-reduce it. ``intermediate_size`` is this rank's part.

    ``num_shared_experts`` S: always-on experts of the same width, stacked after the E
    routed ones (modules E to E + S - 1), which every token takes at weight 1 in S more
    slots after its top k (DeepSeek's shared experts, ``n_shared_experts`` of
    ``moe_intermediate_size`` channels: one gated MLP of S times the width is the sum of
    S such experts over its channel blocks). At batch 1 they then stream in the same two
    launches as the routed experts, instead of two GEMVs and an add of their own.

    ``activation``: what each expert computes between gate/up and down (silu(gate) * up,
    or gpt-oss's clamped SwiGLU). ``bias``: each expert adds a bias after gate/up
    (``w13_bias`` [E, 2I], gate then up, this rank's channels) and after down (``w2_bias``
    [E, H]: added by rank 0 alone, so the ranks' all-reduced sum holds it once)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, expert_names: tuple[str, str, str] = HF_EXPERT_NAMES,
                 num_shared_experts: int = 0,
                 activation: GatedActivation = DEFAULT_ACTIVATION, bias: bool = False) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be between 1 and the {num_experts} experts")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.num_shared_experts = num_shared_experts
        self.num_stacked_experts = num_experts + num_shared_experts
        self.tp = get_tp()
        self.checkpoint_intermediate_size = intermediate_size
        self.first_channel, intermediate_size = split_evenly(intermediate_size, self.tp.size,
                                                             self.tp.rank)
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.expert_names = expert_names
        self.activation = activation
        stacked = self.num_stacked_experts
        self.w13_bias = (nn.Parameter(torch.empty(stacked, 2 * intermediate_size),
                                      requires_grad=False) if bias else None)
        self.w2_bias = (nn.Parameter(torch.empty(stacked, hidden_size), requires_grad=False)
                        if bias else None)
        # A quantized model is built with its dense weights on "meta" (as Linear's).
        self.allocate_dense(torch.device("meta") if _linear.linear_weights_deferred() else None)
        self.quantized: Any = None      # a QuantizedExperts once a quantized checkpoint loads
        self.quant_dtype: torch.dtype | None = None     # the activations' dtype then
        self._impl: Any = None
        self._impl_key: tuple | None = None
        self._operands: tuple = ()
        self.backend_name = ""

    def allocate_dense(self, device: torch.device | None, dtype: torch.dtype | None = None
                       ) -> None:
        """The stacked 16-bit weights and each expert's checkpoint matrices as views."""
        inter, hidden = self.intermediate_size, self.hidden_size
        stacked = self.num_stacked_experts
        self.register_buffer("w13", torch.empty(stacked, 2 * inter, hidden, device=device,
                                                dtype=dtype), persistent=False)
        self.register_buffer("w2", torch.empty(stacked, hidden, inter, device=device,
                                               dtype=dtype), persistent=False)
        for e in range(stacked):
            self.add_module(str(e), _Expert(self.w13[e, :inter], self.w13[e, inter:],
                                            self.w2[e], self.expert_names, self.first_channel,
                                            self.checkpoint_intermediate_size))

    def checkpoint_shape(self, param: str) -> tuple[int, ...]:
        """The biases as the checkpoint holds them: gate/up over every rank's channels."""
        if param == "w13_bias":
            return (self.num_stacked_experts, 2 * self.checkpoint_intermediate_size)
        return tuple(getattr(self, param).shape)

    @torch.no_grad()
    def load_checkpoint(self, param: str, tensor: torch.Tensor) -> None:
        """A bias, whole; a tensor-parallel rank keeps its channels of gate and of up."""
        if param == "w13_bias":
            gate, up = tensor.chunk(2, dim=1)
            tensor = torch.cat([t.narrow(1, self.first_channel, self.intermediate_size)
                                for t in (gate, up)], dim=1)
        getattr(self, param).copy_(tensor)

    def biases(self) -> ExpertBiases | None:
        if self.w13_bias is None:
            return None
        return ExpertBiases(self.w13_bias, self.w2_bias if self.tp.rank == 0 else None)

    @property
    def slots(self) -> int:
        """Experts each token runs: its top k and the shared ones."""
        return self.top_k + self.num_shared_experts

    def set_quantized(self, quantized: Any, dtype: torch.dtype) -> None:
        """From here on the experts are ``quantized`` (the dense buffers and the
        per-expert checkpoint tensors are dropped)."""
        for e in range(self.num_stacked_experts):
            delattr(self, str(e))
        empty = torch.empty(0, device=quantized_device(quantized))
        self.w13, self.w2 = empty, empty
        self.quantized, self.quant_dtype = quantized, dtype
        self._impl_key = None

    def held_bytes(self) -> int:
        """What the layer's experts occupy: their 16-bit matrices (each expert's views of
        the stacked weights) or the quantized experts' tensors, and the biases."""
        held = sum(p.numel() * p.element_size() for p in self.parameters())
        if self.quantized is not None:
            held += sum(t.numel() * t.element_size()
                        for w in (self.quantized.w13, self.quantized.w2)
                        for t in vars(w).values() if isinstance(t, torch.Tensor))
        return held

    def expert_params(self, shared: bool = False) -> int:
        """The weights the routed experts stand for (gate, up and down of each); with
        ``shared``, those of the shared experts."""
        experts = self.num_shared_experts if shared else self.num_experts
        return 3 * experts * self.hidden_size * self.intermediate_size

    def spec(self, dtype: torch.dtype) -> Any:
        from archserve.kernels.specs import MoESpec
        quant = {} if self.quantized is None else dict(
            quant_scheme=self.quantized.weight_format, activation=self.quantized.activation)
        return MoESpec(dtype=dtype, num_experts=self.num_experts, top_k=self.top_k,
                       hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                       gated_activation=self.activation.kind,
                       expert_bias=self.w13_bias is not None, **quant)

    def impl(self) -> Any:
        """The selected backend's implementation for where the weights live (selected on
        first use and again only if the weights move or change dtype). Quantized experts
        are prepared for it once (TORCH_MOE dequantizes them)."""
        dtype = self.w13.dtype if self.quantized is None else self.quant_dtype
        key = (self.w13.device, dtype)
        if self._impl_key != key:
            from archserve.kernels.catalog import select_moe_backend
            device = device_info_for(self.w13.device)
            spec = self.spec(dtype)
            selection = select_moe_backend(device, spec)
            self._impl = selection.backend.make_impl(device, spec)
            self._impl_key, self.backend_name = key, selection.name
            if self.quantized is not None:
                self._operands = self._impl.prepare(self.quantized, dtype)
        return self._impl

    def operands(self) -> tuple[Any, Any]:
        """(w13, w2) as the selected backend's forward takes them: the 16-bit stacked
        weights, or the quantized experts as its ``prepare`` made them."""
        return (self.w13, self.w2) if self.quantized is None else self._operands

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor,
                grouping: dict[str, Any] | None = None) -> torch.Tensor:
        """``grouping``: a family's own top-k (DeepSeek's scoring, expert groups, selection
        bias and scaling: ``routing.grouped_route``'s keywords), which the backend routes in
        its own way (one Triton launch, or torch); else the backend's softmax top-k."""
        return self.forward_add(hidden, router_logits, None, grouping)[0]

    def forward_add(self, hidden: torch.Tensor, router_logits: torch.Tensor,
                    residual: torch.Tensor | None, grouping: dict[str, Any] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(``forward`` + ``residual``, None) with the add in the backend's last kernel
        where it takes one (``forward``'s ``add``: the fused MoE's slot sum, on one rank);
        else (``forward``, ``residual``): the (output, residual) pair a decoder block
        returns (norm_folding.py)."""
        impl = self.impl()
        operands = self.operands()
        routed = impl.route(router_logits, self.top_k, self.renormalize, **(grouping or {}),
                            shared_experts=self.num_shared_experts)
        add = residual if residual is not None and self.takes_residual(impl, hidden) else None
        kwargs = {"add": add} if add is not None else {}
        if self.activation != DEFAULT_ACTIVATION or self.w13_bias is not None:
            kwargs.update(activation=self.activation, biases=self.biases())
        out = impl.forward(hidden, router_logits, *operands, self.slots, self.renormalize,
                           routed=routed, **kwargs)
        if self.tp.size > 1:
            out = self.tp.all_reduce(out)
        return (out, None) if add is not None else (out, residual)

    def takes_residual(self, impl: Any, hidden: torch.Tensor) -> bool:
        """Whether ``impl`` adds the residual in its last kernel here: it says so
        (``adds_residual``), the experts are 16-bit, one rank holds the whole sum, and
        the fusion is on."""
        from archserve.kernels.elementwise.dispatch import fusion_enabled
        return (getattr(impl, "adds_residual", False) and self.quantized is None
                and self.tp.size == 1 and fusion_enabled("fold_norm_weights", hidden.device))

    def input_matrix(self) -> torch.Tensor | None:
        """The stacked gate/up weights [E, 2I, H] that read the experts' input (for
        ``RMSNorm.fold_into``), or None for quantized experts."""
        from archserve.models.layers.norm_folding import FOLDABLE_DTYPES
        if self.quantized is not None or self.w13.is_meta or self.w13.dtype not in FOLDABLE_DTYPES:
            return None
        return self.w13


def quantized_device(quantized: Any) -> torch.device:
    from archserve.kernels.moe.quantized_experts import expert_tensor
    return expert_tensor(quantized.w13).device


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) of a given width: a shared expert (split over
    tensor-parallel ranks as a dense MLP is). With ``limit`` (DeepSeek V4's
    ``swiglu_limit``) gate and up are clamped first, as its routed experts' are
    (expert_activation.SILU_CLAMPED)."""

    def __init__(self, hidden_size: int, intermediate_size: int,
                 limit: float | None = None) -> None:
        super().__init__()
        self.gate_up_proj = GateUpParallelLinear(hidden_size, intermediate_size)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)
        self.activation = None if limit is None else GatedActivation(SILU_CLAMPED, limit=limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation is None:
            return self.down_proj(self.gate_up_proj.forward_silu_mul(x))
        # The clamps sit between the GEMM and the product, where the fused epilogue of
        # forward_silu_mul has no place for them.
        return self.down_proj(self.activation(*self.gate_up_proj(x).chunk(2, dim=-1)))


class RouterFirstBlock(nn.Module):
    """A MoE block whose first GEMM is its router's (``self.gate``), so the norm before the
    block can run in that GEMM (``forward_after_norm``); ``_experts(x, logits, residual)``
    is the rest of the block, as an (output, residual) pair (``FusedMoE.forward_add``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._experts(x, self.gate(x), None)[0]

    def forward_after_norm(self, x: torch.Tensor, residual: torch.Tensor | None,
                           norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor | None]:
        """forward(norm(x, residual)) and the new residual, the norm fused into the
        router's GEMM where the linear routine can, the residual added in the experts'
        last kernel where they can (then the residual returned is None)."""
        logits, residual, x = self.gate.forward_after_norm(x, residual, norm)
        return self._experts(x, logits, residual)

    def _experts(self, x: torch.Tensor, router_logits: torch.Tensor,
                 residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def input_matrices(self) -> list[torch.Tensor] | None:
        """The matrices that read the block's input (norm_folding.py): the router's, the
        routed experts' gate/up, and those of ``_other_readers``."""
        matrices = float_matrices(self.gate, *self._other_readers())
        experts = self.experts.input_matrix()
        return None if matrices is None or experts is None else matrices + [experts]

    def _other_readers(self) -> tuple[nn.Module | None, ...]:
        """The block's modules besides the router and the routed experts that read its
        input (None entries are skipped)."""
        return ()


class SparseMoEBlock(RouterFirstBlock):
    """Router + routed experts (+ a shared expert scaled by its sigmoid gate, Qwen2-MoE)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool, expert_names: tuple[str, str, str] = HF_EXPERT_NAMES,
                 shared_intermediate_size: int = 0, router_bias: bool = False,
                 activation: GatedActivation = DEFAULT_ACTIVATION,
                 expert_bias: bool = False) -> None:
        super().__init__()
        self.gate = Router(num_experts, hidden_size, bias=router_bias)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size,
                                renormalize, expert_names, activation=activation,
                                bias=expert_bias)
        self.shared_expert = (GatedMLP(hidden_size, shared_intermediate_size)
                              if shared_intermediate_size else None)
        self.shared_expert_gate = Router(1, hidden_size) if shared_intermediate_size else None

    def _experts(self, x: torch.Tensor, router_logits: torch.Tensor,
                 residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.shared_expert is None:
            return self.experts.forward_add(x, router_logits, residual)
        out = self.experts(x, router_logits)
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x), residual

    def _other_readers(self) -> tuple[nn.Module | None, ...]:
        shared = self.shared_expert
        return (self.shared_expert_gate, shared.gate_up_proj if shared is not None else None)


# ---- checkpoint names -------------------------------------------------------------------

_PER_EXPERT = re.compile(r"^(?P<block>.*)\.(?P<moe>mlp|block_sparse_moe)\.experts\."
                         r"(?P<e>\d+)\.(?P<proj>\w+)\.(?P<param>\w+)$")
_STACKED = re.compile(r"^(?P<block>.*)\.(?P<moe>mlp|block_sparse_moe)\.experts\."
                      r"(?P<proj>gate_up_proj|down_proj)$")
_ROUTER = re.compile(r"^(?P<block>.*)\.(?P<moe>mlp|block_sparse_moe)\.gate\.weight$")
_TO_ROLE = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}


def expert_checkpoint_names(weights: Iterable[tuple[str, torch.Tensor]], block_name: str,
                            expert_names: tuple[str, str, str]
                            ) -> Iterator[tuple[str, torch.Tensor]]:
    """Rename the MoE tensors of any checkpoint convention to the model's own.

    Accepts the sparse block as ``mlp`` or ``block_sparse_moe``, each expert's matrices as
    gate_proj/up_proj/down_proj or w1/w3/w2, and transformers 5's stacked form
    (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]), which is split
    per expert. Everything else passes through unchanged.
    """
    for name, tensor in weights:
        if m := _PER_EXPERT.match(name):
            role = _TO_ROLE.get(m["proj"])
            if role is not None:
                name = (f"{m['block']}.{block_name}.experts.{m['e']}."
                        f"{expert_names[role]}.{m['param']}")
        elif m := _STACKED.match(name):
            prefix = f"{m['block']}.{block_name}.experts"
            for e, matrix in enumerate(tensor):
                if m["proj"] == "down_proj":
                    yield f"{prefix}.{e}.{expert_names[2]}.weight", matrix
                else:
                    gate, up = matrix.chunk(2, dim=0)
                    yield f"{prefix}.{e}.{expert_names[0]}.weight", gate
                    yield f"{prefix}.{e}.{expert_names[1]}.weight", up
            continue
        elif m := _ROUTER.match(name):
            name = f"{m['block']}.{block_name}.gate.weight"
        yield name, tensor
