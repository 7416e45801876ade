"""The tensors a quantized linear layer stores in each checkpoint format, and their repacking
into the kernels' layouts (archserve.kernels.linear.quantized_weights).

A ``TensorLayout`` says how one checkpoint tensor of one layer is shaped for a given
number of output rows, and along which dimension the rows of fused layers (q/k/v,
gate/up) stack, so a fused layer can hold its shards in one tensor. ``to_kernel_weight``
turns a layer's loaded tensors into an IntGroupWeight, Fp8Weight or Int8Weight once,
after loading.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from archserve.kernels.linear.quantized_weights import (
    ACT_DYNAMIC_GROUP,
    ACT_DYNAMIC_TOKEN,
    ACT_NONE,
    ACT_STATIC_TENSOR,
    FP8_DTYPE,
    FP8_MAX,
    Fp8Weight,
    Int8Weight,
    IntGroupWeight,
    Mxfp4Weight,
    QuantizedWeight,
    pack_int_rows,
    unpack_int_rows,
)
from archserve.quant.config import (
    AWQ,
    CT_FLOAT,
    CT_INT,
    CT_PACKED,
    GGUF,
    GPTQ,
    HF_FP8,
    MXFP4,
    ONLINE_FP8,
    LayerQuant,
)

# AWQ's GEMM layout packs eight output columns per int32 in this order of nibbles.
AWQ_NIBBLE_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True)
class TensorLayout:
    name: str                                   # the checkpoint suffix ("weight_scale")
    dtype: torch.dtype                          # how archserve stores it until repacking
    shape: Callable[[int], tuple[int, ...]]     # output rows -> the tensor's shape
    out_dim: int | None = 0                     # the dim along output rows; None: per shard
    rows_per_entry: int = 1                     # rows one entry covers (packing, blocks)
    optional: bool = False                      # absent from some checkpoints of the format
    # The dim along input channels (None: the tensor covers every input channel at once,
    # as a per-row scale does), and the channels one entry covers (packing, groups, blocks):
    # what a row-parallel rank keeps of it.
    in_dim: int | None = None
    channels_per_entry: int = 1

    def stored_shape(self, shard_rows: list[int]) -> tuple[int, ...]:
        if self.out_dim is None:                # one value (or vector) per shard
            return (len(shard_rows), *self.shape(shard_rows[0]))
        return self.shape(sum(shard_rows))


def _div(a: int, b: int) -> int:
    return math.ceil(a / b)


def tensor_layouts(q: LayerQuant, in_features: int) -> list[TensorLayout]:
    """Every tensor one layer of this format holds (for ``rows`` output rows)."""
    k = in_features
    groups = k // q.group_size if q.group_size else 1
    # Along the input channels: one entry per group (none when a single group spans K).
    by_group = dict(in_dim=None) if not q.group_size else {}
    group = q.group_size or 1
    if q.layout == MXFP4:
        # gpt-oss's ``*_blocks`` [N, K/32, 16] (as [N, K/2]: two values a byte) and
        # ``*_scales`` [N, K/32], one expert matrix's rows each (models/gpt_oss.py).
        return [TensorLayout("blocks", torch.uint8, lambda r: (r, k // 2), in_dim=1,
                             channels_per_entry=2),
                TensorLayout("scales", torch.uint8, lambda r: (r, k // 32), in_dim=1,
                             channels_per_entry=32)]
    if q.layout in (CT_FLOAT, HF_FP8):
        scale_name = "weight_scale_inv" if q.layout == HF_FP8 and q.block else "weight_scale"
        layouts = [TensorLayout("weight", FP8_DTYPE, lambda r: (r, k), in_dim=1)]
        layouts.append(_scale_layout(q, scale_name, k))
        if q.activation == ACT_STATIC_TENSOR:
            layouts.append(TensorLayout("input_scale", torch.float32, lambda r: (), None))
        return layouts
    if q.layout == CT_INT:
        scale = _scale_layout(q, "weight_scale", k)
        layouts = [TensorLayout("weight", torch.int8, lambda r: (r, k), in_dim=1), scale,
                   dataclasses.replace(scale, name="weight_zero_point", dtype=torch.int8,
                                       optional=q.symmetric)]
        if q.activation == ACT_STATIC_TENSOR:
            layouts.append(TensorLayout("input_scale", torch.float32, lambda r: (), None))
        return layouts
    pack = 32 // q.bits
    if q.layout == CT_PACKED:
        layouts = [TensorLayout("weight_packed", torch.int32, lambda r: (r, k // pack),
                                in_dim=1, channels_per_entry=pack),
                   TensorLayout("weight_scale", torch.float32, lambda r: (r, groups),
                                **{"in_dim": 1, "channels_per_entry": group, **by_group}),
                   TensorLayout("weight_shape", torch.int64, lambda r: (2,), None)]
        if not q.symmetric:
            layouts.append(TensorLayout("weight_zero_point", torch.int32,
                                        lambda r: (_div(r, pack), groups), 0, pack,
                                        **{"in_dim": 1, "channels_per_entry": group,
                                           **by_group}))
        return layouts
    per_group = {"in_dim": 0, "channels_per_entry": group, **by_group}
    if q.layout == GPTQ:
        return [TensorLayout("qweight", torch.int32, lambda r: (k // pack, r), 1,
                             in_dim=0, channels_per_entry=pack),
                TensorLayout("qzeros", torch.int32, lambda r: (groups, _div(r, pack)), 1, pack,
                             **per_group),
                TensorLayout("scales", torch.float32, lambda r: (groups, r), 1, **per_group),
                TensorLayout("g_idx", torch.int32, lambda r: (k,), None, optional=True,
                             in_dim=0)]
    if q.layout == AWQ:
        return [TensorLayout("qweight", torch.int32, lambda r: (k, _div(r, 8)), 1, 8, in_dim=0),
                TensorLayout("qzeros", torch.int32, lambda r: (groups, _div(r, 8)), 1, 8,
                             **per_group),
                TensorLayout("scales", torch.float32, lambda r: (groups, r), 1, **per_group)]
    raise ValueError(f"no tensor layout for {q.layout}")


def tensor_layout(q: LayerQuant, in_features: int, name: str) -> TensorLayout:
    """The layout of the tensor ``name`` of a layer of ``in_features`` input channels."""
    return next(t for t in tensor_layouts(q, in_features) if t.name == name)


def _scale_layout(q: LayerQuant, name: str, k: int) -> TensorLayout:
    if q.strategy == "tensor":
        return TensorLayout(name, torch.float32, lambda r: (), None)
    if q.strategy == "channel":
        return TensorLayout(name, torch.float32, lambda r: (r, 1))
    if q.strategy == "group":
        return TensorLayout(name, torch.float32, lambda r: (r, k // q.group_size),
                            in_dim=1, channels_per_entry=q.group_size)
    bn, bk = q.block
    return TensorLayout(name, torch.float32, lambda r: (_div(r, bn), _div(k, bk)), 0, bn,
                        in_dim=1, channels_per_entry=bk)


# ---- tensor parallelism: what one rank keeps of a checkpoint tensor --------------------------

def _part(first: int, length: int, whole: int, per: int) -> tuple[int, int] | None:
    """(first entry, entries) covering [first, first + length) of ``whole`` when entries
    of ``per`` each align with it, else None."""
    if first % per or (length % per and first + length != whole):
        return None
    return first // per, _div(length, per)


def rows_part(layout: TensorLayout, tensor: torch.Tensor, first: int, rows: int, whole: int
              ) -> torch.Tensor:
    """A column-parallel rank's part of one checkpoint tensor of ``whole`` output rows: rows
    [first, first + rows) (a tensor per shard is kept whole). ``rows_split_problem`` first."""
    if layout.out_dim is None:
        return tensor
    start, entries = _part(first, rows, whole, layout.rows_per_entry)
    return tensor.narrow(layout.out_dim, start, entries)


def channels_part(layout: TensorLayout, tensor: torch.Tensor, first: int, channels: int,
                  whole: int) -> torch.Tensor:
    """A row-parallel rank's part: input channels [first, first + channels) of ``whole``
    (a tensor over all channels at once is kept whole). ``channels_split_problem`` first."""
    if layout.in_dim is None:
        return tensor
    start, entries = _part(first, channels, whole, layout.channels_per_entry)
    return tensor.narrow(layout.in_dim, start, entries)


def rows_split_problem(q: LayerQuant, in_features: int, first: int, rows: int, whole: int
                       ) -> str | None:
    """Why output rows [first, first + rows) of a layer in this format cannot be one rank's
    part (a packed int32 or a scale block would straddle two ranks), else None."""
    for layout in tensor_layouts(q, in_features):
        if layout.out_dim is not None and _part(first, rows, whole,
                                                layout.rows_per_entry) is None:
            return (f"its {layout.name} covers {layout.rows_per_entry} output rows an entry, "
                    f"and a rank's part starts at row {first} ({rows} rows)")
    return None


def channels_split_problem(q: LayerQuant, whole: int, first: int, channels: int) -> str | None:
    """Why input channels [first, first + channels) cannot be one rank's part, else None."""
    if q.layout == GPTQ and q.act_order:
        return ("GPTQ with act order (desc_act) orders its groups across all input channels; "
                "a rank's part of them is not whole groups")
    for layout in tensor_layouts(q, whole):
        if layout.in_dim is not None and _part(first, channels, whole,
                                               layout.channels_per_entry) is None:
            return (f"its {layout.name} covers {layout.channels_per_entry} input channels an "
                    f"entry, and a rank's part starts at channel {first} ({channels} channels)")
    return None


