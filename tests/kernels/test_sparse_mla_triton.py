"""TRITON_MLA_SPARSE against the torch reference (kernels/sparse_mla/reference.py): the cache
row writer, the indexer's scores, the per-row top-k, the indexed MLA decode kernel, and the
whole implementation (decode and prompt rows, dense steps, shared selections), over every
cache layout (16-bit, fp8_ds_mla latent, fp8 indexer keys).

On CPU the kernels run under Triton's interpreter in a child process at tiny, odd sizes
(latent 48 + 16, indexer keys of 48, 8 indexer heads, blocks of 8 tokens) and compile for
SM80, SM90, SM100 and SM120; on a GPU the gpu-marked tests run them at DeepSeek's sizes.
"""

from __future__ import annotations

import pytest
import torch

from archserve.kernels.mla.sparse_cases import make_sparse_case
from archserve.kernels.mla.torch_mla import TorchMlaImpl
from archserve.kernels.rules import triton_interpreted

INTERPRETED = triton_interpreted()
INTERPRETER_TIMEOUT_S = 600
TINY = dict(num_heads=16, kv_lora_rank=48, rope=16, nope=16, v_head=24, index_heads=8,
            index_dim=48, block_size=8)
# (kv_cache_dtype, index_cache_dtype): 16-bit rows, fp8_ds_mla latents with fp8 keys (the
# default beside them), an fp8 indexer beside a 16-bit latent, fp8_ds_mla beside 16-bit keys.
LAYOUTS = [("auto", "auto"), ("fp8_ds_mla", "auto"), ("auto", "fp8"),
           ("fp8_ds_mla", "bfloat16")]
LAYOUT_IDS = ["16bit", "ds_mla", "fp8-index", "ds_mla-16bit-index"]


def step_rows(case):
    """(row_seq, row_len) of a case's step's rows, as the impl builds them."""
    from archserve.kernels.mla.triton_sparse_mla import TritonSparseMlaImpl
    return TritonSparseMlaImpl(layout=case.layout)._rows(case.meta, case.meta.num_tokens)


def assert_same_selection(got: torch.Tensor, expected: torch.Tensor) -> None:
    for row, (a, b) in enumerate(zip(got.tolist(), expected.tolist(), strict=True)):
        assert sorted(a) == sorted(b), f"row {row}: {sorted(a)} != {sorted(b)}"


def assert_impl_matches_reference(case, impl, atol=2e-3) -> None:
    out, indices = case.run(impl)
    expected, expected_indices = case.run(TorchMlaImpl(layout=case.layout))
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=atol)
    if indices is not None:
        assert_same_selection(indices, expected_indices)


