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
  steps, 0 leaves them eager. Where none is given, ``$ARCHSERVE_COMPILATION_LEVEL``, else 3:
  as vLLM, archserve compiles by default, because a compiled step of the embedded model
  takes half an eager one's time (docs/benchmarks.md). The first start of a model pays the
  compile (~40 s on 2 cores); torch's caches serve later starts (see
  ``cpu_decode_steps_decision``). GPU graphs follow ``cudagraph_mode`` alone.

Any other key is refused by name rather than ignored.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from archserve.engine.config_json import loads_option, refuse_unknown_keys
from archserve.platform.decision import Decision

CUDAGRAPH_MODES = ("NONE", "FULL_DECODE_ONLY", "FULL")
_NOT_BUILT = ("PIECEWISE", "FULL_AND_PIECEWISE")
_KEYS = ("cudagraph_mode", "cudagraph_capture_sizes", "level")
_LEVELS = range(4)
# The optimisation level where compilation_config names none. An environment variable so
# that processes an engine is started in (the CLI, servers a test spawns) take it too.
LEVEL_ENV = "ARCHSERVE_COMPILATION_LEVEL"
DEFAULT_LEVEL = 3


def default_level() -> int:
    """The level where compilation_config names none: ``$ARCHSERVE_COMPILATION_LEVEL``,
    else 3 (compile, as vLLM's default)."""
    text = os.environ.get(LEVEL_ENV, "").strip()
    if not text:
        return DEFAULT_LEVEL
    if text not in {str(level) for level in _LEVELS}:
        raise ValueError(f"{LEVEL_ENV}={text!r} is not an optimisation level 0-3")
    return int(text)


@dataclass(frozen=True)
class CompilationChoice:
    cudagraph_mode: str = "FULL"
    capture_sizes: tuple[int, ...] = ()       # empty: the default ladder
    level: int | None = None                  # the optimisation level, where one was given
    # Whether the user named the mode: the default FULL says nothing where graphs are off.
    mode_given: bool = field(default=False, compare=False)

    @property
    def effective_level(self) -> int:
        """The level that applies: the one given, else ``default_level()``."""
        return self.level if self.level is not None else default_level()

    def level_source(self) -> str:
        """Where the effective level comes from, for start-up's decision."""
        if self.level is not None:
            return f"level {self.level}"
        if os.environ.get(LEVEL_ENV, "").strip():
            return f"level {self.effective_level} (${LEVEL_ENV})"
        return f"level {self.effective_level} (the default)"


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


def cpu_decode_steps_decision() -> Decision:
    """What a CPU engine's decode steps run as where compilation_config names no level, for
    explain and doctor (start-up's own decision says which batch sizes compiled, or why
    they run eager)."""
    choice = CompilationChoice()
    try:
        default_level()
    except ValueError as exc:   # an engine would refuse to start: say so, and why
        return Decision("decode steps (CPU)", f"${LEVEL_ENV}", "refused", str(exc))
    if not choice.effective_level:
        return Decision("decode steps (CPU)", choice.level_source(), "eager",
                        "-O 1-3 compiles them")
    return Decision(
        "decode steps (CPU)", choice.level_source(),
        "compiled by inductor at batch size 1 (cudagraph_capture_sizes: others)",
        "Python runs once a step instead of once an op: the embedded model's step takes "
        "about half an eager one's time (docs/benchmarks.md). A model's first start compiles "
        "(~40 s on 2 cores); later starts load torch's caches (a few seconds). Each size is "
        "checked against the eager step at start-up and runs eager where it differs; tensor "
        "parallel, LoRA, calculate_kv_scales and drafters that read hidden states keep "
        "steps eager, as do -O 0 and enforce_eager")
