"""How many tokens of the latent the MLA decode kernel (triton_mla_decode.py) may take per
tile on a GPU, by its shared memory: one rule for the tile choice and for the backends'
refusal (kernels/mla/backends.py), so that ``explain`` shows the fallback where the kernel
cannot fit rather than the engine failing at its first decode step.

From SM80 Triton loads the tiles with asynchronous copies and the default 32-token tile
fits every profile's shared memory (the compile sweep, tests/compile_sweep.py, checks it).
Below SM80 it stages the dots' operands through shared memory instead, and the kernel's
footprint grows with the tile: ``4096 + L * (4 * BLOCK_N + 64)`` bytes for a latent of L
columns (a power of two), measured by compiling it for sm_70 and sm_75 at 16 heads per
program: 102400 bytes at L = 512 and 32 tokens, 69632 at 16; 53248 and 36864 at L = 256.

Sparse MLA's fp8_ds_mla cache (rank 512, its tiles dequantized in the kernel) takes more
from SM80 on: 104960 bytes at two stages and 125952 at three (sm_80 to sm_120 alike), more
than the 99 KiB of an A10, L40S, RTX 4090 or RTX 50xx.
"""

from __future__ import annotations

from archserve.platform.capability import SM80
from archserve.platform.device import DeviceInfo

DECODE_BLOCK_N = 32          # the latent tile's tokens wherever it fits
SMALLEST_BLOCK_N = 16        # tl.dot's smallest K


def _power_of_two_at_least(value: int) -> int:
    return 1 << max(value - 1, 0).bit_length()


def staged_shared_bytes(kv_rank: int, block_n: int) -> int:
    """Shared memory of the decode kernel below SM80 (the measured model above)."""
    return 4096 + _power_of_two_at_least(kv_rank) * (4 * block_n + 64)


def latent_tile_tokens(device: DeviceInfo, kv_rank: int) -> int | None:
    """The decode kernel's latent tile (BLOCK_N) on ``device`` for a latent of ``kv_rank``
    values: 32 tokens, or below SM80 the largest of 32 and 16 whose footprint fits the
    GPU's shared memory; None where neither does."""
    if not device.is_cuda or device.has_capability(SM80):
        return DECODE_BLOCK_N
    limit = device.shared_memory_per_block_bytes or 0
    for block_n in (DECODE_BLOCK_N, SMALLEST_BLOCK_N):
        if staged_shared_bytes(kv_rank, block_n) <= limit:
            return block_n
    return None


DS_MLA_SHARED_BYTES = {2: 104960, 3: 125952}    # num_stages -> bytes, from SM80


def ds_mla_max_stages(device: DeviceInfo) -> int:
    """The decode kernel's pipeline depth over an fp8_ds_mla cache: 3 where the GPU's
    shared memory holds it, else 2."""
    limit = device.shared_memory_per_block_bytes or 0
    return 3 if not device.is_cuda or limit >= DS_MLA_SHARED_BYTES[3] else 2


def too_large_reason(device: DeviceInfo, kv_rank: int, ds_mla: bool = False) -> str | None:
    """Why the decode kernel cannot run ``kv_rank`` on ``device`` (None: it can); with
    ``ds_mla``, over an fp8_ds_mla cache."""
    limit = device.shared_memory_per_block_bytes or 0
    if (ds_mla and device.is_cuda and device.has_capability(SM80)
            and limit < DS_MLA_SHARED_BYTES[2]):
        return (f"its decode over an fp8_ds_mla cache needs {DS_MLA_SHARED_BYTES[2] // 1024} "
                f"KiB of shared memory, the GPU has {limit // 1024} KiB")
    if latent_tile_tokens(device, kv_rank) is not None:
        return None
    need = staged_shared_bytes(kv_rank, SMALLEST_BLOCK_N)
    return (f"below SM80 its decode's smallest latent tile for kv_lora_rank {kv_rank} needs "
            f"{need // 1024} KiB of shared memory, the GPU has "
            f"{(device.shared_memory_per_block_bytes or 0) // 1024} KiB")
