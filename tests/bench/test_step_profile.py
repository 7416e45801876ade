"""The step profiler on a real engine (CPU: host side only) and its interval arithmetic."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from archserve.bench.step_profile import critical_path_shares, profile_decode_steps, union_length

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_union_length_counts_overlaps_once():
    assert union_length([]) == 0
    assert union_length([(0, 2), (1, 3)]) == 3          # overlap
    assert union_length([(5, 6), (0, 1)]) == 2          # unsorted, disjoint
    assert union_length([(0, 10), (2, 3), (4, 12)]) == 12  # nested, then extending
    assert union_length([(0, 1), (1, 2)]) == 2          # touching


def test_critical_path_charges_each_kernel_what_it_added_to_the_end():
    # b starts inside a (scheduled early, as under PDL) and ends 3 later; c runs inside b.
    shares = critical_path_shares([(0, 4, "a"), (1, 7, "b"), (2, 5, "c"), (9, 10, "a")])
    assert shares == {"a": 5, "b": 3}
    assert sum(shares.values()) == union_length([(0, 4), (1, 7), (2, 5), (9, 10)])


def test_profile_of_decode_steps_names_the_engine_phases(tiny_checkpoint):
    from archserve.engine.config import EngineConfig
    from archserve.engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineConfig(model=tiny_checkpoint("llama"), max_model_len=128,
                                    max_num_seqs=8))
    result = profile_decode_steps(engine, batch_size=8, input_len=20, steps=5)
    assert result.steps == 5 and result.batch_size == 8 and result.step_ms > 0
    # No device here: nothing ran on one, and the whole step is host work.
    assert result.device_busy_ms == 0 and not result.top_kernels
    assert {"schedule", "build_batch", "forward", "sample", "outputs"} <= set(result.phases_ms)
    assert sum(result.phases_ms.values()) <= result.step_ms * 1.05
    assert any(op["name"] == "aten::mm" for op in result.top_host_ops)
    assert not engine.has_unfinished_requests()      # it cleans up after itself
    assert "batch 8: 5 steps" in result.render()


def test_profile_script_writes_json(tiny_checkpoint, tmp_path):
    out = tmp_path / "profile.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "profile_engine_step.py"),
         "--model", tiny_checkpoint("llama"), "--batch-sizes", "1,3", "--input-len", "9",
         "--steps", "3", "--max-model-len", "128", "--out", str(out),
         "--trace-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(out.read_text())
    assert [r["batch_size"] for r in results] == [1, 3]
    assert (tmp_path / "trace_b3.json").exists()
    assert "engine phases" in proc.stdout