if INTERPRETED:   # the rest runs under Triton's interpreter (tests/kernels/conftest.py)

    @pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
    def test_row_writer_matches_the_torch_format(layout):
        # Padding tokens (slot -1) write nothing; every byte of every row as torch writes it.
        from archserve.kernels.sparse_mla.layout import write_rows
        from archserve.kernels.sparse_mla.triton_rows import write_sparse_rows

        kv, index = layout
        case = make_sparse_case([(3, 20), (1, 9)], topk=4, kv_cache_dtype=kv,
                                index_cache_dtype=index, pad_tokens=2, seed=1, **TINY)
        expected, got = case.kv_cache.clone(), case.kv_cache.clone()
        write_rows(case.layout, expected, case.meta.slot_mapping, case.latent, case.indexer.key)
        write_sparse_rows(case.layout, got, case.meta.slot_mapping, case.latent,
                          case.indexer.key)
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
        # A layer that shares another's selection writes its latent only.
        expected, got = case.kv_cache.clone(), case.kv_cache.clone()
        write_rows(case.layout, expected, case.meta.slot_mapping, case.latent, None)
        write_sparse_rows(case.layout, got, case.meta.slot_mapping, case.latent, None)
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))

    @pytest.mark.parametrize("index", ["auto", "fp8"])
    @pytest.mark.parametrize("form", ["decode", "prompt"])
    def test_index_scores_match_reference(form, index):
        # Decode rows (a row a program, its tiles split over programs) and prompt rows
        # (blocks of rows of one sequence, one ending mid-block; contexts at and past block
        # and tile edges) over 16-bit or fp8 keys; entries past a row's length are not read.
        from archserve.kernels.sparse_mla.layout import read_index_keys, sequence_slots
        from archserve.kernels.sparse_mla.reference import index_scores
        from archserve.kernels.sparse_mla.triton_indexer import (
            index_scores_triton,
            row_blocks,
        )

        seqs = ([(1, 130), (1, 64), (1, 9)] if form == "decode"
                else [(21, 70), (5, 65), (2, 129)])
        case = make_sparse_case(seqs, topk=4, index_cache_dtype=index, seed=2, **TINY)
        cache, meta = case.written_cache(), case.meta
        row_seq, row_len = step_rows(case)
        blocks = None if form == "decode" else row_blocks(meta.query_lens_cpu, 4,
                                                          torch.device("cpu"))
        scores = index_scores_triton(case.layout, cache, meta.block_tables,
                                     case.indexer.query, case.indexer.weights, row_seq,
                                     row_len, meta.max_seq_len, case.topk, blocks=blocks,
                                     num_sms=2)
        for row, (seq, length) in enumerate(zip(row_seq.tolist(), row_len.tolist(),
                                                strict=True)):
            keys = read_index_keys(case.layout, cache, sequence_slots(
                meta.block_tables[seq], torch.arange(length), cache.shape[2]))
            expected = index_scores(case.indexer.query[row:row + 1],
                                    case.indexer.weights[row:row + 1], keys)[0]
            torch.testing.assert_close(scores[row, :length], expected, atol=1e-4, rtol=1e-4)

    @pytest.mark.parametrize("lengths", [[3, 16, 1500], [-1, 0, 1]],
                             ids=["dense-and-sparse", "chunk-edges"])
    def test_topk_keeps_the_best_and_breaks_ties_by_position(lengths):
        # Rows shorter than k keep every key (dense); longer ones their k best, over rows
        # that end at, before and after the select's chunks (TOPK_BLOCK scores: "chunk-
        # edges" are offsets from it). Scores repeat (the k-th best tied with others): the
        # ties are taken in position order, as many as fit.
        from archserve.kernels.sparse_mla.triton_topk import TOPK_BLOCK, select_topk_triton

        if max(lengths) < 16:
            lengths = [TOPK_BLOCK + n for n in lengths]
        k = 16
        gen = torch.Generator().manual_seed(3)
        scores = torch.randn(len(lengths), max(lengths), generator=gen)
        scores = torch.round(scores * 4) / 4          # many equal scores
        scores[:, 5] = -0.0                           # and a negative zero
        got, counts = select_topk_triton(scores, torch.tensor(lengths, dtype=torch.int32), k)
        for row, n in enumerate(lengths):
            chosen = [p for p in got[row].tolist() if p >= 0]
            assert counts[row] == len(chosen) == min(n, k)
            if n <= k:
                assert chosen == list(range(n))
                continue
            kth = scores[row, :n].topk(k).values[-1]
            values = scores[row, chosen]
            assert (values >= kth).all() and len(set(chosen)) == k
            above = int((scores[row, :n] > kth).sum())
            ties = [p for p in range(n) if scores[row, p] == kth]
            assert sorted(c for c in chosen if scores[row, c] == kth) == ties[:k - above]

    @pytest.mark.parametrize("splits", [2, 3, 7, 9, 17])
    def test_a_row_split_over_programs_selects_what_one_program_does(splits):
        # Position for position, over dense rows, rows whose last slices are empty, slices
        # that end mid-chunk, many ties at the k-th best and -0.0 beside +0.0; twice, so
        # the second launch finds the arrival counters reset.
        from archserve.kernels.sparse_mla.triton_topk import SPLIT_BLOCK, select_topk_triton

        lengths = [3, 16, 17, 1500, SPLIT_BLOCK * 3 + 5, SPLIT_BLOCK * 7, 9000]
        gen = torch.Generator().manual_seed(5)
        scores = torch.round(torch.randn(len(lengths), 9100, generator=gen) * 4) / 4
        scores[:, 5], scores[:, 6] = -0.0, 0.0
        row_lengths = torch.tensor(lengths, dtype=torch.int32)
        for k in (16, 64):
            one, one_counts = select_topk_triton(scores, row_lengths, k, splits=1)
            for _ in range(2):
                split, counts = select_topk_triton(scores, row_lengths, k, splits=splits)
                assert torch.equal(split, one) and torch.equal(counts, one_counts)

    @pytest.mark.parametrize("tiles", [None, (16, 16, 4, 2, True)], ids=["heads", "keys"])
    @pytest.mark.parametrize("layout", LAYOUTS[:2], ids=LAYOUT_IDS[:2])
    def test_indexed_decode_kernel_matches_reference(layout, tiles):
        # Rows of a prompt and decode rows, each over its own selection, in 4 splits (the
        # short selections' later splits empty), with W_UV in the merge.
        from archserve.kernels.mla.interface import latent_output_to_heads
        from archserve.kernels.mla.triton_mla_decode import mla_decode
        from archserve.kernels.sparse_mla.reference import sparse_attend, sparse_topk

        kv, index = layout
        case = make_sparse_case([(6, 60), (1, 5), (1, 90)], topk=24, kv_cache_dtype=kv,
                                index_cache_dtype=index, seed=4, **TINY)
        cache, meta = case.written_cache(), case.meta
        selection = sparse_topk(case.layout, cache, meta, case.indexer.query,
                                case.indexer.weights, case.topk)
        row_seq, row_len = step_rows(case)
        rows = case.num_valid_tokens
        expected = latent_output_to_heads(sparse_attend(case.layout, cache, meta,
                                                        case.absorbed_query, selection,
                                                        case.scale), case.w_uv)
        got = mla_decode(case.absorbed_query, cache, meta.block_tables,
                         row_len.clamp(max=case.topk), torch.arange(rows + 1, dtype=torch.int32),
                         torch.empty(rows, 16, 48), num_seqs=rows, max_seq_len=case.topk,
                         scale=case.scale, num_splits=4, tiles=tiles, w_uv=case.w_uv,
                         indices=selection, row_seq=row_seq, layout=case.layout)
        torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)

    # Decode steps over every layout; prompts beside a decode over the 16-bit and the
    # fp8_ds_mla rows (the prompt-row forms over fp8 keys are the scores test's).
    NAMED = list(zip(LAYOUTS, LAYOUT_IDS, strict=True))
    IMPL_CASES = ([("decode", *named) for named in NAMED]
                  + [("mixed", *named) for named in NAMED[:2]])

    @pytest.mark.parametrize("step,layout", [case[:2] for case in IMPL_CASES],
                             ids=[f"{case[0]}-{case[2]}" for case in IMPL_CASES])
    def test_impl_matches_reference(step, layout):
        from archserve.kernels.mla.triton_sparse_mla import TritonSparseMlaImpl

        seqs = {"decode": [(1, 45), (1, 8), (1, 17)],                  # padded rows too
                "mixed": [(20, 33), (1, 40), (4, 4), (3, 19)]}[step]   # prompts + a decode
        kv, index = layout
        case = make_sparse_case(seqs, topk=12, kv_cache_dtype=kv, index_cache_dtype=index,
                                pad_tokens=2, seed=5, **TINY)
        assert_impl_matches_reference(case, TritonSparseMlaImpl(layout=case.layout))

    @pytest.mark.parametrize("layout", LAYOUTS[:2], ids=LAYOUT_IDS[:2])
    def test_verification_rows_match_reference_and_their_captured_bucket(layout):
        # A verification step (k = 3: up to 4 query tokens a sequence, contexts past top-k):
        # each token a decode row, its indexer scores and top-k from its own causal length,
        # as the reference selects and attends; laid out as a captured bucket (device
        # lengths only, a padding sequence, empty slots) the same rows bit for bit.
        from mla_bucket_cases import bucket_layout, padded_rows

        from archserve.kernels.mla.triton_sparse_mla import TritonSparseMlaImpl
        from archserve.kernels.sparse_mla.interface import IndexerInputs

        kv, index = layout
        case = make_sparse_case([(4, 30), (1, 40), (3, 15), (4, 9)], topk=12,
                                kv_cache_dtype=kv, index_cache_dtype=index, seed=8, **TINY)
        impl = TritonSparseMlaImpl(layout=case.layout)
        assert_impl_matches_reference(case, impl)
        out, selection = case.run(impl)
        bucket = 16
        meta = bucket_layout(case.meta, bucket, TINY["block_size"], 4)
        indexer = IndexerInputs(*(padded_rows(x, bucket) for x in (
            case.indexer.query, case.indexer.key, case.indexer.weights)))
        replayed, replayed_selection = impl.forward_sparse(
            padded_rows(case.q_nope, bucket), padded_rows(case.q_pe, bucket),
            padded_rows(case.latent, bucket), case.kv_cache.clone(), meta, case.w_uk,
            case.w_uv, case.scale, case.topk, indexer)
        rows = case.num_valid_tokens
        assert torch.equal(replayed_selection[:rows], selection)
        assert torch.equal(replayed[:rows], out)
        assert torch.isfinite(replayed.float()).all()

    def test_impl_dense_steps_and_shared_selections():
        # Every context within topk: exactly dense MLA (TRITON_MLA's path over the latent,
        # the expanded prefill for the prompt), no selection returned. A layer that reuses
        # an earlier layer's selection writes no key and attends over that selection.
        from archserve.kernels.mla.triton_sparse_mla import TritonSparseMlaImpl

        dense = make_sparse_case([(5, 12), (1, 16)], topk=16, seed=6, **TINY)
        impl = TritonSparseMlaImpl(layout=dense.layout)
        assert_impl_matches_reference(dense, impl)
        assert dense.run(impl)[1] is None
        case = make_sparse_case([(5, 30), (1, 41)], topk=16, seed=7, **TINY)
        _, selection = case.run(TorchMlaImpl(layout=case.layout))
        shared = case.kv_cache.clone()
        out, reused = impl.forward_sparse(case.q_nope, case.q_pe, case.latent, shared,
                                          case.meta, case.w_uk, case.w_uv, case.scale,
                                          case.topk, None, selection)
        expected, _ = TorchMlaImpl(layout=case.layout).forward_sparse(
            case.q_nope, case.q_pe, case.latent, case.kv_cache.clone(), case.meta, case.w_uk,
            case.w_uv, case.scale, case.topk, None, selection)
        assert reused is selection
        torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)


    def test_glm5_layers_through_the_triton_impl_match_the_torch_path(tmp_path):
        # A tiny GLM-5 (a layer that shares the previous one's selection, the indexer's
        # interleaved rope, top-5) stepped through the paged cache by TRITON_MLA_SPARSE and
        # by the torch reference: a batched prefill, then a decode step beside a chunk.
        from models.helpers import PROMPTS, PagedSequences, saved_and_loaded, tiny_hf_model
        from models.test_sparse_mla_vs_hf import DSA, VARIANTS

        from archserve.kernels.mla.triton_sparse_mla import TritonSparseMlaImpl

        model_type, overrides = VARIANTS["glm"]
        _, model, config = saved_and_loaded(
            tiny_hf_model(model_type, **{**DSA, **overrides, "vocab_size": 256}), tmp_path)
        reference, triton = PagedSequences.for_config(config), PagedSequences.for_config(config)
        triton.attn_impl = TritonSparseMlaImpl(layout=reference.attn_impl.layout)
        for step in ({0: PROMPTS[0], 1: PROMPTS[2]}, {0: [7], 1: [1, 2, 3]}):
            torch.testing.assert_close(triton.run(model, step), reference.run(model, step),
                                       atol=1e-4, rtol=1e-4)


    def test_start_up_canary_passes_and_can_fail():
        # The engine's numerics canary at a sparse model's sizes (top-16 here): dense steps,
        # a decode past top-k, a prompt chunk past top-k. A kernel off by its scale fails it.
        from archserve.engine.canary import attention_canary
        from archserve.kernels.mla.triton_sparse_mla import TritonSparseMlaImpl
        from archserve.kernels.specs import AttentionSpec

        spec = AttentionSpec(head_size=64, dtype=torch.float32, num_heads=16, num_kv_heads=1,
                             use_mla=True, mla_sparse=True, kv_lora_rank=48,
                             qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24,
                             index_topk=16, index_head_dim=48, index_num_heads=8)
        impl = TritonSparseMlaImpl(spec=spec)
        assert attention_canary(impl, spec, 8, torch.device("cpu")) is None

        class OffByScale(TritonSparseMlaImpl):
            def forward_sparse(self, *args):
                args = list(args)
                args[7] *= 1.5                      # the softmax scale
                return super().forward_sparse(*args)

        reason = attention_canary(OffByScale(spec=spec), spec, 8, torch.device("cpu"))
        assert reason is not None and "numerics canary" in reason


