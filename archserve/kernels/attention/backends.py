"""Attention backends (op ``attention``): each backend's rules in one class, and the priority list.

The priority list follows seed 000 §2.1 (vLLM's ``_get_backend_priorities``); where we
follow today's vLLM instead of the seed, docs/deviations.md says so.
"""

from __future__ import annotations

import torch

from archserve.kernels.rules import (
    RuleBackend,
    bf16_on_device,
    block_size_rule,
    device_text,
    needs_capability,
    needs_dtype,
    needs_gpu,
    needs_triton_device,
    triton_target_rule,
)
from archserve.kernels.specs import RUNNABLE_KV_CACHE_DTYPES, AttentionSpec
from archserve.platform.capability import SM80, SM90, SM121
from archserve.platform.device import DeviceInfo

HALF_DTYPES = (torch.float16, torch.bfloat16)
_IMPL = "archserve.kernels.attention"


def _not_mla(spec: AttentionSpec) -> str | None:
    if spec.use_mla:
        return "the model uses MLA; MLA layers select among mla_attention backends"
    return None


def _torch_at_least(device: DeviceInfo, major: int, minor: int) -> str | None:
    text = device.toolchain.torch_version or torch.__version__
    try:
        have = tuple(int(p) for p in text.split("+")[0].split(".")[:2])
    except ValueError:
        return None
    if have < (major, minor):
        return f"needs torch {major}.{minor}+, this build has {text}"
    return None


def flash_attn_versions_on(device: DeviceInfo) -> tuple[int, ...]:
    """The FlashAttention generations built for this device's family: FA2 on SM80+, FA3 on
    Hopper only, FA4 on the SM90, SM100 and SM110 families."""
    if device.capability is None or not device.has_capability(SM80):
        return ()
    family = device.family
    return ((2,) + ((3,) if family == 90 else ())
            + ((4,) if family in (90, 100, 110) else ()))


def uses_fa4_hd256(device: DeviceInfo, head_size: int | None, value_head: int | None) -> bool:
    """FA4's dedicated head-256 kernel (families 10 and 11 only)."""
    return (head_size == 256 and value_head in (None, 256)
            and device.family in (100, 110))


def fa4_hd256_refusal(spec: AttentionSpec, *, with_block: bool = True) -> str | None:
    """What FA4's head-256 kernel cannot do, so FA2 runs instead: sinks, soft-capping, a
    quantized KV cache, a block size that is not a multiple of its 128-token page."""
    if spec.has_sinks:
        return "attention sinks"
    if spec.logit_soft_cap:
        return "logit soft-capping"
    if spec.quantized_kv:
        return f"a {spec.kv_cache_dtype} KV cache"
    if with_block and spec.block_size is not None and spec.block_size % FA4_HD256_PAGE:
        return f"KV block size {spec.block_size}"
    return None


def flash_attn_version(device: DeviceInfo, spec: AttentionSpec, *,
                       per_layer: bool = True, with_block: bool = True) -> int | None:
    """Which FlashAttention generation runs here (None: the forced one cannot).

    The default is FA3 on Hopper, FA4 on the SM100 family, FA2 elsewhere (SM110 included);
    ``spec.fa_version`` overrides it. Then: FA3 never runs on Blackwell; Hopper moves to FA4
    for heads above 256; batch-invariant mode drops FA4 for FA2; FA4's head-256 kernel
    (families 10/11) hands what it cannot do to FA2; on Blackwell FA4 takes heads <= 128,
    256, or 192 with a 128 value head (tensor memory). ``per_layer=False`` asks without the
    layer's head size, as the device-wide questions (sinks, per-head scales) do.
    """
    supported = flash_attn_versions_on(device)
    if not supported:
        return None
    major = device.capability.major
    version = 3 if major == 9 and 3 in supported else 4 if major == 10 and 4 in supported else 2
    if spec.fa_version is not None:
        version = spec.fa_version
    if major >= 10 and version == 3:
        version = 4 if 4 in supported else 2
    head = spec.head_size if per_layer else None
    value_head = (spec.v_head_dim if spec.use_mla else spec.head_size) if per_layer else None
    if version == 3 and major == 9 and 4 in supported and head is not None and head > 256:
        version = 4
    if spec.batch_invariant and version == 4:
        version = 2
    if (version == 4 and uses_fa4_hd256(device, head, value_head)
            and fa4_hd256_refusal(spec, with_block=with_block)):
        version = 2
    if (version == 4 and major >= 10 and head is not None and head > 128
            and not ((head == 256 and value_head in (None, 256))
                     or (head == 192 and value_head == 128))):
        version = 2
    return version if version in supported else None


