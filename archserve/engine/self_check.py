"""Roofline self-check at warm-up: is a decode step as fast as this device allows?

A batch-1 decode step must read every weight once, so its floor is weight bytes over
the measured copy bandwidth. A step far slower than that (below 50% of the floor's
speed) usually means an op fell back to a slow path; the profile of one eager step
names the op kind that takes the most time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger("archserve")

WARN_BELOW = 0.5


@dataclass
class SelfCheck:
    step_ms: float
    floor_ms: float
    ratio: float                      # floor / measured: 1.0 is the roofline
    time_by_kind: dict[str, float]    # op kind -> share of one eager step's kernel time
    graphs: bool

    def summary(self) -> str:
        kinds = ", ".join(f"{k} {v:.0%}" for k, v in sorted(self.time_by_kind.items(),
                                                            key=lambda kv: -kv[1]))
        return (f"decode step (batch 1, {'graph' if self.graphs else 'eager'}) "
                f"{self.step_ms:.3f} ms, floor {self.floor_ms:.3f} ms "
                f"({self.ratio:.0%} of roofline); kernel time: {kinds or 'n/a'}")


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def classify_kernel(name: str) -> str:
    """The op kind a CUDA kernel belongs to, from its name."""
    n = name.lower()
    if any(k in n for k in ("attn", "attention", "_decode", "_prefill", "flash", "cache",
                            "_write_kv", "merge_splits")):
        return "attention"
    if any(k in n for k in ("gemm", "gemv", "matmul", "cutlass", "xmma", "nvjet", "cublas",
                            "splitk")):
        return "linear"
    if any(k in n for k in ("softmax", "argmax", "topk", "sort", "exponential")):
        return "sampling"
    return "elementwise"


def profile_kinds(run_step) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_step()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if t and evt.device_type == torch.autograd.DeviceType.CUDA:
            kind = classify_kernel(evt.key)
            totals[kind] = totals.get(kind, 0.0) + t
    total = sum(totals.values()) or 1.0
    return {k: v / total for k, v in totals.items()}


def run_self_check(runner, copy_bytes_per_s: float, repeats: int = 20) -> SelfCheck:
    """Time a batch-1 decode step (graph replay when captured) against its floor."""
    from archserve.kernels.attention.interface import AttentionMetadata
    dev = runner.device
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([1], dtype=torch.int32, device=dev),
        block_tables=torch.zeros((1, 1), dtype=torch.int32, device=dev),
        slot_mapping=torch.full((1,), -1, dtype=torch.long, device=dev),
        max_query_len=1, max_seq_len=1, num_seqs=1, query_lens_cpu=[1], seq_lens_cpu=[1])
    ids = torch.zeros(1, dtype=torch.long, device=dev)
    pos = torch.zeros(1, dtype=torch.long, device=dev)
    graphs = runner.graphs is not None and runner.graphs.size_for(1) is not None

    def step() -> None:
        with torch.inference_mode():
            if graphs:
                runner.graphs.replay(runner.graphs.size_for(1), ids, pos, meta)
            else:
                runner._forward_logits(ids, pos, meta)

    step()
    torch.cuda.synchronize(dev)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        step()
    end.record()
    end.synchronize()
    step_ms = start.elapsed_time(end) / repeats
    floor_ms = weight_bytes(runner.model) / copy_bytes_per_s * 1e3

    def eager_step() -> None:
        with torch.inference_mode():
            runner._forward_logits(ids, pos, meta)

    kinds = profile_kinds(eager_step)
    check = SelfCheck(step_ms, floor_ms, floor_ms / step_ms if step_ms else 0.0, kinds, graphs)
    if check.ratio < WARN_BELOW:
        slowest = max(kinds, key=kinds.get) if kinds else "unknown"
        log.warning("roofline self-check: %s — below %d%%: likely on a fallback path; "
                    "the slowest op kind is %s", check.summary(), WARN_BELOW * 100, slowest)
    else:
        log.info("roofline self-check: %s", check.summary())
    return check