# ---------------------------------------------------------------- compiled for real GPUs

TARGETS = {"sm80": ("cuda", 80, 32), "sm90": ("cuda", 90, 32), "sm100": ("cuda", 100, 32),
           "sm120": ("cuda", 120, 32)}


@pytest.mark.skipif(INTERPRETED, reason="the interpreter does not compile")
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_sparse_decode_step_compiles(target):
    """A sparse decode step's kernels for each GPU generation: the row writer, the
    indexer's scores, the top-k and the indexed decode over an fp8_ds_mla cache with fp8
    indexer keys (SM80 reads e4m3 as bytes: it has no e4m3 type). Hopper at DeepSeek-V3.2's
    sizes (latent 512 + 64, 16 heads; indexer 64 heads of 128, top-2048), the others at a
    quarter of the latent (a cold compile of every kernel at 512 costs CI seconds)."""
    from triton_compile import compiled_launches

    from archserve.kernels.mla.triton_sparse_mla import TritonSparseMlaImpl

    rank, index_heads = (512, 64) if target == "sm90" else (128, 32)
    case = make_sparse_case([(1, 3000), (1, 2500)], topk=2048, num_heads=16,
                            kv_lora_rank=rank, rope=64, nope=128, v_head=128,
                            index_heads=index_heads, index_dim=128, block_size=64,
                            dtype=torch.bfloat16, kv_cache_dtype="fp8_ds_mla")
    impl = TritonSparseMlaImpl(layout=case.layout, fp8_bytes=target == "sm80")
    with compiled_launches(TARGETS[target]) as launches:
        case.run(impl)
    kernels = [launch.kernel for launch in launches]
    assert kernels[:4] == ["_write_rows_kernel", "_index_scores_kernel", "_topk_kernel",
                           "_mla_decode_kernel"], kernels
    assert "mma" in launches[1].code() and "mma" in launches[3].code()


