"""Measured ceilings of this device: matrix FLOP/s and copy bandwidth, cached on disk.

A roofline needs the rates this device actually reaches, not datasheet peaks. They
come from a short run — a large matmul (bf16 on a GPU, fp32 on a CPU) and a
device-to-device copy — and are cached as JSON under
``$ARCHSERVE_CACHE_DIR/calibration`` (default ``~/.cache/archserve/calibration``),
keyed by device name, driver, torch version (on a CPU also its thread count) and
CALIBRATION_VERSION, so only the first run pays for it. A measurement taken on a busy
machine comes out low; a benchmark that then beats it measures again, and if it still
beats the new rates raises them to what it reached (``raised_by_run``), so no figure
derived from them exceeds 100%.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, replace

import torch

from archserve.cache import cache_dir

# Part of the cache key: a change to how the ceilings are measured retires every entry.
CALIBRATION_VERSION = 2


@dataclass(frozen=True)
class Ceilings:
    matmul_flops_per_s: float
    copy_bytes_per_s: float      # bytes read + bytes written per second
    device_name: str
    matmul_dtype: str
    cached: bool = False
    measured_at: str = ""        # UTC time of the measurement (ISO 8601)
    # > 1 when a run went faster than the measurement allowed, even measured again right
    # after it (a measurement taken under load): both rates were raised by this factor.
    raised_by_run: float = 1.0

    def to_json(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """One line: the rates and where they come from, for reports."""
        origin = "cached" if self.cached else "measured now"
        text = (f"{self.matmul_flops_per_s / 1e12:.3g} TFLOP/s {self.matmul_dtype} matmul, "
                f"{self.copy_bytes_per_s / 1e9:.3g} GB/s copy; {origin}, "
                f"measured {self.measured_at or 'at an unknown time'}")
        if self.raised_by_run > 1:
            text += f"; raised {self.raised_by_run:.2f}x to what a run reached"
        return text

    def raised(self, factor: float) -> Ceilings:
        return replace(self, matmul_flops_per_s=self.matmul_flops_per_s * factor,
                       copy_bytes_per_s=self.copy_bytes_per_s * factor,
                       raised_by_run=self.raised_by_run * factor)


def calibration_dir() -> str:
    return cache_dir("calibration")


def device_key(device: torch.device) -> tuple[str, str, str]:
    """(device name, driver, torch version): what invalidates a measurement."""
    from archserve.platform.detect import cpu_name, nvml_driver_versions
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        driver = nvml_driver_versions()[0] or f"cuda-runtime-{torch.version.cuda}"
    else:
        name, driver = cpu_name(), f"cpu-threads-{torch.get_num_threads()}"
    return name, driver, torch.__version__


def cache_path(device: torch.device) -> str:
    key = "|".join((*device_key(device), f"calibration-v{CALIBRATION_VERSION}"))
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return os.path.join(calibration_dir(), f"{device.type}-{digest}.json")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(fn, device: torch.device, repeats: int) -> float:
    fn()                               # warm-up: allocations, kernel selection
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def measure_matmul_flops(device: torch.device, size: int, dtype: torch.dtype,
                         repeats: int = 5) -> float:
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    inner = 10 if device.type == "cuda" else 1   # amortise launch gaps on a GPU

    def run() -> None:
        for _ in range(inner):
            torch.mm(a, b)
    return 2.0 * size**3 * inner / _best_seconds(run, device, repeats)


def measure_copy_bandwidth(device: torch.device, num_bytes: int, repeats: int = 5) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    return 2.0 * num_bytes / _best_seconds(lambda: dst.copy_(src), device, repeats)


def measure(device: torch.device) -> Ceilings:
    """Run the calibration now (about a second on a GPU, a few on a CPU)."""
    if device.type == "cuda":
        dtype, size, copy_bytes = torch.bfloat16, 8192, 1 << 30
    else:
        dtype, size, copy_bytes = torch.float32, 1024, 64 << 20
    return Ceilings(matmul_flops_per_s=measure_matmul_flops(device, size, dtype),
                    copy_bytes_per_s=measure_copy_bandwidth(device, copy_bytes),
                    device_name=device_key(device)[0],
                    matmul_dtype=str(dtype).removeprefix("torch."),
                    measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def load_or_measure(device: torch.device, refresh: bool = False) -> Ceilings:
    """The cached ceilings of ``device``, measuring and caching them on a miss."""
    path = cache_path(device)
    if not refresh and os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            data["cached"] = True
            return Ceilings(**data)
        except (OSError, ValueError, TypeError):
            pass   # a corrupt or old-format entry is measured again
    ceilings = measure(device)
    store(device, ceilings)
    return ceilings


def store(device: torch.device, ceilings: Ceilings) -> None:
    """Cache ``ceilings`` as this device's (replacing what was there)."""
    path = cache_path(device)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(ceilings.to_json(), f, indent=1)
        os.replace(tmp, path)      # atomic: a concurrent reader never sees half a file
    except OSError:
        pass   # a read-only cache only costs the next run a re-measurement
