"""TRITON_ATTN: the AttentionImpl built from our Triton kernels over the engine's paged cache.

Runs on any GPU Triton targets (CUDA, ROCm); on CPU only under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch

from archserve.kernels.attention.interface import (
    AttentionLayerParams,
    AttentionMetadata,
    PagedAttentionImpl,
)
from archserve.kernels.attention.triton_cache_write import write_kv_cache
from archserve.kernels.attention.triton_decode import decode_attention
from archserve.kernels.attention.triton_prefill import prefill_attention
from archserve.kernels.specs import AttentionSpec
from archserve.platform.detect import device_info_for
from archserve.platform.device import DeviceInfo


class TritonAttentionImpl(PagedAttentionImpl):
    """Writes this step's K/V, then runs the decode kernel or the general varlen kernel."""

    # Given no key/value, the kernels read this step's from the cache: a layer may write
    # them itself (the fused attention preamble, kernels/attention/preamble.py).
    takes_written_kv = True

    def __init__(self, device: DeviceInfo | None = None, spec: AttentionSpec | None = None,
                 fp8_bytes: bool | None = None) -> None:
        super().__init__(device, spec)
        # Whether an fp8 cache is written and read as bytes with integer conversions (what
        # GPUs without fp8 need); None: decided per GPU by the kernels' wrappers.
        self.fp8_bytes = fp8_bytes
        # The split-KV heuristic needs the SM count; unknown (0) means "never split".
        self.num_sms = (device.multiprocessor_count if device is not None else None) or 0

    def _sm_count(self, tensor: torch.Tensor) -> int:
        if self.num_sms == 0:
            self.num_sms = device_info_for(tensor.device).multiprocessor_count or 0
        return self.num_sms

    def _fp8_bits(self, kv_cache: torch.Tensor) -> tuple[bool | None, bool | None]:
        """(e4m3, e5m2): whether the kernels treat the cache as those fp8 bytes; None: the
        wrappers decide per GPU."""
        if self.fp8_bytes is None:
            return None, None
        return (self.fp8_bytes and kv_cache.dtype == torch.float8_e4m3fn,
                self.fp8_bytes and kv_cache.dtype == torch.float8_e5m2)

    def write_cache(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, k_scale: float, v_scale: float) -> None:
        e4m3, e5m2 = self._fp8_bits(kv_cache)
        write_kv_cache(key, value, kv_cache, slot_mapping, k_scale, v_scale,
                       e4m3_bits=e4m3, e5m2_bits=e5m2)

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
               layer: AttentionLayerParams, out: torch.Tensor, k_scale: float,
               v_scale: float) -> None:
        e4m3, _ = self._fp8_bits(kv_cache)
        common = dict(scale=layer.scale, sliding_window=layer.sliding_window,
                      soft_cap=layer.logit_soft_cap, k_scale=k_scale, v_scale=v_scale,
                      num_seqs=meta.num_seqs, e4m3_bits=e4m3, sinks=layer.sinks)
        # max_query_len is a host int: choosing the kernel costs no device sync.
        if meta.max_query_len == 1:
            decode_attention(query, kv_cache, meta.block_tables, meta.seq_lens,
                             meta.query_start_loc, out, max_seq_len=meta.max_seq_len,
                             num_sms=self._sm_count(query), **common)
        else:
            prefill_attention(query, kv_cache, meta.block_tables, meta.seq_lens,
                              meta.query_start_loc, out, max_query_len=meta.max_query_len,
                              flat_grid=meta.padded_bucket, **common)
