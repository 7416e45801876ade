"""Tensor parallelism from the engine's side: one worker process per rank, each building
its runner on its shard (``runner_setup.build_runner``), driven by the engine process,
which keeps the scheduler, the tokenizer and the server.

Each step the engine sends every rank the scheduled chunks; every rank runs the forward
pass (the parallel layers all-reduce and all-gather among the ranks); rank 0 alone
samples, from the gathered logits, and replies with the tokens. The engine sees a
``ParallelRunner`` with the ModelRunner's ``execute``, so its step is unchanged.
"""

from __future__ import annotations

import copy
import dataclasses
import logging

import torch

from archserve.distributed.executor import Executor, WorkerFailure
from archserve.distributed.executor_backends import make_executor
from archserve.distributed.layout import layout_decision, layout_problems
from archserve.distributed.process_group import RankPlace
from archserve.engine import startup
from archserve.engine.config import EngineConfig
from archserve.engine.heap import freeze_startup_heap
from archserve.engine.launched_step import LaunchedStep
from archserve.engine.phases import WAIT_FOR_DEVICE, phase
from archserve.engine.runner_setup import RunnerSetup, build_runner, peek_model_config
from archserve.engine.scheduler import ScheduledSeq
from archserve.platform.decision import Decision

log = logging.getLogger("archserve")

__all__ = ["ParallelRunner", "start_parallel_runner", "WorkerFailure"]

# Imported by the mp executor's fork server before it forks a rank: the slow imports every
# rank makes (torch.distributed; transformers' config machinery, for the model's config).
WORKER_PRELOAD = ("torch.distributed", "transformers.activations", "archserve.loader.loader")


def start_parallel_runner(config: EngineConfig) -> RunnerSetup:
    """Check the layout, start the workers, and return the engine's view of their runner."""
    size = config.tensor_parallel_size
    device_type = startup.resolve_torch_device(config).type
    model_config, _gguf = peek_model_config(config.model)
    num_devices = torch.cuda.device_count() if device_type == "cuda" else 0
    if config.distributed_executor_backend == "ray":   # Ray counts the cluster's GPUs
        num_devices = size
    problems = layout_problems(model_config, size, device_type, num_devices)
    if problems:
        raise ValueError(f"tensor_parallel_size={size}: {'; '.join(problems)}")
    # The step's tokens come back through the engine before the next step is built.
    rank_config = dataclasses.replace(config, async_scheduling=False)
    executor = make_executor(config.distributed_executor_backend, size, device_type)
    try:
        replies = executor.start(rank_worker, rank_config)
    except BaseException:
        executor.shutdown()
        raise
    setup: RunnerSetup = replies[0]
    setup.report.decisions.insert(0, layout_decision(
        setup.model_config, size, device_type, config.distributed_executor_backend))
    setup.report.decisions = [d for d in setup.report.decisions if d.what != "scheduling"]
    setup.report.decisions.append(Decision(
        "scheduling", {None: "auto", True: "async", False: "sync"}[config.async_scheduling],
        "sync", "tensor parallel: each step's tokens return through the engine process"))
    setup.runner = ParallelRunner(executor, setup.report.torch_device)
    return setup


class ParallelRunner:
    """The engine's runner when the model runs in worker processes."""

    def __init__(self, executor: Executor, device: torch.device) -> None:
        self.executor = executor
        self.device = device
        self.graphs = None
        self.kv_caches: list[torch.Tensor] = []    # they live in the workers

    def execute(self, chunks: list[ScheduledSeq], previous: LaunchedStep | None = None
                ) -> LaunchedStep:
        wire = [ScheduledSeq(_wire_copy(c.seq), c.num_new_tokens, c.samples) for c in chunks]
        # The ranks run the step (their host and device work) while this process waits.
        with phase(WAIT_FOR_DEVICE):
            sampled_ids, host, prompt_lps = self.executor.call(("step", wire))[0]
        by_id = {c.seq.seq_id: c.seq for c in chunks}
        prompt_logprobs = [(by_id[seq_id], first, logprobs, targets)
                           for seq_id, first, logprobs, targets in prompt_lps]
        return LaunchedStep([by_id[i] for i in sampled_ids], host, prompt_logprobs, host=host)

    def shutdown(self) -> None:
        self.executor.shutdown()


def _wire_copy(seq):
    """What a rank needs of a sequence (tokens, blocks, sampling state), without the
    output text and logprobs only the engine reads."""
    light = copy.copy(seq)
    light.output_logprobs = []
    light.output_text = ""
    light.block_hashes = []
    return light


# ---- in the worker process ----------------------------------------------------------------

class _RankRunner:
    def __init__(self, place: RankPlace, config: EngineConfig) -> None:
        from archserve.distributed.agreement import group_agreement
        from archserve.distributed.parallel_state import get_tp

        self.rank = place.rank
        config = dataclasses.replace(config, device=place.device)
        self.setup = build_runner(config, group_agreement(get_tp()))
        if self.rank != 0:
            self.setup.runner.sampler = None      # rank 0 samples from the gathered logits
        # This process launches the rank's steps for the rest of its life (engine/heap.py).
        freeze_startup_heap(self.setup.runner.device.type)

    def startup_reply(self) -> RunnerSetup | None:
        if self.rank != 0:
            return None
        s = self.setup
        # What the engine keeps: sizes and the report; the runner and weights stay here.
        return dataclasses.replace(s, runner=None, model=None, cpu_threads=None)

    def handle(self, message):
        kind, chunks = message
        if kind != "step":
            raise ValueError(f"unknown message {kind!r}")
        launched = self.setup.runner.execute(chunks)
        host = launched.wait()
        if self.rank != 0:
            return None
        prompt_lps = [(seq.seq_id, first, logprobs.cpu(), targets.cpu())
                      for seq, first, logprobs, targets in launched.prompt_logprobs]
        return [s.seq_id for s in launched.sampled_seqs], host, prompt_lps


def rank_worker(place: RankPlace, config: EngineConfig) -> _RankRunner:
    """The worker factory the executors call in each rank's process."""
    return _RankRunner(place, config)
