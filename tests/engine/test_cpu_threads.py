"""The CPU engine sizes its intra-op threads from the load other processes put on its cores,
measured from /proc/stat against real busy processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from archserve.engine import cpu_threads
from archserve.engine.cpu_threads import CpuLoadMeter, CpuThreadGovernor, threads_for

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs /proc/stat")


def busy_processes(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def test_threads_are_the_cores_left() -> None:
    assert threads_for(2, 0.1, 2) == 2
    assert threads_for(2, 0.9, 2) == 1
    assert threads_for(2, 2.0, 2) == 1          # never fewer than one
    assert threads_for(16, 3.2, 16) == 13
    assert threads_for(16, 0.0, 8) == 8          # never more than torch was given


def test_meter_counts_other_processes_and_not_this_one() -> None:
    meter = CpuLoadMeter()
    cores = len(meter.cpus)
    procs = busy_processes(cores)
    try:
        time.sleep(0.3)
        meter.other_busy_cores()                   # start the window with them running
        time.sleep(1.5)
        loaded = meter.other_busy_cores()
    finally:
        stop(procs)
    assert loaded is not None and loaded > 0.6 * cores, loaded
    # This process's own work is not "other": a busy loop here adds nothing to the figure
    # (counted, it would add a whole core on an idle machine).
    meter.other_busy_cores()
    time.sleep(1.0)
    baseline = meter.other_busy_cores()
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        pass
    own = meter.other_busy_cores()
    assert own is not None and own < baseline + 0.5, (own, baseline)


def test_governor_drops_to_the_free_cores_and_comes_back() -> None:
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        pytest.skip("one core: nothing to govern")
    before = torch.get_num_threads()
    governor = CpuThreadGovernor(cores, interval_s=0.5)
    try:
        assert governor.threads == cores
        procs = busy_processes(cores)
        try:
            time.sleep(0.3)
            governor.meter.other_busy_cores()
            time.sleep(1.0)
            assert governor.update() < cores
            assert torch.get_num_threads() == governor.threads
        finally:
            stop(procs)
        time.sleep(1.0)
        governor.update()
        time.sleep(1.0)
        # Idle again (other tests may run beside this one: allow one busy core).
        assert governor.update() >= cores - 1
    finally:
        governor.restore()
        torch.set_num_threads(before)


def test_a_second_engine_takes_the_users_maximum_not_the_first_ones_choice() -> None:
    before = torch.get_num_threads()
    first = CpuThreadGovernor(4, interval_s=60)
    try:
        first._set(1)                       # as under load
        second, decision = cpu_threads.cpu_thread_governor(torch.device("cpu"))
        if "OMP_NUM_THREADS" not in os.environ:
            assert second is not None and second.max_threads == 4
            assert decision.chosen == "1-4, from the load"
    finally:
        torch.set_num_threads(before)
        cpu_threads._last = None


def test_omp_num_threads_is_kept(monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    governor, decision = cpu_threads.cpu_thread_governor(torch.device("cpu"))
    assert governor is None and decision.reason == "set by OMP_NUM_THREADS"


def test_cpu_engine_reports_its_thread_policy(tiny_checkpoint) -> None:
    from archserve import LLM
    llm = LLM(tiny_checkpoint("llama"), dtype="float32")
    decisions = [d for d in llm.llm_engine.report.decisions if d.what == "cpu_threads"]
    assert len(decisions) == 1
    assert (llm.llm_engine.cpu_threads is None) == ("OMP_NUM_THREADS" in os.environ
                                                    or torch.get_num_threads() == 1)
