"""Where one engine step's time goes: GPU busy vs idle, the kernels, and the host ops.

The roofline says how far a step is from its floor; this says why. It runs a few decode
steps of a real engine under torch.profiler and reduces the trace to:

- wall time per step, and the part of it during which the device ran any kernel (the union
  of kernel intervals, so overlapping kernels are not counted twice). The rest is time the
  device sat idle waiting for the host;
- the kernels that took the most device time, and the kernels that lengthened the step
  the most: each kernel is charged the time by which its end moved the device's latest end
  (its critical-path share). With programmatic dependent launch a kernel is scheduled while
  the one before it drains and waits inside, so device times overlap and add up to more
  than the step; the critical-path shares add up to the time some kernel ran (the busy
  time less the engine's own annotations on the device's track);
- the host-side ops that took the most CPU time, which is what a host-bound step pays for;
- the engine's own phases (``archserve::schedule``, ``build_batch``, ``forward``, ``logits``,
  ``sample``, ``wait_for_device``, ``outputs``: see engine/phases.py), host time each. On a
  GPU, ``wait_for_device`` is the host waiting for the kernels; the other phases are host
  work, and whatever of it runs after that wait leaves the device idle.

On a CPU the trace has no device kernels: busy time is 0 and the host table is the story.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field

from archserve.engine.phases import PREFIX as PHASE_PREFIX


def critical_path_shares(spans: list[tuple[float, float, str]]) -> dict[str, float]:
    """Per name, the time by which its spans (start, end, name) pushed the latest end seen
    so far, in start order: the shares sum to the covered length."""
    shares: dict[str, float] = {}
    end_so_far = float("-inf")
    for start, end, name in sorted(spans):
        if end <= end_so_far:
            continue
        shares[name] = shares.get(name, 0.0) + end - max(start, end_so_far)
        end_so_far = end
    return shares


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (start, end), overlaps counted once."""
    return sum(critical_path_shares([(start, end, "") for start, end in intervals]).values())


@dataclass
class StepProfile:
    batch_size: int
    steps: int
    step_ms: float                 # wall clock per step, mean
    device_busy_ms: float          # per step: some kernel was running
    device_idle_ms: float          # per step: nothing ran on the device
    top_kernels: list[dict] = field(default_factory=list)   # name, calls, total_ms, share
    top_host_ops: list[dict] = field(default_factory=list)  # name, calls, self_cpu_ms
    critical_kernels: list[dict] = field(default_factory=list)  # name, calls, critical_ms
    phases_ms: dict[str, float] = field(default_factory=dict)  # host time per step, inclusive

    def to_json(self) -> dict:
        return asdict(self)

    def render(self) -> str:
        lines = [f"batch {self.batch_size}: {self.steps} steps, {self.step_ms:.3f} ms/step; "
                 f"device busy {self.device_busy_ms:.3f} ms, idle {self.device_idle_ms:.3f} ms"]
        if self.top_kernels:
            lines.append("  kernels (device time per step):")
            lines += [f"    {k['total_ms'] / self.steps:8.3f} ms {k['share']:6.1%} "
                      f"x{k['calls'] // max(1, self.steps)} {k['name'][:90]}"
                      for k in self.top_kernels]
        if self.critical_kernels:
            lines.append("  kernels by critical-path share (what each added to the step, per step):")
            lines += [f"    {k['critical_ms'] / self.steps:8.3f} ms "
                      f"x{k['calls'] // max(1, self.steps)} {k['name'][:90]}"
                      for k in self.critical_kernels]
        if self.phases_ms:
            lines.append("  engine phases (host time per step): " + ", ".join(
                f"{name} {ms:.3f} ms" for name, ms in self.phases_ms.items()))
        lines.append("  host ops (self CPU time per step):")
        lines += [f"    {h['self_cpu_ms'] / self.steps:8.3f} ms x{h['calls'] // max(1, self.steps)} "
                  f"{h['name'][:90]}" for h in self.top_host_ops]
        return "\n".join(lines)


