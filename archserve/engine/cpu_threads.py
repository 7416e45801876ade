"""Intra-op CPU threads sized from the load that other processes put on our cores.

torch runs every matmul as one OpenMP parallel region over all its threads and waits for
the slowest. When other processes keep the cores busy, the region ends only when the
scheduler has given each of our threads a time slice, so each of a decode step's ~120
matmuls waits for the other processes' slices. On this project's 2-core machine, with two
busy processes beside it, one thread decoded the embedded model twice as fast as two;
idle, two threads are 13% faster (`archserve bench`, OMP_NUM_THREADS fixed at 1 and 2).
So the engine measures, about once a second, how many cores other processes used and
runs with the cores that are left (at least one, at most torch's default). A thread count
the user set with ``OMP_NUM_THREADS`` is kept as it is.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from archserve.platform.decision import Decision

log = logging.getLogger("archserve")

INTERVAL_S = 1.0            # how often the load is sampled: a few decode steps on a CPU
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def threads_for(cores: int, other_busy_cores: float, max_threads: int) -> int:
    """Threads to run with when other processes keep ``other_busy_cores`` of our
    ``cores`` busy: the cores left, rounded, within [1, max_threads]."""
    return max(1, min(max_threads, round(cores - other_busy_cores)))


def _busy_ticks(cpus: set[int]) -> tuple[int, int] | None:
    """(busy, total) clock ticks summed over ``cpus`` since boot, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            lines = f.readlines()
    except OSError:
        return None
    busy = total = 0
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        # user nice system idle iowait irq softirq steal (guest time is inside user)
        ticks = [int(x) for x in fields[:8]]
        idle = ticks[3] + ticks[4]
        busy += sum(ticks) - idle
        total += sum(ticks)
    return (busy, total) if total else None


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


class CpuLoadMeter:
    """Cores that processes other than this one kept busy since the previous sample."""

    def __init__(self) -> None:
        self.cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        self._last = self._sample()

    @property
    def available(self) -> bool:
        return self._last is not None

    def _sample(self) -> tuple[int, int, float] | None:
        ticks = _busy_ticks(self.cpus) if self.cpus else None
        return None if ticks is None else (*ticks, _own_cpu_s())

    def other_busy_cores(self) -> float | None:
        now = self._sample()
        if now is None or self._last is None:
            return None
        busy, total, own = (a - b for a, b in zip(now, self._last, strict=True))
        self._last = now
        if total <= 0:
            return None
        others = max(0.0, busy - own * _CLK_TCK)
        return others / total * len(self.cpus)


# (the count a governor last set, the maximum it governed): torch's thread count is
# process-wide, so an engine made after another one must not take that engine's current
# choice (one thread, say) for the user's maximum.
_last: tuple[int, int] | None = None


def _user_max_threads() -> int:
    current = torch.get_num_threads()
    if _last is not None and current == _last[0]:
        return _last[1]
    return current


class CpuThreadGovernor:
    """Keeps torch's intra-op thread count at the cores other processes leave free."""

    def __init__(self, max_threads: int, meter: CpuLoadMeter | None = None,
                 interval_s: float = INTERVAL_S) -> None:
        self.max_threads = max_threads
        self.meter = meter or CpuLoadMeter()
        self.interval_s = interval_s
        self._set(max_threads)
        self._next = time.monotonic() + interval_s

    def update(self) -> int:
        """Re-measure when the interval has passed; returns the thread count in force."""
        now = time.monotonic()
        if now < self._next:
            return self.threads
        self._next = now + self.interval_s
        others = self.meter.other_busy_cores()
        if others is None:
            return self.threads
        wanted = threads_for(len(self.meter.cpus), others, self.max_threads)
        if wanted != self.threads:
            log.debug("CPU threads %d -> %d (other processes kept %.1f of %d cores busy)",
                      self.threads, wanted, others, len(self.meter.cpus))
            self._set(wanted)
        return self.threads

    def restore(self) -> None:
        """Back to the maximum, e.g. before something else (a peer in a benchmark) runs."""
        self._set(self.max_threads)

    def _set(self, threads: int) -> None:
        global _last
        torch.set_num_threads(threads)
        self.threads = threads
        _last = (threads, self.max_threads)


def cpu_thread_governor(torch_device: torch.device) -> tuple[CpuThreadGovernor | None,
                                                              Decision | None]:
    """The governor for a CPU engine, and the decision start-up reports; (None, None) off CPU."""
    if torch_device.type != "cpu":
        return None, None
    default = _user_max_threads()
    if os.environ.get("OMP_NUM_THREADS"):
        return None, Decision("cpu_threads", str(default), str(default),
                              "set by OMP_NUM_THREADS")
    meter = CpuLoadMeter()
    if not meter.available or default == 1:
        reason = ("one thread is the most torch was given" if meter.available
                  else "no /proc/stat to measure other processes' load")
        return None, Decision("cpu_threads", str(default), str(default),
                              reason)
    return (CpuThreadGovernor(default, meter),
            Decision("cpu_threads", str(default), f"1-{default}, from the load",
                     f"re-measured every {INTERVAL_S:g} s: the cores other processes "
                     f"leave free (matmul regions wait for every thread)"))