@pytest.mark.skipif(INTERPRETED, reason="the interpreter does not compile")
@pytest.mark.parametrize("target", ["sm80", "sm90"])
def test_split_topk_compiles(target):
    """A top-2048 row split over programs: its four passes and its write, one compiled
    variant whatever the slices (they follow the step's longest context: a variant per
    count would compile mid-request) and whichever pass."""
    from triton_compile import compiled_launches

    from archserve.kernels.sparse_mla.triton_topk import select_topk_triton, topk_splits

    # An H100's 132 SMs: a batch-1 128k row in 64 slices, an 8k one in 8; 64 rows of 128k
    # in 8 each; more rows than 4 programs an SM (or no SM count), one program a row.
    assert [topk_splits(1, 131072, 132), topk_splits(1, 8192, 132),
            topk_splits(64, 131072, 132), topk_splits(600, 131072, 132),
            topk_splits(1, 131072, 0)] == [64, 8, 8, 1, 1]
    codes = set()
    for splits in (8, 64):
        with compiled_launches(TARGETS[target]) as launches:
            select_topk_triton(torch.zeros(1, 9000), torch.tensor([9000], dtype=torch.int32),
                               2048, splits=splits)
        kernels = [launch.kernel for launch in launches]
        assert kernels == ["_split_pass_kernel"] * 4 + ["_split_write_kernel"], kernels
        codes |= {launch.code() for launch in launches}
    assert len(codes) == 2


