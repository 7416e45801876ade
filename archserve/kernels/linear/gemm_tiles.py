"""The launch shape of a tiled (tl.dot) W8A8 GEMM, and the rule that picks one.

The block-FP8 and INT8 kernels share it: a fixed config per (rows, N) so a call never
tunes and a CUDA graph replays the same launch; ``candidate_tiles`` lists the others a
start-up tuner may time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def key(self) -> str:
        return (f"m{self.block_m}_n{self.block_n}_k{self.block_k}_w{self.num_warps}"
                f"_st{self.num_stages}")

    @classmethod
    def from_key(cls, key: str) -> TileConfig:
        m, n, k, w, st = (int(part.lstrip("mnkwst")) for part in key.split("_"))
        return cls(m, n, k, w, st)


def tile_block_m(rows: int) -> int:
    """Rows per program: the smallest tl.dot height (16) that holds a decode batch, up to
    128 for prefill."""
    return 16 if rows <= 16 else 32 if rows <= 32 else 64 if rows <= 64 else 128


def occupancy_block_n(rows: int, n: int, block_m: int) -> int:
    """128 columns per program where that still gives two programs per SM of a large GPU
    (~132 SMs); narrower where the grid would leave SMs idle (decode-sized rows)."""
    tiles_m = -(-rows // block_m)
    for block_n in (128, 64):
        if tiles_m * -(-n // block_n) >= 264:
            return block_n
    return 32


def default_tile(rows: int, n: int, block_k: int) -> TileConfig:
    """8-bit operands: a stage holds (block_m + block_n) x block_k bytes; two stages of
    the largest tile (64 KiB) fit the ~100 KiB of shared memory of SM86/SM89 parts."""
    block_m = tile_block_m(rows)
    block_n = occupancy_block_n(rows, n, block_m)
    warps = 8 if block_m * block_n >= 128 * 128 else 4
    return TileConfig(block_m, block_n, block_k, warps, 3 if block_m <= 64 else 2)


def candidate_tiles(rows: int, n: int, block_k: int) -> list[TileConfig]:
    """``default_tile`` first, then variations a tuner may time (larger ones need the
    shared memory of SM80/SM90 parts and fail to compile elsewhere; the tuner skips them)."""
    block_m = tile_block_m(rows)
    tiles = [default_tile(rows, n, block_k),
             TileConfig(block_m, 32, block_k, 4, 3),
             TileConfig(block_m, 64, block_k, 4, 3),
             TileConfig(block_m, 128, block_k, 4, 4),
             TileConfig(block_m, 128, block_k // 2, 4, 4),
             TileConfig(block_m, 256, block_k, 8, 3)]
    unique: list[TileConfig] = []
    for tile in tiles:
        if tile not in unique:
            unique.append(tile)
    return unique


class ConfiguredRoutine:
    """A linear routine ``routine(x, weight, bias)`` for x [..., K] over a GEMM that takes
    an explicit config: ``configs`` maps ``config_key(rows, weight)`` to a tuned one
    (archserve.kernels.linear.quantized_tuning), absent shapes use the GEMM's default.
    Subclasses name the GEMM in ``run``, its config type and its candidates."""

    config_type: type = TileConfig

    def __init__(self, device=None, spec=None) -> None:
        self.configs: dict[tuple, Any] = {}

    def run(self, x, weight, bias, config):  # noqa: ANN001, ANN201 - the GEMM's own types
        raise NotImplementedError

    def candidates(self, rows: int, weight) -> list:  # noqa: ANN001
        """The configs a tuner may time at ``rows`` rows, the default first; [] when the
        GEMM takes no config there."""
        raise NotImplementedError

    def config_from(self, fields: dict):  # noqa: ANN201
        """A config from its fields (a tuner's cache): of the type in ``config_types``
        (a routine whose candidates are of several types lists them) with those fields."""
        for config_type in getattr(self, "config_types", (self.config_type,)):
            if set(fields) == {f.name for f in dataclasses.fields(config_type)}:
                return config_type(**fields)
        raise ValueError(f"no config type of {type(self).__name__} has the fields {fields}")

    @staticmethod
    def config_key(rows: int, weight) -> tuple:  # noqa: ANN001
        from archserve.kernels.linear.quantized_weights import weight_signature
        return (rows, weight.out_features, weight.in_features, weight_signature(weight))

    def __call__(self, x, weight, bias=None):  # noqa: ANN001, ANN204
        x2 = x.reshape(-1, x.shape[-1])
        y = self.run(x2, weight, bias, self.configs.get(self.config_key(x2.shape[0], weight)))
        return y.reshape(*x.shape[:-1], y.shape[-1])
