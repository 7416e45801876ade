"""Compiled decode steps on a CPU: Python runs once a step instead of once an op.

An eager decode step of a small model on a CPU spends more time in Python and dispatch
than in its GEMMs: a few dozen small ops per layer, each a Python call and a dispatch
(the embedded model: ~2500 ops a step). Here a decode step of one batch size, through the
LM head, is traced once into an FX graph and compiled by inductor, which fuses the
elementwise ops (norms, rotary, SiLU, residual adds) into a few generated C++ loops and
calls the GEMMs (the linear route's own kernels: ``_weight_int4pack_mm_for_cpu``, oneDNN)
directly.

How it stays correct:
- The trace is ``make_fx`` over fake tensors, not dynamo: the model's Python (its routing,
  the forward context) runs once, at trace time, and only tensor ops are recorded. So a
  call checks no guards (dynamo's guards on every parameter cost ms a step), and nothing
  is recompiled behind the engine's back; the runner calls a compiled step only for a
  pure decode batch of its size with the state it was traced in (no LoRA, no kept hidden
  states, no fp8 scale calibration pending: ``compiled_steps_off_reason``).
- Each layer's cache write and attention is one opaque op (``paged_attention_op``) that
  reads the step's lengths, block tables and cache when it runs: one graph serves every
  context length, and nothing of a step's metadata is baked in.
- Inductor rounds a 16-bit model's intermediates where eager does
  (``emulate_precision_casts``). By default it computes a fused elementwise chain in
  float32 and rounds once at its end: the embedded model's bfloat16 logits then moved by
  up to 1.56 (of 26) from eager's; emulated, they are eager's bit for bit.
- A canary runs the compiled step against the eager one on cache blocks of random
  values at context lengths unlike the trace's; a size that differs is not kept, with
  the reason (a stale length, a wrong cache row or weight differs by the logits' scale).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from archserve.engine.cuda_graphs import CANARY_BLOCKS, random_cache_values, replay_mismatch
from archserve.kernels.attention.interface import AttentionMetadata
from archserve.models.layers.attention import attention_as_opaque_op
from archserve.models.layers.forward_context import ForwardContext, set_forward_context

log = logging.getLogger(__name__)

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]   # (ids, positions) -> logits


@dataclass
class CompiledSteps:
    """The compiled decode step of each batch size, and why a size has none."""

    steps: dict[int, Step] = field(default_factory=dict)
    demoted: dict[int, str] = field(default_factory=dict)

    @property
    def sizes(self) -> list[int]:
        return sorted(self.steps)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def decode_meta(lengths: list[int], block_tables: torch.Tensor, device: torch.device
                ) -> AttentionMetadata:
    """A decode step's metadata: one query per sequence at ``lengths``, writing nothing
    (slot -1)."""
    return AttentionMetadata.from_lengths(
        [1] * len(lengths), lengths, block_tables,
        torch.full((len(lengths),), -1, dtype=torch.long, device=device), device)


def example_inputs(size: int, device: torch.device) -> list[torch.Tensor]:
    """(input ids, positions) of a decode step of ``size`` sequences: two tensors, never
    one passed twice, which a tracer would take for one input read in both places."""
    return [torch.zeros(size, dtype=torch.long, device=device) for _ in range(2)]


def trace_decode_step(model: torch.nn.Module, context: ForwardContext, size: int,
                      device: torch.device) -> torch.fx.GraphModule:
    """The decode forward of ``size`` sequences through the LM head, as an FX graph of
    tensor ops (attention opaque), traced over fake inputs in ``context``."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return model.compute_logits(model(input_ids, positions))

    with torch.inference_mode(), set_forward_context(context), attention_as_opaque_op():
        # The parameters are real tensors; the graph holds them as constants.
        return make_fx(step, tracing_mode="fake", _allow_non_fake_inputs=True)(
            *example_inputs(size, device))


