"""TRITON_MLA against TORCH_REFERENCE: the MLA decode kernel over the latent cache (absorbed
queries, head blocks, split-KV), and the whole implementation (latent write, decode, mixed
steps whose prompts take the expanded Triton prefill).

On CPU the kernels run under Triton's interpreter in a child process at tiny sizes (see
test_attention_triton.py for why a child), and compile for real GPU targets; on a GPU the
gpu-marked tests run them at DeepSeek's sizes (latent 512 + 64; 16 and 128 heads).
"""

from __future__ import annotations

import pytest
import torch

from archserve.kernels.mla.cases import make_mla_case
from archserve.kernels.mla.torch_mla import TorchMlaImpl
from archserve.kernels.rules import triton_interpreted

INTERPRETED = triton_interpreted()
INTERPRETER_TIMEOUT_S = 300
# (The interpreter's time goes by programs x ops: one head block but where masking is tested.)
TINY = dict(num_heads=16, kv_lora_rank=32, rope=16, nope=16, v_head=24)
# (BLOCK_H, BLOCK_N, warps, stages, KEYS_AS_ROWS): the transposed products, 16-token tiles.
KEYS_AS_ROWS_TINY = (16, 16, 4, 2, True)
KEYS_AS_ROWS = (16, 64, 4, 2, True)     # the GPU candidate: 64-row operands for wgmma
# The rule's tiles at each stage count (three where a launch has few splits).
THREE_STAGES, TWO_STAGES = (16, 32, 4, 3, False), (16, 32, 4, 2, False)


def decode_against_reference(case, *, num_splits=None, tiles=None, num_sms=0, e4m3_bits=None,
                             atol=2e-3) -> None:
    from archserve.kernels.mla.triton_mla_decode import mla_decode

    meta = case.meta
    query = case.absorbed_query
    cache = case.kv_cache.clone()
    expected = TorchMlaImpl().attend_latent(query, cache, meta, case.scale,
                                            case.w_uk.shape[-1], case.k_scale)
    out = torch.zeros_like(expected)
    mla_decode(query, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, out,
               num_seqs=meta.num_seqs, max_seq_len=meta.max_seq_len, scale=case.scale,
               k_scale=case.k_scale, num_splits=num_splits, tiles=tiles, num_sms=num_sms,
               e4m3_bits=e4m3_bits)
    n = case.num_valid_tokens
    err = (out[:n].float() - expected[:n].float()).abs().max().item()
    assert err <= atol * max(1.0, expected[:n].float().abs().max().item()), f"max error {err:.3g}"


def heads_against_reference(case, *, num_splits=None, num_sms=0, atol=2e-3) -> None:
    """mla_decode with W_UV (the merge and W_UV in one kernel) against the reference's
    latent output times W_UV, on the rows of live sequences."""
    from archserve.kernels.mla.interface import latent_output_to_heads
    from archserve.kernels.mla.triton_mla_decode import mla_decode

    meta, query = case.meta, case.absorbed_query
    cache = case.kv_cache.clone()
    latent = TorchMlaImpl().attend_latent(query, cache, meta, case.scale,
                                          case.w_uk.shape[-1], case.k_scale)
    expected = latent_output_to_heads(latent, case.w_uv)
    got = mla_decode(query, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                     torch.zeros_like(latent), num_seqs=meta.num_seqs,
                     max_seq_len=meta.max_seq_len, scale=case.scale, k_scale=case.k_scale,
                     num_splits=num_splits, num_sms=num_sms, w_uv=case.w_uv)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    n = case.num_valid_tokens
    err = (got[:n].float() - expected[:n].float()).abs().max().item()
    assert err <= atol * max(1.0, expected[:n].float().abs().max().item()), f"max error {err:.3g}"


