"""Every older generation's route, run on the GPU here under ``--emulate-device``.

Each profile runs in processes of its own (tests/engine/emulated_run.py: a process fixes
its emulation with its first GPU engine), its models spread over a few of them
(emulated_parts.py), all side by side on the one GPU; each test reads its profile's
results, merged from its processes: the tiny Llama, Qwen3, Qwen3-MoE and DeepSeek-V2-Lite,
and the quantized fixtures, greedy against transformers in float32 (16-bit runs within
transformers' own drift in that dtype), the printed route equal to ``explain --device``'s,
decode in CUDA graphs, Triton's code for the profile's architecture, and a kernel over the
profile's shared memory refused.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import emulated_parts
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROFILES = ("v100", "t4", "a100", "a10", "l40s", "rtx4090")
RUN = os.path.join(os.path.dirname(__file__), "emulated_run.py")
# A part's limit: three models' starts (their tuners compiling for the profile) with the
# GPU and the CPU shared by every other part. Three profiles' parts at once (13 processes,
# the control's included) fit a 16-core host and a device call's 600 s.
TIMEOUT_S = 480
# Processes at once: one a core, two cores left for the GPU's driver threads and pytest;
# more parts than that wait for a process to end.
MAX_PROCESSES = max(1, (os.cpu_count() or 2) - 2)


@pytest.fixture(scope="module")
def emulated(request, tmp_path_factory):
    """profile -> (its results, its parts' logs), every selected profile's parts started
    at once (at most MAX_PROCESSES of them running)."""
    wanted = {item.callspec.params["profile"] for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec")}
    # The logs stay where the device script asks (EMULATED_LOGS), else with pytest's files.
    out = os.environ.get("EMULATED_LOGS") or tmp_path_factory.mktemp("emulated")
    os.makedirs(out, exist_ok=True)
    out = pathlib.Path(out)
    jobs = emulated_parts.jobs([p for p in PROFILES if p in wanted])
    files = {(p, i): (out / f"{p}.{i}.json", out / f"{p}.{i}.log") for p, i, _ in jobs}
    commands = {(p, i): [sys.executable, RUN, p, str(files[p, i][0]), ",".join(names)]
                for p, i, names in jobs}
    emulated_parts.run_all(commands, {key: log for key, (_, log) in files.items()},
                           MAX_PROCESSES, TIMEOUT_S)
    results = {}
    for profile in dict.fromkeys(p for p, _, _ in jobs):
        results[profile] = emulated_parts.merge([files[k] for k in files if k[0] == profile])
        (out / f"{profile}.json").write_text(json.dumps(results[profile][0], indent=1))
    return results


@pytest.mark.parametrize("profile", PROFILES)
def test_profile_runs_emulated_like_transformers(emulated, profile):
    results, log = emulated[profile]
    models = {k: v for k, v in results.items() if k != "mechanics"}
    assert len(models) == 12, log
    for name, record in models.items():
        print(f"{profile} {name}: {record.get('detail')} | {record.get('routes')} | graphs "
              f"{record.get('graph_sizes')}")
    bad = {name: r.get("traceback") or r["detail"] for name, r in models.items() if not r["ok"]}
    assert not bad, bad
    for name, record in models.items():
        assert record["routes_equal_explain"], (name, record["routes"])
        assert f"emulated on {torch.cuda.get_device_name()}" in record["device"], record
        assert record["graph_sizes"], (name, record["graphs_off"])
        half = profile in ("v100", "t4")
        if name != "llama float32":
            assert record["dtype"] == ("torch.float16" if half else "torch.bfloat16"), record


@pytest.mark.parametrize("profile", PROFILES)
def test_profile_kernels_are_built_for_it_and_held_to_its_limits(emulated, profile):
    from archserve.platform.profiles import get_profile

    results, log = emulated[profile]
    mechanics = results.get("mechanics")
    assert mechanics and "traceback" not in mechanics, (mechanics, log)
    cap = get_profile(profile).capability
    assert mechanics["triton_arch"] == f"sm{cap.to_int()}"
    assert mechanics["shared_memory_limit"] == get_profile(profile).shared_memory_per_block_bytes
    assert not mechanics["wgmma"]                        # Hopper's instruction: not below SM90
    if cap.major >= 8:
        assert mechanics["mma_sync"]
    # The large tile runs exactly where the profile holds its shared memory. From SM80
    # Triton pipelines its loads (cp.async): two 64 KiB buffers at least, which an A100's
    # 163 KiB holds and the 99 KiB of SM86/SM89 do not (emulated_run.mechanics).
    limit = get_profile(profile).shared_memory_per_block_bytes
    if mechanics["large_tile_shared"] > limit:
        assert mechanics["large_tile"].startswith("refused: out of resource: shared memory")
    else:
        assert mechanics["large_tile"] == "ran"
    if cap.major >= 8:
        assert mechanics["large_tile_shared"] >= 2 * 64 * 1024, mechanics


def test_the_gpu_as_it_is_builds_hopper_code_and_holds_the_large_tile(emulated):
    """The control: without emulation the same kernels take wgmma on an H200 and the
    192 KiB tile runs (so the checks above can fail)."""
    results, log = emulated["native"]
    mechanics = results.get("mechanics")
    assert mechanics and "traceback" not in mechanics, (mechanics, log)
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the control's expectations are an SM90 GPU's")
    assert mechanics["triton_arch"] is None and mechanics["wgmma"]
    assert mechanics["large_tile"] == "ran"
