"""Sequence: one decoding stream of one request, as the scheduler and block pool see it.

A request with ``n > 1`` becomes ``n`` sequences sharing a ``request_id`` (``index``
0..n-1). Each one is scheduled independently; prefix caching lets them share the
prompt's full KV blocks (see ``block_pool``).
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Sequence as SequenceOf
from typing import Any

from archserve.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"          # waiting again after its blocks were taken back
    FINISHED_STOPPED = "stop"        # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "length"       # max_tokens or max_model_len reached
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI/vLLM ``finish_reason`` string, None while unfinished."""
        return self.value if self in _FINISHED else None


_FINISHED = frozenset({SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                       SequenceStatus.FINISHED_ABORTED})

_seq_ids = itertools.count()

# Stands for a sampled token whose value is still on the device (asynchronous scheduling).
PLACEHOLDER = -1


class Sequence:
    """Token state, KV bookkeeping and output state of one sequence.

    ``token_ids`` holds the prompt followed by the generated tokens; ``output_token_ids``
    holds the generated tokens alone (kept separately because penalties and outputs
    need it every step and slicing would copy).
    """

    __slots__ = (
        "seq_id", "request_id", "index", "sampling_params", "arrival_time", "status",
        "prompt_token_ids", "token_ids", "output_token_ids",
        "num_computed_tokens", "num_cached_tokens", "block_table", "block_hashes", "ring",
        "output_logprobs", "cumulative_logprob", "stop_reason", "num_preemptions",
        "output_text", "extra", "num_pending", "gate", "spec_token_ids",
        "lora",
    )

    def __init__(self, request_id: str, prompt_token_ids: SequenceOf[int],
                 sampling_params: SamplingParams | None = None, index: int = 0,
                 arrival_time: float | None = None, seq_id: int | None = None) -> None:
        if len(prompt_token_ids) == 0:
            raise ValueError("a sequence needs at least one prompt token")
        self.seq_id: int = next(_seq_ids) if seq_id is None else seq_id
        self.request_id = request_id
        self.index = index
        self.sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = SequenceStatus.WAITING
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        # Tokens whose keys and values are in the KV cache (advanced after each forward pass).
        self.num_computed_tokens = 0
        # Prefix-cache hit at the most recent admission, in tokens.
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        # A model that keeps its window's keys in a ring per sequence (DeepSeek V4): this
        # sequence's (first row, rows), a token's slot is first row + position % rows;
        # None elsewhere, or while it holds no blocks.
        self.ring: tuple[int, int] | None = None
        # Chained hashes of this sequence's computed full blocks, in order (see block_pool).
        self.block_hashes: list[bytes] = []
        # Filled by the engine: one {token_id: Logprob} per generated token when asked for.
        self.output_logprobs: list[Any] = []
        self.cumulative_logprob = 0.0
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        # Detokenized output and engine-private state (incremental detokenizer offsets...).
        self.output_text = ""
        self.extra: dict[str, Any] = {}
        # Trailing tokens sampled on the device whose values the host does not know yet
        # (PLACEHOLDER in token_ids and output_token_ids): counted, not read.
        self.num_pending = 0
        # Work the sequence waits for before it may be scheduled (a future: its grammar's
        # compilation); None when it waits for nothing.
        self.gate: Any = None
        # Draft tokens to follow this sequence's tokens, proposed after its newest token
        # (speculative decoding): its next decode step verifies them.
        self.spec_token_ids: list[int] = []
        # The LoRA adapter it runs with (engine/lora/manager.py's LoadedLoRA), or None.
        self.lora: Any = None

    # -- lengths ------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_ready(self) -> bool:
        """Nothing it waits for is still running (see ``gate``)."""
        return self.gate is None or self.gate.done()

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        return self.token_ids[start:end]

    # -- updates ------------------------------------------------------------------
    def append_token(self, token_id: int, logprob: float | None = None) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        if logprob is not None:
            self.cumulative_logprob += logprob

    def append_placeholder(self) -> None:
        """A token was sampled on the device but not copied back yet: it counts (lengths,
        positions, max_tokens) before its value is known."""
        self.token_ids.append(PLACEHOLDER)
        self.output_token_ids.append(PLACEHOLDER)
        self.num_pending += 1

    def resolve_placeholder(self, token_id: int, logprob: float | None = None) -> None:
        """Give the oldest pending token its value."""
        if self.num_pending == 0:
            raise RuntimeError(f"sequence {self.seq_id} has no pending token to resolve")
        self.token_ids[len(self.token_ids) - self.num_pending] = token_id
        self.output_token_ids[len(self.output_token_ids) - self.num_pending] = token_id
        self.num_pending -= 1
        if logprob is not None:
            self.cumulative_logprob += logprob

    def drop_newest_tokens(self, count: int, logprobs: SequenceOf[float] = ()) -> None:
        """Take back the newest ``count`` output tokens (a stop string ended the sequence
        before them); ``logprobs``: theirs, added to ``cumulative_logprob`` when they came."""
        if count:
            del self.token_ids[-count:]
            del self.output_token_ids[-count:]
        self.cumulative_logprob -= sum(logprobs)

    def drop_newest_placeholder(self) -> None:
        if self.num_pending == 0:
            raise RuntimeError(f"sequence {self.seq_id} has no pending token to drop")
        self.token_ids.pop()
        self.output_token_ids.pop()
        self.num_pending -= 1

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, request={self.request_id!r}, index={self.index}, "
                f"status={self.status.name}, tokens={self.num_prompt_tokens}+"
                f"{self.num_output_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={self.block_table})")
