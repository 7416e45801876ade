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
- Each layer's cache write and attention is one opaque op (``layer_attention_op``) that
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

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from archserve.engine.cuda_graphs import CANARY_BLOCKS, random_cache_values, replay_mismatch
from archserve.kernels.attention.interface import AttentionMetadata, DecodeRows
from archserve.models.layers.attention import attention_in_traced_step
from archserve.models.layers.forward_context import (
    ForwardContext,
    get_forward_context,
    set_forward_context,
)

log = logging.getLogger(__name__)

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]   # (ids, positions) -> logits


@dataclass
class CompiledSteps:
    """The compiled decode step of each batch size, and why a size has none."""

    steps: dict[int, Step] = field(default_factory=dict)
    demoted: dict[int, str] = field(default_factory=dict)
    # Attention layers each size's graph calls back into Python for (an opaque op).
    opaque_layers: dict[int, int] = field(default_factory=dict)
    # Sizes whose compiled step torch's caches held (a warm start), not compiled afresh.
    from_cache: set[int] = field(default_factory=set)

    @property
    def sizes(self) -> list[int]:
        return sorted(self.steps)

    @property
    def attention(self) -> str:
        """Where the compiled steps attend: in the graph, or through an opaque op (the
        backend's Python, once a layer) for some layers."""
        opaque = {size: n for size, n in self.opaque_layers.items()
                  if n and size in self.steps}
        if not opaque:
            return "attention in the graph"
        return f"attention an opaque op in {max(opaque.values())} layers"


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def decode_meta(lengths: list[int], block_tables: torch.Tensor, block_size: int,
                device: torch.device, ring_rows: int = 0) -> AttentionMetadata:
    """A decode step's metadata: one query per sequence at ``lengths``, writing its key
    and value at its last position: the slot its block table gives, or with ``ring_rows``
    (a model whose window keys live in a ring a sequence: DeepSeek V4) the row of ring
    i's for sequence i."""
    last = torch.tensor(lengths, device=device) - 1
    if ring_rows:
        slots = torch.arange(len(lengths), device=device) * ring_rows + last % ring_rows
    else:
        blocks = block_tables.long().gather(1, (last // block_size)[:, None])[:, 0]
        slots = blocks * block_size + last % block_size
    return AttentionMetadata.from_lengths([1] * len(lengths), lengths, block_tables, slots,
                                          device)


# The sizes the trace sees for the padded context and the cache's blocks, both symbols:
# each unlike the other (tracing takes two sizes of one value for one symbol) and unlike
# any fixed size. The blocks are a symbol so that inductor's on-disk cache, keyed by the
# graph, serves a start whose memory gave the cache another number of blocks.
TRACED_CONTEXT = 37
TRACED_CACHE_BLOCKS = 53


def traced_inputs(size: int, kv_caches: list[torch.Tensor], device: torch.device
                  ) -> list[torch.Tensor]:
    """Fake inputs of a decode step of ``size`` sequences: input ids, positions, then its
    ``DecodeRows`` (slots, cache rows [size, L], lengths) and the caches. Every size is
    fixed but the padded context's L and the caches' blocks, symbols: the graph serves
    every context length and cache size."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (
        DimDynamic,
        ShapeEnv,
        StatelessSymbolicContext,
    )

    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)

    def fake(shape: tuple[int, ...], dtype: torch.dtype, dynamic: int | None = None
             ) -> torch.Tensor:
        sizes = [DimDynamic.DYNAMIC if d == dynamic else DimDynamic.STATIC
                 for d in range(len(shape))]
        return mode.from_tensor(torch.empty(shape, dtype=dtype, device=device),
                                symbolic_context=StatelessSymbolicContext(sizes))

    # Two tensors for ids and positions, never one passed twice, which a tracer would
    # take for one input read in both places.
    return [fake((size,), torch.long), fake((size,), torch.long), fake((size,), torch.long),
            fake((size, TRACED_CONTEXT), torch.long, dynamic=1), fake((size,), torch.int32),
            *(fake((kv.shape[0], TRACED_CACHE_BLOCKS, *kv.shape[2:]), kv.dtype, dynamic=1)
              for kv in kv_caches)]


def trace_decode_step(model: torch.nn.Module, context: ForwardContext,
                      inputs: list[torch.Tensor]) -> torch.fx.GraphModule:
    """The decode forward through the LM head, as an FX graph of tensor ops over
    ``traced_inputs``; attention in the graph where its backend allows
    (``attention_in_traced_step``), else an opaque op."""
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
             rows: torch.Tensor, seq_lens: torch.Tensor, *kv_caches: torch.Tensor
             ) -> torch.Tensor:
        traced = dataclasses.replace(context, kv_caches=list(kv_caches))
        with set_forward_context(traced), attention_in_traced_step(
                DecodeRows(slots, rows, seq_lens)):
            return model.compute_logits(model(input_ids, positions))

    with torch.inference_mode():
        # The parameters are real tensors; the graph holds them as constants.
        graph = make_fx(step, tracing_mode="symbolic", _allow_non_fake_inputs=True)(*inputs)
    # Nothing checks a guard when the graph runs: one taken while tracing (the model's
    # Python branching on a context length or the cache's size) would hold silently.
    guards = detect_fake_mode(inputs).shape_env.guards
    if guards:
        raise ValueError(f"the trace assumed {', '.join(str(g.expr) for g in guards)}, "
                         f"which another step's sizes may break")
    return graph


def opaque_attention_layers(graph: torch.fx.GraphModule) -> int:
    """How many attention layers ``graph`` calls back into Python for (``layer_attention_op``)."""
    return sum(1 for node in graph.graph.nodes
               if node.op == "call_function" and "archserve.layer_attention" in str(node.target))


def make_cacheable(graph: torch.fx.GraphModule) -> None:
    """Drop the ShapeEnv the trace left on ``graph``: AOTAutograd's cache key pickles the
    graph, and a ShapeEnv holds objects that cannot be pickled, for which the cache is
    bypassed. With it gone a warm start finds the compiled step in that cache, which skips
    re-tracing the graph (~10 s of the embedded model's ~14 s warm start on 2 cores); the
    symbols' guards live in the fake inputs' own ShapeEnv, which the compile uses."""
    if hasattr(graph, "shape_env"):
        del graph.shape_env


def compile_graph(graph: torch.fx.GraphModule, inputs: list[torch.Tensor], block_size: int
                  ) -> Step:
    """``graph`` compiled by inductor (its Python wrapper: the C++ one timed no faster here
    and compiles longer), rounding 16-bit intermediates as eager does, without autotuning
    (a start-up would time GEMM templates for minutes). Torch caches what it compiles
    (AOTAutograd's and inductor's FX graph caches, keyed by the graph and its constants'
    shapes: ``make_cacheable``), so a second start loads it in seconds. The step reads
    its ``DecodeRows`` and caches from the forward context when it runs."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    make_cacheable(graph)
    # size_asserts off: the wrapper checked the shape of every kernel's output, ~600 Python
    # calls a step of the embedded model, for shapes fixed by the trace.
    with torch.inference_mode(), inductor_config.patch(max_autotune=False, size_asserts=False,
                                                       emulate_precision_casts=True):
        compiled = compile_fx(graph, inputs)

    def run(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        step = DecodeRows.of_step(ctx.attn_metadata, block_size)
        if bool((step.slots < 0).any()):
            # The graph writes every row's key and value; a slot of -1 would write row -1.
            raise ValueError("a compiled decode step writes every sequence's key and value: "
                             "slot -1 (write nothing) has no compiled form")
        out = compiled(input_ids, positions, step.slots, step.rows, step.seq_lens,
                       *ctx.kv_caches)
        return out[0] if isinstance(out, (list, tuple)) else out
    return run


def compile_decode_steps(model: torch.nn.Module, make_context: Callable[[AttentionMetadata],
                         ForwardContext], kv_caches: list[torch.Tensor], sizes: list[int],
                         device: torch.device, tolerance: float, ring_rows: int = 0
                         ) -> CompiledSteps:
    """A compiled decode step per size of ``sizes``, each checked by the canary
    (``canary_mismatch``); a size whose trace, compile or canary fails is demoted with its
    reason (its steps run eager). ``ring_rows``: decode_meta's."""
    from torch._dynamo.utils import counters

    result = CompiledSteps()
    block_size = kv_caches[0].shape[2] if kv_caches else 16
    for size in sizes:
        start = time.perf_counter()
        hits = counters["aot_autograd"]["autograd_cache_hit"]
        try:
            tables = torch.zeros((size, 1), dtype=torch.int32, device=device)
            context = make_context(decode_meta([1] * size, tables, block_size, device))
            inputs = traced_inputs(size, kv_caches, device)
            graph = trace_decode_step(model, context, inputs)
            result.opaque_layers[size] = opaque_attention_layers(graph)
            step = compile_graph(graph, inputs, block_size)
            if counters["aot_autograd"]["autograd_cache_hit"] > hits:
                result.from_cache.add(size)
            reason = canary_mismatch(model, step, make_context, kv_caches, size, block_size,
                                     device, tolerance, ring_rows)
        except Exception as exc:  # demote this size only
            reason = f"compiling failed: {first_line(exc)}"
        if reason is None:
            result.steps[size] = step
            log.info("compiled the decode step of batch size %d in %.1fs%s", size,
                     time.perf_counter() - start,
                     " (from torch's caches)" if size in result.from_cache else "")
        else:
            result.demoted[size] = reason
            log.warning("decode steps of batch size %d run eager: %s", size, reason)
    return result


def canary_mismatch(model: torch.nn.Module, step: Step,
                    make_context: Callable[[AttentionMetadata], ForwardContext],
                    kv_caches: list[torch.Tensor], size: int, block_size: int,
                    device: torch.device, tolerance: float, ring_rows: int = 0) -> str | None:
    """None when the compiled ``step`` gives the eager step's logits, else why not: at two
    context lengths unlike the trace's, over cache blocks of random values (on a zero
    cache a wrong length would give the same output), restored after. Each run starts
    from the same values and writes its own keys and values, so a wrong write slot shows.
    With ``ring_rows`` the caches' second half are window rings (model_kv_caches' order),
    one a sequence, touched whole."""
    paged = kv_caches[:len(kv_caches) // 2] if ring_rows else kv_caches
    rings = kv_caches[len(paged):]
    if rings and size > rings[0].shape[1]:
        return f"the compiled step canary has {rings[0].shape[1]} window rings for {size} sequences"
    blocks = min(CANARY_BLOCKS, *(kv.shape[1] for kv in paged)) if paged else 1
    touched = [kv[:, :blocks] for kv in paged] + list(rings)
    saved = [t.clone() for t in touched]
    generator = torch.Generator(device=device).manual_seed(0)
    filled = [random_cache_values(t.shape, t.dtype, generator, device) for t in touched]
    rows = torch.arange(size, device=device)
    capacity = block_size * blocks

    def logits(meta: AttentionMetadata, ids: torch.Tensor, positions: torch.Tensor,
               compiled: bool) -> torch.Tensor:
        for t, values in zip(touched, filled, strict=True):
            t.copy_(values)
        with torch.inference_mode(), set_forward_context(make_context(meta)):
            if compiled:
                return step(ids, positions).float()
            return model.compute_logits(model(ids, positions)).float()

    try:
        for base in (3, capacity - size - 1):
            # Lengths that wrap within the touched blocks: rows share blocks (each table
            # is the blocks rotated by its row), but no two write one slot.
            lengths = [1 + (base - 1 + 5 * r) % capacity for r in range(size)]
            tables = ((rows[:, None] + torch.arange(blocks, device=device)) % blocks
                      ).to(torch.int32)
            meta = decode_meta(lengths, tables, block_size, device, ring_rows)
            if meta.slot_mapping.unique().numel() < size:
                return (f"the compiled step canary has no distinct cache slots for {size} "
                        f"sequences in {blocks} blocks")
            ids = 5 + rows % 11
            positions = torch.tensor(lengths, device=device) - 1
            reason = replay_mismatch(
                logits(meta, ids, positions, compiled=False),
                logits(meta, ids, positions, compiled=True), tolerance,
                f"compiled step canary (batch {size}, lengths {lengths})")
            if reason is not None:
                return reason
        return None
    finally:
        for t, before in zip(touched, saved, strict=True):
            t.copy_(before)
