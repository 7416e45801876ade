"""Triton kernels that reach the compiler after start-up: what the warm-up missed.

Start-up runs every kernel variant it can reach (the prefill warm-up, decode graph capture,
the tuners), so that no request waits for a compiler. Triton builds one variant per set of
constexprs and per specialisation of its integer arguments (equal to 1, divisible by 16),
so a batch of a shape the warm-up did not reach (the first step of 16 prompts, say) compiles
on the serving path, or loads from the disk cache, and its requests wait 0.1-1 s. After
``watch_after_startup()`` every such variant is counted and logged, so a slow first request
says why.
"""

from __future__ import annotations

import logging
from collections import Counter

log = logging.getLogger(__name__)

LOGGED_PER_KERNEL = 3       # warnings per kernel name; the count goes on
_compiled: Counter[str] = Counter()
_serving = False            # between an engine's start-up and the next one's


def starting() -> None:
    """An engine of this process starts: its compiles are the warm-up, not misses."""
    global _serving
    _serving = False


def compiled_after_startup() -> dict[str, int]:
    """Kernel name -> variants compiled (or loaded) since ``watch_after_startup``."""
    return dict(_compiled)


def compiled_since(before: dict[str, int]) -> dict[str, int]:
    """Variants compiled since ``before`` (an earlier ``compiled_after_startup()``): what
    a run waited for the compiler for, by kernel name."""
    return {name: count - before.get(name, 0) for name, count in _compiled.items()
            if count > before.get(name, 0)}


def watch_after_startup() -> bool:
    """Count, from now on, Triton variants that are not already loaded in this process.
    False where Triton, or its runtime hook (``triton.knobs.runtime.jit_cache_hook``), is
    absent; installed once per process, in front of any hook already there."""
    global _serving
    try:
        from triton import knobs
        runtime = knobs.runtime
        previous = runtime.jit_cache_hook
    except (ImportError, AttributeError):
        return False
    _serving = True
    if getattr(previous, "archserve_watch", False):
        return True

    def hook(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - Triton's hook signature
        note_compile(kwargs)
        return previous(*args, **kwargs) if previous is not None else None

    hook.archserve_watch = True   # type: ignore[attr-defined]
    runtime.jit_cache_hook = hook
    return True


def note_compile(hook_kwargs: dict) -> None:
    """Count and log one variant from the hook's keywords (``fn``, ``repr``,
    ``is_manual_warmup``); an explicit ``kernel.warmup()`` is not the serving path."""
    if not _serving or hook_kwargs.get("is_manual_warmup"):
        return
    fn = hook_kwargs.get("fn")
    name = str(getattr(fn, "name", None) or getattr(fn, "__name__", None) or "triton kernel")
    _compiled[name] += 1
    if _compiled[name] <= LOGGED_PER_KERNEL:
        # Triton's repr spans lines (one per argument): one line keeps it whole in the
        # logs that a tail or a grep reads.
        log.warning("Triton compiled a variant of %s after start-up (the warm-up did not "
                    "reach this shape; its request waited for the compiler): %s%s", name,
                    " ".join(str(hook_kwargs.get("repr", "")).split()),
                    specialization(hook_kwargs))


def specialization(hook_kwargs: dict) -> str:
    """What made this variant, by argument name: the arguments Triton fixed to a value
    (constexprs, integers equal to 1) and those it took as divisible by 16, from the hook's
    ``compile`` payload; "" where the payload has another form (Triton 3.6's repr names
    only the first argument, so the repr alone does not say which shape was missed)."""
    payload = hook_kwargs.get("compile") or {}
    params = getattr(getattr(hook_kwargs.get("fn"), "jit_function", None), "params", None) or []
    names = [getattr(p, "name", str(p)) for p in params]

    def arg(path) -> str:  # noqa: ANN001 - Triton keys arguments by (index,) tuples
        index = path[0] if isinstance(path, tuple) and len(path) == 1 else path
        return names[index] if isinstance(index, int) and 0 <= index < len(names) else str(path)
    try:
        fixed = [f"{arg(path)}={value}" for path, value in (payload.get("constants") or {}).items()]
        divisible = sorted({arg(path) for config in payload.get("configs") or ()
                            for path, attrs in dict(config).items()
                            if any("divisibility" in str(a) for a in attrs)})
    except (TypeError, ValueError, AttributeError):
        return ""
    parts = ([f"fixed {', '.join(fixed)}"] if fixed else []) + (
        [f"divisible by 16: {', '.join(divisible)}"] if divisible else [])
    return f" ({'; '.join(parts)})" if parts else ""