@pytest.mark.skipif(INTERPRETED, reason="the interpreter does not compile")
def test_prompt_steps_of_any_length_share_one_variant():
    """Prompt steps past top-k whose row blocks and longest contexts differ (so do the
    scores kernel's tile splits and the score rows' length) launch the same scores kernel
    and the same one-program top-k: none compiles a variant mid-request that the warm-up's
    lengths did not (seen on an H100: a variant per split count and per unaligned row)."""
    from triton_compile import collected_launches

    from archserve.engine.batch import block_table_width
    from archserve.kernels.sparse_mla.triton_indexer import IndexKeySource, select_top_keys

    keys = {}
    # Few rows split each over programs (_split_*), hundreds take one program a row.
    for seqs in ([(64, 2200)], [(3, 2209)], [(5, 4000), (7, 3001)], [(600, 2300)],
                 [(530, 2201)]):
        case = make_sparse_case(seqs, topk=2048, **TINY)
        row_seq, row_len = step_rows(case)
        meta = case.meta
        # As wide as the engine's tables (whose widths step so their stride is one variant).
        width = meta.block_tables.shape[1]
        tables = torch.nn.functional.pad(meta.block_tables, (0, block_table_width(width) - width))
        with collected_launches(TARGETS["sm90"]) as specs:
            select_top_keys(IndexKeySource.of_sparse_mla(case.layout, case.kv_cache),
                            tables, case.indexer.query, case.indexer.weights,
                            row_seq, row_len, meta.max_seq_len, case.topk,
                            meta.query_lens_cpu, num_sms=132)
        for spec in specs:
            keys.setdefault(spec.name, set()).add(spec.key())
    assert {name: len(found) for name, found in keys.items()} == {
        "_index_scores_kernel": 1, "_topk_kernel": 1, "_split_pass_kernel": 1,
        "_split_write_kernel": 1}


