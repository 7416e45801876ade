"""TRITON_MLA_SPARSE_DSV4 (DeepSeek V4's attention) against the torch reference
(kernels/compressed_attention/reference.py): the compressor's entries, index keys and carried
accumulators, the indexer's selection over entries, the window + entries + sinks attention,
the window's ring, over the three layer kinds, decode and prompt steps (chunks ending inside a
group and across the ring's wrap, blocks smaller and larger than the window, a graph's
padding slots).

On CPU the kernels run under Triton's interpreter in a child process at tiny, odd sizes
(head 48 with 16 rope channels, 9 indexer heads of 16, top-3, rates 4 and 8, windows of 6
and 12, blocks of 8 and 16) and compile for SM80, SM90, SM100 and SM120; on a GPU the
gpu-marked tests run them at DeepSeek V4's sizes.
"""

from __future__ import annotations

import pytest
import torch

from archserve.kernels.mla.dsv4_cases import make_compressed_case, with_padding
from archserve.kernels.mla.torch_mla import TorchMlaImpl
from archserve.kernels.mla.triton_dsv4 import TritonDsv4Impl
from archserve.kernels.rules import triton_interpreted

INTERPRETED = triton_interpreted()
INTERPRETER_TIMEOUT_S = 900
gpu = pytest.mark.gpu
# (compress_rate, overlap): compressed sparse, heavily compressed, sliding window only.
KINDS = {"csa": (4, True), "hca": (8, False), "sliding": (0, False)}
TINY = dict(num_heads=5, head_dim=48, rope_dim=16, index_dim=16, index_heads=9, topk=3)
# (history, step tokens) per sequence: a prompt continuing a cached prefix mid-group, a
# fresh prompt longer than the window and several groups, a decode mid-group, a decode
# closing a group, and a decode at the start of a block.
PROMPT = [(13, 11), (0, 30), (21, 1), (23, 1), (16, 1)]
DECODE = [(6, 1), (23, 1), (16, 1), (31, 1), (2, 1)]
# Far past the window (the ring wrapped many times): a chunk that starts and ends mid-ring
# and is longer than it, a chunk shorter than the ring across its wrap, decodes.
WRAPPED = [(53, 17), (61, 5), (70, 1), (89, 1)]


def assert_matches_reference(case, impl, atol: float = 2e-3, reference_case=None) -> None:
    """``impl`` on ``case`` against the torch reference on ``reference_case`` (default the
    same case): the real rows' output, and the cache through the layout's views."""
    out, (cache, rings) = case.run(impl)
    expected, (expected_cache, expected_rings) = (reference_case or case).run(TorchMlaImpl())
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=atol)
    layout = case.layout
    torch.testing.assert_close(rings.float(), expected_rings.float(), atol=atol, rtol=atol)
    views = []
    if layout.compress_rate:
        views += [layout.entry_view, layout.state_view]
    if layout.index_dim:
        views.append(layout.index_view)
    for view in views:
        torch.testing.assert_close(view(cache).float(), view(expected_cache).float(),
                                   atol=atol, rtol=atol, equal_nan=True)


if INTERPRETED:   # the rest runs under Triton's interpreter (tests/kernels/conftest.py)
    @pytest.mark.parametrize("block_size, window", [(8, 6), (16, 12)])
    @pytest.mark.parametrize("kind", sorted(KINDS))
    @pytest.mark.parametrize("step", ["prompt", "decode", "wrapped"])
    def test_impl_matches_reference(step, kind, block_size, window):
        rate, overlap = KINDS[kind]
        seqs = {"prompt": PROMPT, "decode": DECODE, "wrapped": WRAPPED}[step]
        case = make_compressed_case(seqs, seed=3,
                                    compress_rate=rate, overlap=overlap, window=window,
                                    block_size=block_size, **TINY)
        assert_matches_reference(case, TritonDsv4Impl())

    @pytest.mark.parametrize("kind", ["csa", "hca"])
    def test_decode_with_padding_slots(kind):
        # A CUDA graph's batch: padding sequences (one token at position 0, slot -1, block 0)
        # write nothing: output and cache are the unpadded step's.
        rate, overlap = KINDS[kind]
        case = make_compressed_case(DECODE, seed=4, compress_rate=rate, overlap=overlap,
                                    block_size=8, window=6, **TINY)
        assert_matches_reference(with_padding(case, 3), TritonDsv4Impl(), reference_case=case)

    def test_the_canary_passes_the_kernels_and_fails_a_wrong_one():
        from archserve.engine.canary import attention_canary
        from archserve.kernels.specs import AttentionSpec
        spec = AttentionSpec(head_size=48, dtype=torch.float32, num_heads=5, num_kv_heads=1,
                             sliding_window=6, use_mla=True, mla_sparse=True, compress_rate=4,
                             qk_rope_head_dim=16, index_topk=3, index_head_dim=16,
                             index_num_heads=9, has_sinks=True)
        impl = TritonDsv4Impl()
        assert attention_canary(impl, spec, 8, torch.device("cpu")) is None

        class NoSinks(TritonDsv4Impl):
            def forward_compressed(self, layout, layer, *args):
                layer.sinks = layer.sinks - 1e4
                return super().forward_compressed(layout, layer, *args)

        reason = attention_canary(NoSinks(), spec, 8, torch.device("cpu"))
        assert reason is not None and "numerics canary" in reason

    def test_the_selection_matters():
        # With top-3 of up to 7 entries, attending every entry would differ: the comparison
        # can fail.
        case = make_compressed_case(PROMPT, seed=5, compress_rate=4, overlap=True,
                                    block_size=8, window=6, **TINY)
        out, _ = case.run(TritonDsv4Impl())
        case.layer.index_topk = 100
        dense, _ = case.run(TorchMlaImpl())
        assert (out - dense).abs().max() > 1e-2


