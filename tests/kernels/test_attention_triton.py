"""TRITON_ATTN kernels against ReferenceAttentionImpl on CPU, through Triton's interpreter.

The interpreter is chosen when a kernel is decorated, i.e. when the kernel module is first
imported, so it needs TRITON_INTERPRET=1 before that import. A normal pytest process may have
imported triton already; so without a GPU and without the variable, this file's only test
re-runs the file in a fresh process with the variable set. Run it directly with
TRITON_INTERPRET=1 to see the individual cases.
"""

from __future__ import annotations

import pytest
import torch

from archserve.kernels.rules import triton_interpreted

INTERPRETED = triton_interpreted()
INTERPRETER_TIMEOUT_S = 600

if INTERPRETED:   # the rest runs under Triton's interpreter (tests/kernels/conftest.py)
    from attention_cases import (
        CPU_CASES,
        SINK_CASES,
        assert_matches_reference,
        make_case,
        poison_split_partials,
        with_empty_slots,
    )

    from archserve.kernels.attention import triton_decode
    from archserve.kernels.attention.reference import ReferenceAttentionImpl
    from archserve.kernels.attention.triton_backend import TritonAttentionImpl
    from archserve.kernels.attention.triton_decode import decode_attention
    from archserve.kernels.attention.triton_prefill import prefill_attention

    @pytest.mark.parametrize("name,case_args", CPU_CASES, ids=[n for n, _ in CPU_CASES])
    def test_triton_matches_reference(name, case_args):
        assert_matches_reference(make_case(**case_args), TritonAttentionImpl())

    @pytest.mark.parametrize("num_splits", [2, 4])
    @pytest.mark.parametrize("window", [None, 40])
    def test_split_kv_decode_matches_reference(num_splits, window, monkeypatch):
        # Splits of 64-token tiles: the 5-token sequence leaves later splits empty; they
        # store nothing and the merge reads only the splits with keys (the split buffers
        # start as NaN, so a read of an empty split's row would show).
        poison_split_partials(monkeypatch, triton_decode)
        case = make_case([(1, 150), (1, 5), (1, 97)], num_heads=8, num_kv_heads=2,
                         sliding_window=window, soft_cap=10.0 if window else None, seed=3)
        expected, cache = case.run(ReferenceAttentionImpl())
        out = torch.zeros_like(case.query)
        decode_attention(case.query, cache, case.meta.block_tables, case.meta.seq_lens,
                         case.meta.query_start_loc, out, num_seqs=3, max_seq_len=150,
                         scale=case.layer.scale, sliding_window=window,
                         soft_cap=case.layer.logit_soft_cap, num_splits=num_splits)
        torch.testing.assert_close(out[:3], expected, atol=2e-3, rtol=2e-3)

    @pytest.mark.parametrize("name,case_args", SINK_CASES, ids=[n for n, _ in SINK_CASES])
    def test_sinks_match_reference(name, case_args):
        assert_matches_reference(make_case(**case_args, sinks=True), TritonAttentionImpl())

    @pytest.mark.parametrize("num_splits", [2, 4])
    @pytest.mark.parametrize("window", [None, 70])
    def test_split_decode_with_sinks(num_splits, window, monkeypatch):
        # The first split alone takes the sinks; the merge weighs the others against it
        # (the 5-token sequence has one split with keys, the others none).
        poison_split_partials(monkeypatch, triton_decode)
        case = make_case([(1, 150), (1, 5), (1, 97)], num_heads=6, num_kv_heads=2,
                         sliding_window=window, seed=9, sinks=True)
        expected, cache = case.run(ReferenceAttentionImpl())
        without, _ = make_case([(1, 150), (1, 5), (1, 97)], num_heads=6, num_kv_heads=2,
                               sliding_window=window, seed=9).run(ReferenceAttentionImpl())
        assert (expected - without).abs().max() > 0.05, "the sinks must change the output"
        out = torch.zeros_like(case.query)
        decode_attention(case.query, cache, case.meta.block_tables, case.meta.seq_lens,
                         case.meta.query_start_loc, out, num_seqs=3, max_seq_len=150,
                         scale=case.layer.scale, sliding_window=window,
                         num_splits=num_splits, sinks=case.layer.sinks)
        torch.testing.assert_close(out[:3], expected, atol=2e-3, rtol=2e-3)

    # vLLM 0.33 TRITON_ATTN takes any head size >= 32 (v1/attention/backends/triton_attn.py,
    # TritonAttentionBackend.supports_head_size): the kernels pad to the next power of two.
    # (CPU time: 40 and 192 cover padding up and the largest tile; the GPU's
    # test_attention_compile.py runs the other odd sizes at real shapes.)
    @pytest.mark.parametrize("head_size", [40, 192])
    @pytest.mark.parametrize("phase", ["decode", "chunked"])
    def test_any_head_size_from_32(head_size, phase):
        seqs = [(1, 37), (1, 20)] if phase == "decode" else [(9, 30), (1, 17)]
        case = make_case(seqs, num_heads=4, num_kv_heads=2, head_size=head_size,
                         seed=head_size)
        assert_matches_reference(case, TritonAttentionImpl())

    # fp8 below SM89: vLLM 0.33 keeps an fp8 KV cache on every GPU (selection:
    # platforms/cuda.py, get_attn_backend_cls; TritonAttentionBackend and FlashInferBackend
    # list fp8 in supported_kv_cache_dtypes with no capability check). archserve's kernels
    # then read and write it as bytes; here the byte path is bit-for-bit the torch writer.
    @pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
    @pytest.mark.parametrize("seqs", [[(1, 40), (1, 70)], [(20, 40), (1, 30)]],
                             ids=["decode", "chunked"])
    @pytest.mark.parametrize("head_size", [72])
    def test_fp8_cache_as_bytes_matches_reference(kv, seqs, head_size):
        case = make_case(seqs, num_heads=4, num_kv_heads=2, head_size=head_size,
                         kv_cache_dtype=kv, dtype=torch.float16, fp8_exact_kv=False, seed=7)
        assert_matches_reference(case, TritonAttentionImpl(fp8_bytes=True))

    def test_fp8_byte_encoders_round_like_torch_everywhere():
        # Every fp16 value in range (ties, subnormals, saturation edges): bytes equal torch's.
        from archserve.kernels.attention.triton_cache_write import write_kv_cache
        values = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
        for dtype, limit in ((torch.float8_e4m3fn, 448.0), (torch.float8_e5m2, 57344.0)):
            x = values[values.float().abs() <= limit].float()
            x = x[torch.isfinite(x)]
            # 256 values per slot (zero-padded): one interpreted program per 256 values.
            x = torch.cat((x, x.new_zeros(-x.numel() % 256)))
            src = x.reshape(-1, 1, 256)
            cache = torch.zeros(2, src.shape[0], 1, 1, 256, dtype=dtype)
            slots = torch.arange(src.shape[0])
            bits = dtype == torch.float8_e4m3fn
            write_kv_cache(src, src, cache, slots, e4m3_bits=bits, e5m2_bits=not bits)
            expected = src.to(dtype).view(torch.uint8)
            assert torch.equal(cache[0].reshape(-1, 1, 256).view(torch.uint8), expected), dtype

    def test_prefill_causal_skipping_with_small_tiles():
        # 16x16 tiles over a 2-block prefix: unmasked, diagonal and skipped tiles all occur,
        # and query tiles start mid-block.
        case = make_case([(45, 77), (16, 16)], num_heads=4, num_kv_heads=2, seed=5)
        expected, cache = case.run(ReferenceAttentionImpl())
        out = torch.empty_like(case.query)
        prefill_attention(case.query, cache, case.meta.block_tables, case.meta.seq_lens,
                          case.meta.query_start_loc, out, num_seqs=2, max_query_len=45,
                          scale=case.layer.scale, tiles=(16, 16, 4, 1))
        torch.testing.assert_close(out[:61], expected, atol=2e-3, rtol=2e-3)

    def test_kernels_read_no_cache_row_outside_the_sequences():
        # Unused cache blocks full of NaN: a row read from one (a wrong offset, a masked
        # block-table load taken as block 0) would turn a softmax weight of 0 into NaN.
        # Prefill over a prefix (query tiles whose last key tile ends past the diagonal),
        # then decode, split and not.
        case = make_case([(70, 80), (1, 45), (33, 50)], num_heads=4, num_kv_heads=2, seed=3)
        expected, cache = case.run(ReferenceAttentionImpl())
        tables = case.meta.block_tables
        unused = sorted(set(range(cache.shape[1])) - set(tables[tables >= 0].tolist()))
        # Block 0 among them: a masked block-table load reads as block 0.
        assert 0 in unused, "the case's shuffle uses block 0"
        cache[:, unused] = float("nan")
        meta = case.meta
        out = torch.empty_like(case.query)
        prefill_attention(case.query, cache, tables, meta.seq_lens, meta.query_start_loc,
                          out, num_seqs=meta.num_seqs, max_query_len=70,
                          scale=case.layer.scale, tiles=(32, 16, 4, 1))
        torch.testing.assert_close(out[:104], expected, atol=2e-3, rtol=2e-3)
        decode = make_case([(1, 80), (1, 45)], num_heads=4, num_kv_heads=2, seed=4)
        expected, cache = decode.run(ReferenceAttentionImpl())
        tables = decode.meta.block_tables
        unused = sorted(set(range(cache.shape[1])) - set(tables[tables >= 0].tolist()))
        assert unused, "the case leaves no cache block unused"
        cache[:, unused] = float("nan")
        for splits in (1, 4):
            out = torch.empty_like(decode.query)
            decode_attention(decode.query, cache, tables, decode.meta.seq_lens,
                             decode.meta.query_start_loc, out, num_seqs=2, max_seq_len=80,
                             scale=decode.layer.scale, num_splits=splits)
            torch.testing.assert_close(out[:2], expected, atol=2e-3, rtol=2e-3)

    @pytest.mark.parametrize("window", [None, 24])
    def test_prefill_flat_grid_with_empty_sequence_slots(window):
        # A mixed batch as a captured bucket lays it out: decodes, a chunk over a prefix,
        # a fresh prompt, then empty sequence slots; query tiles of 16 start mid-sequence.
        case = make_case([(1, 40), (37, 60), (1, 9), (20, 20)], num_heads=4, num_kv_heads=2,
                         seed=11, sliding_window=window)
        expected, cache = case.run(ReferenceAttentionImpl())
        meta = case.meta
        tokens = case.query.shape[0]
        empty = 5
        starts, seq_lens, tables = with_empty_slots(meta, empty)
        out = torch.full_like(case.query, float("nan"))
        prefill_attention(case.query, cache, tables, seq_lens, starts, out,
                          num_seqs=meta.num_seqs + empty, max_query_len=tokens,
                          scale=case.layer.scale, sliding_window=window,
                          tiles=(16, 16, 4, 1), flat_grid=True)
        torch.testing.assert_close(out[:tokens], expected, atol=2e-3, rtol=2e-3)
