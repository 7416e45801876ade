"""The emulated runs' spread over processes (emulated_parts.py), without a GPU: every
model of a profile in exactly one part, the processes capped and timed out, and a
profile's parts merged back into one result."""

from __future__ import annotations

import json

import emulated_parts as parts


def test_each_profile_runs_every_model_once_and_its_mechanics():
    jobs = parts.jobs(["v100", "t4"])
    for profile in ("v100", "t4"):
        names = [n for p, _, group in jobs if p == profile for n in group]
        assert sorted(names) == sorted([*parts.MODELS, parts.MECHANICS])
    assert len(parts.MODELS) == 12 and len(set(parts.MODELS)) == 12
    assert jobs[0] == (parts.NATIVE, 0, (parts.MECHANICS,))
    assert [j for j in jobs if j[0] == parts.NATIVE] == jobs[:1]


def test_run_all_caps_the_processes_at_once_and_kills_one_past_its_limit(tmp_path):
    stamp = "date +%s.%N; sleep 0.1; date +%s.%N"
    commands = {"a": ["sh", "-c", stamp], "b": ["sh", "-c", stamp],
                "slow": ["sleep", "30"], "fails": ["sh", "-c", "exit 3"]}
    logs = {key: tmp_path / f"{key}.log" for key in commands}
    status = parts.run_all(commands, logs, max_running=1, timeout_s=0.5, poll_s=0.02)
    assert status == {"a": 0, "b": 0, "slow": None, "fails": 3}
    (a_start, a_end), (b_start, b_end) = (
        [float(t) for t in logs[k].read_text().split()] for k in ("a", "b"))
    assert a_end <= b_start          # one at a time: b started after a ended


def test_merge_takes_every_parts_records_and_names_a_part_without_results(tmp_path):
    files = []
    for i, records in enumerate([{"llama": {"ok": True}}, None, {"mechanics": {"wgmma": False}}]):
        path, log = tmp_path / f"t4.{i}.json", tmp_path / f"t4.{i}.log"
        if records is not None:
            path.write_text(json.dumps(records))
        log.write_text(f"log of part {i}\n")
        files.append((path, log))
    results, logs = parts.merge(files)
    assert results == {"llama": {"ok": True}, "mechanics": {"wgmma": False}}
    assert "== t4.1.log (no results)\nlog of part 1" in logs
    assert "log of part 0" in logs and "log of part 2" in logs