if INTERPRETED:   # the rest runs under Triton's interpreter (tests/kernels/conftest.py)
    from attention_cases import poison_split_partials

    from archserve.kernels.mla import triton_mla_decode

    @pytest.mark.parametrize("tiles", [None, KEYS_AS_ROWS_TINY], ids=["heads", "keys"])
    def test_split_decode_kernel_matches_reference(tiles, monkeypatch):
        # 4 splits of one 32-token tile: the 5-token sequence's later splits are empty;
        # 20 heads leave the second block of 16 partly masked; blocks of 8 tokens.
        poison_split_partials(monkeypatch, triton_mla_decode)   # empty splits are not read
        case = make_mla_case([(1, 70), (1, 5)], block_size=8, seed=1,
                             **{**TINY, "num_heads": 20})
        decode_against_reference(case, num_splits=4, tiles=tiles)

    @pytest.mark.parametrize("splits", [1, 4])
    def test_carried_offsets_over_many_tiles(splits):
        # Each tile's cache offsets come from the iteration before: 200 tokens in 32-token
        # tiles, unsplit (7 tiles a program) and in 4 splits of 2; a second sequence of 131
        # tokens ends inside a tile; blocks of 8 tokens, shuffled. (The interpreter runs
        # no pipeline: the stage counts are the GPU tests'.)
        case = make_mla_case([(1, 200), (1, 131)], block_size=8, seed=5, **TINY)
        decode_against_reference(case, num_splits=splits)

    @pytest.mark.parametrize("splits", [1, 4, 16])
    def test_decode_with_w_uv_gives_the_heads_values(splits, monkeypatch):
        # The merge and W_UV in one kernel (4 splits: 16 sequences a program, 16 splits: 4,
        # most splits of the short ones empty), W_UV alone (one split): 20 heads; 17
        # sequences leave the last program's rows partly masked.
        poison_split_partials(monkeypatch, triton_mla_decode)   # empty splits are not read
        case = make_mla_case([(1, 5 + 4 * i) for i in range(17)], block_size=8, seed=4,
                             **{**TINY, "num_heads": 20})
        heads_against_reference(case, num_splits=splits)

    @pytest.mark.parametrize("splits", [8, 32])
    def test_decode_with_w_uv_of_one_sequence(splits, monkeypatch):
        # Batch 1, split: a program merges one sequence's row and multiplies it by W_UV's
        # block on the CUDA cores (ROW_PRODUCT), not as a 16-row tl.dot.
        poison_split_partials(monkeypatch, triton_mla_decode)
        case = make_mla_case([(1, 300)], block_size=8, seed=6, **TINY)
        heads_against_reference(case, num_splits=splits)

    @pytest.mark.parametrize("tiles", [None, KEYS_AS_ROWS_TINY], ids=["heads", "keys"])
    def test_decode_kernel_reads_e4m3_bytes(tiles):
        case = make_mla_case([(1, 40)], kv_cache_dtype="fp8_e4m3", dtype=torch.float16,
                             seed=2, **TINY)
        decode_against_reference(case, num_splits=2, e4m3_bits=True, atol=2e-2, tiles=tiles)

    @pytest.mark.parametrize("seqs", [[(1, 21), (1, 40)],              # decode, padded rows
                                      [(5, 21), (1, 40), (3, 3)]],     # prompts + a decode
                             ids=["decode", "mixed"])
    def test_impl_matches_reference(seqs):
        from archserve.kernels.mla.triton_mla import TritonMlaImpl

        case = make_mla_case(seqs, pad_tokens=2, seed=3, **TINY)
        (out, cache), (expected, expected_cache) = case.run(TritonMlaImpl()), \
            case.run(TorchMlaImpl())
        torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(cache, expected_cache)    # the same latent rows written

    @pytest.mark.parametrize("seqs", [[(4, 21), (1, 40), (3, 3), (4, 9)],   # k = 3
                                      [(20, 33), (4, 12), (1, 7)]],          # beside a prompt
                             ids=["verification", "beside-a-prompt"])
    def test_decode_rows_match_reference_and_their_captured_bucket(seqs):
        # A verification step (at most k + 1 query tokens a sequence) runs each token as a
        # decode row of its own causal length: the reference's multi-token attention, and
        # the same rows bit for bit where the step sits in a captured bucket's layout
        # (device lengths only, a padding sequence, empty slots). Beside a long prompt
        # chunk (expanded prefill) the short sequences are decode rows too.
        from mla_bucket_cases import bucket_layout, padded_rows

        from archserve.kernels.mla.triton_mla import TritonMlaImpl

        case = make_mla_case(seqs, seed=3, **TINY)
        (out, cache), (expected, expected_cache) = case.run(TritonMlaImpl()), \
            case.run(TorchMlaImpl())
        torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(cache, expected_cache)
        if max(q for q, _ in seqs) > 4:
            return          # a step with a prompt chunk runs eagerly, never in a bucket
        bucket = 16
        meta = bucket_layout(case.meta, bucket, case.kv_cache.shape[2], 4)
        replayed = TritonMlaImpl().forward(
            padded_rows(case.q_nope, bucket), padded_rows(case.q_pe, bucket),
            padded_rows(case.latent, bucket), case.kv_cache.clone(), meta, case.w_uk,
            case.w_uv, case.scale, case.k_scale)
        assert torch.equal(replayed[:case.num_valid_tokens], out)
        assert torch.isfinite(replayed).all()     # the padding sequence's rows too

    @pytest.mark.parametrize("seqs", [[(20, 33), (5, 21), (1, 40), (3, 3)],
                                      [(5, 21), (1, 40), (3, 3)]],
                             ids=["beside-a-prompt", "decode-rows"])
    def test_mixed_step_decode_metadata_is_not_written_by_the_kernel_before(monkeypatch, seqs):
        # The decode kernel reads its metadata (query starts, lengths, block tables) before
        # PDL's wait (kernels/pdl.py), while the kernel launched right before it may still
        # be running: in a step with more than one query token a sequence, where the decode
        # rows' metadata is gathered on the device (beside a prompt chunk, or for every
        # token), the last op before the decode must be another's (the absorbed query).
        from torch.utils._python_dispatch import TorchDispatchMode

        from archserve.kernels.mla import triton_mla

        class Writes(TorchDispatchMode):
            """The storages each op that launches work wrote, in launch order."""
            def __init__(self):
                super().__init__()
                self.ops = []

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if not func.is_view and func.overloadpacket not in (
                        torch.ops.aten.empty, torch.ops.aten.empty_strided,
                        torch.ops.aten.empty_like):
                    outs = out if isinstance(out, (tuple, list)) else (out,)
                    self.ops.append((func, {t.untyped_storage().data_ptr() for t in outs
                                            if isinstance(t, torch.Tensor)}))
                return out

        writes, checked = Writes(), []

        def decode_after(query, kv_cache, block_tables, seq_lens, query_start_loc, *args,
                         **kwargs):
            last_op, last_written = writes.ops[-1]
            for name, tensor in (("block tables", block_tables), ("seq lens", seq_lens),
                                 ("query starts", query_start_loc)):
                assert tensor.untyped_storage().data_ptr() not in last_written, \
                    f"the {name} come from {last_op}, launched right before the decode"
            checked.append(True)
            return decode(query, kv_cache, block_tables, seq_lens, query_start_loc, *args,
                          **kwargs)

        decode = triton_mla.mla_decode
        monkeypatch.setattr(triton_mla, "mla_decode", decode_after)
        case = make_mla_case(seqs, seed=3, **TINY)
        with writes:
            case.run(triton_mla.TritonMlaImpl())
        assert checked