def check_shard_alignment(q: LayerQuant, in_features: int, shard_rows: list[int]) -> str | None:
    """Why a layer of this shape (fused shards of these sizes) cannot hold this format,
    else None."""
    if q.activation == ACT_DYNAMIC_GROUP and in_features % 128:
        return (f"block-FP8 activations are quantized per 128 input channels; the layer has "
                f"{in_features}")
    if q.layout in (ONLINE_FP8, GGUF):       # dense or per-shard until finalize
        return None
    offset = 0
    for rows in shard_rows[:-1]:
        offset += rows
        for layout in tensor_layouts(q, in_features):
            if layout.out_dim is not None and offset % layout.rows_per_entry:
                return (f"a fused shard starts at output row {offset}, not a multiple of the "
                        f"{layout.rows_per_entry} rows one {layout.name} entry covers")
    return None


# ---- repacking into the kernels' layouts ---------------------------------------------------

def _per_channel(per_shard: torch.Tensor, shard_rows: list[int]) -> torch.Tensor:
    """One scale per shard -> one per output row."""
    sizes = torch.tensor(shard_rows, device=per_shard.device)
    return per_shard.reshape(-1).float().repeat_interleave(sizes)


def _weight_scales(q: LayerQuant, scale: torch.Tensor, shard_rows: list[int]) -> torch.Tensor:
    """float32 scales in the kernels' form: one per output row, or the block grid as is."""
    if q.strategy == "tensor":
        scale = _per_channel(scale, shard_rows)
    elif q.strategy == "channel":
        scale = scale.reshape(-1)
    return scale.float().contiguous()