@pytest.mark.skipif(INTERPRETED, reason="the interpreter does not compile")
def test_sparse_prompt_rows_compile_for_hopper():
    """A prompt chunk past topk (rows stacked four a program in the indexer) over 16-bit
    rows: the prompt form of the indexer and the indexed decode over prompt rows."""
    from triton_compile import compiled_launches

    from archserve.kernels.mla.triton_sparse_mla import TritonSparseMlaImpl

    case = make_sparse_case([(64, 2200)], topk=2048, num_heads=16, kv_lora_rank=512, rope=64,
                            nope=128, v_head=128, index_heads=32, index_dim=128,
                            block_size=64, dtype=torch.bfloat16)
    with compiled_launches(TARGETS["sm90"]) as launches:
        case.run(TritonSparseMlaImpl(layout=case.layout))
    scores = next(launch for launch in launches if launch.kernel == "_index_scores_kernel")
    assert scores.constexprs["BLOCK_Q"] == 4 and "mma" in scores.code()


# ---------------------------------------------------------------- GPU, DeepSeek's sizes

DEEPSEEK = dict(kv_lora_rank=512, rope=64, nope=128, v_head=128, index_heads=64,
                index_dim=128)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_impl_at_deepseek_sizes(heads, layout):
    """Top-2048 over contexts up to 9000: a decode batch (short and long rows), then a
    prompt chunk over a long cached prefix beside decodes; bf16. The selections agree with
    the reference's (the scores differ by bf16 rounding; a swapped near-tie at the k-th
    place would show here, and has not), the outputs within bf16 noise."""
    from archserve.kernels.mla.triton_sparse_mla import TritonSparseMlaImpl

    kv, index = layout
    for seqs in ([(1, 100), (1, 2048), (1, 2049), (1, 9000)],
                 [(300, 4000), (1, 2500), (1, 3)]):
        case = make_sparse_case(seqs, topk=2048, num_heads=heads, block_size=64,
                                dtype=torch.bfloat16, kv_cache_dtype=kv,
                                index_cache_dtype=index, device="cuda", seed=8, **DEEPSEEK)
        out, indices = case.run(TritonSparseMlaImpl(layout=case.layout))
        expected, expected_indices = case.run(TorchMlaImpl(layout=case.layout))
        agree = sum(sorted(a) == sorted(b) for a, b in zip(indices.tolist(),
                                                         expected_indices.tolist(),
                                                         strict=True))
        assert agree >= len(indices) - 1, f"{agree} of {len(indices)} selections agree"
        torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 64])
