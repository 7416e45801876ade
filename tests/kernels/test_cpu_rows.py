"""The CPU's linear routine for a few rows (kernels/linear/cpu_rows.py): both forms give
x Wᵀ (+ b), the timed choice is cached and read back, and it covers the counts between the
timed ones."""

from __future__ import annotations

import pytest
import torch

import archserve.kernels.linear.cpu_rows as cpu_rows
from archserve.kernels.linear.cpu_rows import MAX_ROWS, ROWS, CpuRowsLinear


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17])
def test_both_forms_compute_x_wt(rows):
    torch.manual_seed(rows)
    x, w, b = torch.randn(rows, 64), torch.randn(96, 64), torch.randn(96)
    routine = CpuRowsLinear()
    plain = routine(x, w, b)
    routine.transposed_rows = frozenset(range(2, MAX_ROWS + 1))
    transposed = routine(x, w, b)
    torch.testing.assert_close(transposed, torch.nn.functional.linear(x, w, b))
    torch.testing.assert_close(plain, transposed)
    assert transposed.is_contiguous()


def test_the_choice_is_timed_once_and_cached(tmp_path, monkeypatch):
    weights = [torch.randn(128, 64) for _ in range(3)]
    path = str(tmp_path / "cpu_gemms.json")
    first = CpuRowsLinear()
    text = first.tune_rows(weights, path)
    assert "timed x WT / (W xT)T" in text and all(f"{r} rows" in text for r in ROWS)

    def no_timing(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("timed again despite the cache")

    monkeypatch.setattr(cpu_rows, "_time_forms", no_timing)
    second = CpuRowsLinear()
    assert second.tune_rows(weights, path) == text
    assert second.transposed_rows == first.transposed_rows
    # A count between two timed ones takes the lower one's form.
    for rows in range(2, MAX_ROWS + 1):
        lower = max(r for r in ROWS if r <= rows)
        assert (rows in second.transposed_rows) == (lower in second.transposed_rows)
    other_model = [torch.randn(256, 64)]     # other shapes: timed anew
    monkeypatch.undo()
    assert CpuRowsLinear().tune_rows(other_model, path)
