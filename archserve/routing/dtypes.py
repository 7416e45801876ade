"""Compute dtype and KV-cache dtype: what the user asked for, what this device gets, and why.

Where vLLM refuses (bfloat16 on a V100, fp8 KV on an A100) archserve degrades to the
nearest thing the silicon supports and records the decision (DESIGN principle 3).
"""

from __future__ import annotations

import torch

from archserve.kernels.rules import device_text
from archserve.kernels.specs import KV_CACHE_DTYPES, RUNNABLE_KV_CACHE_DTYPES
from archserve.platform.capability import SM80
from archserve.platform.decision import Decision
from archserve.platform.device import DeviceInfo

_DTYPE_NAMES: dict[str, torch.dtype | None] = {
    "auto": None,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(requested: str | torch.dtype | None) -> torch.dtype | None:
    """A dtype name or torch.dtype; None for "auto"."""
    if requested is None or isinstance(requested, torch.dtype):
        return requested
    key = requested.strip().lower().removeprefix("torch.")
    if key not in _DTYPE_NAMES:
        raise ValueError(f"unknown dtype {requested!r}; choose from {', '.join(_DTYPE_NAMES)}")
    return _DTYPE_NAMES[key]


def resolve_dtype(device: DeviceInfo, requested: str | torch.dtype | None = "auto",
                  model_dtype: str | torch.dtype | None = None
                  ) -> tuple[torch.dtype, list[Decision]]:
    """The compute dtype for this device.

    auto: on a CPU, ``cpu_auto_dtype``; on GPUs the checkpoint's float16 if it is float16,
    else bfloat16 where supported, else float16. An explicit bfloat16 on a device without
    it becomes float16 with a decision.
    """
    wanted = parse_dtype(requested)
    model = parse_dtype(model_dtype)
    asked = "auto" if wanted is None else dtype_name(wanted)
    if wanted is None:
        if not device.is_gpu:
            chosen, why = cpu_auto_dtype(device, model)
        elif model == torch.float16:
            chosen, why = torch.float16, "the checkpoint is float16"
        elif device.features.bf16:
            chosen, why = torch.bfloat16, f"{device_text(device)} supports bfloat16"
        else:
            chosen, why = torch.float16, (f"bfloat16 needs {SM80}+, device is "
                                          f"{device_text(device)}")
        return chosen, [Decision("dtype", asked, dtype_name(chosen), why)]
    if wanted == torch.bfloat16 and not device.features.bf16:
        why = (f"bfloat16 needs {SM80}+, device is {device_text(device)}; float16 instead "
               "(vLLM refuses; archserve degrades: watch for overflow in large activations)")
        return torch.float16, [Decision("dtype", asked, "float16", why)]
    return wanted, [Decision("dtype", asked, asked, "as requested")]


def cpu_auto_dtype(device: DeviceInfo, model: torch.dtype | None = None
                   ) -> tuple[torch.dtype, str]:
    """"auto" on a CPU, and why: bfloat16 where the CPU multiplies it in hardware, as
    vLLM's CPU backend runs it (a decode step reads half float32's bytes, and
    CPU_WEIGHT_ONLY keeps quantized weights packed for bfloat16 models only); float32
    elsewhere, exact, where oneDNN would convert bfloat16 products in software: that
    wins at one row on half the bytes but loses at prompt sizes (benchmarks/
    cpu_bf16_emulation.py, a Zen 4 with oneDNN capped below AVX-512 BF16: the embedded
    model's linears at 256 rows 1.1x float32's time capped at AVX-512, 3.6x at AVX2;
    at 16 rows 0.8x and 1.6x; at 1 row 0.3x and 0.2x). A float16
    checkpoint takes bfloat16 too (vLLM keeps float16): no x86 CPU here multiplies float16
    in hardware short of AVX-512 FP16, and torch's weight-only CPU kernels take bfloat16."""
    features = device.features
    if not features.cpu_bf16:
        return torch.float32, ("CPU without native bfloat16 (no AVX-512 BF16 or AMX): "
                               "float32, exact; bfloat16 products would be converted in "
                               "software, slower than float32 at prompt sizes")
    native = " and ".join(name for name, has in (("AVX-512 BF16", features.avx512_bf16),
                                                 ("AMX", features.amx)) if has)
    checkpoint = f", the checkpoint {dtype_name(model)}" if model is not None else ""
    return torch.bfloat16, (f"CPU with native bfloat16 ({native}{checkpoint}): half "
                            "float32's bytes per token, as vLLM's CPU backend runs; "
                            "--dtype float32 for float32's exactness")


# Why no kernel of this build reads each rules-only KV-cache dtype, and what reads it in
# vLLM 0.33 (each backend's supported_kv_cache_dtypes and supports_kv_cache_dtype).
_KV_READERS_IN_VLLM = {
    "fp8_inc": "Intel Gaudi's fp8 cache: no CUDA backend of vLLM 0.33 reads it",
    "fp8_ds_mla": "DeepSeek's packed fp8 MLA latent: vLLM 0.33's sparse MLA backends only",
    "nvfp4_ds_mla": "an NVFP4 MLA latent with fp8 rope: vLLM 0.33's FlashMLA sparse (SM100) only",
    "nvfp4": "vLLM 0.33 reads it with FlashInfer (SM80+)",
    "nvfp4_4over6": "vLLM 0.33 reads it with FlashInfer's TRT-LLM kernels (SM100 family)",
    "int8_per_token_head": "vLLM 0.33 reads it with its Triton attention",
    "int4_per_token_head": "vLLM 0.33 reads it with its Triton attention",
    "fp8_per_token_head": "vLLM 0.33 reads it with its Triton attention",
    "octave": "vLLM 0.33 reads it on ROCm only (ROCM_OCTAVE): no CUDA backend does",
    "ultraquant": "vLLM 0.33 reads it on ROCm only (ULTRAQUANT): no CUDA backend does",
    "turboquant": "vLLM 0.33 reads it with its TURBOQUANT backend (SM80+)",
}


def kv_cache_refusal(kv_cache_dtype: str, sparse_mla: bool = False) -> str | None:
    """Why this build refuses a KV-cache dtype (None: a kernel here reads it). A sparse-MLA
    model's cache rows also take fp8_ds_mla (kernels/sparse_mla/layout.py)."""
    if kv_cache_dtype in RUNNABLE_KV_CACHE_DTYPES or (
            sparse_mla and kv_cache_dtype == "fp8_ds_mla"):
        return None
    where = _KV_READERS_IN_VLLM.get(kv_cache_dtype) or next(
        text for prefix, text in _KV_READERS_IN_VLLM.items()
        if kv_cache_dtype.startswith(prefix))
    return f"no kernel in this build reads the {kv_cache_dtype} KV cache: {where}"


# vLLM 0.33's own defaults for "auto" on some models (model_executor/models/config.py,
# each class's verify_and_update_config): architecture -> (SM families, cache dtype).
_VLLM_MODEL_KV_DEFAULTS = {"GlmMoeDsaForCausalLM": ((100,), "fp8_e4m3")}


def model_kv_cache_default(architecture: str, device: DeviceInfo) -> str | None:
    """The cache vLLM 0.33 gives ``architecture`` on this device for "auto", where it
    departs from the compute dtype (GLM-5 takes an fp8 cache on the SM100 family)."""
    families, dtype = _VLLM_MODEL_KV_DEFAULTS.get(architecture, ((), None))
    return dtype if device.is_cuda and device.family in families else None


def resolve_kv_cache_dtype(device: DeviceInfo, requested: str = "auto",
                           checkpoint: str | None = None, sparse_mla: bool = False,
                           model_default: str | None = None) -> tuple[str, list[Decision]]:
    """The KV cache dtype: "auto" (the compute dtype) or any name vLLM knows.

    "auto" takes the cache a checkpoint was calibrated for (``checkpoint``: its
    kv_cache_scheme or ModelOpt's kv_cache_quant_algo), as vLLM does; an explicit choice
    wins over it. fp8 is kept on every CUDA GPU, as vLLM keeps it (FlashInfer reads it on
    SM8x, Triton everywhere: archserve's Triton kernels decode e4m3 bytes in software below
    SM89); on a device with neither CUDA nor fp8 (a CPU) it becomes the compute dtype.
    "float16" and "bfloat16" mean a 16-bit cache, which archserve keeps in the compute
    dtype. The other names (nvfp4, int8 per token-head, turboquant, ...) pass through to
    selection, whose rules know them; no kernel in this build reads them, so they have an
    ideal, not a route, and the decision says why (``kv_cache_refusal``).
    """
    key = (requested or "auto").strip().lower()
    if key not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv-cache dtype {requested!r}; "
                         f"choose from {', '.join(KV_CACHE_DTYPES)}")
    if key == "auto" and model_default and not checkpoint:
        chosen, decisions = resolve_kv_cache_dtype(device, model_default,
                                                   sparse_mla=sparse_mla)
        return chosen, [Decision("kv_cache_dtype", "auto", d.chosen,
                                 f"vLLM 0.33 gives this model an {model_default} cache on "
                                 f"{device_text(device)}"
                                 + ("" if d.reason == "as requested"
                                    else f"; {d.reason.removeprefix('as requested; ')}"))
                        for d in decisions]
    if key == "auto" and checkpoint:
        chosen, decisions = resolve_kv_cache_dtype(device, checkpoint)
        return chosen, [Decision("kv_cache_dtype", "auto", d.chosen,
                                 f"the checkpoint's KV cache scheme is {checkpoint}"
                                 + ("" if d.reason == "as requested"
                                    else f"; {d.reason.removeprefix('as requested; ')}"))
                        for d in decisions]
    if key == "auto":
        return "auto", [Decision("kv_cache_dtype", "auto", "auto", "same as the compute dtype")]
    if key in ("float16", "bfloat16"):
        return "auto", [Decision("kv_cache_dtype", key, "auto",
                                 "a 16-bit cache: archserve stores it in the compute dtype")]
    chosen = "fp8_e4m3" if key == "fp8" else key
    runnable = kv_cache_refusal(chosen, sparse_mla) is None
    if runnable and not device.features.fp8 and not device.is_cuda:
        why = (f"fp8 KV cache needs fp8 support or a CUDA GPU, device is "
               f"{device_text(device)}; using the compute dtype")
        return "auto", [Decision("kv_cache_dtype", key, "auto", why)]
    served = ("; a sparse-MLA latent keeps it as fp8_ds_mla (e4m3 with a scale per 128 "
              "values, the rope part 16-bit), as vLLM's FlashMLA sparse does"
              if sparse_mla and chosen in ("fp8_e4m3", "fp8_ds_mla") else "")
    if runnable and not device.features.fp8:
        why = (f"kept on {device_text(device)} without fp8 tensor cores: the cache stores fp8 "
               "bytes and the attention kernel widens them as it reads (as vLLM does)")
        return chosen, [Decision("kv_cache_dtype", key, chosen, why + served)]
    refusal = kv_cache_refusal(chosen, sparse_mla)
    if refusal:
        return chosen, [Decision("kv_cache_dtype", key, chosen, f"refused: {refusal}")]
    return chosen, [Decision("kv_cache_dtype", key, chosen, "as requested" + served)]
