"""Greedy decoding's argmax kernel (kernels/elementwise/triton_argmax.py) against
``torch.argmax`` of the float32 logits: the first index of the maximum, NaN above
everything, -0.0 equal to +0.0, whichever block of the row holds it.

Without a GPU one test re-runs this file under Triton's interpreter (as test_elementwise.py
does); on a GPU the ``gpu``-marked tests run the compiled kernel at real vocabularies.
"""

from __future__ import annotations

import pytest
import torch

from archserve.kernels.rules import triton_interpreted

INTERPRETED = triton_interpreted()
INTERPRETER_TIMEOUT_S = 600
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def cases(device: str, vocab: int = 10_001) -> list[tuple[str, torch.Tensor]]:
    """Rows whose argmax a block-wise reduction could get wrong."""
    gen = torch.Generator().manual_seed(0)
    out = [("random", torch.randn(3, vocab, generator=gen))]
    ties = torch.full((4, vocab), -5.0)
    ties[0, [9000, 20, 4500]] = 3.0           # the same maximum in three blocks: the first
    ties[1, [4096, 4097]] = 3.0               # a block's first element, twice
    ties[2, vocab - 1] = 3.0                  # the last element, in the partial block
    ties[3, :] = 1.0                          # every element: index 0
    out.append(("ties", ties))
    special = torch.randn(4, vocab, generator=gen)
    special[0, [7000, 300]] = float("nan")    # NaN wins, the first one
    special[1, :] = float("-inf")             # all -inf: index 0
    special[1, 5000] = float("-inf")
    special[2, :] = -0.0
    special[2, [50, 8000]] = 0.0              # -0.0 and +0.0 tie: index 0
    special[3, 6000] = float("inf")
    out.append(("special", special))
    nans = torch.randn(3, vocab, generator=gen)
    as_int = nans.view(torch.int32)
    as_int[0, 9000] = -0x003FFFFF - 1            # a negative NaN (0xFFC00000): still above all
    as_int[1, [5000, 9500]] = torch.tensor([0x7FC00000, 0x7FFFFFFF], dtype=torch.int32)
    as_int[2, [200, 8000]] = torch.tensor([0x7FFFFFFF, 0x7FC00000], dtype=torch.int32)
    out.append(("NaN signs and payloads: the first NaN", nans))
    out.append(("short row", torch.randn(2, 33, generator=gen)))   # one partial block
    return [(name, rows.to(device)) for name, rows in out]


def check(device: str, dtype: torch.dtype, vocab: int = 10_001) -> None:
    from archserve.kernels.elementwise.triton_argmax import argmax_unsupported, triton_argmax
    for name, rows in cases(device, vocab):
        # Also as a slice of wider rows (an LM head's padded vocabulary): the row stride.
        padded = torch.full((rows.shape[0], rows.shape[1] + 64), 1e4).to(device)
        padded[:, :rows.shape[1]] = rows
        for logits in (rows.to(dtype), padded.to(dtype)[:, :rows.shape[1]]):
            assert argmax_unsupported(logits) is None
            got = triton_argmax(logits)
            assert got.dtype == torch.int64
            assert got.tolist() == logits.float().argmax(dim=-1).tolist(), (name, dtype)


def test_argmax_refuses_what_it_cannot_take():
    pytest.importorskip("triton")
    from archserve.kernels.elementwise.triton_argmax import argmax_unsupported
    assert "contiguous" in argmax_unsupported(torch.zeros(4, 8).t())
    assert "int64" in argmax_unsupported(torch.zeros(2, 8, dtype=torch.int64))
    assert "rows" in argmax_unsupported(torch.zeros(5000, 8))
    assert argmax_unsupported(torch.zeros(4, 8)) is None


if INTERPRETED:   # the rest runs under Triton's interpreter (tests/kernels/conftest.py)

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    def test_argmax_matches_torch(dtype):
        check("cpu", dtype)

    def test_argmax_twice_resets_its_counters():
        # The last program of a row resets that row's counter: a second call finds zeros.
        check("cpu", torch.float32)
        check("cpu", torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("vocab", [102_400, 151_936, 262_144])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_argmax_matches_torch(dtype, vocab):
    check("cuda", dtype, vocab)
    from archserve.kernels.elementwise.triton_argmax import triton_argmax
    wide = torch.randn(256, vocab, device="cuda").to(dtype)    # a batch of 256
    assert torch.equal(triton_argmax(wide), wide.float().argmax(dim=-1))