FA4_HD256_PAGE = 128          # FA4's head-256 kernel reads one 128-token page per tile
FA4_SM90_FP8_PAGE = 64        # Hopper FA4 with an fp8 cache (head 512): 64-token TMA pages
FA_KV_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3")


def _fa_block_multiple(device: DeviceInfo, spec: AttentionSpec) -> int:
    """FlashAttention's advertised KV block size: any block must be a multiple of it."""
    version = flash_attn_version(device, spec, with_block=False)
    if device.family == 90 and spec.fp8_kv and spec.head_size == 512 and version == 4:
        return FA4_SM90_FP8_PAGE
    if version == 4 and uses_fa4_hd256(device, spec.head_size, spec.head_size):
        return FA4_HD256_PAGE
    return 16


def _fa_kv_rule(device: DeviceInfo, spec: AttentionSpec, version: int | None) -> str | None:
    """FlashAttention reads an e4m3 cache only, and only with FA3 on Hopper, FA4 with head 512
    on Hopper, or FA4 on the SM100 family."""
    if spec.kv_cache_dtype == "fp8_e5m2":
        return "FlashAttention's fp8 KV cache is e4m3 only, requested fp8_e5m2"
    if spec.kv_cache_dtype not in FA_KV_DTYPES:
        return f"KV cache dtype {spec.kv_cache_dtype} unsupported"
    if not spec.quantized_kv:
        return None
    family = device.family
    if ((family == 90 and (version == 3 or (version == 4 and spec.head_size == 512)))
            or (family == 100 and version == 4)):
        return None
    return ("fp8 KV cache needs FA3 on Hopper, FA4 with head size 512 on Hopper, or FA4 on "
            f"the SM100 family; {device_text(device)} runs "
            f"{'no FA' if version is None else f'FA{version}'} here")


class FlashAttentionBackend(RuleBackend):
    name = "FLASH_ATTN"
    op = "attention"
    library = "flash_attn"
    implemented = False   # the flash_attn library is not on our GPU machine yet
    description = ("FlashAttention (FA2 on SM8x/SM11x/SM12x, FA3 on Hopper, FA4 on the SM100 "
                   "family and for heads above 256 on Hopper)")
    graph_capturable = True

    def device_rule(self, device: DeviceInfo) -> str | None:
        return needs_capability(device, SM80)

    def request_rule(self, device: DeviceInfo, spec: AttentionSpec) -> str | None:
        version = flash_attn_version(device, spec)
        device_wide = flash_attn_version(device, spec, per_layer=False)
        max_head = 512 if 4 in flash_attn_versions_on(device) else 256
        return (_not_mla(spec)
                or (f"FA{spec.fa_version} does not run on {device_text(device)}"
                    if spec.fa_version is not None and device_wide is None else None)
                or needs_dtype(spec.dtype, HALF_DTYPES)
                or bf16_on_device(device, spec.dtype)
                or (f"head size {spec.head_size} unsupported (multiples of 8 up to {max_head})"
                    if spec.head_size % 8 or spec.head_size > max_head else None)
                or _fa_kv_rule(device, spec, version)
                or (f"attention sinks need FA3/FA4 on SM90+; {device_text(device)} runs "
                    f"FA{device_wide}"
                    if spec.has_sinks and (device_wide not in (3, 4)
                                          or not device.has_capability(SM90)) else None)
                or (f"per-head KV scales need FA3+, {device_text(device)} runs FA{device_wide}"
                    if spec.per_head_kv_scales and (device_wide or 0) < 3 else None)
                or block_size_rule(spec.block_size,
                                   multiple_of=_fa_block_multiple(device, spec)))

    def detail(self, device: DeviceInfo, spec: AttentionSpec) -> str:
        version = flash_attn_version(device, spec)
        return f"FA{version}" if version else ""


FLASHINFER_HEAD_SIZES = (64, 128, 256, 512)
FLASHINFER_KV_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2",
                        "nvfp4", "nvfp4_4over6")


def _flashinfer_trtllm(device: DeviceInfo, spec: AttentionSpec, prefill: bool) -> bool:
    """TRT-LLM kernels inside FlashInfer: decode on SM90 and SM12x (XQA), both phases on the
    SM100 family; never in batch-invariant mode."""
    if spec.batch_invariant:
        return False
    if device.capability == SM90 or device.family == 120:
        return not prefill
    return device.family == 100