# ---------------------------------------------------------------- the start-up tile choice

def _shape():
    from archserve.kernels.mla.tuning import MlaShape
    return MlaShape(16, 512, 64, torch.bfloat16, "auto", 16)


def test_tile_choice_takes_the_fastest_agreeing_candidate_and_caches_it(tmp_path):
    """The selection logic, over stated timings (the GPU times real launches): a faster
    candidate whose output disagrees is refused, the fastest agreeing one is taken, and a
    second start reads the cache without timing."""
    from archserve.kernels.mla.tuning import CANDIDATE_TILES, describe, tune_mla_tiles

    reference = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    wrong, right, slower = CANDIDATE_TILES
    timed = []

    def timer(shape, tiles):
        timed.append(tiles)
        if tiles is None:
            return 100.0, reference
        return {wrong: (50.0, reference + 5.0), right: (80.0, reference + 1e-3),
                slower: (90.0, reference)}[tiles]

    path = str(tmp_path / "mla_tiles.json")
    tiles, timing, source = tune_mla_tiles(_shape(), path, torch.device("cpu"), timer)
    assert tiles == right and source.startswith("tuned in") and timed == [None, wrong, right, slower]
    assert "disagrees" in timing.note and "80.0 µs against the rule's 100.0" in \
        describe(timing, source)
    again = tune_mla_tiles(_shape(), path, torch.device("cpu"), lambda *_: 1 / 0)
    assert again[0] == right and again[2] == "cached"


