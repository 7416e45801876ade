"""A step whose kernels are queued: its sampled tokens on their way to the host.

The runner queues a step and returns at once. The sampler's outputs (token ids, logprobs,
and ranks and top-N where asked) start a non-blocking copy into pinned host memory right
behind the sampler, with an event after it. ``wait`` then blocks only until *this* step is
done, not the one queued after it, which is what lets the engine prepare step N+1 (and
resolve step N) while the device still runs.

Until then, a sequence that sampled here holds a placeholder token (Sequence.PLACEHOLDER).
If the next step must feed that token back as an input, ``feed_pending_inputs`` copies it
from this step's device output: the host never needs its value for that.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields

import numpy as np
import torch

from archserve.engine.batch import ModelBatch
from archserve.engine.sampler import SamplerOutput
from archserve.engine.scheduler import ScheduledSeq
from archserve.engine.sequence import Sequence
from archserve.engine.staging import StagingRing


@functools.cache
def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream that copies sampled outputs home, one per device."""
    return torch.cuda.Stream(device)


@dataclass
class LaunchedStep:
    sampled_seqs: list[Sequence]
    result: SamplerOutput | None                 # on the device
    prompt_logprobs: list
    host: SamplerOutput | None = None            # its copy on the host, complete once ready
    ready: torch.cuda.Event | None = None        # None off CUDA: the copy was synchronous
    row_of: dict[int, int] = field(default_factory=dict)   # seq_id -> row of the output

    @classmethod
    def start_copy(cls, seqs: list[Sequence], result: SamplerOutput, prompt_logprobs: list,
                   rows: list | None = None) -> LaunchedStep:
        """Queue the copy of every tensor of ``result`` (tokens, logprobs, and the ranks and
        top-N when asked) to the host, behind the sampler. ``rows``: what each row of
        ``result`` samples for (ModelBatch.sample_rows), where that is not ``seqs``."""
        row_of = {seq.seq_id: row for row, seq in enumerate(rows or seqs)
                  if isinstance(seq, Sequence)}    # a sequence's first row
        step = cls(seqs, result, prompt_logprobs, row_of=row_of)
        device = result.sampled_token_ids.device
        on_cuda = device.type == "cuda"
        copies = {}
        # The copies run on a stream of their own, behind the sampler: on the step's stream
        # they would sit between this step's last kernel and the next step's first, which
        # they do not feed (the next step takes its tokens from ``result`` on the device).
        stream = _copy_stream(device) if on_cuda else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(device))
        for f in fields(result):
            tensor = getattr(result, f.name)
            if tensor is None:
                copies[f.name] = None
            elif on_cuda:
                host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                with torch.cuda.stream(stream):
                    copies[f.name] = host.copy_(tensor, non_blocking=True)
                # Not freed to the step's stream for reuse before the copy has read it.
                tensor.record_stream(stream)
            else:
                copies[f.name] = tensor
        step.host = SamplerOutput(**copies)
        if on_cuda:
            step.ready = torch.cuda.Event()
            step.ready.record(stream)
        return step

    def wait(self) -> SamplerOutput | None:
        """The sampler's output on the host (None if nothing was sampled), once this step's
        copies have landed."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host

    def token_of(self, seq: Sequence) -> int:
        """The token this step sampled for ``seq``, on the host (waits for the copy)."""
        host = self.wait()
        if host is None or seq.seq_id not in self.row_of:
            raise RuntimeError(f"sequence {seq.seq_id} sampled nothing in this step")
        return int(host.sampled_token_ids[self.row_of[seq.seq_id]])

    def feed_pending_inputs(self, batch: ModelBatch, chunks: list[ScheduledSeq],
                            staging: StagingRing) -> None:
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
        sampled = self.result.sampled_token_ids
        if rows == sources == list(range(len(rows))):
            # Row i takes this step's row i (a decode batch whose order held): no index
            # upload, gather or scatter; the forward reads them (ModelBatch.fed_ids).
            batch.fed_ids = sampled[:len(rows)]
            return
        (pairs,) = staging.upload([np.asarray([rows, sources], dtype=np.int64)])
        batch.input_ids[pairs[0]] = sampled[pairs[1]]
