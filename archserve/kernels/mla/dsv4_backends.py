"""DeepSeek V4's attention backends (op ``mla_attention``: vLLM counts V4's attention as sparse
MLA, its own backends as ``*_DSV4``), with vLLM's conditions:

- FLASHMLA_SPARSE_DSV4 (vLLM's default on SM90 and the SM100 family): bf16, a 16-bit cache
  or fp8_ds_mla (V4's: 448 e4m3 values, the 64 rope values in bf16 and a ue8m0 scale per
  64, 584 bytes a token), 256-token blocks, head size 512;
- FLASHINFER_MLA_SPARSE_DSV4 (vLLM's default on SM12x, chosen on SM10x by name): on the
  SM100 family a 16-bit or per-tensor fp8 cache (not fp8_ds_mla), on SM12x an fp8 cache
  (fp8_ds_mla) and FlashInfer's SM120 sparse MLA decode;
- TRITON_MLA_SPARSE_DSV4 (archserve's, no vLLM counterpart; kernels/mla/triton_dsv4.py): the
  compressor, the indexer's top-k and the window + entries + sinks attention in Triton,
  where TRITON_MLA runs, with a cache in the model dtype;
- TORCH_REFERENCE (kernels/mla/torch_mla.py, ``forward_compressed``) everywhere.

The library kernels are rules only in this build: ``explain`` shows them as the ideal, the
route is TRITON_MLA_SPARSE_DSV4. The MLA backends of kernels/mla/backends.py refuse a V4
layer, as vLLM's selector does.
"""

from __future__ import annotations

import torch

from archserve.kernels.mla.backends import MlaBackend, mla_priority
from archserve.kernels.rules import RuleBackend, needs_triton_device
from archserve.kernels.specs import AttentionSpec
from archserve.platform.capability import SM80
from archserve.platform.device import DeviceInfo

DSV4_HEAD_SIZE = 512
DSV4_BLOCK_SIZE = 256
# Below SM80 Triton stages the dots' operands through shared memory (measured by compiling
# the kernels for sm_70 and sm_75; from SM80 they fit every profile): the attention kernel
# takes 192 bytes a head channel (96 KiB at 512), the indexer's prompt scores 96 KiB at V4's
# 64 heads of 128.
STAGED_ATTENTION_BYTES_PER_CHANNEL = 192
STAGED_INDEX_PROMPT_BYTES = 98304


def staged_shared_memory_reason(device: DeviceInfo, spec: AttentionSpec) -> str | None:
    """Why TRITON_MLA_SPARSE_DSV4's kernels do not fit ``device``'s shared memory below SM80
    (None: they do)."""
    if not device.is_cuda or device.has_capability(SM80):
        return None
    channels = 1 << max(spec.head_size - 1, 0).bit_length()
    need = STAGED_ATTENTION_BYTES_PER_CHANNEL * channels
    if spec.index_topk:
        need = max(need, STAGED_INDEX_PROMPT_BYTES)
    limit = device.shared_memory_per_block_bytes or 0
    if need <= limit:
        return None
    return (f"below SM80 its kernels at head size {spec.head_size} need {need // 1024} KiB of "
            f"shared memory, the GPU has {limit // 1024} KiB")


class Dsv4Backend(MlaBackend):
    """Common rules of the DeepSeek V4 backends (head size 512, sinks, every layer kind)."""

    dsv4 = True
    sparse = True
    fixed_latent = False
    dtypes = (torch.bfloat16,)
    preferred_block_size = DSV4_BLOCK_SIZE
    block_multiple = DSV4_BLOCK_SIZE

    def combination_rule(self, device: DeviceInfo, spec: AttentionSpec) -> str | None:
        if spec.head_size != DSV4_HEAD_SIZE:
            return f"head size {spec.head_size} unsupported ({DSV4_HEAD_SIZE})"
        return None


