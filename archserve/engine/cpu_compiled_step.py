"""Compiled decode steps on a CPU: the counterpart of CUDA graphs (engine/cuda_graphs.py).

An eager decode step on a CPU spends much of its time in Python and dispatch: a few dozen
small ops per layer, each a Python call and a dispatch. torch.compile (inductor, C++
wrapper) turns the model's forward into generated C++ run at each decode batch size of the
ladder CUDA graphs use; a batch of ``b`` sequences runs the smallest compiled size >= b
with the tail padded (slot -1: nothing written; outputs discarded), through the same
static buffers and replay as a graph (``compile_model`` says which sizes share a graph).

Attention stays an opaque op (``archserve::attention``, models/layers/attention.py) that
reads the step's lengths and block tables when it runs, so one compiled size serves every
context length. The LM head runs after the compiled body, eagerly: it is one GEMM, and the
LM head's own route (its dtype and kernel) stays what it is for eager steps.

A size whose compile fails is demoted with its reason, as a graph whose capture fails; a
replay canary compares each compiled size with the eager step on random KV blocks and
context lengths unlike the warm-up's, under ``fail_on_recompile``: a compiled size that
would recompile per step, or that computes differently, is dropped with the reason.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

from archserve.engine.cuda_graphs import DecodeGraphRunner, weak_callback
from archserve.kernels.attention.interface import AttentionMetadata

log = logging.getLogger(__name__)


def first_line(exc: BaseException) -> str:
    """An exception as one line for a log or a demotion reason."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def configure_inductor(cache_dir: str | None) -> None:
    """Inductor's settings for a decode step: the C++ wrapper (the generated function calls
    kernels without a Python frame per op), no autotuning (a start-up would time GEMM
    templates for minutes), and its cache under archserve's (``cache_dir``: a second
    start loads the compiled steps instead of compiling them). A cache directory the user
    chose (TORCHINDUCTOR_CACHE_DIR) is respected."""
    import torch._inductor.config as inductor_config
    if cache_dir is not None:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", cache_dir)
    inductor_config.cpp_wrapper = True
    inductor_config.max_autotune = False
    inductor_config.fx_graph_cache = True


def compile_model(model: torch.nn.Module) -> Callable:
    """The model's forward as torch.compile traces it: the whole forward as one graph
    (``fullgraph``: a graph break would put Python back between ops, and fails instead, with
    its reason). Sizes are compiled in ascending order, so dynamo compiles batch size 1
    with static shapes and, at size 2, one graph with a symbolic batch size that every
    larger size of the ladder runs: two compiles whatever the ladder's length (a compile
    of the embedded model takes ~20 s on a 2-core CPU, one per size would take minutes)."""
    return torch.compile(model, fullgraph=True)


class CompiledStep:
    """One batch size's compiled forward, run the way a captured graph replays."""

    def __init__(self, runner: CompiledDecodeRunner, size: int) -> None:
        self.run = weak_callback(runner.run_size)
        self.size = size

    def replay(self) -> None:
        self.run(self.size)


class CompiledDecodeRunner(DecodeGraphRunner):
    """Compiled decode steps over the static buffers of ``DecodeGraphRunner``, at the sizes
    of its ladder. ``forward(input_ids, positions, meta, out)`` is the compiled step
    through the LM head; ``eager`` the same step without compilation (the canary's
    reference)."""

    def __init__(self, forward, eager, device: torch.device, max_size: int,
                 max_blocks_per_seq: int, max_model_len: int) -> None:
        super().__init__(forward, device, max_size, max_blocks_per_seq, max_model_len)
        self.reference = weak_callback(eager)
        self.batch_lengths: list[int] = []   # the running step's context lengths
        self.thread_counts: list[int] = []   # torch thread counts compiled for
        # The canary refuses recompiles (the stance "fail_on_recompile"); serving, a
        # recompile is caught in ``replay``.
        self.stance = "default"

    def capture(self, sizes: list[int], thread_counts: list[int] | None = None) -> object:
        """Compile each size (a warm-up forward traces and compiles it) instead of capturing
        a graph, at each of ``thread_counts`` (default: the current one): inductor's C++
        bakes torch's thread count in, and the CPU thread governor moves it with the load.
        A failed size is demoted with its reason."""
        threads = torch.get_num_threads()
        counts = sorted(set(thread_counts or [threads]))
        self.thread_counts = counts
        # Two graphs (batch size 1, and a symbolic one) per thread count: room for them.
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, 2 * len(counts) + 8)
        try:
            for size in sorted(sizes):
                try:
                    for count in counts:
                        torch.set_num_threads(count)
                        self.batch_lengths = []
                        out = self._forward_at(size)
                    if self.output is None:
                        self.output = torch.empty((max(sizes), *out.shape[1:]),
                                                  dtype=out.dtype, device=self.device)
                    self.set.graphs[size] = CompiledStep(self, size)
                except Exception as exc:  # demote this size only
                    self.set.demoted[size] = first_line(exc)
                    log.warning("compiling the decode step of batch size %d failed (%s); its "
                                "steps run the next larger compiled size, or eager above the "
                                "largest", size, self.set.demoted[size])
        finally:
            torch.set_num_threads(threads)
        self.set.sizes = sorted(self.set.graphs)
        return self.set

    def _meta(self, size: int) -> AttentionMetadata:
        """The static buffers' metadata, with the running step's host lengths (the opaque
        attention op reads them; padded rows attend their one key)."""
        meta = super()._meta(size)
        lengths = self.batch_lengths[:size]
        lengths = lengths + [1] * (size - len(lengths))
        meta.seq_lens_cpu = lengths
        meta.max_seq_len = max(lengths)
        return meta

    def run_size(self, size: int) -> None:
        with torch.compiler.set_stance(self.stance):
            out = self._forward_at(size, self.output)
        target = self.output[:size]
        if out.data_ptr() != target.data_ptr():
            target.copy_(out)

    def replay(self, size: int, input_ids: torch.Tensor, positions: torch.Tensor,
               meta: AttentionMetadata, fed_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The compiled step; where it cannot run (it would recompile: a thread count or
        a global it was not compiled for), every size goes eager with the reason, and this
        step runs eager. Nothing ran then: dynamo decides before the compiled code runs.
        A step at a thread count not compiled for (the governor's between 1 and the
        maximum, on a machine of more than 2 cores) runs eager."""
        self.batch_lengths = list(meta.seq_lens_cpu or meta.seq_lens.tolist())
        if torch.get_num_threads() in self.thread_counts:
            try:
                return super().replay(size, input_ids, positions, meta, fed_ids)
            except Exception as exc:
                if self.stance == "fail_on_recompile":
                    raise   # the canary's
                self.drop_all(f"a compiled step failed: {first_line(exc)}")
        if fed_ids is not None:
            input_ids = input_ids.clone()
            input_ids[:fed_ids.shape[0]] = fed_ids
        return self.reference(input_ids, positions, meta)

    def _canary_at(self, size: int, tolerance: float) -> str | None:
        """The graph canary (random KV blocks, context lengths unlike the warm-up's) with
        recompiles refused: a compiled size that bakes a length in fails it."""
        self.stance = "fail_on_recompile"
        try:
            return super()._canary_at(size, tolerance)
        except Exception as exc:
            return (f"compiled step (batch {size}) recompiles at another context length: "
                    f"{first_line(exc)}")
        finally:
            self.stance = "default"
