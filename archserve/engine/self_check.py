"""Roofline self-check at warm-up: is a decode step as fast as this device allows?

A batch-1 decode step must read every weight once (engine/step_weights.py: the body and
the LM head; the embedding table is one row per token), so its floor is those bytes over
the measured copy bandwidth. A step far slower than that (below 50% of the floor's
speed) usually means an op fell back to a slow path; the profile of one eager step
names the op kind that takes the most time. It runs at start-up on GPUs, and on a CPU
when asked (``self_check=True``): a CPU decode step is rarely near its floor, so there
the check is a diagnosis, not an alarm.

On a GPU the profile is taken only when asked (``self_check_profile``; `archserve
prepare` asks). torch.profiler with CUDA activity attaches CUPTI, and kineto does not
detach it when the profile ends: every kernel launched afterwards by the process pays
CUPTI's callbacks (pytorch/pytorch#144455 reports training 10-20% slower after a profile).
A server launches every prefill and mixed step eagerly, so it would pay that on each.
What it cost here is not yet measured. The CPU profiler has no such cost, so a CPU check
always profiles.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

log = logging.getLogger("archserve")

WARN_BELOW = 0.5
# A GPU decode step whose bytes take less than this is set by its launches, not its bytes:
# a CUDA graph replays a kernel in a few microseconds and a decoder layer runs about ten,
# so a tiny model's step is many times its byte floor on any route; no fallback to flag.
LAUNCH_BOUND_FLOOR_MS = 0.25
NOT_PROFILED = ("not profiled by op kind (the CUDA profiler would slow this process's later "
                "launches; `archserve prepare` profiles it)")


@dataclass
class SelfCheck:
    step_ms: float
    floor_ms: float
    ratio: float                      # floor / measured: 1.0 is the roofline
    time_by_kind: dict[str, float]    # op kind -> share of one eager step's kernel time
    graphs: bool
    launch_bound: bool = False        # a GPU step whose byte floor is under LAUNCH_BOUND_FLOOR_MS

    @property
    def flagged(self) -> bool:
        return self.ratio < WARN_BELOW and not self.launch_bound

    @property
    def slowest_kind(self) -> str:
        return max(self.time_by_kind, key=self.time_by_kind.get) if self.time_by_kind else "unknown"

    def to_json(self) -> dict:
        return {"step_ms": self.step_ms, "floor_ms": self.floor_ms, "ratio": self.ratio,
                "flagged": self.flagged, "warn_below": WARN_BELOW,
                "slowest_kind": self.slowest_kind, "time_by_kind": self.time_by_kind,
                "graphs": self.graphs, "launch_bound": self.launch_bound,
                "summary": self.summary()}

    def summary(self) -> str:
        kinds = ", ".join(f"{k} {v:.0%}" for k, v in sorted(self.time_by_kind.items(),
                                                            key=lambda kv: -kv[1]))
        return (f"decode step (batch 1, {'graph' if self.graphs else 'eager'}) "
                f"{self.step_ms:.3f} ms, floor {self.floor_ms:.3f} ms "
                f"({self.ratio:.0%} of roofline"
                + (f"; launch-bound: the floor is under {LAUNCH_BOUND_FLOOR_MS} ms"
                   if self.launch_bound else "")
                + f"); kernel time: {kinds or NOT_PROFILED}")


def classify_kernel(name: str) -> str:
    """The op kind a CUDA kernel (or, on a CPU, an aten op) belongs to, from its name."""
    n = name.lower()
    # The fused MoE kernels (triton_fused_moe, triton_quantized_moe, triton_routing): their
    # names say neither gemm nor attention, and in a MoE step they take the most time.
    if any(k in n for k in ("moe", "_gate_up_kernel", "_down_kernel", "_gate_up_quant",
                            "_down_quant", "_route_kernel", "_sum_slots")):
        return "moe"
    if any(k in n for k in ("attn", "attention", "_decode", "_prefill", "flash", "cache",
                            "_write_kv", "merge_splits", "latent_output")):
        return "attention"
    if any(k in n for k in ("gemm", "gemv", "matmul", "cutlass", "xmma", "nvjet", "cublas",
                            "splitk", "aten::mm", "aten::addmm", "aten::bmm")):
        return "linear"
    if any(k in n for k in ("softmax", "argmax", "topk", "sort", "exponential")):
        return "sampling"
    return "elementwise"


def profile_kinds(run_step, device: torch.device) -> dict[str, float]:
    """Share of one step's time per op kind: CUDA kernel time by kernel name on GPUs; on a
    CPU, wall time inside the attention region (engine/phases.py), matmuls outside it, and
    the rest of the forward as elementwise."""
    from torch.profiler import ProfilerActivity, profile
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        run_step()
        if cuda:
            torch.cuda.synchronize()
    totals = _kernel_times(prof) if cuda else _cpu_times(prof)
    total = sum(totals.values()) or 1.0
    return {k: v / total for k, v in totals.items() if v > 0}


def _kernel_times(prof) -> dict[str, float]:
    totals: dict[str, float] = {}
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if t and evt.device_type == torch.autograd.DeviceType.CUDA:
            kind = classify_kernel(evt.key)
            totals[kind] = totals.get(kind, 0.0) + t
    return totals


def _cpu_times(prof) -> dict[str, float]:
    from archserve.models.layers.forward_context import OP_PREFIX
    events = prof.events()

    def inside_attention(evt) -> bool:
        parent = evt.cpu_parent
        while parent is not None:
            if parent.name == OP_PREFIX + "attention":
                return True
            parent = parent.cpu_parent
        return False

    top = [e for e in events if e.cpu_parent is None]
    total = sum(e.cpu_time_total for e in top)
    attention = sum(e.cpu_time_total for e in events if e.name == OP_PREFIX + "attention"
                    and not inside_attention(e))
    linear = sum(e.self_cpu_time_total for e in events if e.name.startswith("aten::")
                 and classify_kernel(e.name) == "linear" and not inside_attention(e))
    return {"attention": attention, "linear": linear,
            "elementwise": max(0.0, total - attention - linear)}


def run_self_check(runner, copy_bytes_per_s: float, repeats: int = 20,
                   profile: bool = False) -> SelfCheck:
    """Time a batch-1 decode step (graph replay when captured) against its floor; split
    one eager step's time by op kind on a CPU, and on a GPU when ``profile``."""
    from archserve.kernels.attention.interface import AttentionMetadata
    dev = runner.device
    meta = AttentionMetadata.from_lengths(
        [1], [1], torch.zeros((1, 1), dtype=torch.int32, device=dev),
        torch.full((1,), -1, dtype=torch.long, device=dev), dev)
    ids = torch.zeros(1, dtype=torch.long, device=dev)
    pos = torch.zeros(1, dtype=torch.long, device=dev)
    graphs = runner.graphs is not None and runner.graphs.size_for(1) is not None

    def step() -> None:
        with torch.inference_mode():
            if graphs:
                runner.graphs.replay(runner.graphs.size_for(1), ids, pos, meta)
            else:
                runner._forward_logits(ids, pos, meta)

    step_ms = _mean_ms(step, repeats, dev)
    floor_ms = runner.step_weights.bytes_per_step / copy_bytes_per_s * 1e3

    def eager_step() -> None:
        with torch.inference_mode():
            runner._forward_logits(ids, pos, meta)

    kinds = profile_kinds(eager_step, dev) if profile or dev.type != "cuda" else {}
    check = SelfCheck(step_ms, floor_ms, floor_ms / step_ms if step_ms else 0.0, kinds, graphs,
                      launch_bound=dev.type == "cuda" and floor_ms < LAUNCH_BOUND_FLOOR_MS)
    if check.flagged and dev.type == "cuda":
        log.warning("roofline self-check: %s — below %d%%: likely on a fallback path%s",
                    check.summary(), WARN_BELOW * 100,
                    f"; the slowest op kind is {check.slowest_kind}" if kinds else "")
    else:
        log.info("roofline self-check: %s", check.summary())
    return check


def _mean_ms(step, repeats: int, device: torch.device) -> float:
    step()                                     # warm: the first call may allocate
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(repeats):
            step()
        return (time.perf_counter() - t0) / repeats * 1e3
    from archserve.kernels.cuda_timing import mean_ms
    return mean_ms(step, repeats)