class FlashMlaSparseDsv4Backend(Dsv4Backend):
    name = "FLASHMLA_SPARSE_DSV4"
    implemented = False
    kv_dtypes = ("auto", "bfloat16", "fp8_ds_mla", "fp8")
    description = "FlashMLA sparse for DeepSeek V4 (Hopper and SM100 family)"
    families = (90, 100)


class FlashInferMlaSparseDsv4Backend(Dsv4Backend):
    name = "FLASHINFER_MLA_SPARSE_DSV4"
    library = "flashinfer"
    implemented = False
    kv_dtypes = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_ds_mla")
    description = ("FlashInfer sparse MLA for DeepSeek V4 (TRT-LLM kernels on the SM100 "
                   "family, the SM120 sparse decode on RTX Blackwell)")
    families = (100, 120)

    def combination_rule(self, device: DeviceInfo, spec: AttentionSpec) -> str | None:
        reason = super().combination_rule(device, spec)
        if reason:
            return reason
        kv = spec.kv_cache_dtype
        if device.family == 100 and kv == "fp8_ds_mla":
            return ("the SM100 family's kernels read the plain per-tensor fp8 cache, not "
                    "fp8_ds_mla")
        if device.family == 120 and kv not in ("fp8", "fp8_e4m3", "fp8_ds_mla"):
            return f"SM12x reads an fp8 (fp8_ds_mla) cache only, requested {kv}"
        return None


class TritonMlaSparseDsv4Backend(Dsv4Backend):
    name = "TRITON_MLA_SPARSE_DSV4"
    library = "triton"
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    kv_dtypes = ("auto", "float16", "bfloat16")
    description = ("archserve's Triton DeepSeek V4 attention: the compressor, the indexer's "
                   "top-k over compressed entries, then one kernel over each query's window, "
                   "entries and sinks (any GPU)")
    # vLLM's 256-token V4 block is preferred (inherited); any block holding whole groups
    # runs (the rate rule below; startup.kv_block_size checks every rate of the model).
    block_multiple = None
    graph_capturable = True
    impl_path = "archserve.kernels.mla.triton_dsv4:TritonDsv4Impl"

    def device_rule(self, device: DeviceInfo) -> str | None:
        return needs_triton_device(device)

    def combination_rule(self, device: DeviceInfo, spec: AttentionSpec) -> str | None:
        return None

    def build_rule(self, device: DeviceInfo, spec: AttentionSpec) -> str | None:
        return staged_shared_memory_reason(device, spec)

    def request_rule(self, device: DeviceInfo, spec: AttentionSpec) -> str | None:
        # A compression group never straddles two blocks (compressed_attention/layout.py).
        rate = spec.compress_rate or 0
        if rate and spec.block_size is not None and spec.block_size % rate:
            return (f"KV block size must be a multiple of the compress rate {rate}, requested "
                    f"{spec.block_size}")
        return super().request_rule(device, spec)


DSV4_BACKENDS: tuple[type[RuleBackend], ...] = (FlashMlaSparseDsv4Backend,
                                                FlashInferMlaSparseDsv4Backend,
                                                TritonMlaSparseDsv4Backend)


def dsv4_priority(device: DeviceInfo, spec: AttentionSpec) -> list[str]:
    """vLLM's _select_dsv4_attn_cls (FlashInfer on SM12x, FlashMLA elsewhere, FlashInfer on
    the SM100 family when named), then archserve's Triton route on any GPU."""
    triton = ["TRITON_MLA_SPARSE_DSV4"] if device.is_gpu else []
    if device.platform != "cuda":
        return triton
    if device.family == 120:
        return ["FLASHINFER_MLA_SPARSE_DSV4", *triton]
    return ["FLASHMLA_SPARSE_DSV4", "FLASHINFER_MLA_SPARSE_DSV4", *triton]


def mla_attention_priority(device: DeviceInfo, spec: AttentionSpec) -> list[str]:
    """The ``mla_attention`` order: DeepSeek V4's backends for its layers, MLA's otherwise."""
    if spec.compress_rate is not None:
        return dsv4_priority(device, spec)
    return mla_priority(device, spec)