def test_tile_choice_keeps_the_rule_when_no_candidate_pays_or_timing_fails(tmp_path):
    from archserve.kernels.mla.tuning import describe, tune_mla_tiles

    out = torch.ones(2, 2)
    tiles, timing, source = tune_mla_tiles(_shape(), str(tmp_path / "a.json"),
                                           torch.device("cpu"),
                                           lambda shape, t: (100.0 if t is None else 99.0, out))
    assert tiles is None and "no candidate faster" in describe(timing, source)
    path = tmp_path / "b.json"
    tiles, timing, source = tune_mla_tiles(_shape(), str(path), torch.device("cpu"),
                                           lambda *_: 1 / 0)
    assert tiles is None and "timing failed" in describe(timing, source)
    assert not path.exists()      # a failed timing is not cached: the next start tries again


def test_three_stages_only_where_splits_are_few():
    """The rule pipelines the latent tiles three stages deep only for a few long splits
    (many sequences); a few sequences split many ways, or short contexts, get two (a
    batch-1 step lost 0.12 ms with three on the H200), and so does a GPU whose blocks
    cannot take three stages' shared memory."""
    from archserve.kernels.mla.triton_mla_decode import (
        PIPELINED_MAX_SPLITS,
        PIPELINED_MIN_TILES,
        mla_decode_tiles,
        mla_num_splits,
    )
    long = PIPELINED_MAX_SPLITS * PIPELINED_MIN_TILES * 32
    assert mla_decode_tiles(16, 1, 4096) == THREE_STAGES
    assert mla_decode_tiles(16, PIPELINED_MAX_SPLITS, long) == THREE_STAGES
    assert mla_decode_tiles(16, PIPELINED_MAX_SPLITS, long - 1) == TWO_STAGES
    assert mla_decode_tiles(16, 2 * PIPELINED_MAX_SPLITS, 1 << 20) == TWO_STAGES
    assert mla_decode_tiles(16, 1, 4096, max_stages=2) == TWO_STAGES
    # On 132 SMs: 64 x 4096 gets 4 splits (three stages), batch 1 32 (two), 256 one.
    assert mla_num_splits(64, 16, 4096, 132, 16) == 4
    assert mla_num_splits(1, 16, 4224, 132, 16) == 32
    assert mla_num_splits(256, 16, 4224, 132, 16) == 1


def test_the_latent_tile_fits_the_gpus_shared_memory():
    """Below SM80 the decode kernel's footprint grows with its latent tile (the compile
    sweep measures it, tests/compile_sweep.py): DeepSeek's rank 512 takes 16-token tiles on
    a V100 and does not fit a T4 at all (TRITON_MLA refuses it there); rank 256 fits both
    at 32; from SM80, and on ROCm, 32 everywhere."""
    from archserve.kernels.mla.decode_shared_memory import latent_tile_tokens, too_large_reason
    from archserve.kernels.mla.triton_mla_decode import mla_decode_tiles
    from archserve.platform.profiles import get_profile

    tokens = {(gpu, rank): latent_tile_tokens(get_profile(gpu), rank)
              for gpu in ("v100", "t4", "a10", "h200", "mi300x") for rank in (256, 512)}
    assert tokens == {("v100", 256): 32, ("v100", 512): 16, ("t4", 256): 32, ("t4", 512): None,
                      ("a10", 256): 32, ("a10", 512): 32, ("h200", 256): 32,
                      ("h200", 512): 32, ("mi300x", 256): 32, ("mi300x", 512): 32}
    assert too_large_reason(get_profile("t4"), 512).endswith("the GPU has 64 KiB")
    assert mla_decode_tiles(16, 1, 4096, block_n=16)[1] == 16


