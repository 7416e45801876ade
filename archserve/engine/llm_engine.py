"""LLMEngine: ``step()`` = schedule -> run -> postprocess, over continuously batched requests."""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures

from archserve.engine import heap, startup
from archserve.engine.block_pool import KVBlockPool
from archserve.engine.config import EngineConfig
from archserve.engine.cuda_graphs import describe_demoted
from archserve.engine.launched_step import LaunchedStep
from archserve.engine.lora.manager import LoadedLoRA, LoRAManager
from archserve.engine.lora.request import LoRARequest
from archserve.engine.output_processor import OutputProcessor, RequestState
from archserve.engine.outputs import RequestMetrics, RequestOutput
from archserve.engine.phases import WAIT_FOR_DEVICE, phase
from archserve.engine.rank_memory import describe_rank_memory
from archserve.engine.runner_setup import build_runner
from archserve.engine.sampling_params import SamplingParams
from archserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from archserve.engine.sequence import Sequence, SequenceStatus
from archserve.structured import GrammarCompiler, attach_grammars, grammar_error

log = logging.getLogger("archserve")

class LLMEngine:
    """Owns the model runner, the scheduler and the tokenizer; serves requests step by step."""

    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        t0 = time.perf_counter()
        heap.release_frozen()
        from archserve.loader.tokenizer import load_tokenizer

        if config.tensor_parallel_size > 1:
            from archserve.engine.parallel_runner import start_parallel_runner
            setup = start_parallel_runner(config)      # one worker process per rank
        else:
            setup = build_runner(config)
        self.runner, self.model, self.model_config = setup.runner, setup.model, setup.model_config
        self.report, self.cpu_threads = setup.report, setup.cpu_threads
        self.step_weights = setup.step_weights      # of one rank's shard under TP
        self.config = config = dataclasses.replace(config,
                                                   async_scheduling=setup.async_scheduling)
        self.tokenizer = (None if config.skip_tokenizer_init
                          else load_tokenizer(config.tokenizer or config.model))
        self.max_model_len = setup.max_model_len
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        # Grammars of structured-output requests (xgrammar loads on first use).
        self.grammars = (GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                         sorted(self.eos_token_ids))
                         if self.tokenizer is not None else None)
        self.block_pool = KVBlockPool(setup.num_blocks, setup.block_size,
                                      config.enable_prefix_caching, setup.num_rings,
                                      setup.ring_rows)
        # The adapters' host cache and slots (engine/lora/), where LoRA is enabled.
        step_lora = getattr(self.runner, "lora", None)
        self.lora: LoRAManager | None = step_lora.manager if step_lora is not None else None
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, setup.max_num_batched_tokens,
                            self.max_model_len, config.enable_chunked_prefill,
                            setup.decoding_token_budget,
                            config.max_loras if self.lora is not None else None,
                            setup.decoding_token_budget_by_streams),
            self.block_pool, self.eos_token_ids)
        self.report.timings["total_s"] = startup.elapsed(t0)
        self.speculator = setup.speculator    # None: no speculative decoding
        if self.speculator is not None:
            self.speculator.attach(self.block_pool)
        # A verification's writes that a rejected draft must not leave behind (DeepSeek V4's
        # window rings and compressor sums), saved before each such step.
        self.draft_rollback = None
        if self.speculator is not None and self.block_pool.rings is not None:
            from archserve.engine.spec_decode.cache_rollback import CompressedCacheRollback
            self.draft_rollback = CompressedCacheRollback(self.model_config,
                                                          self.runner.kv_caches, self.block_pool)
        self.requests: dict[str, RequestState] = {}
        self.outputs = OutputProcessor(self.tokenizer, self.requests, self.scheduler.finish)
        self._counter = 0
        # async_scheduling: the step launched but not yet resolved (its schedule, its launch).
        self._in_flight: tuple[SchedulerOutput, LaunchedStep] | None = None
        # Queued requests whose grammar is still compiling (the scheduler passes them over).
        self._compiling: dict[str, RequestState] = {}
        log.info("%s", self.describe_route())
        heap.freeze_startup_heap(self.runner.device.type)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (a single-rank engine holds none), and
        give what start-up froze back to the garbage collector (engine/heap.py)."""
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()
        heap.release_frozen()

    # -- introspection ---------------------------------------------------------------
    def describe_route(self) -> str:
        r = self.report
        lines = [
            f"device: {r.device.describe()}  dtype: {str(r.dtype).removeprefix('torch.')}  "
            f"kv cache: {r.kv_cache_dtype}"]
        for route in r.routes:
            rejected = "; ".join(f"{x.backend}: {x.reason}" for x in route.rejected) or "none"
            detail = f" [{route.detail}]" if route.detail else ""
            lines.append(f"route {route.layer}: {route.backend}{detail}"
                         f"{' (forced)' if route.forced else ''} (ideal {route.ideal}); "
                         f"rejected: {rejected}")
        from archserve.kernels.elementwise.dispatch import fused_kernel_route
        fused, why = fused_kernel_route(r.torch_device)
        lines.append(f"route elementwise (rms norm, rotary, silu*mul): {fused} ({why})")
        lines += [
            f"kv cache: {r.num_blocks} blocks x {r.block_size} tokens = "
            f"{r.num_blocks * r.block_size} tokens ({r.kv_sizing}); max_model_len {r.max_model_len}",
        ]
        if r.rank_memory:
            lines.append("memory after start-up: " + describe_rank_memory(
                r.rank_memory, self.config.gpu_memory_utilization))
        if r.canary:
            lines.append("numerics canary: " + "; ".join(r.canary))
        for d in r.decisions:
            lines.append(f"decision: {d.what}: {d.requested} -> {d.chosen} ({d.reason})")
        if r.self_check is not None:
            lines.append(f"roofline self-check: {r.self_check.summary()}")
        if r.graphs_off and r.torch_device.type == "cuda":
            lines.append(f"cuda graphs: off ({r.graphs_off})")
        if r.graph_sizes or r.graph_demoted:
            lines.append(f"cuda graphs: {len(r.graph_sizes)} decode sizes"
                         + (f"; not captured: {describe_demoted(r.graph_sizes, r.graph_demoted)}"
                            if r.graph_demoted else ""))
        return "\n".join(lines)

    # -- requests --------------------------------------------------------------------
    def new_request_id(self) -> str:
        self._counter += 1
        return str(self._counter)

    def tokenize_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer (skip_tokenizer_init): "
                                 "send prompts as token ids")
            return prompt, list(self.tokenizer.encode(prompt))
        ids = list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        return None, ids

    def add_request(self, request_id: str | None, prompt: str | list[int],
                    params: SamplingParams | None = None, arrival_time: float | None = None,
                    lora_request: LoRARequest | None = None) -> str:
        """Validate and queue a request; raises ValueError and changes nothing on bad input
        (a grammar that does not compile included: this waits for its compilation)."""
        state = self.prepare_request(request_id, prompt, params, arrival_time, lora_request)
        self.wait_for_grammars([state])
        return self.queue_request(state)

    @staticmethod
    def wait_for_grammars(states: list[RequestState]) -> None:
        """Wait until the grammars of ``states`` are compiled (in parallel); raises the
        first one's error (a ValueError naming the problem)."""
        for state in states:
            if state.grammar is not None:
                wait_futures([state.grammar])
                error = grammar_error(state.grammar)
                if error is not None:
                    raise error

    def prepare_request(self, request_id: str | None, prompt: str | list[int],
                        params: SamplingParams | None = None,
                        arrival_time: float | None = None,
                        lora_request: LoRARequest | None = None) -> RequestState:
        """Validate and tokenize a request without queuing it (ValueError on bad input):
        a caller with several requests prepares them all before it queues any.
        ``lora_request``: the adapter it runs with (read from its directory unless the host
        holds it)."""
        params = params or SamplingParams()
        params.validate()
        request_id = request_id or self.new_request_id()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        vocab = self.model_config.vocab_size
        out_of_vocab = [t for t in [*params.stop_token_ids, *(params.logit_bias or {}),
                                    *(params.allowed_token_ids or [])] if t >= vocab]
        if out_of_vocab:
            raise ValueError(f"token ids must be below the vocabulary size {vocab}; "
                             f"got {out_of_vocab[:5]}")
        if params.structured_outputs is not None and self.config.tensor_parallel_size > 1:
            # The grammar matchers live with the engine's sequences; rank 0 samples in its
            # worker process, which does not hold them.
            raise ValueError("structured output is not supported with tensor_parallel_size > 1 "
                             "yet; serve this model with --tensor-parallel-size 1 for it")
        text, ids = self.tokenize_prompt(prompt)
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens:]
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; this model's maximum context length is "
                f"{self.max_model_len} tokens, and at least one must be left to generate")
        adapter = self._adapter_of(lora_request)
        now = time.time() if arrival_time is None else arrival_time
        seqs = [Sequence(request_id, ids, params, index=i) for i in range(params.n)]
        for seq in seqs:
            seq.lora = adapter
        grammar = attach_grammars(self.grammars, seqs)   # compiles on the compiler's threads
        return RequestState(request_id, text, ids, params, seqs, RequestMetrics(now),
                            [None] if params.prompt_logprobs is not None else None,
                            grammar=grammar, lora_request=lora_request)

    # -- LoRA adapters (vLLM's add_lora / remove_lora / list_loras) ---------------------
    def _adapter_of(self, lora_request: LoRARequest | None) -> LoadedLoRA | None:
        if lora_request is None:
            return None
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got "
                             f"{type(lora_request).__name__}")
        return self._lora_manager().get(lora_request)

    def _lora_manager(self) -> LoRAManager:
        if self.lora is None:
            raise ValueError("LoRA is not enabled: start the engine with enable_lora=True "
                             "(--enable-lora) to serve adapters")
        return self.lora

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read an adapter into the host cache now, so its first request waits for no disk
        (ValueError on a bad adapter)."""
        self.add_read_lora(self.read_lora(lora_request))
        return True

    def read_lora(self, lora_request: LoRARequest) -> LoadedLoRA:
        """Read and check an adapter without changing the engine: a server reads on a
        worker thread, then hands the result to ``add_read_lora`` on the engine's."""
        return self._lora_manager().read(lora_request)

    def add_read_lora(self, loaded: LoadedLoRA, replace: bool = False) -> None:
        """Keep an adapter ``read_lora`` read (``replace``: in place of the one its id
        names)."""
        self._lora_manager().add(loaded, replace)

    def remove_lora(self, lora_id: int) -> bool:
        """Forget adapter ``lora_id``; requests running with it finish with it."""
        return self._lora_manager().remove(lora_id)

    def list_loras(self) -> set[int]:
        return set(self.lora.list_ids()) if self.lora is not None else set()

    def queue_request(self, state: RequestState) -> str:
        """Queue a prepared request; returns its id. One whose grammar is still compiling
        waits in the queue while others run (a compile that fails later ends it: see
        ``_end_failed_grammars``)."""
        if state.request_id in self.requests:
            raise ValueError(f"request id {state.request_id!r} is already in use")
        error = grammar_error(state.grammar)
        if error is not None:
            raise error
        if self.tokenizer is not None:
            from archserve.loader.tokenizer import IncrementalDetokenizer
            state.detokenizers = [IncrementalDetokenizer(self.tokenizer,
                                                         state.params.skip_special_tokens,
                                                         state.prompt_token_ids)
                                  for _ in state.seqs]
        state.sent = [(0, 0)] * len(state.seqs)
        for seq in state.seqs:
            self.scheduler.add(seq)
        self.requests[state.request_id] = state
        if state.grammar is not None and not state.grammar.done():
            self._compiling[state.request_id] = state
        return state.request_id

    def abort_request(self, request_id: str) -> bool:
        """Abort a request now; its KV blocks are free when this returns."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return False
        self._compiling.pop(request_id, None)
        self.scheduler.abort(request_id)
        return True

    def finish_aborted(self, request_id: str, stop_reason: str | None = None
                       ) -> RequestOutput | None:
        """Abort a request now and return its final output: the unfinished choices end
        with finish_reason "abort" (and ``stop_reason``), for a consumer that is still
        listening (a server shutting down). None for an unknown request."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        self._compiling.pop(request_id, None)
        for seq in state.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED,
                                      stop_reason=stop_reason)
        state.metrics.finished_time = time.time()
        return self.outputs.request_output(state, True)

    # -- the loop -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; return the outputs of the requests it advanced.

        With ``async_scheduling``, the step scheduled and launched here is resolved by the
        next call: its outputs come one call later, while the device runs that next step.
        """
        # A failure leaves a consistent state: a step that raised before its commit changed
        # nothing, and one whose tokens never arrived is rolled back (see _finish).
        if self._in_flight is not None and not self._can_overlap():
            return self._finish_in_flight()
        if self.cpu_threads is not None:
            self.cpu_threads.update()
        ended = self._end_failed_grammars() if self._compiling else []
        with phase("schedule"):
            out = self.scheduler.schedule()
        if out.is_empty:
            if self._in_flight is not None:
                return ended + self._finish_in_flight()
            if not ended and self._compiling:   # only grammars to wait for: not a busy loop
                wait_futures([s.grammar for s in self._compiling.values()], timeout=0.01,
                             return_when=FIRST_COMPLETED)
            return ended
        now = time.time()
        for entry in out.scheduled:
            state = self.requests.get(entry.seq.request_id)
            if state is not None and state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = now
                # The prefix-cache hit users see is the first admission's, not a
                # recompute's after preemption (those hit the sequence's own blocks).
                state.num_cached_tokens = max(s.num_cached_tokens for s in state.seqs)
        if out.ring_copies:   # window rings (DeepSeek V4), before the step's forward
            self.runner.copy_rings(out.ring_copies)
        if self.draft_rollback is not None:
            self.draft_rollback.save(out)
        launched = self.runner.execute(out.scheduled, self._in_flight and self._in_flight[1])
        # The previous step resolves while this one runs; its finished sequences are then
        # skipped by commit (their work in this step is discarded).
        outputs = self._finish_in_flight() if self._in_flight is not None else []
        self.scheduler.commit(out)
        if self.config.async_scheduling and self.speculator is None:
            self._in_flight = (out, launched)
            return ended + outputs
        return ended + outputs + self._finish(out, launched)

    def _end_failed_grammars(self) -> list[RequestOutput]:
        """Finish (aborted, the error as stop_reason) the queued requests whose grammar
        failed to compile after they were queued; forget those that compiled."""
        outputs = []
        for request_id, state in list(self._compiling.items()):
            if not state.grammar.done():
                continue
            del self._compiling[request_id]
            error = grammar_error(state.grammar)
            if error is None or self.requests.get(request_id) is not state:
                continue
            log.warning("request %s: %s", request_id, error)
            outputs.append(self.finish_aborted(request_id, stop_reason=str(error)))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self._in_flight is not None or self.scheduler.has_unfinished()

    def _can_overlap(self) -> bool:
        """Whether the next step may be scheduled before the one in flight resolves.

        Not when a sampler needs the previous tokens' values (penalties), and not when
        the pool might have to preempt: a preempted sequence is recomputed from its token
        ids, and a placeholder is not one.
        """
        running = self.scheduler.running
        if any(s.sampling_params.needs_output_token_values for s in running):
            return False
        pool = self.block_pool
        budget = self.scheduler.config.max_num_batched_tokens   # the most one step computes
        needed = sum(pool.blocks_needed(s, min(s.num_uncomputed_tokens, budget))
                     for s in running)
        return needed <= pool.num_free_blocks

    def _finish_in_flight(self) -> list[RequestOutput]:
        out, launched = self._in_flight
        self._in_flight = None
        return self._finish(out, launched)

    def _finish(self, out: SchedulerOutput, launched: LaunchedStep) -> list[RequestOutput]:
        """Wait for ``launched``'s tokens, give them to their sequences, build the outputs."""
        with phase(WAIT_FOR_DEVICE):
            try:
                host = launched.wait()
            except BaseException:
                self.scheduler.uncommit(out)   # to be computed again, not left a placeholder
                if self.draft_rollback is not None:
                    self.draft_rollback.rewind_rejected(out)
                raise
        with phase("outputs"):
            self.outputs.record_prompt_logprobs(launched.prompt_logprobs)
            if host is None:
                self.scheduler.resolve(out, [])
                outputs = []
            else:
                outputs = self._resolve(out, launched, host)
        if self.speculator is not None:
            with phase("propose"):
                self.speculator.propose(out, getattr(self.runner, "hidden_out", None))
        if self.draft_rollback is not None:   # after propose: it reads the step's span
            self.draft_rollback.rewind_rejected(out)
        return outputs

    def _resolve(self, out: SchedulerOutput, launched: LaunchedStep, host
                 ) -> list[RequestOutput]:
        """Give the step's sampled tokens (``host``: the sampler's output on the host) to
        their sequences, and build the outputs."""
        drawn = host.sampled_token_ids.tolist()
        rows = (self.speculator.emitted_rows(out, drawn) if self.speculator is not None
                else [[row] for row in range(len(drawn))])
        logprobs = None if host.sampled_logprobs is None else host.sampled_logprobs.tolist()
        seqs = launched.sampled_seqs
        before = [seq.num_output_tokens - 1 for seq in seqs]   # the placeholder is new
        updated = {id(seq) for seq in self.scheduler.resolve(
            out, [[drawn[r] for r in seq_rows] for seq_rows in rows],
            None if logprobs is None else [[logprobs[r] for r in seq_rows]
                                           for seq_rows in rows])}
        # Each sequence's rows, cut where a stop rule ended it.
        emitted = [(seq, seq_rows[:seq.num_output_tokens - first])
                   for seq, seq_rows, first in zip(seqs, rows, before, strict=True)
                   if id(seq) in updated]
        return self.outputs.process_sampled(host, emitted)

    # -- stats ----------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counts of requests (not sequences: an n=4 request counts once), KV pool usage."""
        pool = self.block_pool
        sched = self.scheduler
        running = {s.request_id for s in sched.running}
        return {
            "num_running": len(running),
            "num_waiting": len({s.request_id for s in sched.waiting} - running),
            "kv_usage": pool.usage,
            "num_used_blocks": pool.num_used_blocks,
            "num_blocks": pool.num_blocks,
        }