def test_gpu_split_topk_is_the_one_program_select_in_a_cuda_graph(rows):
    """Top-2048 of rows up to 128k scores, as the step splits them over the GPU's SMs:
    position for position what one program a row selects, captured once and replayed with
    other lengths (the slices follow each row's length; the counters reset each launch)."""
    from archserve.kernels.sparse_mla.triton_topk import select_topk_triton, topk_splits

    width = 131072
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = topk_splits(rows, width, sms)
    assert splits > 1 or rows * 2 > sms
    gen = torch.Generator(device="cuda").manual_seed(11)
    scores = torch.round(torch.randn(rows, width, device="cuda", generator=gen) * 64) / 64
    lengths = torch.randint(1, width + 1, (rows,), device="cuda", generator=gen,
                            dtype=torch.int32)
    lengths[0] = width
    out = torch.empty(rows, 2048, dtype=torch.int32, device="cuda")
    counts = torch.empty(rows, dtype=torch.int32, device="cuda")
    select_topk_triton(scores, lengths, 2048, out, counts, sms)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        select_topk_triton(scores, lengths, 2048, out, counts, sms)
    for replay in range(3):
        if replay:
            lengths.copy_(torch.randint(1, width + 1, (rows,), device="cuda", generator=gen,
                                        dtype=torch.int32))
        graph.replay()
        one, one_counts = select_topk_triton(scores, lengths, 2048, splits=1)
        assert torch.equal(out, one) and torch.equal(counts, one_counts), replay
        expected = scores[0, :int(lengths[0])].float()
        if int(lengths[0]) > 2048:
            kth = expected.topk(2048).values[-1]
            assert (expected[out[0].long()] >= kth).all()


@pytest.mark.gpu
def test_gpu_sparse_decode_replays_in_a_cuda_graph():
    """Captured once at the longest context, replayed with other lengths and selections in
    the same buffers: grids come from shapes and host maxima, never from the lengths."""
    from archserve.kernels.mla.triton_sparse_mla import TritonSparseMlaImpl

    case = make_sparse_case([(1, 6000), (1, 3000), (1, 10)], topk=2048, num_heads=16,
                            block_size=64, dtype=torch.bfloat16, device="cuda", seed=9,
                            **DEEPSEEK)
    impl = TritonSparseMlaImpl(layout=case.layout)
    cache = case.written_cache()
    meta = case.meta

    def step():
        return impl.forward_sparse(case.q_nope, case.q_pe, case.latent, cache, meta, case.w_uk,
                                   case.w_uv, case.scale, case.topk, case.indexer)[0]

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    meta.seq_lens.copy_(torch.tensor([2500, 2999, 9], dtype=torch.int32))
    graph.replay()
    expected = step()
    torch.testing.assert_close(captured, expected, atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
def test_gpu_sparse_tile_choice_times_the_indexed_kernel(tmp_path):
    """The start-up choice for TRITON_MLA_SPARSE's decode: the rule's tiles and every
    candidate timed over top-2048 selections (16-bit rows and fp8_ds_mla), none fails or
    disagrees, and what it chose is one of them."""
    from archserve.kernels.mla.tuning import CANDIDATE_TILES, MlaShape, tune_mla_tiles

    for cache in ("auto", "fp8_ds_mla"):
        shape = MlaShape(16, 512, 64, torch.bfloat16, cache, 64, sparse_topk=2048,
                         index_dim=128)
        tiles, timing, source = tune_mla_tiles(shape, str(tmp_path / "mla.json"),
                                               torch.device("cuda"))
        assert source.startswith("tuned in") and timing.default_us > 0, (cache, source)
        assert "disagrees" not in timing.note and "Error" not in timing.note, timing.note
        assert tiles is None or tiles in CANDIDATE_TILES