# ---------------------------------------------------------------- compiled for real GPUs

@pytest.mark.skipif(INTERPRETED, reason="the interpreter does not compile")
def test_decode_compiles_for_hopper():
    """DeepSeek's latent (512 + 64, 16 heads) in bf16 over an e4m3 cache read as bytes,
    split (decode and merge kernels), as the compiler takes it: tensor-core MMAs. (One
    target: a cold compile costs CI seconds; the GPU tests run the rest.)"""
    from triton_compile import compiled_launches

    from archserve.kernels.mla.triton_mla_decode import mla_decode

    target, cache_dtype = ("cuda", 90, 32), torch.float8_e4m3fn
    query = torch.zeros(2, 16, 576, dtype=torch.bfloat16)
    cache = torch.zeros(1, 4, 64, 1, 576, dtype=cache_dtype)
    tables, lens = torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    starts = torch.arange(3, dtype=torch.int32)
    with compiled_launches(target) as launches:
        mla_decode(query, cache, tables, lens, starts, torch.zeros(2, 16, 512, dtype=torch.bfloat16),
                   num_seqs=2, max_seq_len=256, scale=0.1, k_scale=0.5, num_splits=2,
                   e4m3_bits=True)
    assert [launch.kernel for launch in launches] == ["_mla_decode_kernel", "_merge_splits_kernel"]
    assert "mma" in launches[0].code()


@pytest.mark.skipif(INTERPRETED, reason="the interpreter does not compile")
def test_keys_as_rows_gives_hopper_wgmma():
    """Why KEYS_AS_ROWS exists: with 16 heads as M the dots compile to mma.sync on SM90;
    with 64 tokens (scores) and 512 latent values (output) as M, to wgmma."""
    from triton_compile import compiled_launches

    from archserve.kernels.mla.triton_mla_decode import mla_decode

    query = torch.zeros(2, 16, 576, dtype=torch.bfloat16)
    cache = torch.zeros(1, 4, 64, 1, 576, dtype=torch.bfloat16)
    tables, lens = torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    codes = {}
    for name, tiles in (("heads", None), ("keys", KEYS_AS_ROWS)):
        with compiled_launches(("cuda", 90, 32)) as launches:
            mla_decode(query, cache, tables, lens, torch.arange(3, dtype=torch.int32),
                       torch.zeros(2, 16, 512, dtype=torch.bfloat16), num_seqs=2,
                       max_seq_len=256, scale=0.1, num_splits=1, tiles=tiles)
        codes[name] = launches[0].code()
    assert "wgmma.mma_async" not in codes["heads"] and "mma.sync" in codes["heads"]
    assert "wgmma.mma_async" in codes["keys"] and "mma.sync" not in codes["keys"]


# ---------------------------------------------------------------- GPU, DeepSeek's sizes