def _flashinfer_kv_rule(device: DeviceInfo, spec: AttentionSpec) -> str | None:
    kv = spec.kv_cache_dtype
    if kv not in FLASHINFER_KV_DTYPES:
        return f"KV cache dtype {kv} unsupported"
    if not kv.startswith("nvfp4"):
        return None
    if device.family in (80, 90, 120):      # FA2 prefill path: no scale search
        if kv != "nvfp4":
            return f"{kv} KV cache needs the SM100 family; {device_text(device)} reads nvfp4"
        if spec.head_size == 64:
            return "the FA2 prefill path misreads an NVFP4 KV cache at head size 64"
        if spec.has_sinks:
            return "the sink prefill path cannot read an NVFP4 KV cache"
        return None
    if device.family == 100 and _flashinfer_trtllm(device, spec, True):
        return None
    return f"NVFP4 KV cache needs SM8x/SM90/SM12x or the SM100 family, device is " \
           f"{device_text(device)}"


class FlashInferBackend(RuleBackend):
    name = "FLASHINFER"
    op = "attention"
    library = "flashinfer"
    implemented = False   # flashinfer is not on our GPU machine yet
    description = "FlashInfer paged attention (SM80..SM121)"
    graph_capturable = True

    def device_rule(self, device: DeviceInfo) -> str | None:
        # Today's vLLM: SM75 is listed by the seed, but FlashInfer is broken on Turing.
        reason = needs_capability(device, SM80)
        if reason:
            return reason
        if device.capability > SM121:
            return f"supports up to {SM121}, device is {device_text(device)}"
        return None

    def request_rule(self, device: DeviceInfo, spec: AttentionSpec) -> str | None:
        sinks = (_flashinfer_trtllm(device, spec, False)
                 and (device.family != 100 or _flashinfer_trtllm(device, spec, True)))
        return (_not_mla(spec)
                or needs_dtype(spec.dtype, HALF_DTYPES)
                or bf16_on_device(device, spec.dtype)
                or (f"head size {spec.head_size} unsupported "
                    f"({', '.join(map(str, FLASHINFER_HEAD_SIZES))})"
                    if spec.head_size not in FLASHINFER_HEAD_SIZES else None)
                or _flashinfer_kv_rule(device, spec)
                or _decoder_only(spec)
                or ("batch-invariant mode unsupported" if spec.batch_invariant else None)
                or ("per-head KV scales unsupported" if spec.per_head_kv_scales else None)
                or (f"attention sinks need its TRT-LLM kernels (SM90, SM100 or SM12x "
                    f"families), device is {device_text(device)}"
                    if spec.has_sinks and not sinks else None)
                or block_size_rule(spec.block_size, multiple_of=16))


def _decoder_only(spec: AttentionSpec) -> str | None:
    if spec.attn_type != "decoder":
        return f"{spec.attn_type} attention unsupported (decoder only)"
    return None


TRITON_MIN_HEAD_SIZE = 32
TRITON_KV_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2",
                    "int8_per_token_head", "int4_per_token_head", "fp8_per_token_head")


def archserve_kernel_rule(spec: AttentionSpec, *, what: str) -> str | None:
    """What archserve's own attention kernels (Triton, flex, SDPA, reference) do not
    implement, though vLLM's backends of the same name may: the build rule they share."""
    if spec.kv_cache_dtype not in RUNNABLE_KV_CACHE_DTYPES:
        return f"{spec.kv_cache_dtype} KV cache is not implemented in {what}"
    if spec.attn_type != "decoder" or spec.non_causal:
        kind = "non-causal" if spec.attn_type == "decoder" else spec.attn_type
        return f"{kind} attention is not implemented in {what} (causal decoder only)"
    if spec.batch_invariant:
        return f"batch-invariant mode is not implemented in {what}"
    if spec.per_head_kv_scales:
        return f"per-head KV scales are not implemented in {what}"
    return None