def _input_scale(t: dict[str, torch.Tensor]) -> torch.Tensor | None:
    # Fused shards calibrated separately share the largest input scale (as vLLM does).
    return t["input_scale"].max().float() if "input_scale" in t else None


def _fp8(q: LayerQuant, t: dict[str, torch.Tensor], shard_rows: list[int]) -> Fp8Weight:
    scale = t.get("weight_scale_inv", t.get("weight_scale"))
    return Fp8Weight(t["weight"], _weight_scales(q, scale, shard_rows), q.activation,
                     block=q.block if q.strategy == "block" else None,
                     input_scale=_input_scale(t))


def _int8(q: LayerQuant, t: dict[str, torch.Tensor], shard_rows: list[int]) -> Int8Weight:
    zero = t.get("weight_zero_point")
    if zero is not None and bool(zero.ne(0).any()):
        raise ValueError("int8 W8A8 weights with non-zero zero points are not loadable")
    return Int8Weight(t["weight"], _weight_scales(q, t["weight_scale"], shard_rows),
                      q.activation, input_scale=_input_scale(t))


def _unpack_columns(packed: torch.Tensor, bits: int, order: tuple[int, ...] | None = None
                    ) -> torch.Tensor:
    """int32 [R, N / pack] packed along the columns -> [R, N] unsigned ints."""
    values = unpack_int_rows(packed.t().contiguous(), bits)        # [N, R], nibble order
    if order is not None:
        pack = 32 // bits
        n = values.shape[0]
        inverse = torch.tensor(order, device=values.device).argsort()
        index = (torch.arange(n, device=values.device).view(-1, pack)[:, inverse]).reshape(-1)
        values = values[index]
    return values.t()


def _int_group(q: LayerQuant, in_features: int, qvalues: torch.Tensor, scales: torch.Tensor,
               zeros: torch.Tensor | None, perm: torch.Tensor | None = None) -> IntGroupWeight:
    """qvalues unsigned [K, N]; scales, zeros [G, N] (zeros None: symmetric)."""
    scales = scales.float()
    offsets = None if zeros is None else (-zeros.float() * scales)
    n = qvalues.shape[1]
    weight = IntGroupWeight(pack_int_rows(qvalues, q.bits), scales.contiguous(),
                            None if offsets is None else offsets.contiguous(), q.bits,
                            q.group_size or in_features, in_features, n, perm)
    weight.validate()
    return weight


def _ct_packed(q: LayerQuant, t: dict[str, torch.Tensor], in_features: int) -> IntGroupWeight:
    n = t["weight_packed"].shape[0]
    qvalues = unpack_int_rows(t["weight_packed"].t().contiguous(), q.bits)[:in_features]
    zeros = None
    if "weight_zero_point" in t:                      # packed along the output rows
        zeros = unpack_int_rows(t["weight_zero_point"], q.bits)[:n].t()
    return _int_group(q, in_features, qvalues, t["weight_scale"].t(), zeros)


