"""The same requests through llama.cpp (llama-cpp-python's bindings), as a CPU peer.

Only a GGUF file can be compared (llama.cpp reads nothing else). The requests are the
archserve run's own token ids, decoded greedily, each to its output length (EOS ignored
unless the bench stops at it), with up to ``max_num_seqs`` sequences in one llama.cpp batch
(continuous batching over llama.cpp's sequence ids, as llama-server's slots do): a finished
sequence's cache is dropped and the next request's prompt joins the next batch. Greedy
sampling is an argmax over each sampled row's logits. ``benchmarks/build_llama_cpp_peer.sh``
builds the bindings from source for this CPU (GGML_NATIVE=ON); nothing here installs them.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np

from archserve.bench.offline import ThroughputResult
from archserve.bench.progress import progress_bar
from archserve.bench.workload import BenchRequest


def llama_cpp_available() -> str | None:
    """None when llama-cpp-python imports here, else why not."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as exc:   # ImportError, or its library failing to load (OSError)
        return (f"llama_cpp does not import ({type(exc).__name__}: {exc}); "
                f"benchmarks/build_llama_cpp_peer.sh builds it")
    return None


@dataclass
class _Slot:
    request: BenchRequest
    seq_id: int
    pending: list[int]               # tokens to feed in the next batch
    position: int = 0
    generated: list[int] = field(default_factory=list)
    first_token_s: float | None = None


class LlamaCppPeer:
    """One llama.cpp model and context with ``max_seqs`` sequence slots."""

    def __init__(self, gguf_path: str, max_seqs: int, n_ctx: int, threads: int,
                 n_batch: int = 2048) -> None:
        import logging

        import llama_cpp as lc
        # The bindings print llama.cpp's log to stderr unless their logger is above INFO.
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
        self.lc = lc
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(gguf_path.encode(), mparams)
        if not self.model:
            raise ValueError(f"llama.cpp could not load {gguf_path}")
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = cparams.n_ubatch = n_batch
        cparams.n_seq_max = max_seqs
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.no_perf = True
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise ValueError("llama.cpp could not create a context")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.n_batch = n_batch
        self.max_seqs = max_seqs
        self.batch = lc.llama_batch_init(n_batch, 0, 1)

    def close(self) -> None:
        lc = self.lc
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)
        lc.llama_model_free(self.model)

    def _decode(self, entries: list[tuple[_Slot, int, bool]]) -> None:
        """One llama_decode of (slot, token, wants logits) rows; raises on failure."""
        b = self.batch
        for i, (slot, token, logits) in enumerate(entries):
            b.token[i] = token
            b.pos[i] = slot.position
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = slot.seq_id
            b.logits[i] = logits
            slot.position += 1
        b.n_tokens = len(entries)
        code = self.lc.llama_decode(self.ctx, b)
        if code != 0:
            raise RuntimeError(f"llama_decode returned {code}")

    def _argmax(self, row: int) -> int:
        ptr = self.lc.llama_get_logits_ith(self.ctx, row)
        return int(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def run(self, requests: list[BenchRequest], ignore_eos: bool, eos: set[int],
            show_progress: bool = False) -> tuple[ThroughputResult, list[list[int]], list[float]]:
        """(throughput, each request's tokens, each request's time to first token)."""
        queue = list(enumerate(requests))
        free_ids = list(range(self.max_seqs))
        active: dict[int, _Slot] = {}
        tokens: list[list[int]] = [[] for _ in requests]
        ttft = [0.0] * len(requests)
        index_of: dict[int, int] = {}
        memory = self.lc.llama_get_memory(self.ctx)
        with progress_bar(show_progress) as bar:
            task = bar.add_task("llama.cpp", total=len(requests))
            t0 = time.perf_counter()
            while queue or active:
                while queue and free_ids:
                    index, request = queue.pop(0)
                    seq = free_ids.pop(0)
                    self.lc.llama_memory_seq_rm(memory, seq, -1, -1)
                    active[seq] = _Slot(request, seq, list(request.prompt_token_ids))
                    index_of[seq] = index
                # Decodes first (one token each), then prompt tokens up to the batch size.
                entries: list[tuple[_Slot, int, bool]] = []
                for slot in active.values():
                    if slot.generated and slot.pending:
                        entries.append((slot, slot.pending.pop(0), True))
                for slot in active.values():
                    while not slot.generated and slot.pending and len(entries) < self.n_batch:
                        token = slot.pending.pop(0)
                        entries.append((slot, token, not slot.pending))
                self._decode(entries)
                now = time.perf_counter()
                for row, (slot, _token, wants) in enumerate(entries):
                    if not wants:
                        continue
                    token = self._argmax(row)
                    slot.generated.append(token)
                    if slot.first_token_s is None:
                        slot.first_token_s = now - t0
                    done = (len(slot.generated) >= slot.request.output_len
                            or (not ignore_eos and token in eos))
                    if done:
                        index = index_of.pop(slot.seq_id)
                        tokens[index], ttft[index] = slot.generated, slot.first_token_s
                        del active[slot.seq_id]
                        free_ids.append(slot.seq_id)
                        bar.advance(task)
                    else:
                        slot.pending.append(token)
            elapsed = time.perf_counter() - t0
        result = ThroughputResult(len(requests), sum(r.input_len for r in requests),
                                  sum(len(t) for t in tokens), elapsed, list(ttft))
        return result, tokens, ttft


def run_llama_cpp_peer(gguf_path: str, requests: list[BenchRequest], ignore_eos: bool,
                       max_num_seqs: int, eos: set[int], threads: int | None = None,
                       show_progress: bool = True) -> tuple[ThroughputResult, str]:
    """(throughput, method) of llama.cpp on the same requests."""
    threads = threads or len(os.sched_getaffinity(0))
    seqs = min(max_num_seqs, len(requests))
    n_ctx = seqs * max(r.input_len + r.output_len for r in requests)
    peer = LlamaCppPeer(gguf_path, seqs, n_ctx, threads)
    try:
        result, _tokens, _ttft = peer.run(requests, ignore_eos, eos, show_progress)
    finally:
        peer.close()
    return result, f"llama.cpp batched, {seqs} sequences, {threads} threads"