def summarize(events, batch_size: int, steps: int, wall_s: float, top: int = 15
              ) -> StepProfile:
    """Reduce torch.profiler ``events()`` of ``steps`` steps to a StepProfile."""
    kernels: dict[str, list[float]] = {}
    intervals: list[tuple[float, float]] = []
    spans: list[tuple[float, float, str]] = []   # kernels only, not the engine's annotations
    host: dict[str, list[float]] = {}
    phases: dict[str, float] = {}
    for e in events:
        if e.name.startswith(PHASE_PREFIX) and not _on_device(e):
            name = e.name[len(PHASE_PREFIX):]
            phases[name] = phases.get(name, 0.0) + e.cpu_time_total / 1e3 / steps
        elif _on_device(e):
            start, end = e.time_range.start, e.time_range.end
            intervals.append((start, end))
            if not e.name.startswith(PHASE_PREFIX):
                spans.append((start, end, e.name))
            entry = kernels.setdefault(e.name, [0, 0.0])
            entry[0] += 1
            entry[1] += (end - start) / 1e3
        else:
            entry = host.setdefault(e.name, [0, 0.0])
            entry[0] += 1
            entry[1] += e.self_cpu_time_total / 1e3
    shares = critical_path_shares(spans)
    busy_ms = union_length(intervals) / 1e3 / steps
    device_total = sum(t for _, t in kernels.values()) or 1.0
    step_ms = wall_s * 1e3 / steps
    return StepProfile(
        batch_size=batch_size, steps=steps, step_ms=step_ms, device_busy_ms=busy_ms,
        device_idle_ms=max(0.0, step_ms - busy_ms) if intervals else 0.0,
        top_kernels=[{"name": n, "calls": c, "total_ms": t, "share": t / device_total}
                     for n, (c, t) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]],
        top_host_ops=[{"name": n, "calls": c, "self_cpu_ms": t}
                      for n, (c, t) in sorted(host.items(), key=lambda kv: -kv[1][1])[:top]],
        phases_ms=phases,
        critical_kernels=[{"name": n, "calls": kernels[n][0], "critical_ms": t / 1e3}
                          for n, t in sorted(shares.items(),
                                             key=lambda kv: -kv[1])[:top]])


def _on_device(event) -> bool:
    kind = getattr(event, "device_type", None)
    return kind is not None and str(kind).rsplit(".", 1)[-1] in ("CUDA", "PrivateUse1", "XPU")


def profile_decode_steps(engine, batch_size: int, input_len: int, steps: int,
                         warmup_steps: int = 3, trace_path: str | None = None,
                         output_kind: str = "FINAL_ONLY", use_profiler: bool = True,
                         lora_request=None) -> StepProfile:
    """Fill ``engine`` with ``batch_size`` requests (the offline bench's sampling
    parameters; each with ``lora_request`` where given), run past their prefill and a few
    warm-up decode steps, then profile ``steps`` pure decode steps."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from archserve.bench.offline import bench_sampling_params
    from archserve.engine.sampling_params import RequestOutputKind

    params = bench_sampling_params(steps + warmup_steps + 8,
                                   output_kind=RequestOutputKind[output_kind.upper()])
    vocab = engine.model_config.vocab_size
    for i in range(batch_size):
        prompt = [(7 + 31 * i + 17 * j) % (vocab - 1) + 1 for j in range(input_len)]
        engine.add_request(f"profile-{i}", prompt, params, lora_request=lora_request)
    # Until every prompt is in the cache and a few decode steps ran (graphs warm).
    scheduler = engine.scheduler
    while scheduler.waiting or any(s.num_output_tokens - s.num_pending == 0
                                   for s in scheduler.running):
        engine.step()
    for _ in range(warmup_steps):
        engine.step()
    on_cuda = engine.runner.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    sync()
    # Without the profiler: plain wall-clock steps, for timings the profiler does not inflate.
    prof = profile(activities=activities) if use_profiler else nullcontext()
    with prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        wall = time.perf_counter() - start
    if trace_path and use_profiler:
        prof.export_chrome_trace(trace_path)
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    return summarize(prof.events() if use_profiler else [], batch_size, steps, wall)
