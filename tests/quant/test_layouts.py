"""Checkpoint layouts -> the kernels' layout, through the same path a model load takes.

The checkpoint tensors are packed here independently from each format's definition
(GPTQ packs along the input channels and stores zero - 1, AWQ interleaves eight output
columns per int32, compressed-tensors packs signed values offset by 2**(bits-1)), for a
fused q/k/v layer, and the repacked weight must dequantize to exactly (q - z) * s.
"""

from __future__ import annotations

import pytest
import torch

from archserve.kernels.linear.quantized_weights import dequantize
from archserve.models.layers.linear import QKVLinear, deferred_linear_weights
from archserve.quant.config import parse_quant_config
from archserve.quant.linear_state import QuantizedLinearState

K = 256
SHARDS = {"q": 128, "k": 64, "v": 64}


def pack_along(values: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """Pack unsigned ints along ``dim`` into int32, value j of each word at bits j*bits."""
    pack = 32 // bits
    v = values.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // pack, pack)
    if order is not None:                          # nibble i holds element order[i]
        v = v[..., list(order)]
    words = sum(v[..., j] << (bits * j) for j in range(pack))
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return words.movedim(-1, dim)


def random_quant(rows: int, bits: int, group: int, symmetric: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2 ** bits, (rows, K), generator=g)
    s = (torch.rand(rows, K // group, generator=g) * 0.01 + 0.001).half().float()
    # From 1: GPTQ's v1 format stores zero - 1 in `bits` bits, so it cannot hold a zero of 0.
    z = (torch.full((rows, K // group), 2 ** (bits - 1)) if symmetric
         else torch.randint(1, 2 ** bits, (rows, K // group), generator=g))
    dense = (q - z.repeat_interleave(group, 1)).float() * s.repeat_interleave(group, 1)
    return q, s, z, dense


def gptq_tensors(q, s, z, bits, group):
    return {"qweight": pack_along(q.t(), bits, 0), "qzeros": pack_along(z.t() - 1, bits, 1),
            "scales": s.t().half(), "g_idx": torch.arange(K, dtype=torch.int32) // group}


def awq_tensors(q, s, z, bits, group):
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    return {"qweight": pack_along(q.t(), 4, 1, order), "qzeros": pack_along(z.t(), 4, 1, order),
            "scales": s.t().half()}


def ct_packed_tensors(q, s, z, bits, group):
    out = {"weight_packed": pack_along(q, bits, 1), "weight_scale": s.half(),
           "weight_shape": torch.tensor([q.shape[0], K])}
    out["weight_zero_point"] = pack_along(z, bits, 0)
    return out


CASES = {
    "gptq-4-g32-asym": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False},
                        gptq_tensors, 4, 32, False),
    "gptq-8-g128": ({"quant_method": "gptq", "bits": 8, "group_size": 128, "sym": True},
                    gptq_tensors, 8, 128, True),
    "awq-4-g64": ({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True},
                  awq_tensors, 4, 64, False),
    "ct-4-g32-asym": ({"quant_method": "compressed-tensors", "format": "pack-quantized",
                       "config_groups": {"g": {"targets": ["Linear"], "weights": {
                           "num_bits": 4, "type": "int", "strategy": "group",
                           "group_size": 32, "symmetric": False}}}},
                      ct_packed_tensors, 4, 32, False),
    "ct-8-g128-sym": ({"quant_method": "compressed-tensors", "format": "pack-quantized",
                       "config_groups": {"g": {"targets": ["Linear"], "weights": {
                           "num_bits": 8, "type": "int", "strategy": "group",
                           "group_size": 128, "symmetric": True}}}},
                      ct_packed_tensors, 8, 128, True),
}


def load_fused(config: dict, make_tensors, bits: int, group: int, symmetric: bool):
    quant = parse_quant_config(config).layers[0]
    with deferred_linear_weights():
        layer = QKVLinear(K, 64, 2, 1)
    layer.quant = QuantizedLinearState(layer, quant, torch.device("cpu"), torch.float16)
    expected = []
    for i, (shard, rows) in enumerate(SHARDS.items()):
        q, s, z, dense = random_quant(rows, bits, group, symmetric, seed=i)
        expected.append(dense)
        for name, tensor in make_tensors(q, s, z, bits, group).items():
            if name in layer.checkpoint_params():
                assert tuple(tensor.shape) == layer.shard_shape(shard, name), name
                layer.load_shard(shard, name, tensor)
    layer.quant.finalize()
    return layer, torch.cat(expected)


@pytest.mark.parametrize("case", sorted(CASES))
def test_repacked_weight_dequantizes_exactly(case: str) -> None:
    layer, expected = load_fused(*CASES[case])
    got = dequantize(layer.quant.weight)
    # q * s + (-z * s) in fp32 rounds a little differently from (q - z) * s.
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    names = {n for n, _ in layer.named_parameters()}
    assert "qweight" in names and "scales" in names      # what is held is what is counted


def test_gptq_act_order_sorts_groups_and_permutes_inputs() -> None:
    bits, group, rows = 4, 32, 64
    q, s, z, dense = random_quant(rows, bits, group, False, seed=7)
    perm = torch.randperm(K, generator=torch.Generator().manual_seed(1))
    g_idx = torch.empty(K, dtype=torch.int32)
    g_idx[perm] = (torch.arange(K, dtype=torch.int32) // group)   # channel perm[i] in group i//G
    # The checkpoint's channel k belongs to group g_idx[k]: build q, s, z in that order.
    groups = g_idx.long()
    s_full, z_full = s[:, groups], z[:, groups]
    original = (q - z_full).float() * s_full
    tensors = {"qweight": pack_along(q.t(), bits, 0), "qzeros": pack_along(z.t() - 1, bits, 1),
               "scales": s.t().half(), "g_idx": g_idx}
    quant = parse_quant_config({"quant_method": "gptq", "bits": 4, "group_size": group,
                                "sym": False, "desc_act": True}).layers[0]
    from archserve.models.layers.linear import Linear
    with deferred_linear_weights():
        layer = Linear(K, rows)
    layer.quant = QuantizedLinearState(layer, quant, torch.device("cpu"), torch.float16)
    for name, tensor in tensors.items():
        layer.load_shard(None, name, tensor)
    layer.quant.finalize()
    w = layer.quant.weight
    x = torch.randn(3, K, dtype=torch.float64)
    y = x[:, w.perm] @ dequantize(w).double().t()
    torch.testing.assert_close(y, x @ original.double().t(), rtol=1e-9, atol=1e-9)


def test_block_fp8_needs_input_channels_in_whole_groups() -> None:
    """Per-128-group activation scales need K a multiple of 128 (SmolLM2's 576 is not):
    refused at load, naming the layer, not a crash in the first forward."""
    from archserve.quant.layouts import check_shard_alignment

    quant = parse_quant_config({"quant_method": "fp8", "weight_block_size": [128, 128]})
    assert "per 128 input channels" in check_shard_alignment(quant.layers[0], 576, [576])
    assert check_shard_alignment(quant.layers[0], 512, [512]) is None