class TritonAttentionBackend(RuleBackend):
    name = "TRITON_ATTN"
    op = "attention"
    library = "triton"
    description = "archserve's Triton paged attention (any CUDA or ROCm GPU, head size >= 32)"
    graph_capturable = True
    mixed_graph_capturable = True   # the varlen kernel's grid: max query length x sequences
    # A verification step (k + 1 <= 16 tokens a sequence) runs as decode rows of the decode
    # kernel, which applies windows, sinks and soft caps per row. Each row reads its
    # sequence's keys again (mostly from L2: the sequence's rows run side by side) where
    # the varlen kernel reads them once per query tile, a cost that grows with the rows a
    # sequence brings: up to 15 drafts a sequence, as MLA's decode rows.
    decode_rows_max_query_len = 16
    impl_path = f"{_IMPL}.triton_backend:TritonAttentionImpl"

    def device_rule(self, device: DeviceInfo) -> str | None:
        return needs_triton_device(device)

    def request_rule(self, device: DeviceInfo, spec: AttentionSpec) -> str | None:
        # An fp8 cache is read on every GPU (the kernels decode e4m3 bits in software
        # where the silicon has no fp8), as vLLM's selection keeps it on every GPU.
        return (_not_mla(spec)
                or (f"head size {spec.head_size} unsupported (>= {TRITON_MIN_HEAD_SIZE})"
                    if spec.head_size < TRITON_MIN_HEAD_SIZE else None)
                or (bf16_on_device(device, spec.dtype) if device.is_gpu else None)
                or (f"KV cache dtype {spec.kv_cache_dtype} unsupported"
                    if spec.kv_cache_dtype not in TRITON_KV_DTYPES else None)
                or ("per-head KV scales unsupported" if spec.per_head_kv_scales else None)
                or block_size_rule(spec.block_size, multiple_of=16))

    def build_rule(self, device: DeviceInfo, spec: AttentionSpec) -> str | None:
        return archserve_kernel_rule(spec, what="archserve's Triton kernels")


class TurboQuantAttentionBackend(RuleBackend):
    """vLLM's last CUDA candidate: the only reader of a turboquant KV cache. Rules only."""

    name = "TURBOQUANT"
    op = "attention"
    implemented = False
    description = "TurboQuant attention over a turboquant-compressed KV cache (rules only)"

    def device_rule(self, device: DeviceInfo) -> str | None:
        return needs_capability(device, SM80)

    def request_rule(self, device: DeviceInfo, spec: AttentionSpec) -> str | None:
        if not spec.kv_cache_dtype.startswith("turboquant"):
            return "reads a turboquant_* KV cache only"
        return _not_mla(spec) or _decoder_only(spec)


def _torch_attention_request_rule(device: DeviceInfo, spec: AttentionSpec) -> str | None:
    """The torch backends (flex, SDPA) dequantize an fp8 cache as they gather it and apply
    soft-capping themselves (flex: a score_mod; SDPA: the explicit-scores path), so only
    MLA and the dtype constrain them. They read 16-bit and per-tensor fp8 caches only and
    have no per-head KV scales: with those, no backend of vLLM's CUDA list is left either."""
    return (_not_mla(spec) or (bf16_on_device(device, spec.dtype) if device.is_gpu else None)
            or (f"KV cache dtype {spec.kv_cache_dtype} unsupported"
                if spec.kv_cache_dtype not in RUNNABLE_KV_CACHE_DTYPES else None)
            or ("per-head KV scales unsupported" if spec.per_head_kv_scales else None))


def _torch_build_rule(spec: AttentionSpec) -> str | None:
    return archserve_kernel_rule(spec, what="archserve's torch attention")


class FlexAttentionBackend(RuleBackend):
    name = "FLEX_ATTENTION"
    op = "attention"
    description = "torch flex_attention with a paged block mask (any device, torch >= 2.5)"
    impl_path = f"{_IMPL}.flex_backend:FlexAttentionImpl"

    def device_rule(self, device: DeviceInfo) -> str | None:
        return _torch_at_least(device, 2, 5)

    def request_rule(self, device: DeviceInfo, spec: AttentionSpec) -> str | None:
        return (_torch_attention_request_rule(device, spec)
                # vLLM 0.33's FlexAttentionBackend takes no sinks (supports_sink is the
                # base class's False), so archserve's flex has none either.
                or ("attention sinks unsupported" if spec.has_sinks else None)
                or (f"{spec.attn_type} attention unsupported"
                    if spec.attn_type not in ("decoder", "encoder_only") else None))

    def build_rule(self, device: DeviceInfo, spec: AttentionSpec) -> str | None:
        # On CUDA, flex_attention is compiled: its kernels are Triton's.
        return triton_target_rule(device) or _torch_build_rule(spec)