def _ct_int_weight_only(q: LayerQuant, t: dict[str, torch.Tensor], in_features: int
                        ) -> IntGroupWeight:
    mid = 1 << (q.bits - 1)                           # signed values -> unsigned
    qvalues = (t["weight"].to(torch.int32) + mid).t()
    zero = t.get("weight_zero_point")
    zeros = None if zero is None or q.symmetric else (zero.to(torch.int32) + mid).t()
    return _int_group(q, in_features, qvalues, t["weight_scale"].t(), zeros)


def _gptq(q: LayerQuant, t: dict[str, torch.Tensor], in_features: int) -> IntGroupWeight:
    qvalues = unpack_int_rows(t["qweight"], q.bits)
    n = qvalues.shape[1]
    zeros = _unpack_columns(t["qzeros"], q.bits)[:, :n] + q.zero_point_offset
    perm = None
    g_idx = t.get("g_idx")
    group = q.group_size or in_features
    if g_idx is not None and q.act_order:
        if bool((g_idx != g_idx[0]).any()):           # stored per fused shard
            raise ValueError("GPTQ act order: the fused shards have different g_idx")
        g_idx = g_idx[0]
        perm = torch.argsort(g_idx.long(), stable=True)
        expected = torch.arange(in_features, device=g_idx.device) // group
        if not torch.equal(g_idx.long()[perm], expected):
            raise ValueError("GPTQ g_idx does not put group_size channels in every group")
        qvalues = qvalues[perm]
    return _int_group(q, in_features, qvalues, t["scales"], zeros, perm)


def _awq(q: LayerQuant, t: dict[str, torch.Tensor], in_features: int) -> IntGroupWeight:
    qvalues = _unpack_columns(t["qweight"], 4, AWQ_NIBBLE_ORDER)
    n = t["scales"].shape[1]
    zeros = _unpack_columns(t["qzeros"], 4, AWQ_NIBBLE_ORDER)[:, :n]
    return _int_group(q, in_features, qvalues[:, :n], t["scales"], zeros)


def quantize_fp8_per_channel(weight: torch.Tensor) -> Fp8Weight:
    """Online fp8 (``--quantization fp8``): per-row scales from the 16-bit weight."""
    wf = weight.float()
    scale = (wf.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    values = (wf / scale.unsqueeze(1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Fp8Weight(values, scale, ACT_DYNAMIC_TOKEN)


def gguf_weight(parts: list, in_features: int, device: torch.device
                ) -> IntGroupWeight | torch.Tensor:
    """A fused layer's GGUF shards (GgufGroups, or dense tensors for types not kept
    quantized) -> one IntGroupWeight in the widest container and finest groups of its
    shards (exact), or a dense float32 weight when any shard is dense."""
    from archserve.quant.gguf_blocks import GgufGroups, widen

    if any(not isinstance(p, GgufGroups) for p in parts):
        return torch.cat([p.dense() if isinstance(p, GgufGroups) else p.float()
                          for p in parts])
    bits = max(p.groups.bits for p in parts)
    group = min(p.groups.group for p in parts)
    wide = [widen(p.groups, bits, group) for p in parts]
    q = torch.from_numpy(np.concatenate([w.q for w in wide])).to(device)
    scale = torch.from_numpy(np.concatenate([w.scale for w in wide])).to(device)
    offset = torch.from_numpy(np.concatenate([w.offset for w in wide])).to(device)
    weight = IntGroupWeight(pack_int_rows(q.t().to(torch.int32), bits), scale.t().contiguous(),
                            offset.t().contiguous(), bits, group, in_features, q.shape[0])
    weight.validate()
    return weight


def to_kernel_weight(q: LayerQuant, tensors: dict[str, torch.Tensor], shard_rows: list[int],
                     in_features: int) -> QuantizedWeight:
    """A loaded layer's checkpoint tensors (fused shards stacked) -> the kernels' layout."""
    if q.layout == ONLINE_FP8:
        return quantize_fp8_per_channel(tensors["weight"])
    if q.layout in (CT_FLOAT, HF_FP8):
        return _fp8(q, tensors, shard_rows)
    if q.layout == CT_INT and q.activation != ACT_NONE:
        return _int8(q, tensors, shard_rows)
    if q.layout == CT_INT:
        return _ct_int_weight_only(q, tensors, in_features)
    if q.layout == CT_PACKED:
        return _ct_packed(q, tensors, in_features)
    if q.layout == GPTQ:
        return _gptq(q, tensors, in_features)
    if q.layout == AWQ:
        return _awq(q, tensors, in_features)
    if q.layout == MXFP4:             # the checkpoint's layout is the kernels' own
        weight = Mxfp4Weight(tensors["blocks"].contiguous(), tensors["scales"].contiguous())
        weight.validate()
        return weight
    raise ValueError(f"no repacking for {q.layout}")
