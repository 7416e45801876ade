"""The paged cache row of a sparse-MLA layer: the latent beside the lightning indexer's key.

A sparse-MLA (DSA) layer keeps two things per token: the MLA latent (``c_kv`` then the
rotated ``k_pe``) that attention reads, and the indexer's key that scores the token for
top-k selection. Both live in one row of the layer's paged cache, ``[1, num_blocks,
block_size, 1, row]`` like a dense MLA latent's, so the block pool, the prefix cache,
chunked prefill, preemption and CUDA graphs handle them as one: a block holds both for its
tokens.

Each part is kept in the model dtype, or quantized:

- latent, ``fp8_ds_mla`` (DeepSeek's FlashMLA format): ``c_kv`` as e4m3 with one fp32 scale
  (amax / 448) per 128 values, ``k_pe`` in the model dtype (656 bytes for DeepSeek's
  512 + 64 in bf16);
- indexer key, ``fp8`` (vLLM's indexer cache): e4m3 with one power-of-two (ue8m0) fp32
  scale per 128 values (132 bytes for index_head_dim 128).

Both parts in the model dtype: the row is of that dtype, latent then key. Otherwise the
row is bytes (uint8): the latent part, then the key part from the next 16-byte boundary,
the row rounded up to 16 bytes. ``index_dim`` 0 is a latent alone (a compressed-attention
cache that a later model scores with another layer's indexer may use that form).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QUANT_TILE = 128            # values per fp8 scale, in both formats
E4M3_MAX = 448.0
# --kv-cache-dtype names served by the fp8_ds_mla latent (as vLLM's FlashMLA sparse
# serves fp8 through it); "auto", "float16", "bfloat16" keep the model dtype.
FP8_LATENT_NAMES = ("fp8", "fp8_e4m3", "fp8_ds_mla")
INDEX_CACHE_DTYPES = ("auto", "fp8", "bfloat16", "float16")


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def fp8_tiles(width: int) -> int:
    return -(-width // QUANT_TILE)


@dataclass(frozen=True)
class SparseMlaLayout:
    kv_lora_rank: int
    rope_dim: int
    index_dim: int
    model_dtype: torch.dtype
    latent_fp8: bool = False       # fp8_ds_mla
    index_fp8: bool = False        # e4m3 + ue8m0 scale per 128 values

    @classmethod
    def for_cache(cls, kv_lora_rank: int, rope_dim: int, index_dim: int,
                  model_dtype: torch.dtype, kv_cache_dtype: str = "auto",
                  index_cache_dtype: str = "auto") -> SparseMlaLayout:
        """The layout an engine run keeps: an fp8 latent for the fp8 --kv-cache-dtype names;
        an fp8 indexer key when asked, or by default beside an fp8 latent."""
        if index_cache_dtype not in INDEX_CACHE_DTYPES:
            raise ValueError(f"index cache dtype {index_cache_dtype!r} is not one of "
                             f"{', '.join(INDEX_CACHE_DTYPES)}")
        latent_fp8 = kv_cache_dtype in FP8_LATENT_NAMES
        index_fp8 = index_cache_dtype == "fp8" or (index_cache_dtype == "auto" and latent_fp8)
        return cls(kv_lora_rank, rope_dim, index_dim, model_dtype, latent_fp8,
                   index_fp8 and index_dim > 0)

    @classmethod
    def for_spec(cls, spec) -> SparseMlaLayout:  # noqa: ANN001 - an AttentionSpec
        """The layout of a sparse-MLA attention spec's cache."""
        return cls.for_cache(spec.kv_lora_rank, spec.qk_rope_head_dim, spec.index_head_dim,
                             spec.dtype, spec.kv_cache_dtype, spec.index_cache_dtype)

    # ---- the row ------------------------------------------------------------------------
    @property
    def typed(self) -> bool:
        """Whether the row is of the model dtype (no part quantized)."""
        return not (self.latent_fp8 or self.index_fp8)

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.model_dtype if self.typed else torch.uint8

    @property
    def elem(self) -> int:
        return torch.empty((), dtype=self.model_dtype).element_size()

    @property
    def latent_size(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @property
    def scale_offset(self) -> int:
        """fp8_ds_mla: byte offset of the latent's fp32 scales."""
        return _align(self.kv_lora_rank, 4)

    @property
    def rope_offset(self) -> int:
        """Byte offset of k_pe (model dtype) in the row."""
        if not self.latent_fp8:
            return self.kv_lora_rank * self.elem
        return _align(self.scale_offset + 4 * fp8_tiles(self.kv_lora_rank), self.elem)

    @property
    def latent_bytes(self) -> int:
        return self.rope_offset + self.rope_dim * self.elem

    @property
    def index_offset(self) -> int:
        """Byte offset of the indexer key."""
        return self.latent_bytes if self.typed else _align(self.latent_bytes, 16)

    @property
    def index_scale_offset(self) -> int:
        """fp8 indexer key: byte offset of its fp32 scales."""
        return self.index_offset + _align(self.index_dim, 4)

    @property
    def index_bytes(self) -> int:
        if self.index_fp8:
            return _align(self.index_dim, 4) + 4 * fp8_tiles(self.index_dim)
        return self.index_dim * self.elem

    @property
    def row_bytes(self) -> int:
        end = self.index_offset + self.index_bytes
        return end if self.typed else _align(end, 16)

    @property
    def row_size(self) -> int:
        """Entries of ``storage_dtype`` per token (the cache's last dimension)."""
        return self.row_bytes // torch.empty((), dtype=self.storage_dtype).element_size()

    def describe(self) -> str:
        """E.g. "fp8_ds_mla latent + fp8 indexer key, 800 bytes a token"."""
        model = str(self.model_dtype).removeprefix("torch.")
        latent = "fp8_ds_mla" if self.latent_fp8 else model
        index = (f" + {'fp8' if self.index_fp8 else model} indexer key"
                 if self.index_dim else "")
        return f"{latent} latent{index}, {self.row_bytes} bytes a token"

    # ---- views --------------------------------------------------------------------------
    def byte_rows(self, cache: torch.Tensor) -> torch.Tensor:
        """The cache as [num_blocks * block_size, row_bytes] uint8 (a view: writes through
        it land in the cache, so the cache must be one contiguous tensor, as a layer's is)."""
        assert cache.is_contiguous(), "a sparse-MLA cache is addressed as contiguous rows"
        return cache.reshape(-1, cache.shape[-1]).view(torch.uint8)

    def latent_view(self, cache: torch.Tensor) -> torch.Tensor:
        """The model-dtype latent [1, blocks, block_size, 1, L + R] of a cache whose latent
        is not quantized, in the dense MLA kernels' layout (the row stride is the row's)."""
        assert not self.latent_fp8, "an fp8_ds_mla latent has no model-dtype view"
        if self.typed:
            return cache[..., :self.latent_size]
        return cache.view(torch.uint8)[..., :self.latent_bytes].view(self.model_dtype)

    def index_view(self, cache: torch.Tensor) -> torch.Tensor:
        """The model-dtype indexer keys [1, blocks, block_size, 1, I] (not quantized)."""
        assert not self.index_fp8 and self.index_dim
        if self.typed:
            return cache[..., self.latent_size:]
        start = self.index_offset
        return cache.view(torch.uint8)[..., start:start + self.index_bytes].view(
            self.model_dtype)

    def allocate(self, num_blocks: int, block_size: int, device: torch.device | str = "cpu"
                 ) -> torch.Tensor:
        return torch.zeros(1, num_blocks, block_size, 1, self.row_size,
                           dtype=self.storage_dtype, device=device)


# ---- the formats, in torch (the reference and the CPU path) --------------------------------

def quantize_fp8_tiles(x: torch.Tensor, power_of_two: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, D] -> (e4m3 values [n, D], fp32 scales [n, tiles]) with x ~ values * scale per
    tile of QUANT_TILE values: scale amax / 448, or the power of two at or above it (ue8m0,
    vLLM's indexer cache). A tile of zeros gets scale 1."""
    n, width = x.shape
    tiles = fp8_tiles(width)
    padded = torch.nn.functional.pad(x.float(), (0, tiles * QUANT_TILE - width))
    blocks = padded.view(n, tiles, QUANT_TILE)
    amax = blocks.abs().amax(-1)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    if power_of_two:   # the power of two at or above: frexp's m in [0.5, 1), exact
        mantissa, exponent = torch.frexp(scale)
        scale = torch.ldexp(torch.ones_like(scale), exponent - (mantissa == 0.5).int())
    values = (blocks / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return values.view(n, -1)[:, :width], scale


def dequantize_fp8_tiles(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(e4m3 [n, D], fp32 scales [n, tiles]) -> fp32 [n, D]."""
    width = values.shape[1]
    expanded = scales.repeat_interleave(QUANT_TILE, dim=1)[:, :width]
    return values.float() * expanded


def write_rows(layout: SparseMlaLayout, cache: torch.Tensor, slots: torch.Tensor,
               latent: torch.Tensor | None, index_key: torch.Tensor | None) -> None:
    """Write tokens' latents [n, L + R] and indexer keys [n, I] (either None: that part
    is left as it is) at ``slots`` (slot -1 skipped), in the layout's formats."""
    valid = slots >= 0
    slots = slots[valid].long()
    if slots.numel() == 0:
        return
    rows = layout.byte_rows(cache)
    L = layout.kv_lora_rank

    def put(offset: int, data: torch.Tensor) -> None:
        raw = data.contiguous().view(torch.uint8).reshape(slots.numel(), -1)
        rows[:, offset:offset + raw.shape[1]].index_copy_(0, slots, raw)

    if latent is not None:
        latent = latent[valid]
        if layout.latent_fp8:
            values, scales = quantize_fp8_tiles(latent[:, :L], power_of_two=False)
            put(0, values)
            put(layout.scale_offset, scales)
            put(layout.rope_offset, latent[:, L:].to(layout.model_dtype))
        else:
            put(0, latent.to(layout.model_dtype))
    if index_key is not None and layout.index_dim:
        index_key = index_key[valid]
        if layout.index_fp8:
            values, scales = quantize_fp8_tiles(index_key, power_of_two=True)
            put(layout.index_offset, values)
            put(layout.index_scale_offset, scales)
        else:
            put(layout.index_offset, index_key.to(layout.model_dtype))


def _take(rows: torch.Tensor, slots: torch.Tensor, offset: int, width: int,
          dtype: torch.dtype) -> torch.Tensor:
    nbytes = width * torch.empty((), dtype=dtype).element_size()
    return rows[slots.long(), offset:offset + nbytes].contiguous().view(dtype)


def read_latent(layout: SparseMlaLayout, cache: torch.Tensor, slots: torch.Tensor
                ) -> torch.Tensor:
    """The latents at ``slots`` as fp32 [n, L + R] (dequantized)."""
    rows, L = layout.byte_rows(cache), layout.kv_lora_rank
    if not layout.latent_fp8:
        return _take(rows, slots, 0, layout.latent_size, layout.model_dtype).float()
    values = _take(rows, slots, 0, L, torch.float8_e4m3fn)
    scales = _take(rows, slots, layout.scale_offset, fp8_tiles(L), torch.float32)
    rope = _take(rows, slots, layout.rope_offset, layout.rope_dim, layout.model_dtype)
    return torch.cat((dequantize_fp8_tiles(values, scales), rope.float()), dim=1)


def read_index_keys(layout: SparseMlaLayout, cache: torch.Tensor, slots: torch.Tensor
                    ) -> torch.Tensor:
    """The indexer keys at ``slots`` as fp32 [n, I] (dequantized)."""
    rows, width = layout.byte_rows(cache), layout.index_dim
    if not layout.index_fp8:
        return _take(rows, slots, layout.index_offset, width, layout.model_dtype).float()
    values = _take(rows, slots, layout.index_offset, width, torch.float8_e4m3fn)
    scales = _take(rows, slots, layout.index_scale_offset, fp8_tiles(width), torch.float32)
    return dequantize_fp8_tiles(values, scales)


def sequence_slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int
                   ) -> torch.Tensor:
    """The cache slots of one sequence's ``positions`` (long)."""
    positions = positions.long()
    return block_table.long()[positions // block_size] * block_size + positions % block_size

