"""Expanded MLA prefill in bounded windows: the prefill kernel's key window and LSE output
against a torch reference, and expanded_prefill with windows far smaller than the contexts
(many launches merged by their LSEs) against its single launch and TORCH_REFERENCE.

On CPU the kernels run under Triton's interpreter in a child process (tests/kernels/
conftest.py) and compile for real GPU targets; the gpu-marked test runs DeepSeek-V3's sizes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from archserve.kernels.rules import triton_interpreted

INTERPRETED = triton_interpreted()
INTERPRETER_TIMEOUT_S = 400
TINY = dict(num_heads=16, kv_lora_rank=32, rope=16, nope=16, v_head=24)
DEEPSEEK = dict(kv_lora_rank=512, rope=64, nope=128, v_head=128)


def windowed_reference(case, key_window):
    """(out [T, H, D], lse [T, H]) of every row over the keys of its sequence inside
    ``key_window`` and causally visible; a row that sees none: zeros and -inf."""
    from archserve.kernels.attention.reference import gather_kv

    meta, query = case.meta, case.query
    heads, kv_heads = query.shape[1], case.kv_cache.shape[3]
    starts = meta.query_start_loc.tolist()
    out = torch.zeros(query.shape, dtype=torch.float32)
    lse = torch.full(query.shape[:2], float("-inf"))
    for i, seq_len in enumerate(meta.seq_lens.tolist()):
        q0, q1 = starts[i], starts[i + 1]
        k, v = gather_kv(case.kv_cache_after, meta.block_tables[i], seq_len, case.k_scale,
                         case.v_scale)
        k = k.repeat_interleave(heads // kv_heads, 1)
        v = v.repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("qhd,khd->hqk", query[q0:q1].float(), k) * case.layer.scale
        q_pos = torch.arange(seq_len - (q1 - q0), seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        lo, hi = key_window
        allowed = (k_pos <= q_pos) & (k_pos >= lo) & (k_pos < hi)
        scores = scores.masked_fill(~allowed, float("-inf"))
        row_lse = torch.logsumexp(scores, -1)                           # [H, Q]
        probs = torch.exp(scores - row_lse.masked_fill(row_lse == float("-inf"), 0)[..., None])
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, v)
        lse[q0:q1] = row_lse.T
    return out, lse


def expanded_case(seqs, *, dtype=torch.float32, device="cpu", seed=0, **dims):
    """An MLA case with this step's latent rows written, and TORCH_REFERENCE's output."""
    from archserve.kernels.attention.triton_cache_write import write_kv_cache
    from archserve.kernels.mla.cases import make_mla_case
    from archserve.kernels.mla.torch_mla import TorchMlaImpl

    case = make_mla_case(seqs, dtype=dtype, device=device, seed=seed, **dims)
    expected, _ = case.run(TorchMlaImpl())
    cache = case.kv_cache.clone()
    write_kv_cache(case.latent[:, None, :], None, cache, case.meta.slot_mapping, case.k_scale)
    return case, cache, expected


def run_expanded(case, cache, window=None):
    from archserve.kernels.mla.expanded_prefill import expanded_prefill

    meta = case.meta
    query_lens = np.diff(meta.query_start_loc.tolist()).tolist()
    return expanded_prefill(case.q_nope, case.q_pe, cache, meta.block_tables, query_lens,
                            meta.seq_lens.tolist(), case.w_uk, case.w_uv, case.scale,
                            case.k_scale, window=window)


if INTERPRETED:   # the rest runs under Triton's interpreter (tests/kernels/conftest.py)
    from archserve.kernels.attention.cases import make_case
    from archserve.kernels.attention.reference import ReferenceAttentionImpl
    from archserve.kernels.attention.triton_prefill import prefill_attention

    # A chunk over a prefix, a fresh prompt and a short chunk: windows below the first
    # query, across it, past a short sequence's end, and edges off the 32-key tiles.
    WINDOW_SEQS = [(20, 90), (45, 45), (3, 70)]

    @pytest.mark.parametrize("key_window", [(0, 90), (0, 32), (17, 61), (40, 50), (64, 90)],
                             ids=["all", "first-tile", "off-tile-edges", "inside-a-tile",
                                  "last"])
    def test_prefill_key_window_and_lse_match_reference(key_window):
        case = make_case(WINDOW_SEQS, num_heads=4, num_kv_heads=2, head_size=32, seed=5)
        _, case.kv_cache_after = case.run(ReferenceAttentionImpl())
        expected, expected_lse = windowed_reference(case, key_window)
        meta, n = case.meta, case.num_valid_tokens
        out = torch.full_like(case.query, float("nan"))
        lse = torch.full(case.query.shape[:2], float("nan"))
        prefill_attention(case.query, case.kv_cache_after, meta.block_tables, meta.seq_lens,
                          meta.query_start_loc, out, num_seqs=meta.num_seqs,
                          max_query_len=45, scale=case.layer.scale, key_window=key_window,
                          lse=lse, tiles=(16, 32, 4, 1))
        torch.testing.assert_close(out[:n], expected[:n], atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(lse[:n], expected_lse[:n], atol=2e-4, rtol=2e-4)

    def test_prefill_lse_without_window_is_the_whole_rows():
        from archserve.kernels.mla.expanded_prefill import merge_partial

        case = make_case(WINDOW_SEQS, num_heads=4, num_kv_heads=2, head_size=32, seed=6)
        expected, case.kv_cache_after = case.run(ReferenceAttentionImpl())
        _, expected_lse = windowed_reference(case, (0, 90))
        meta, n = case.meta, case.num_valid_tokens
        out, lse = torch.zeros_like(case.query), torch.zeros(case.query.shape[:2])
        prefill_attention(case.query, case.kv_cache_after, meta.block_tables, meta.seq_lens,
                          meta.query_start_loc, out, num_seqs=meta.num_seqs,
                          max_query_len=45, scale=case.layer.scale, lse=lse)
        torch.testing.assert_close(out[:n], expected, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(lse[:n], expected_lse[:n], atol=2e-4, rtol=2e-4)
        # Two windows merged by their LSEs give the whole rows back.
        acc = torch.zeros_like(out[:n])
        run_lse = torch.full_like(lse[:n], float("-inf"))
        for window in ((0, 37), (37, 90)):
            part, part_lse = torch.zeros_like(out), torch.zeros_like(lse)
            prefill_attention(case.query, case.kv_cache_after, meta.block_tables,
                              meta.seq_lens, meta.query_start_loc, part,
                              num_seqs=meta.num_seqs, max_query_len=45,
                              scale=case.layer.scale, key_window=window, lse=part_lse)
            merge_partial(acc, run_lse, part[:n], part_lse[:n])
        torch.testing.assert_close(acc, expected, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(run_lse, expected_lse[:n], atol=2e-4, rtol=2e-4)

    # Sequences of mixed query and context lengths (every one a prompt chunk > 16 tokens):
    # a 32- or 48-token window splits the long contexts into many launches (windows wholly
    # before a sequence's first query, the one holding its queries, a short last one) while
    # the short ones share launches.
    MIXED_SEQS = [(20, 70), (17, 17), (30, 100), (18, 40), (20, 20)]

    @pytest.mark.parametrize("window", [32, 48], ids=["tile-aligned", "off-tile"])
    def test_windowed_expanded_prefill_matches_one_launch_and_reference(window):
        case, cache, expected = expanded_case(MIXED_SEQS, seed=4, **TINY)
        whole = run_expanded(case, cache)
        windowed = run_expanded(case, cache, window=window)
        n = case.num_valid_tokens
        torch.testing.assert_close(windowed[:n], whole[:n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(windowed[:n], expected, atol=2e-3, rtol=2e-3)

    def test_windowed_expanded_prefill_in_bf16():
        case, cache, expected = expanded_case([(40, 130), (24, 24)], dtype=torch.bfloat16,
                                              seed=8, **TINY)
        windowed = run_expanded(case, cache, window=32)
        torch.testing.assert_close(windowed.float(), expected.float(), atol=3e-2, rtol=3e-2)


def test_launch_groups_share_the_window_and_isolate_long_contexts():
    from archserve.kernels.mla.expanded_prefill import launch_groups

    # Block-rounded contexts 32, 32, 112, 16, 16, 16 against a 64-token window.
    assert launch_groups([17, 20, 100, 3, 16, 1], 64) == [(0, 2), (2, 3), (3, 6)]
    assert launch_groups([17, 20], 64) == [(0, 2)]          # all fit: one launch
    assert launch_groups([100], 64) == [(0, 1)]


def test_workspace_holds_the_budget_in_whole_tiles():
    from archserve.kernels.mla.expanded_prefill import (
        EXPANDED_WORKSPACE_BYTES,
        WINDOW_ALIGN,
        workspace_tokens,
    )

    tokens = workspace_tokens(128, 192, torch.bfloat16)      # DeepSeek-V3
    per_token = 2 * 128 * 192 * 2
    assert tokens % WINDOW_ALIGN == 0
    assert tokens * per_token <= EXPANDED_WORKSPACE_BYTES < (tokens + WINDOW_ALIGN) * per_token
    assert workspace_tokens(4096, 4096, torch.float32) == WINDOW_ALIGN   # never empty


def test_window_off_the_block_grid_is_refused():
    from archserve.kernels.mla.cases import make_mla_case

    case = make_mla_case([(20, 20)], **TINY)   # refused before any kernel runs
    with pytest.raises(ValueError, match="multiple of 16"):
        run_expanded(case, case.kv_cache, window=40)


SM80, SM90, SM100, SM120 = (("cuda", c, 32) for c in (80, 90, 100, 120))


@pytest.mark.skipif(INTERPRETED, reason="the interpreter does not compile")
@pytest.mark.parametrize("target", [SM80, SM90, SM100, SM120],
                         ids=["sm80", "sm90", "sm100", "sm120"])
def test_windowed_prefill_compiles(target):
    """The windowed launch with LSE at DeepSeek-V3's expanded head (192) compiles for each
    GPU generation, and today's launches keep their variant (no window, no LSE)."""
    from triton_compile import compiled_launches

    from archserve.kernels.attention.triton_prefill import prefill_attention

    q = torch.zeros(40, 8, 192, dtype=torch.bfloat16)
    cache = torch.zeros(2, 6, 16, 1, 192, dtype=torch.bfloat16)
    tables = torch.zeros(1, 6, dtype=torch.int32)
    seq_lens = torch.tensor([90], dtype=torch.int32)
    starts = torch.tensor([0, 40], dtype=torch.int32)
    out, lse = torch.empty_like(q), torch.empty(40, 8)
    with compiled_launches(target) as launches:
        prefill_attention(q, cache, tables, seq_lens, starts, out, num_seqs=1,
                          max_query_len=40, scale=0.1, tiles=(64, 64, 4, 2),
                          key_window=(32, 64), lse=lse)
        prefill_attention(q, cache, tables, seq_lens, starts, out, num_seqs=1,
                          max_query_len=40, scale=0.1, tiles=(64, 64, 4, 2))
    windowed, plain = launches
    assert windowed.constexprs["KEY_WINDOW"] and windowed.constexprs["WRITE_LSE"]
    assert not plain.constexprs.get("KEY_WINDOW") and not plain.constexprs.get("WRITE_LSE")


