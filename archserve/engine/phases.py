"""Named phases of an engine step, visible in a torch.profiler trace as ``archserve::NAME``.

Free when no profiler runs (one C-level flag check), so the step loop always carries them;
benchmarks/profile_engine_step.py reads them to split a step into host and device parts.
"""

from __future__ import annotations

from archserve.models.layers.forward_context import profiled_region

PREFIX = "archserve::"


def phase(name: str):
    """Context manager marking ``name`` in a running profile; a no-op otherwise."""
    return profiled_region(PREFIX + name)
