"""The executor backends by name (vLLM's ``distributed_executor_backend``): one process per
rank through multiprocessing, or Ray actors across machines."""

from __future__ import annotations

from archserve.distributed.executor import Executor

BACKENDS = ("mp", "ray")


def make_executor(backend: str, size: int, device_type: str) -> Executor:
    if backend == "mp":
        from archserve.distributed.mp_executor import MultiprocessExecutor
        return MultiprocessExecutor(size, device_type)
    if backend == "ray":
        from archserve.distributed.ray_executor import RayExecutor
        return RayExecutor(size, device_type)
    raise ValueError(f"distributed_executor_backend {backend!r} is not one of "
                     f"{', '.join(BACKENDS)}")
