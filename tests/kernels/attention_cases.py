"""Shared by the attention backend tests: the case builder lives in the library
(archserve.kernels.attention.cases); this adds the assertion and the CPU case list."""

from __future__ import annotations

import torch

from archserve.kernels.attention.cases import (  # noqa: F401  (re-exported for the tests)
    FP8_CACHE,
    AttentionCase,
    make_case,
    reference_run,
    tolerance,
    with_empty_slots,
)


def assert_matches_reference(case: AttentionCase, impl) -> None:
    """Output and written cache of ``impl`` agree with ReferenceAttentionImpl on ``case``."""
    expected, expected_cache = reference_run(case)
    actual, actual_cache = case.run(impl)
    tol = tolerance(case.query.dtype, case.layer.kv_cache_dtype)
    assert actual.dtype == case.query.dtype
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)
    # Same rounding rule (round-to-nearest-even) for every writer: bit-equal caches.
    assert torch.equal(actual_cache.view(torch.uint8), expected_cache.view(torch.uint8)), \
        "cache contents differ"


# Small cases every backend must pass on CPU: (id, make_case kwargs).
CPU_CASES = [
    ("decode-mha-bs16", dict(seqs=[(1, 37), (1, 16), (1, 5)], num_heads=4, num_kv_heads=4)),
    ("decode-one-seq-gqa3-bf16", dict(seqs=[(1, 37)], num_heads=9, num_kv_heads=3,
                                      dtype=torch.bfloat16)),
    ("decode-one-seq-window", dict(seqs=[(1, 50)], num_heads=4, num_kv_heads=2,
                                   sliding_window=16)),
    ("decode-pad-slots", dict(seqs=[(1, 20), (1, 3)], num_heads=4, num_kv_heads=1,
                              pad_tokens=2)),
    ("decodes-after-a-chunk-bf16", dict(seqs=[(9, 30), (1, 20), (1, 7)], num_heads=6,
                                        num_kv_heads=2, dtype=torch.bfloat16)),
    ("decode-gqa4-fp16", dict(seqs=[(1, 33), (1, 70)], num_heads=8, num_kv_heads=2,
                              dtype=torch.float16)),
    ("decode-gqa16-dot", dict(seqs=[(1, 40), (1, 17)], num_heads=16, num_kv_heads=1,
                              dtype=torch.float16)),
    ("prefill-varlen-gqa8-bs32", dict(seqs=[(40, 40), (3, 3), (17, 17)], num_heads=8,
                                      num_kv_heads=1, block_size=32)),
    ("chunked-mixed-head80", dict(seqs=[(20, 52), (5, 40), (1, 9)], num_heads=4,
                                  num_kv_heads=2, head_size=80)),
    ("chunked-fp16-pad", dict(seqs=[(24, 64), (1, 31)], num_heads=8, num_kv_heads=2,
                              dtype=torch.float16, pad_tokens=3)),
    ("chunked-bf16", dict(seqs=[(24, 64), (9, 9)], num_heads=8, num_kv_heads=2,
                          dtype=torch.bfloat16)),
    ("window-softcap-prefill", dict(seqs=[(33, 50), (7, 7)], num_heads=8, num_kv_heads=2,
                                    block_size=32, sliding_window=9, soft_cap=5.0)),
    ("window-softcap-decode", dict(seqs=[(1, 50), (1, 30)], num_heads=8, num_kv_heads=2,
                                   sliding_window=9, soft_cap=5.0)),
    ("fp8-e4m3-chunked", dict(seqs=[(20, 40), (1, 30)], num_heads=4, num_kv_heads=1,
                              kv_cache_dtype="fp8_e4m3")),
    ("fp8-e5m2-decode-bf16", dict(seqs=[(1, 40), (1, 30)], num_heads=4, num_kv_heads=2,
                                  kv_cache_dtype="fp8_e5m2", dtype=torch.bfloat16)),
    ("fp8-e4m3-decode-gqa4", dict(seqs=[(1, 40), (1, 70)], num_heads=8, num_kv_heads=2,
                                  kv_cache_dtype="fp8_e4m3", dtype=torch.float16)),
    # A serving step: running decodes beside prompt chunks, the decodes first (as the
    # scheduler orders them) or between the chunks.
    ("mixed-decodes-first", dict(seqs=[(1, 37), (1, 16), (1, 5), (12, 30), (7, 7)],
                                 num_heads=4, num_kv_heads=2)),
    ("mixed-decodes-between-window-fp8", dict(seqs=[(9, 20), (1, 33), (5, 5), (1, 50), (1, 3)],
                                              num_heads=8, num_kv_heads=2, sliding_window=9,
                                              soft_cap=5.0, kv_cache_dtype="fp8_e4m3")),
]

# Attention sinks (gpt-oss): GQA, odd head counts and group sizes, windows shorter than the
# context, decode and chunked prefill, 16- and 32-bit queries.
SINK_CASES = [
    ("sinks-decode-gqa4", dict(seqs=[(1, 37), (1, 70), (1, 5)], num_heads=8, num_kv_heads=2)),
    ("sinks-decode-odd-heads", dict(seqs=[(1, 40), (1, 17)], num_heads=5, num_kv_heads=5,
                                    dtype=torch.float16)),
    ("sinks-chunked-group3", dict(seqs=[(20, 52), (5, 40), (1, 9)], num_heads=6,
                                  num_kv_heads=2, head_size=80)),
    ("sinks-window-prefill", dict(seqs=[(33, 50), (7, 7)], num_heads=8, num_kv_heads=2,
                                  block_size=32, sliding_window=9)),
    ("sinks-window-decode-bf16", dict(seqs=[(1, 50), (1, 30)], num_heads=3, num_kv_heads=1,
                                      sliding_window=16, dtype=torch.bfloat16)),
    ("sinks-mixed", dict(seqs=[(1, 21), (6, 6), (1, 40)], num_heads=4, num_kv_heads=2)),
]


def poison_split_partials(monkeypatch, module) -> None:
    """Make ``module``'s split buffers start as NaN (``torch.empty`` may hand back zeros):
    a merge that read a row no split wrote would then give NaN."""
    made = module.split_partials

    def poisoned(*args, **kwargs):
        partial_out, partial_lse = made(*args, **kwargs)
        if partial_out is not partial_lse:   # (one split: both are the output itself)
            partial_out.fill_(float("nan"))
            partial_lse.fill_(float("nan"))
        return partial_out, partial_lse

    monkeypatch.setattr(module, "split_partials", poisoned)
