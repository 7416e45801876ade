"""GGUF block types as integer groups: each type's bytes split into (q, scale, offset).

Every type archserve keeps quantized is affine per group: ``w = q * scale + offset``
with unsigned integer ``q``. So a GGUF tensor becomes the kernels' IntGroupWeight
exactly (scales and offsets in float32), and one dequantizing kernel serves all of them:

| type | bits (stored as) | group | scale | offset |
|---|---|---|---|---|
| Q8_0 | 8 | 32 | d | -128 d |
| Q4_0 | 4 | 32 | d | -8 d |
| Q4_1 | 4 | 32 | d | m |
| Q5_0 | 5 (8) | 32 | d | -16 d |
| Q4_K | 4 | 32 | d sc_j | -dmin m_j |
| Q5_K | 5 (8) | 32 | d sc_j | -dmin m_j |
| Q6_K | 6 (8) | 16 | d sc_j | -32 d sc_j |

The byte layouts follow ggml's (and the ``gguf`` package's dequantizers, which the tests
use as the oracle); the 6-bit K-quant scales are unpacked by ``gguf.quants.Q4_K``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK_K = 256


@dataclass
class IntGroups:
    q: np.ndarray          # uint8 [rows, K], unsigned values
    scale: np.ndarray      # float32 [rows, K // group]
    offset: np.ndarray     # float32 [rows, K // group]
    bits: int              # the container: 4 or 8
    group: int


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, chunk: int) -> np.ndarray:
    """[n, bytes] -> [n, 2 * bytes]: per ``chunk`` bytes, the low nibbles then the high."""
    n = qs.shape[0]
    split = qs.reshape(n, -1, 1, chunk) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (split & np.uint8(0x0F)).reshape(n, -1)


def _q8_0(b: np.ndarray) -> tuple:
    d = _f16(b[:, :2])
    q = (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return q, d, -128.0 * d, 8, 32


def _q4_0(b: np.ndarray) -> tuple:
    d = _f16(b[:, :2])
    return _nibbles(b[:, 2:], 16), d, -8.0 * d, 4, 32


def _q4_1(b: np.ndarray) -> tuple:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    return _nibbles(b[:, 4:], 16), d, m, 4, 32


def _q5_0(b: np.ndarray) -> tuple:
    d = _f16(b[:, :2])
    qh = b[:, 2:6].copy().view(np.uint32).reshape(-1, 1)
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    return _nibbles(b[:, 6:], 16) | (high << 4), d, -16.0 * d, 8, 32


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    from gguf.quants import Q4_K

    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, m = Q4_K.get_scale_min(b[:, 4:16].copy())
    return d * sc.astype(np.float32), -dmin * m.astype(np.float32)


def _q4_k(b: np.ndarray) -> tuple:
    scale, offset = _k_scales(b)
    return _nibbles(b[:, 16:], 32), scale, offset, 4, 32


def _q5_k(b: np.ndarray) -> tuple:
    scale, offset = _k_scales(b)
    qh, qs = b[:, 16:48], b[:, 48:]
    n = b.shape[0]
    high = (qh.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    return _nibbles(qs, 32) | (high.reshape(n, -1) << 4), scale, offset, 8, 32


def _q6_k(b: np.ndarray) -> tuple:
    n = b.shape[0]
    ql, qh = b[:, :128], b[:, 128:192]
    scales = b[:, 192:208].copy().view(np.int8).astype(np.float32)
    d = _f16(b[:, 208:210])
    low = _nibbles(ql, 64)
    high = (qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)
            .reshape(1, 1, 4, 1)) & 3
    scale = d * scales
    return low | (high.reshape(n, -1) << 4), scale, -32.0 * scale, 8, 16


# GGML type name -> (elements per block, decoder)
_DECODERS = {"Q8_0": (32, _q8_0), "Q4_0": (32, _q4_0), "Q4_1": (32, _q4_1),
             "Q5_0": (32, _q5_0), "Q4_K": (QK_K, _q4_k), "Q5_K": (QK_K, _q5_k),
             "Q6_K": (QK_K, _q6_k)}
KEPT_QUANTIZED = tuple(_DECODERS)


def split_blocks(type_name: str, data: np.ndarray, rows: int, cols: int) -> IntGroups:
    """A GGUF tensor's raw bytes (``rows`` rows of ``cols`` values) as integer groups."""
    if type_name not in _DECODERS:
        raise ValueError(f"GGUF {type_name} is not kept quantized (kept: "
                         f"{', '.join(KEPT_QUANTIZED)})")
    per_block, decode = _DECODERS[type_name]
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows * cols // per_block, -1)
    q, scale, offset, bits, group = decode(blocks)
    return IntGroups(q.reshape(rows, cols), scale.reshape(rows, cols // group).astype(np.float32),
                     offset.reshape(rows, cols // group).astype(np.float32), bits, group)


class GgufGroups:
    """A GGUF linear weight kept quantized, as the loader hands it to the model: it has the
    weight's logical shape, so the model's name and shape checks treat it like a tensor."""

    def __init__(self, groups: IntGroups) -> None:
        self.groups = groups
        self.shape = tuple(groups.q.shape)

    def reshape(self, *shape) -> GgufGroups:
        return self          # the logical shape is already the checkpoint's

    def permute_rows(self, order: np.ndarray) -> GgufGroups:
        g = self.groups
        return GgufGroups(IntGroups(g.q[order], g.scale[order], g.offset[order], g.bits,
                                    g.group))

    def dense(self):
        import torch
        g = self.groups
        values = (g.q.astype(np.float32) * np.repeat(g.scale, g.group, 1)
                  + np.repeat(g.offset, g.group, 1))
        return torch.from_numpy(values)


def widen(groups: IntGroups, bits: int, group: int) -> IntGroups:
    """The same values in a wider container and finer groups (to fuse with other shards)."""
    repeat = groups.group // group
    return IntGroups(groups.q, np.repeat(groups.scale, repeat, axis=1),
                     np.repeat(groups.offset, repeat, axis=1), bits, group)
