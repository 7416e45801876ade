"""vLLM's ``compilation_config``, as far as archserve has what it names.

On a GPU archserve captures CUDA graphs by hand; on a CPU it can compile decode steps with
inductor (engine/cpu_compiled_step.py). Of vLLM's keys it takes:

- ``cudagraph_mode``: ``FULL`` (the default: steps with prompt tokens replay graphs too, at
  token buckets: engine/mixed_graphs.py; where the attention backend cannot be captured
  with prompt tokens, it falls back to decode steps alone and says so),
  ``FULL_DECODE_ONLY`` (decode steps replay graphs, steps with prompt tokens run eagerly)
  or ``NONE`` (no graphs, as ``enforce_eager``). FULL is the default because an eager step
  costs 15-21 ms of host launches at any length on an H200 (docs/benchmarks.md), which
  every running stream waits for; a replayed one 1.3-6.8 ms.
  ``PIECEWISE`` and ``FULL_AND_PIECEWISE`` need graphs split around attention, which
  archserve does not build;
- ``cudagraph_capture_sizes``: the decode batch sizes to capture (``cuda_graph_sizes``),
  on a CPU the batch sizes to compile (default: 1);
- an optimisation level (``-O3``, or ``level``: 0-3): on a CPU, 1-3 compile the decode
  steps (not by default: a cold compile of the embedded model takes 30-45 s on 2 cores, a
  second start loads inductor's cache in seconds), 0 or none leaves them eager. GPU graphs
  follow ``cudagraph_mode`` alone.

Any other key is refused by name rather than ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from archserve.engine.config_json import loads_option, refuse_unknown_keys

CUDAGRAPH_MODES = ("NONE", "FULL_DECODE_ONLY", "FULL")
_NOT_BUILT = ("PIECEWISE", "FULL_AND_PIECEWISE")
_KEYS = ("cudagraph_mode", "cudagraph_capture_sizes", "level")
_LEVELS = range(4)


@dataclass(frozen=True)
class CompilationChoice:
    cudagraph_mode: str = "FULL"
    capture_sizes: tuple[int, ...] = ()       # empty: the default ladder
    level: int | None = None                  # the optimisation level, where one was given
    # Whether the user named the mode: the default FULL says nothing where graphs are off.
    mode_given: bool = field(default=False, compare=False)


def parse_compilation_config(value: dict | str | None) -> CompilationChoice:
    """The choice a ``compilation_config`` (a dict, or its JSON text) asks for."""
    if value is None:
        return CompilationChoice()
    value = loads_option(value, "compilation_config")
    if isinstance(value, int) and not isinstance(value, bool):
        value = {"level": value}                 # -O3: vLLM's optimisation level
    if not isinstance(value, dict):
        raise ValueError("compilation_config must be a JSON object such as "
                         '{"cudagraph_mode": "FULL"}, or an optimisation level 0-3')
    refuse_unknown_keys(value, _KEYS, "compilation_config")
    if "level" in value and value["level"] not in _LEVELS:
        raise ValueError(f"optimisation level {value['level']!r} is not one of 0-3")
    mode = str(value.get("cudagraph_mode", "FULL")).upper()
    mode = mode.removeprefix("CUDAGRAPHMODE.")   # vLLM's enum printed as text
    if mode in _NOT_BUILT:
        raise ValueError(f"cudagraph_mode {mode} needs graphs split around attention, which "
                         f"archserve does not build; use FULL or FULL_DECODE_ONLY")
    if mode not in CUDAGRAPH_MODES:
        raise ValueError(f"unknown cudagraph_mode {mode!r}; one of {', '.join(CUDAGRAPH_MODES)}")
    sizes = value.get("cudagraph_capture_sizes") or ()
    if not all(isinstance(s, int) and s > 0 for s in sizes):
        raise ValueError("cudagraph_capture_sizes must be positive integers")
    return CompilationChoice(mode, tuple(sorted(set(sizes))), value.get("level"),
                             "cudagraph_mode" in value)