DEEPSEEK = dict(kv_lora_rank=512, rope=64, nope=128, v_head=128)
CONTEXTS = [1, 17, 64, 255, 1000, 4096]


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [None, KEYS_AS_ROWS, THREE_STAGES],
                         ids=["heads", "keys", "three stages"])
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_decode_kernel_at_deepseek_sizes(heads, block_size, kv, tiles):
    """Contexts 1..4096 in one batch, unsplit, split by the rule (the H200's SMs) and split
    8 ways; bf16 queries over a bf16 or e4m3 latent; heads or keys as the dots' rows."""
    case = make_mla_case([(1, n) for n in CONTEXTS], num_heads=heads, block_size=block_size,
                         dtype=torch.bfloat16, kv_cache_dtype=kv, device="cuda", seed=heads,
                         fp8_exact_kv=False, **DEEPSEEK)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for splits, num_sms in ((1, 0), (None, sms), (8, 0)):
        decode_against_reference(case, num_splits=splits, num_sms=num_sms, atol=3e-2,
                                 tiles=tiles)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_decode_with_w_uv_at_deepseek_sizes(heads, kv):
    """The merge and W_UV in one kernel: contexts 1..4096, unsplit, split by the rule and
    8 ways, against the reference's latent output times W_UV."""
    case = make_mla_case([(1, n) for n in CONTEXTS], num_heads=heads, block_size=16,
                         dtype=torch.bfloat16, kv_cache_dtype=kv, device="cuda", seed=heads,
                         fp8_exact_kv=False, **DEEPSEEK)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for splits, num_sms in ((1, 0), (None, sms), (8, 0)):
        heads_against_reference(case, num_splits=splits, num_sms=num_sms, atol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_impl_at_deepseek_sizes(heads, kv):
    """Through TritonMlaImpl: a prompt, a chunk over a 700-token cached prefix and a decode
    in one step (expanded prefill beside the absorbed kernel), then a pure-decode step."""
    from archserve.kernels.mla.cases import compare_mla_with_reference
    from archserve.kernels.mla.triton_mla import TritonMlaImpl

    for seqs in ([(300, 300), (64, 764), (1, 4096)], [(1, 300), (1, 764), (1, 4096)]):
        case = make_mla_case(seqs, num_heads=heads, block_size=16, dtype=torch.bfloat16,
                             kv_cache_dtype=kv, device="cuda", seed=7, fp8_exact_kv=False,
                             **DEEPSEEK)
        assert compare_mla_with_reference(case, TritonMlaImpl()) is None, seqs


@pytest.mark.gpu
def test_gpu_tile_choice_times_both_forms_at_deepseek_sizes(tmp_path):
    """The start-up choice on this GPU: the rule's tiles and every candidate are timed as
    graph replays (none fails or disagrees), and what it chose is one of them."""
    from archserve.kernels.mla.tuning import CANDIDATE_TILES, tune_mla_tiles

    tiles, timing, source = tune_mla_tiles(_shape(), str(tmp_path / "mla.json"),
                                           torch.device("cuda"))
    assert source.startswith("tuned in") and timing.default_us > 0
    assert "disagrees" not in timing.note
    assert "Error" not in timing.note, timing.note
    assert tiles is None or tiles in CANDIDATE_TILES


@pytest.mark.gpu
def test_gpu_decode_replays_in_a_cuda_graph():
    """Captured once at the longest context, replayed with other lengths in the same
    buffers: the split count and grid come from shapes, not from the lengths."""
    from archserve.kernels.mla.triton_mla_decode import mla_decode

    case = make_mla_case([(1, n) for n in (4096, 2000, 1)], num_heads=16, block_size=16,
                         dtype=torch.bfloat16, device="cuda", seed=5, **DEEPSEEK)
    meta, query = case.meta, case.absorbed_query.contiguous()
    out = torch.zeros(*query.shape[:2], 512, dtype=query.dtype, device="cuda")

    def launch():
        mla_decode(query, case.kv_cache, meta.block_tables, meta.seq_lens,
                   meta.query_start_loc, out, num_seqs=3, max_seq_len=4096, scale=case.scale,
                   num_sms=torch.cuda.get_device_properties(0).multi_processor_count)

    launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    # (each no longer than at capture: the block tables cover those lengths)
    meta.seq_lens.copy_(torch.tensor([100, 1999, 1], dtype=torch.int32))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    expected = TorchMlaImpl().attend_latent(query, case.kv_cache, meta, case.scale, 512)
    torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=3e-2)
