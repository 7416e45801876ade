"""LLMEngine: ``step()`` = schedule -> run -> postprocess, over continuously batched requests."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

import torch

from archserve.engine import startup
from archserve.engine.block_pool import KVBlockPool
from archserve.engine.ceilings import load_or_measure
from archserve.engine.config import EngineConfig
from archserve.engine.cpu_threads import cpu_thread_governor
from archserve.engine.cuda_graphs import default_graph_sizes
from archserve.engine.decode_gemms import (
    install_linear_route,
    install_quantized_kernels,
    tune_moe_decode,
    tune_quantized_decode,
)
from archserve.engine.kernel_cache import configure_kernel_caches
from archserve.engine.launched_step import LaunchedStep
from archserve.engine.model_runner import ModelRunner
from archserve.engine.outputs import (
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
)
from archserve.engine.phases import phase
from archserve.engine.sampler import Sampler, SamplerOutput
from archserve.engine.sampling_params import RequestOutputKind, SamplingParams
from archserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from archserve.engine.self_check import run_self_check
from archserve.engine.sequence import Sequence, SequenceStatus
from archserve.engine.stop_checker import find_stop_string

log = logging.getLogger("archserve")

DEFAULT_MAX_BATCHED_TOKENS = 8192


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    prompt_logprobs: list | None = None
    detokenizers: list = field(default_factory=list)
    sent: list = field(default_factory=list)   # per sequence (text, tokens) already output
    num_cached_tokens: int = 0                 # prompt tokens found in the prefix cache


class LLMEngine:
    """Owns the model runner, the scheduler and the tokenizer; serves requests step by step."""

    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        t0 = time.perf_counter()
        from archserve.loader.loader import load_model
        from archserve.loader.tokenizer import load_tokenizer

        torch_device = startup.resolve_torch_device(config)
        # Unseeded requests draw from torch's global generator: make runs repeatable.
        torch.manual_seed(config.seed)
        device = startup.device_info_for(torch_device)
        model_path = config.model
        probe_config, gguf_path = _peek_model_config(model_path)
        dtype, kv_cache_dtype, decisions = startup.resolve_precision(device, config, probe_config)
        # Refused here, before any weight is read, when no kernel can run the checkpoint.
        quant_plan = startup.plan_checkpoint_quantization(device, config, probe_config,
                                                          gguf_path, dtype)
        decisions += quant_plan.decisions
        scheduling = startup.resolve_async_scheduling(config.async_scheduling, torch_device)
        decisions.append(scheduling)
        self.cpu_threads, threads_decision = cpu_thread_governor(torch_device)
        if threads_decision is not None:
            decisions.append(threads_decision)
        self.config = config = dataclasses.replace(
            config, async_scheduling=scheduling.chosen == "async")
        self.model, self.model_config = load_model(model_path, dtype=dtype, device=torch_device,
                                                   load_format=config.load_format,
                                                   quantization=quant_plan.config)
        decisions += install_quantized_kernels(device, self.model, quant_plan)
        self.tokenizer = (None if config.skip_tokenizer_init
                          else load_tokenizer(config.tokenizer or model_path))
        load_s = startup.elapsed(t0)

        mc = self.model_config
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings,
                                 mc.max_position_embeddings)
        kernel_cache = configure_kernel_caches(device)
        t_select = time.perf_counter()
        selection, attn_impl, canary = startup.select_attention_with_canary(
            device, config, mc, dtype, kv_cache_dtype, torch_device)
        block_size = config.block_size or getattr(selection.backend, "preferred_block_size", 16)
        select_s = startup.elapsed(t_select)
        graphs_off = startup.cuda_graphs_off_reason(torch_device, config, selection)
        graph_sizes = (config.cuda_graph_sizes or default_graph_sizes(config.max_num_seqs)
                       if graphs_off is None else [])
        t_gemms = time.perf_counter()
        for gemm_decision in (install_linear_route(device, self.model, dtype, graph_sizes),
                              tune_quantized_decode(device, self.model, dtype, graph_sizes),
                              tune_moe_decode(device, self.model, graph_sizes)):
            if gemm_decision is not None:
                decisions.append(gemm_decision)
        gemm_tune_s = startup.elapsed(t_gemms)
        self.eos_token_ids = set(mc.eos_token_ids)
        self.sampler = Sampler(self.eos_token_ids)
        self.runner = ModelRunner(self.model, mc, torch_device, dtype, attn_impl, block_size,
                                  self.max_model_len, self.sampler)
        max_batched = config.max_num_batched_tokens or DEFAULT_MAX_BATCHED_TOKENS
        if not config.enable_chunked_prefill:
            max_batched = max(max_batched, self.max_model_len)  # a whole prompt fits one step
        kv_torch_dtype = startup.kv_dtype_of(kv_cache_dtype, dtype)
        num_blocks, sizing = startup.size_kv_pool(config, self.runner, mc, kv_torch_dtype,
                                                  max_batched, self.max_model_len,
                                                  config.max_num_seqs, torch_device)
        if num_blocks * block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache has room for {num_blocks * block_size} tokens ({sizing}), "
                f"fewer than max_model_len={self.max_model_len}; lower max_model_len or give "
                f"the cache more memory")
        self.runner.allocate_kv_cache(num_blocks, kv_torch_dtype, kv_cache_dtype)
        self.block_pool = KVBlockPool(num_blocks, block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, max_batched, self.max_model_len,
                            config.enable_chunked_prefill),
            self.block_pool, self.eos_token_ids)
        t_warm = time.perf_counter()
        if torch_device.type == "cuda":  # JIT compilers run on GPUs only
            self.runner.warm_up_prefill(max_batched)
        warm_up_s = startup.elapsed(t_warm)
        graphs = graphs_off is None
        t_graphs = time.perf_counter()
        if graphs:
            self.runner.capture_cuda_graphs(graph_sizes)
        graphs_s = startup.elapsed(t_graphs)
        self.report = startup.StartupReport(
            device=device, torch_device=torch_device, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
            decisions=decisions, attention=selection, block_size=block_size, canary=canary,
            num_blocks=num_blocks, max_model_len=self.max_model_len,
            graph_sizes=self.runner.graphs.set.sizes if graphs else [],
            graph_demoted=self.runner.graphs.set.demoted if graphs else {},
            graphs_off=graphs_off, kernel_cache=kernel_cache, kv_sizing=sizing,
            routes=startup.model_routes(device, config, mc, dtype, kv_cache_dtype, selection,
                                        is_gguf=gguf_path is not None),
            timings={"load_s": load_s, "select_and_canary_s": select_s,
                     "decode_gemm_tuning_s": gemm_tune_s, "prefill_warm_up_s": warm_up_s,
                     "cuda_graphs_s": graphs_s})
        if config.self_check or (config.self_check is None and torch_device.type == "cuda"):
            t_check = time.perf_counter()
            ceilings = load_or_measure(torch_device)
            self.report.self_check = run_self_check(self.runner, ceilings.copy_bytes_per_s)
            self.report.timings["self_check_s"] = startup.elapsed(t_check)
        self.report.timings["total_s"] = startup.elapsed(t0)
        self.requests: dict[str, RequestState] = {}
        self._counter = 0
        # async_scheduling: the step launched but not yet resolved (its schedule, its launch).
        self._in_flight: tuple[SchedulerOutput, LaunchedStep] | None = None
        log.info("%s", self.describe_route())

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
                         + (f"; eager for {r.graph_demoted}" if r.graph_demoted else ""))
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
                    params: SamplingParams | None = None, arrival_time: float | None = None
                    ) -> str:
        """Validate and queue a request; raises ValueError and changes nothing on bad input."""
        return self.queue_request(self.prepare_request(request_id, prompt, params,
                                                       arrival_time))

    def prepare_request(self, request_id: str | None, prompt: str | list[int],
                        params: SamplingParams | None = None,
                        arrival_time: float | None = None) -> RequestState:
        """Validate and tokenize a request without queuing it (ValueError on bad input):
        a caller with several requests prepares them all before it queues any."""
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
        text, ids = self.tokenize_prompt(prompt)
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens:]
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; this model's maximum context length is "
                f"{self.max_model_len} tokens, and at least one must be left to generate")
        now = time.time() if arrival_time is None else arrival_time
        seqs = [Sequence(request_id, ids, params, index=i) for i in range(params.n)]
        return RequestState(request_id, text, ids, params, seqs, RequestMetrics(now),
                            [None] if params.prompt_logprobs is not None else None)

    def queue_request(self, state: RequestState) -> str:
        """Queue a prepared request; returns its id."""
        if state.request_id in self.requests:
            raise ValueError(f"request id {state.request_id!r} is already in use")
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
        return state.request_id

    def abort_request(self, request_id: str) -> bool:
        """Abort a request now; its KV blocks are free when this returns."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return False
        self.scheduler.abort(request_id)
        return True

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
        with phase("schedule"):
            out = self.scheduler.schedule()
        if out.is_empty:
            return self._finish_in_flight() if self._in_flight is not None else []
        now = time.time()
        for entry in out.scheduled:
            state = self.requests.get(entry.seq.request_id)
            if state is not None and state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = now
                # The prefix-cache hit users see is the first admission's, not a
                # recompute's after preemption (those hit the sequence's own blocks).
                state.num_cached_tokens = max(s.num_cached_tokens for s in state.seqs)
        launched = self.runner.execute(out.scheduled, self._in_flight and self._in_flight[1])
        # The previous step resolves while this one runs; its finished sequences are then
        # skipped by commit (their work in this step is discarded).
        outputs = self._finish_in_flight() if self._in_flight is not None else []
        self.scheduler.commit(out)
        if self.config.async_scheduling:
            self._in_flight = (out, launched)
            return outputs
        return self._finish(out, launched)

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
        with phase("wait_for_device"):
            try:
                host = launched.wait()
            except BaseException:
                self.scheduler.uncommit(out)   # to be computed again, not left a placeholder
                raise
        with phase("outputs"):
            self._record_prompt_logprobs(launched.prompt_logprobs)
            if host is None:
                self.scheduler.resolve(out, [])
                return []
            logprobs = host.sampled_logprobs
            updated = self.scheduler.resolve(out, host.sampled_token_ids.tolist(),
                                             None if logprobs is None else logprobs.tolist())
            return self._process_sampled(launched.sampled_seqs, host, updated)

    def _process_sampled(self, sampled_seqs: list[Sequence], result: SamplerOutput,
                         updated: list[Sequence]) -> list[RequestOutput]:
        """Logprobs, detokenizing, stop strings and outputs of the sequences that got a token.

        ``result`` is the sampler's output copied to the host."""
        topn = self._topn_per_row(result, sampled_seqs)
        updated_ids = {id(s) for s in updated}
        touched: dict[str, RequestState] = {}
        now = time.time()
        for row, seq in enumerate(sampled_seqs):
            if id(seq) not in updated_ids:
                continue
            state = self.requests.get(seq.request_id)
            if state is None:
                continue
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            if seq.sampling_params.logprobs is not None:
                seq.output_logprobs.append(topn[row])
            self._detokenize(state, seq)
            touched[seq.request_id] = state
        outputs = []
        for request_id, state in touched.items():
            finished = all(s.is_finished for s in state.seqs)
            if finished:
                state.metrics.finished_time = now
                del self.requests[request_id]
            elif state.params.output_kind is RequestOutputKind.FINAL_ONLY:
                continue
            outputs.append(self._request_output(state, finished))
        return outputs

    def _detokenize(self, state: RequestState, seq: Sequence) -> None:
        params = seq.sampling_params
        if not params.detokenize or self.tokenizer is None:
            return
        detok = state.detokenizers[seq.index]
        stopped_by_token = (seq.status is SequenceStatus.FINISHED_STOPPED)
        # The stop token's text is not part of the output (vLLM semantics).
        drop_last = stopped_by_token and not params.include_stop_str_in_output
        if params.output_kind is RequestOutputKind.FINAL_ONLY and not params.stop_strings:
            # Nobody reads the text before the end: detokenize once, when it finishes.
            if seq.is_finished:
                ids = seq.output_token_ids[:-1] if drop_last else seq.output_token_ids
                seq.output_text = detok.add_tokens(list(ids)) + detok.finish()
            return
        if drop_last:
            seq.output_text += detok.finish()
            return
        delta = detok.add_tokens([seq.last_token_id])
        if seq.is_finished:
            delta += detok.finish()
        seq.output_text += delta
        if not params.stop_strings or seq.num_output_tokens < params.min_tokens:
            return
        hit = find_stop_string(seq.output_text, len(delta), params.stop_strings)
        if hit is None:
            return
        index, matched = hit
        end = index + len(matched) if params.include_stop_str_in_output else index
        seq.output_text = seq.output_text[:end]
        self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED, stop_reason=matched)

    def _topn_per_row(self, result, seqs: list[Sequence]) -> list:
        if result.sampled_ranks is None:
            return [None] * len(seqs)
        ids = result.sampled_token_ids.tolist()
        lps = result.sampled_logprobs.tolist()
        ranks = result.sampled_ranks.tolist()
        top_ids = result.topn_token_ids.tolist() if result.topn_token_ids is not None else None
        top_lps = result.topn_logprobs.tolist() if result.topn_logprobs is not None else None
        rows = []
        for i, seq in enumerate(seqs):
            n = seq.sampling_params.logprobs
            if n is None:
                rows.append(None)
                continue
            entry = {ids[i]: Logprob(lps[i], ranks[i], self._decode_one(ids[i]))}
            if n and top_ids is not None:
                for rank, (tid, lp) in enumerate(zip(top_ids[i][:n], top_lps[i][:n], strict=True), start=1):
                    entry.setdefault(tid, Logprob(lp, rank, self._decode_one(tid)))
            rows.append(entry)
        return rows

    def _record_prompt_logprobs(self, prompt_lps) -> None:
        for seq, first_pos, logprobs, targets in prompt_lps:
            state = self.requests.get(seq.request_id)
            # By identity: a request id reused after an abort must not get the old one's rows.
            if (state is None or state.prompt_logprobs is None
                    or not any(s is seq for s in state.seqs)):
                continue
            have = len(state.prompt_logprobs)          # entries for positions 0..have-1
            skip = have - (first_pos + 1)             # rows already recorded (recompute)
            if skip < 0 or skip >= targets.numel():
                continue
            n = seq.sampling_params.prompt_logprobs
            tok_lp = logprobs.gather(1, targets[:, None]).squeeze(1)
            ranks = (logprobs > tok_lp[:, None]).sum(-1) + 1
            top_v, top_i = logprobs.topk(min(n, logprobs.shape[-1]), dim=-1) if n else (None, None)
            for r in range(skip, targets.numel()):
                tid = int(targets[r])
                entry = {tid: Logprob(float(tok_lp[r]), int(ranks[r]), self._decode_one(tid))}
                if n:
                    for rank, (v, t) in enumerate(zip(top_v[r].tolist(), top_i[r].tolist(), strict=True), 1):
                        entry.setdefault(t, Logprob(v, rank, self._decode_one(t)))
                state.prompt_logprobs.append(entry)

    def _decode_one(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _request_output(self, state: RequestState, finished: bool) -> RequestOutput:
        delta = state.params.output_kind is RequestOutputKind.DELTA
        wants_logprobs = state.params.logprobs is not None
        completions = []
        for s in state.seqs:
            text_from, tokens_from = state.sent[s.index] if delta else (0, 0)
            text_to = visible_text_length(s)
            completions.append(CompletionOutput(
                index=s.index, text=s.output_text[text_from:text_to],
                token_ids=s.output_token_ids[tokens_from:],
                cumulative_logprob=s.cumulative_logprob if wants_logprobs else None,
                logprobs=s.output_logprobs[tokens_from:] if wants_logprobs else None,
                finish_reason=s.finish_reason, stop_reason=s.stop_reason))
            if delta:
                state.sent[s.index] = (max(text_from, text_to), s.num_output_tokens)
        return RequestOutput(
            request_id=state.request_id, prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=state.prompt_logprobs, outputs=completions, finished=finished,
            metrics=state.metrics,
            num_cached_tokens=state.num_cached_tokens)

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


def visible_text_length(seq: Sequence) -> int:
    """How much of a running sequence's text may be shown: while a stop string could still
    be completing at its end, the last ``len(longest stop) - 1`` characters wait (text once
    shown cannot be taken back when the stop string truncates it)."""
    params = seq.sampling_params
    if seq.is_finished or not params.stop_strings or params.include_stop_str_in_output:
        return len(seq.output_text)
    hold = max(len(stop) for stop in params.stop_strings) - 1
    return max(0, len(seq.output_text) - hold)


def _peek_model_config(model_path: str | None):
    """(the model's config, its GGUF file or None), without its weights."""
    from archserve.loader.loader import load_model_config, resolve_model_path
    return load_model_config(resolve_model_path(model_path))
