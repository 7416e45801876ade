"""A step whose kernels are queued: its sampled tokens on their way to the host.

The runner queues a step and returns at once. The sampled token ids and their logprobs
start a non-blocking copy into pinned host memory right behind the sampler, with an event
after it. ``wait`` then blocks only until *this* step is done, not the one queued after
it, which is what lets the engine prepare step N+1 (and resolve step N) while the
device still runs.

Until then, a sequence that sampled here holds a placeholder token (Sequence.PLACEHOLDER).
If the next step must feed that token back as an input, ``feed_pending_inputs`` copies it
from this step's device output: the host never needs its value for that.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from archserve.engine.batch import ModelBatch, host_to_device
from archserve.engine.sampler import SamplerOutput
from archserve.engine.scheduler import ScheduledSeq
from archserve.engine.sequence import Sequence


@dataclass
class LaunchedStep:
    sampled_seqs: list[Sequence]
    result: SamplerOutput | None
    prompt_logprobs: list
    host_tokens: torch.Tensor | None = None     # int64 [B], on the host once ``ready``
    host_logprobs: torch.Tensor | None = None   # float32 [B]
    ready: torch.cuda.Event | None = None       # None off CUDA: the copy was synchronous
    row_of: dict[int, int] = field(default_factory=dict)   # seq_id -> row of the output

    @classmethod
    def start_copy(cls, seqs: list[Sequence], result: SamplerOutput, prompt_logprobs: list
                   ) -> LaunchedStep:
        step = cls(seqs, result, prompt_logprobs,
                   row_of={seq.seq_id: row for row, seq in enumerate(seqs)})
        tokens, logprobs = result.sampled_token_ids, result.sampled_logprobs
        if tokens.device.type == "cuda":
            step.host_tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            step.host_logprobs = torch.empty(logprobs.shape, dtype=logprobs.dtype,
                                             pin_memory=True)
            step.host_tokens.copy_(tokens, non_blocking=True)
            step.host_logprobs.copy_(logprobs, non_blocking=True)
            step.ready = torch.cuda.Event()
            step.ready.record(torch.cuda.current_stream(tokens.device))  # cuda:N too
        else:
            step.host_tokens, step.host_logprobs = tokens.cpu(), logprobs.cpu()
        return step

    def wait(self) -> tuple[list[int], list[float]]:
        """The sampled token ids and logprobs, once this step's copies have landed."""
        if self.result is None:
            return [], []
        if self.ready is not None:
            self.ready.synchronize()
        return self.host_tokens.tolist(), self.host_logprobs.tolist()

    def feed_pending_inputs(self, batch: ModelBatch, chunks: list[ScheduledSeq],
                            device: torch.device) -> None:
        """Overwrite ``batch``'s placeholder input ids with this step's sampled tokens."""
        rows: list[int] = []
        sources: list[int] = []
        row = 0
        for chunk in chunks:
            seq = chunk.seq
            if seq.num_pending:
                # The placeholders are the newest tokens; those inside this chunk are inputs.
                start = seq.num_computed_tokens
                first_pending = seq.num_tokens - seq.num_pending
                for position in range(max(start, first_pending), start + chunk.num_new_tokens):
                    if position != first_pending or seq.seq_id not in self.row_of:
                        raise RuntimeError(f"sequence {seq.seq_id}: input token {position} is "
                                           "pending but not from the step in flight")
                    rows.append(row + position - start)
                    sources.append(self.row_of[seq.seq_id])
            row += chunk.num_new_tokens
        if not rows:
            return
        pairs = host_to_device(np.asarray([rows, sources], dtype=np.int64), device)
        batch.input_ids[pairs[0]] = self.result.sampled_token_ids[pairs[1]]