# ---------------------------------------------------------------- compiled for GPU targets

TARGETS = {"sm80": ("cuda", 80, 32), "sm90": ("cuda", 90, 32), "sm100": ("cuda", 100, 32),
           "sm120": ("cuda", 120, 32)}
# DeepSeek V4's attention sizes (64 heads of 512, 64 rope channels, 64 indexer heads of 128),
# over short contexts: the compiled specializations do not depend on the lengths. Top-4 so
# that the indexer's scores run (past top-k).
V4_SIZES = dict(num_heads=64, head_dim=512, rope_dim=64, window=128, index_dim=128,
                index_heads=64, topk=4, block_size=256, dtype=torch.bfloat16)


@pytest.mark.skipif(INTERPRETED, reason="the interpreter does not compile")
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_v4_decode_step_compiles(target):
    """A compressed sparse layer's decode step for each GPU generation: the compressor's
    emit and carry, the indexer's scores and top-k, the attention, the window write."""
    from triton_compile import compiled_launches
    case = make_compressed_case([(40, 1), (23, 1)], compress_rate=4, overlap=True, **V4_SIZES)
    with compiled_launches(TARGETS[target]) as launches:
        case.run(TritonDsv4Impl())
    kernels = [launch.kernel for launch in launches]
    assert kernels == ["_compressor_kernel", "_compressor_kernel", "_index_scores_kernel",
                       "_topk_kernel", "_attention_kernel", "_write_window_kernel"], kernels
    attention = launches[4]
    assert attention.constexprs["BLOCK_D"] == 512 and "mma" in attention.code()


@pytest.mark.skipif(INTERPRETED, reason="the interpreter does not compile")
def test_v4_prompt_steps_compile_for_hopper():
    """Prompt chunks of a heavily compressed layer (128-token groups, split attention off)
    and of a compressed sparse one (the indexer's prompt rows stacked in a program)."""
    from triton_compile import compiled_launches
    for rate, overlap in ((128, False), (4, True)):
        case = make_compressed_case([(100, 60)], compress_rate=rate, overlap=overlap,
                                    **V4_SIZES)
        with compiled_launches(TARGETS["sm90"]) as launches:
            case.run(TritonDsv4Impl())
        assert all(launch.code() for launch in launches)
        if overlap:
            scores = next(x for x in launches if x.kernel == "_index_scores_kernel")
            assert scores.constexprs["BLOCK_Q"] > 1


# ---------------------------------------------------------------- GPU, V4's sizes

@gpu
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_gpu_impl_at_v4_sizes(kind):
    """64 heads of 512, window 128, rates 4 and 128, 64 indexer heads of 128, top-512, blocks
    of 256, bf16: a decode batch (contexts past the window, past top-512 entries and past
    several 128-token groups), then a prompt chunk continuing a cached prefix mid-group
    beside decodes. Within bf16 noise of the reference (the selection's near-ties are the
    scores' bf16 rounding: a swap moves an output by the weight of one entry)."""
    rate = {"csa": 4, "hca": 128, "sliding": 0}[kind]
    sizes = dict(V4_SIZES, topk=512, device="cuda")
    for seqs in ([(2100, 1), (300, 1), (4000, 1), (127, 1)], [(1500, 300), (2600, 1)]):
        case = make_compressed_case(seqs, compress_rate=rate, overlap=kind == "csa",
                                    seed=7, **sizes)
        assert_matches_reference(case, TritonDsv4Impl(), atol=3e-2)


@gpu
def test_gpu_decode_step_replays_in_a_cuda_graph():
    """A compressed sparse decode step captured and replayed: the same output and cache as
    the eager step."""
    case = make_compressed_case([(2100, 1), (300, 1)], compress_rate=4, overlap=True, seed=8,
                                **dict(V4_SIZES, topk=512, device="cuda"))
    impl = TritonDsv4Impl()
    eager, (eager_cache, eager_rings) = case.run(impl)
    cache, rings = case.kv_cache.clone(), case.ring_cache.clone()
    graph = torch.cuda.CUDAGraph()
    impl.forward_compressed(case.layout, case.layer, case.inputs, cache.clone(), rings.clone(),
                            case.meta)
    with torch.cuda.graph(graph):
        out = impl.forward_compressed(case.layout, case.layer, case.inputs, cache, rings,
                                      case.meta)
    cache.copy_(case.kv_cache)
    rings.copy_(case.ring_cache)
    graph.replay()
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(cache, eager_cache)
    torch.testing.assert_close(rings, eager_rings)
