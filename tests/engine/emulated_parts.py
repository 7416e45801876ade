"""How test_emulated_generations.py spreads a profile's emulated runs over processes.

A profile's twelve models and its mechanics run in PARTS, each a process of its own
(tests/engine/emulated_run.py given the part's names), every part of every profile side by
side: one profile's models in a single process took longer than a device call may run
(each engine start compiles and times its tuners' Triton candidates for the profile's
architecture, which no other profile's process can reuse). The parts of one profile share
its kernel cache directory (engine/kernel_cache.py keys it by the emulated device), so a
kernel one part compiled first is read, not compiled, by the others. Each profile's results
are merged back, so a test sees all of its models.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import time
from collections.abc import Sequence

# The quantized fixtures (tests/fixtures/quant) each profile runs, besides the tiny models.
FIXTURES = ("ct-fp8-channel-dynamic", "ct-fp8-block", "ct-int8-w8a8", "ct-w4a16-g128-sym",
            "gptq-w4-g128-sym", "ct-moe-w4a16")
MODELS = ("llama float32", "llama", "qwen3", "qwen3_moe", "deepseek_v2", *FIXTURES,
          "gguf-mixed")
MECHANICS = "mechanics"
# Grouped by what their starts compile: the 16-bit dense GEMVs (the tiny Llama and Qwen3
# share shapes), MoE and MLA, the 8-bit and GGUF weights, the 4-bit weights (the W4A16 and
# GPTQ fixtures share their GEMV candidates).
PARTS = (("llama float32", "llama", "qwen3", MECHANICS),
         ("qwen3_moe", "deepseek_v2", "ct-fp8-channel-dynamic"),
         ("ct-fp8-block", "ct-int8-w8a8", "gguf-mixed"),
         ("ct-w4a16-g128-sym", "gptq-w4-g128-sym", "ct-moe-w4a16"))
NATIVE = "native"           # the control: the GPU as it is, its mechanics only


def jobs(profiles: Sequence[str]) -> list[tuple[str, int, tuple[str, ...]]]:
    """(profile, part, names): the native control first (it never waits for a process to
    end), then every part of each profile."""
    return [(NATIVE, 0, (MECHANICS,))] + [(p, i, names) for p in profiles if p != NATIVE
                                          for i, names in enumerate(PARTS)]


def run_all(commands: dict, logs: dict, max_running: int, timeout_s: float,
            poll_s: float = 0.2) -> dict:
    """Run each command (its output into ``logs[key]``), at most ``max_running`` at once,
    each killed ``timeout_s`` after its own start. Returns key -> exit status (None: killed)."""
    pending, running, status = list(commands), {}, {}
    while pending or running:
        while pending and len(running) < max_running:
            key = pending.pop(0)
            with open(logs[key], "w") as log:
                running[key] = (subprocess.Popen(commands[key], stdout=log,
                                                 stderr=subprocess.STDOUT), time.monotonic())
        for key, (process, started) in list(running.items()):
            if process.poll() is not None:
                status[key] = process.returncode
            elif time.monotonic() - started > timeout_s:
                process.kill()
                process.wait()
                status[key] = None
            else:
                continue
            del running[key]
        time.sleep(poll_s)
    return status


def merge(parts: Sequence[tuple[pathlib.Path, pathlib.Path]], tail_chars: int = 4000
          ) -> tuple[dict, str]:
    """One profile's results from its parts' (JSON, log) files: the records of every part
    that wrote any, and the end of each part's log (a part that wrote nothing is named)."""
    results: dict[str, dict] = {}
    tails = []
    share = max(tail_chars // max(len(parts), 1), 200)
    for path, log in parts:
        if path.exists():
            results.update(json.loads(path.read_text()))
        text = log.read_text() if log.exists() else "(no log)"
        tails.append(f"== {log.name}{'' if path.exists() else ' (no results)'}\n"
                     f"{text[-share:]}")
    return results, "\n".join(tails)