def compile_graph(graph: torch.fx.GraphModule, size: int, device: torch.device) -> Step:
    """``graph`` compiled by inductor (its Python wrapper: the C++ one timed no faster here
    and compiles longer), rounding 16-bit intermediates as eager does, without autotuning
    (a start-up would time GEMM templates for minutes). Inductor caches what it compiles (its FX graph cache, keyed by the graph
    and its constants' shapes), so a second start loads it in seconds."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    # size_asserts off: the wrapper checked the shape of every kernel's output, ~600 Python
    # calls a step of the embedded model, for shapes fixed by the trace.
    with torch.inference_mode(), inductor_config.patch(max_autotune=False, size_asserts=False,
                                                       emulate_precision_casts=True):
        compiled = compile_fx(graph, example_inputs(size, device))

    def run(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = compiled(input_ids, positions)
        return out[0] if isinstance(out, (list, tuple)) else out
    return run


def compile_decode_steps(model: torch.nn.Module, make_context: Callable[[AttentionMetadata],
                         ForwardContext], kv_caches: list[torch.Tensor], sizes: list[int],
                         device: torch.device, tolerance: float) -> CompiledSteps:
    """A compiled decode step per size of ``sizes``, each checked by the canary
    (``canary_mismatch``); a size whose trace, compile or canary fails is demoted with its
    reason (its steps run eager)."""
    result = CompiledSteps()
    block_size = kv_caches[0].shape[2] if kv_caches else 16
    for size in sizes:
        start = time.perf_counter()
        try:
            tables = torch.zeros((size, 1), dtype=torch.int32, device=device)
            context = make_context(decode_meta([1] * size, tables, device))
            step = compile_graph(trace_decode_step(model, context, size, device), size, device)
            reason = canary_mismatch(model, step, make_context, kv_caches, size, block_size,
                                     device, tolerance)
        except Exception as exc:  # demote this size only
            reason = f"compiling failed: {first_line(exc)}"
        if reason is None:
            result.steps[size] = step
            log.info("compiled the decode step of batch size %d in %.1fs", size,
                     time.perf_counter() - start)
        else:
            result.demoted[size] = reason
            log.warning("decode steps of batch size %d run eager: %s", size, reason)
    return result


def canary_mismatch(model: torch.nn.Module, step: Step,
                    make_context: Callable[[AttentionMetadata], ForwardContext],
                    kv_caches: list[torch.Tensor], size: int, block_size: int,
                    device: torch.device, tolerance: float) -> str | None:
    """None when the compiled ``step`` gives the eager step's logits, else why not: at two
    context lengths unlike the trace's, over cache blocks of random values (on a zero
    cache a wrong length would give the same output), restored after."""
    blocks = min(CANARY_BLOCKS, *(kv.shape[1] for kv in kv_caches)) if kv_caches else 1
    touched = [kv[:, :blocks] for kv in kv_caches]
    saved = [t.clone() for t in touched]
    generator = torch.Generator(device=device).manual_seed(0)
    for t in touched:
        t.copy_(random_cache_values(t.shape, t.dtype, generator, device))
    rows = torch.arange(size, device=device)
    try:
        for base in (3, block_size * blocks - size - 1):
            lengths = [max(1, min(base + 5 * r, block_size * blocks)) for r in range(size)]
            tables = ((rows[:, None] + torch.arange(blocks, device=device)) % blocks
                      ).to(torch.int32)
            meta = decode_meta(lengths, tables, device)
            ids = 5 + rows % 11
            positions = torch.tensor(lengths, device=device) - 1
            with torch.inference_mode(), set_forward_context(make_context(meta)):
                eager = model.compute_logits(model(ids, positions)).float()
            with torch.inference_mode(), set_forward_context(make_context(meta)):
                compiled = step(ids, positions).float()
            reason = replay_mismatch(eager, compiled, tolerance,
                                     f"compiled step canary (batch {size}, lengths {lengths})")
            if reason is not None:
                return reason
        return None
    finally:
        for t, before in zip(touched, saved, strict=True):
            t.copy_(before)
