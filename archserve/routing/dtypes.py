"""Compute dtype and KV-cache dtype: what the user asked for, what this device gets, and why.

Where vLLM refuses (bfloat16 on a V100, fp8 KV on an A100) archserve degrades to the
nearest thing the silicon supports and records the decision (DESIGN principle 3).
"""

from __future__ import annotations

import torch

from archserve.kernels.rules import device_text
from archserve.platform.capability import SM80, SM89
from archserve.platform.device import DeviceInfo
from archserve.routing.decision import Decision

_DTYPE_NAMES: dict[str, torch.dtype | None] = {
    "auto": None,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
}
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


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

    auto: float32 on CPU (exact, and CPU half-precision matmuls are slow); on GPUs the
    checkpoint's float16 if it is float16, else bfloat16 where supported, else float16.
    An explicit bfloat16 on a device without it becomes float16 with a decision.
    """
    wanted = parse_dtype(requested)
    model = parse_dtype(model_dtype)
    asked = "auto" if wanted is None else dtype_name(wanted)
    if wanted is None:
        if not device.is_gpu:
            chosen, why = torch.float32, "CPU: float32 is exact and fast enough"
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


def resolve_kv_cache_dtype(device: DeviceInfo, requested: str = "auto"
                           ) -> tuple[str, list[Decision]]:
    """"auto" (the compute dtype) or an fp8 format; fp8 without fp8 support degrades to auto."""
    key = (requested or "auto").strip().lower()
    if key not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv-cache dtype {requested!r}; "
                         f"choose from {', '.join(KV_CACHE_DTYPES)}")
    if key == "auto":
        return "auto", [Decision("kv_cache_dtype", "auto", "auto", "same as the compute dtype")]
    chosen = "fp8_e4m3" if key == "fp8" else key
    if not device.features.fp8:
        where = f"needs {SM89}+" if device.is_cuda else "needs fp8 support"
        why = f"fp8 KV cache {where}, device is {device_text(device)}; using the compute dtype"
        return "auto", [Decision("kv_cache_dtype", key, "auto", why)]
    return chosen, [Decision("kv_cache_dtype", key, chosen, "as requested")]