class SdpaAttentionBackend(RuleBackend):
    name = "TORCH_SDPA"
    op = "attention"
    description = "torch scaled_dot_product_attention over gathered blocks (the CPU default)"
    impl_path = f"{_IMPL}.sdpa_backend:SdpaAttentionImpl"

    def request_rule(self, device: DeviceInfo, spec: AttentionSpec) -> str | None:
        return _torch_attention_request_rule(device, spec)

    def build_rule(self, device: DeviceInfo, spec: AttentionSpec) -> str | None:
        return _torch_build_rule(spec)


class ReferenceAttentionBackend(RuleBackend):
    name = "TORCH_REFERENCE"
    op = "attention"
    description = "plain PyTorch paged attention: slow, exact, runs everywhere"
    impl_path = f"{_IMPL}.reference:ReferenceAttentionImpl"

    def request_rule(self, device: DeviceInfo, spec: AttentionSpec) -> str | None:
        return (f"KV cache dtype {spec.kv_cache_dtype} unsupported"
                if spec.kv_cache_dtype not in RUNNABLE_KV_CACHE_DTYPES else None
                ) or ("per-head KV scales unsupported" if spec.per_head_kv_scales else None)

    def build_rule(self, device: DeviceInfo, spec: AttentionSpec) -> str | None:
        return _torch_build_rule(spec)


ATTENTION_BACKENDS: tuple[type[RuleBackend], ...] = (
    FlashAttentionBackend, FlashInferBackend, TritonAttentionBackend, TurboQuantAttentionBackend,
    FlexAttentionBackend, SdpaAttentionBackend, ReferenceAttentionBackend,
)
ATTENTION_FALLBACK = ReferenceAttentionBackend.name


def attention_priority(device: DeviceInfo, spec: AttentionSpec) -> list[str]:
    """vLLM 0.33's CUDA order (platforms/cuda.py, _get_backend_priorities): the SM100 family
    prefers FlashInfer unless the attention is non-causal; every other CUDA GPU prefers
    FlashAttention. TURBOQUANT ends the list; archserve's torch backends follow it."""
    if needs_gpu(device):
        return ["TORCH_SDPA", "FLEX_ATTENTION"]
    if device.platform == "rocm":
        return ["TRITON_ATTN", "FLEX_ATTENTION", "TORCH_SDPA"]
    if device.family == 100 and not spec.non_causal:
        first = ["FLASHINFER", "FLASH_ATTN"]
    else:
        first = ["FLASH_ATTN", "FLASHINFER"]
    return [*first, "TRITON_ATTN", "FLEX_ATTENTION", "TURBOQUANT", "TORCH_SDPA"]


VIT_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "TORCH_SDPA", "FLASHINFER")


def vit_attention_priority(device: DeviceInfo) -> list[str]:
    """vLLM 0.33's ViT (vision encoder) order (platforms/cuda.py,
    get_supported_vit_attn_backends): below SM80, SDPA comes before Triton."""
    if device.has_capability(SM80):
        return ["FLASH_ATTN", "TRITON_ATTN", "TORCH_SDPA", "FLASHINFER"]
    return ["FLASH_ATTN", "TORCH_SDPA", "TRITON_ATTN", "FLASHINFER"]


def vit_rule(name: str, device: DeviceInfo, spec: AttentionSpec) -> str | None:
    """ViT selection asks only head size, dtype and capability (get_vit_attn_backend), and
    takes TORCH_SDPA as soon as it is reached."""
    if name == "TORCH_SDPA":
        return None
    if not device.is_cuda:
        return f"needs an NVIDIA GPU (CUDA), device is {device_text(device)}"
    if name == "FLASH_ATTN":
        max_head = 512 if 4 in flash_attn_versions_on(device) else 256
        return (needs_capability(device, SM80) or needs_dtype(spec.dtype, HALF_DTYPES)
                or (f"head size {spec.head_size} unsupported (multiples of 8 up to "
                    f"{max_head})" if spec.head_size % 8 or spec.head_size > max_head
                    else None))
    if name == "TRITON_ATTN":
        return (needs_dtype(spec.dtype, (*HALF_DTYPES, torch.float32))
                or (f"head size {spec.head_size} unsupported (>= {TRITON_MIN_HEAD_SIZE})"
                    if spec.head_size < TRITON_MIN_HEAD_SIZE else None))
    if name == "FLASHINFER":
        return (FlashInferBackend().device_rule(device) or needs_dtype(spec.dtype, HALF_DTYPES)
                or (f"head size {spec.head_size} unsupported"
                    if spec.head_size not in FLASHINFER_HEAD_SIZES else None))
    return f"{name} is not a ViT attention backend"
