"""The compile sweep (tests/compile_sweep.py): every route ``explain`` prints for every device
profile, each of its Triton kernels compiled for that profile's target with the tiles and
launch options the engine would choose there, and held to its shared memory; the table in
docs/compile-sweep.md is this sweep's."""

from __future__ import annotations

import os

import pytest

from archserve.kernels.rules import triton_interpreted

pytestmark = pytest.mark.skipif(triton_interpreted(), reason="the interpreter does not compile")
triton = pytest.importorskip("triton")

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "compile-sweep.md")


@pytest.fixture(scope="module")
def swept():
    import compile_sweep as sweep

    results = sweep.collect()
    figures = sweep.check(results, "representative", workers=max(2, os.cpu_count() or 2))
    print(f"compile sweep: {figures}")
    return results


def test_every_route_of_every_profile_compiles_and_fits(swept):
    failed = [f"{r.profile} / {r.route}: {line}" for r in swept for line in r.failures]
    assert not failed, "\n".join(failed)
    gpus = {r.profile for r in swept if r.status == "compiles"}
    assert gpus == {"v100", "t4", "a100", "a10", "l40s", "rtx4090", "h100", "h200", "b200",
                    "b300", "thor", "rtx5090", "rtx5070-laptop", "gb10", "mi300x"}
    # The CPU runs torch; so does a Pascal GPU, where Triton does not compile.
    assert all(r.status in ("no Triton kernel", "not loadable")
               for r in swept if r.profile in ("cpu", "p40"))
    assert any(r.status == "no Triton kernel" for r in swept if r.profile == "p40")


def test_the_docs_table_is_the_sweeps(swept):
    """Regenerate with ``python scripts/compile_sweep.py`` when this fails."""
    import compile_sweep as sweep

    with open(DOC) as f:
        doc = f.read()
    committed = doc.split(sweep.TABLE_START, 1)[1].split(sweep.TABLE_END, 1)[0].strip()
    assert committed == sweep.table(swept).strip()


def test_a_launch_over_the_shared_memory_fails_the_sweep():
    """One prefill tile, compiled for SM90, against a GPU that holds it and one that holds
    a byte less: as a default launch the second fails the sweep; as an autotuner's config
    the engine drops it there."""
    import dataclasses

    import compile_sweep as sweep
    import torch
    from triton_compile import AUTOTUNED, DEFAULT, collected_launches, compile_spec

    from archserve.kernels.attention.triton_prefill import prefill_attention
    from archserve.platform.profiles import get_profile

    q = torch.zeros(3, 8, 128, dtype=torch.bfloat16)
    with collected_launches(get_profile("h100")) as specs:
        prefill_attention(q, torch.zeros(2, 6, 16, 2, 128, dtype=torch.bfloat16),
                          torch.zeros(3, 2, dtype=torch.int32),
                          torch.tensor([5, 20, 9], dtype=torch.int32),
                          torch.tensor([0, 1, 2, 3], dtype=torch.int32), torch.empty_like(q),
                          num_seqs=3, max_query_len=2, scale=0.1, tiles=(64, 64, 4, 2))
    launch, = specs
    shared = compile_spec(launch).shared
    holds = dataclasses.replace(get_profile("h100"), id="holds", shared_memory_per_block_bytes=shared)
    short = dataclasses.replace(holds, id="short", shared_memory_per_block_bytes=shared - 1)
    results = []
    for profile, kind in (("holds", DEFAULT), ("short", DEFAULT), ("short", AUTOTUNED)):
        result = sweep.RouteResult(profile, "attention")
        result.launches = [dataclasses.replace(launch, kind=kind)]
        results.append(result)
    sweep.check(results, "autotuned", workers=1, profiles={"holds": holds, "short": short})
    fits, too_big, tuned = results
    assert fits.status == "compiles" and not fits.dropped
    assert too_big.status == "failed"
    assert f"{shared} bytes of shared memory, the GPU has {shared - 1}" in too_big.failures[0]
    assert tuned.status == "compiles" and "shared memory" in tuned.dropped[0]


def test_a_triton_backend_without_launches_fails_the_sweep(monkeypatch):
    """A route whose Triton backend has no entry in LAUNCHES (a new backend) is a failure,
    not a silent pass."""
    import compile_sweep as sweep

    from archserve.platform.profiles import get_profile

    monkeypatch.delitem(sweep.LAUNCHES, ("attention", "TRITON_ATTN"))
    route = next(r for r in sweep.ROUTES if r.name == "attention")
    result, = sweep.collect([get_profile("a100")], (route,))
    assert result.failures == ["attention backend TRITON_ATTN needs Triton and has no entry "
                               "in compile_sweep.LAUNCHES"]