@pytest.mark.gpu
def test_gpu_windowed_expanded_prefill_at_deepseek_sizes():
    """128 heads: a 2000-token chunk over a 6000-token prefix and a fresh 700-token prompt
    in 1024-token windows, against the single launch and TORCH_REFERENCE."""
    case, cache, expected = expanded_case([(2000, 8000), (700, 700)], dtype=torch.bfloat16,
                                          device="cuda", seed=9, num_heads=128, **DEEPSEEK)
    whole, windowed = run_expanded(case, cache), run_expanded(case, cache, window=1024)
    torch.testing.assert_close(windowed.float(), whole.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(windowed.float(), expected.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_gpu_impl_with_a_small_workspace(kv, monkeypatch):
    """Through TritonMlaImpl with the workspace cut to 1024 tokens of 128 heads: a long
    chunk over a prefix takes the windows, beside a prompt and a decode."""
    from archserve.kernels.mla import expanded_prefill as module
    from archserve.kernels.mla.cases import compare_mla_with_reference, make_mla_case
    from archserve.kernels.mla.triton_mla import TritonMlaImpl

    monkeypatch.setattr(module, "EXPANDED_WORKSPACE_BYTES", 1024 * 2 * 128 * 192 * 2)
    case = make_mla_case([(2000, 5000), (300, 300), (1, 900)], num_heads=128, block_size=16,
                         dtype=torch.bfloat16, kv_cache_dtype=kv, device="cuda", seed=9,
                         fp8_exact_kv=False, **DEEPSEEK)
    assert compare_mla_with_reference(case, TritonMlaImpl()) is None
