"""TRITON_FUSED_MOE against TORCH_MOE (the reference), its routing kernel against
routing.route, and the token sort it runs on (or, for a few pairs, the pair layout).

On CPU the kernels run under Triton's interpreter in a child process (as the other Triton
test files do) at small sizes, in float32 and float16 (the interpreter cannot multiply
bf16 in tl.dot); they are also compiled for SM80 and SM90 from the arguments the wrapper
really passes, since the interpreter accepts code the compiler refuses. On a GPU the
``gpu``-marked tests run the compiled kernels at Qwen3-30B-A3B's and Mixtral-8x7B's expert
shapes in bf16, and replay a captured decode step in a CUDA graph.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from archserve.kernels.catalog import select_moe_backend
from archserve.kernels.moe.routing import align_to_blocks, max_padded_rows, route
from archserve.kernels.moe.torch_moe import TorchMoEImpl
from archserve.kernels.rules import triton_interpreted
from archserve.kernels.specs import MoESpec
from archserve.platform import get_profile

INTERPRETED = triton_interpreted()
INTERPRETER_TIMEOUT_S = 900
HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu


def operands(tokens: int, experts: int, hidden: int, inter: int, dtype: torch.dtype,
             device: str = "cpu", seed: int = 0):
    gen = torch.Generator().manual_seed(seed * 7919 + tokens * 31 + experts)
    x = torch.randn(tokens, hidden, generator=gen)
    logits = torch.randn(tokens, experts, generator=gen) * 2
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5
    return [t.to(device) if i == 1 else t.to(device, dtype)
            for i, t in enumerate((x, logits, w13, w2))]


def meta_experts(experts: int, hidden: int, inter: int, dtype=torch.bfloat16):
    """Expert weights of a real shape that take no memory (the tile rules read shapes)."""
    return (torch.empty(experts, 2 * inter, hidden, dtype=dtype, device="meta"),
            torch.empty(experts, hidden, inter, dtype=dtype, device="meta"))


def distinct_logits(tokens: int, experts: int, seed: int = 0) -> torch.Tensor:
    """Router logits whose order no rounding can change: each row a permutation of
    well-separated values, so any routing must pick the same experts as route."""
    gen = torch.Generator().manual_seed(seed)
    steps = torch.stack([torch.randperm(experts, generator=gen) for _ in range(tokens)])
    return steps.float() * (6.0 / experts) - 3.0


# DeepSeek's routings: (experts, top_k, grouped_route keywords). V2-Lite (64 experts, top-6,
# softmax, no groups), V2 (160 experts in 8 groups of 20: not a power of two; top-6 within
# the best 3 groups, scaled), V3 (256 in 8 groups, sigmoid + bias, best two per group).
GROUPINGS = {
    "v2-lite": (64, 6, dict(scoring="softmax", scaling=1.0), False),
    "v2": (160, 6, dict(scoring="softmax", num_groups=8, topk_groups=3, scaling=16.0), False),
    "v3": (256, 8, dict(scoring="sigmoid", num_groups=8, topk_groups=4, scaling=2.5), True),
    "v4": (256, 6, dict(scoring="sqrtsoftplus", scaling=1.5), True),
}
# The inverse of each scoring function with a selection bias: logits from chosen scores.
SCORE_INVERSES = {"sigmoid": lambda s: (s / (1 - s)).log(),
                  "sqrtsoftplus": lambda s: torch.expm1(s * s).log()}


def grouped_case(name: str, tokens: int, seed: int = 0):
    """(logits, top_k, keywords with the bias, renormalize) whose choices no fp32 rounding can
    reorder. Softmax rows are ``distinct_logits``. With a selection bias (sigmoid scores),
    each row's biased scores are put on a grid of 0.5 / E (a permutation of its steps, drawn
    again until the groups' best-two sums differ too), and the logits are solved from them."""
    from archserve.kernels.moe.routing import grouped_route
    experts, top_k, keywords, renormalize = GROUPINGS[name]
    keywords = dict(keywords)
    groups = keywords.get("num_groups", 1)
    if keywords["scoring"] == "softmax":
        logits = distinct_logits(tokens, experts, seed=seed)
    else:
        gen = torch.Generator().manual_seed(seed)
        bias = -0.4 * torch.randperm(experts, generator=gen).double() / experts
        rows = []
        while len(rows) < tokens:
            choice = 0.5 * (torch.randperm(experts, generator=gen).double() + 1) / experts
            sums = choice.view(groups, -1).topk(2, dim=-1).values.sum(-1)
            if sums.unique().numel() == groups:
                rows.append(choice)
        scores = torch.stack(rows) - bias        # in (0, 0.9]: a sigmoid's values
        logits = SCORE_INVERSES[keywords["scoring"]](scores).float()
        keywords["correction_bias"] = bias.float()
    grouped_route(logits, top_k, renormalize=renormalize, **keywords)   # the keywords fit it
    return logits, top_k, keywords, renormalize


def reference(x, logits, w13, w2, top_k, renormalize):
    """TORCH_MOE in float64: the kernel's rounding is then the only difference."""
    out = TorchMoEImpl().forward(x.double(), logits, w13.double(), w2.double(), top_k,
                                 renormalize)
    return out


# ---------------------------------------------------------------- routing and the sort

@pytest.mark.parametrize("tokens, experts, top_k, block_m", [
    (1, 8, 2, 16), (1, 128, 8, 16), (7, 4, 1, 16), (33, 16, 4, 32), (64, 64, 8, 64),
    (5, 8, 8, 16),
])
def test_alignment_groups_every_pair_once_per_expert_tile(tokens, experts, top_k, block_m):
    gen = torch.Generator().manual_seed(tokens + experts)
    ids = torch.randn(tokens, experts, generator=gen).topk(top_k, dim=-1).indices
    align = align_to_blocks(ids, experts, block_m)
    pairs = tokens * top_k
    sorted_pairs = align.sorted_pairs.tolist()
    assert len(sorted_pairs) == max_padded_rows(pairs, experts, block_m)
    assert len(sorted_pairs) % block_m == 0
    real = [p for p in sorted_pairs if p < pairs]
    assert sorted(real) == list(range(pairs))           # every pair exactly once
    assert all(p == pairs for p in sorted_pairs if p >= pairs)   # padding is the sentinel
    flat = ids.reshape(-1).tolist()
    blocks = align.block_expert.tolist()
    for b, expert in enumerate(blocks):
        rows = [p for p in sorted_pairs[b * block_m:(b + 1) * block_m] if p < pairs]
        if expert < 0:
            assert not rows                               # past the end: nothing to do
        else:
            assert all(flat[p] == expert for p in rows)   # a tile holds one expert's pairs
    used = [e for e in blocks if e >= 0]
    assert used == sorted(used)                           # experts in order, no empty tile
    assert all(any(p < pairs for p in sorted_pairs[b * block_m:(b + 1) * block_m])
               for b, e in enumerate(blocks) if e >= 0)


def test_worst_case_length_is_bounded_by_pairs_not_experts():
    # Decode, 1 token, top-8 of 128 experts, tile 16: 8 tiles, not 128.
    assert max_padded_rows(8, 128, 16) == 8 * 16
    assert max_padded_rows(1024, 8, 64) == 1536       # 1024 + 8 * 63, to a whole tile


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_softmax_top_k(renormalize):
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    weights, experts = route(logits, 2, renormalize)
    probs = torch.softmax(logits, -1)[0]
    assert experts.tolist() == [[1, 2]]
    expected = probs[[1, 2]] / (probs[[1, 2]].sum() if renormalize else 1)
    torch.testing.assert_close(weights[0], expected)


# ---------------------------------------------------------------- the backend

def test_cuda_selects_the_fused_kernel_and_cpu_the_torch_loop():
    h100 = select_moe_backend(get_profile("h100"), MoESpec(), libraries="all")
    assert h100.name == "TRITON_FUSED_MOE" and h100.backend.implemented
    assert h100.backend.graph_capturable
    from archserve.kernels.moe.triton_fused_impl import TritonFusedMoEImpl
    assert isinstance(h100.backend.make_impl(get_profile("h100"), MoESpec()),
                      TritonFusedMoEImpl)
    cpu = select_moe_backend(get_profile("cpu"), MoESpec(dtype=torch.float32))
    assert cpu.name == "TORCH_MOE"
    assert cpu.rejected[0].reason == "needs a CUDA or ROCm GPU, device is cpu"
    # No Triton: the GPU falls back to the loop, and says why.
    none = select_moe_backend(get_profile("h100"), MoESpec(), libraries="none")
    assert none.name == "TORCH_MOE" and "triton" in none.rejected[0].reason


def test_shared_experts_take_the_slots_after_the_top_k():
    from archserve.kernels.moe.routing import grouped_route
    logits = distinct_logits(3, 16, seed=2)
    weights, ids = grouped_route(logits, 4, renormalize=True, scaling=2.5)
    with_shared, shared_ids = grouped_route(logits, 4, renormalize=True, scaling=2.5,
                                            shared_experts=2)
    assert shared_ids.tolist() == [row + [16, 17] for row in ids.tolist()]
    assert torch.equal(with_shared[:, :4], weights)       # neither renormalised nor scaled:
    assert torch.equal(with_shared[:, 4:], torch.ones(3, 2))   # DeepSeek adds them as they are


def test_quantized_experts_route_by_vllm_fp8_rule():
    """Triton fp8 experts need SM89+ (vLLM 0.33); below, TORCH_MOE runs them dequantized."""
    h100 = select_moe_backend(get_profile("h100"), MoESpec(quant_scheme="fp8_block"))
    assert h100.name == "TRITON_FUSED_MOE"
    a100 = select_moe_backend(get_profile("a100"), MoESpec(quant_scheme="fp8"), "all")
    assert a100.name == "TORCH_MOE"
    assert any(r.reason == "fp8 experts need SM89+, device is SM80" for r in a100.rejected)
    assert select_moe_backend(get_profile("a100"), MoESpec(quant_scheme="wna16"),
                              "all").name == "TRITON_FUSED_MOE"
    with pytest.raises(Exception, match="int8 experts need a quantized MoE kernel"):
        select_moe_backend(get_profile("h100"), MoESpec(quant_scheme="int8"), "all")


def test_the_kernel_refuses_what_it_cannot_compute():
    from archserve.kernels.moe.triton_fused_moe import fused_moe_unsupported
    x, _, w13, w2 = operands(2, 4, 16, 16, torch.float32)
    assert fused_moe_unsupported(x, w13, w2) is None
    assert "dtype" in fused_moe_unsupported(x, w13.half(), w2)
    assert "float16" in fused_moe_unsupported(x.double(), w13.double(), w2.double())


# ---------------------------------------------------------------- tiles and their tuning

def test_tiles_are_keyed_by_power_of_two_token_buckets():
    from archserve.kernels.moe.triton_fused_impl import TritonFusedMoEImpl
    from archserve.kernels.moe.triton_fused_moe import (
        MoETile,
        candidate_tiles,
        default_tile,
        token_bucket,
    )
    assert [token_bucket(n) for n in (1, 2, 3, 16, 17, 256, 257)] == [1, 2, 4, 16, 32, 256, 512]
    impl = TritonFusedMoEImpl()
    tuned = MoETile(16, 128, 64, 4, 3)
    impl.tiles[32] = tuned
    w13, w2 = meta_experts(128, 2048, 768)
    assert impl.tile_for(17, 8, w13, w2) == tuned and impl.tile_for(32, 8, w13, w2) == tuned
    assert impl.tile_for(33, 8, w13, w2) == default_tile(33) != tuned
    for n in (1, 64, 1024):
        tiles = candidate_tiles(n, 8, w13, w2)
        assert len(set(tiles)) == len(tiles) > 2
        assert tiles[0] == impl.tile_for(n, 8, w13, w2)
    assert candidate_tiles(1024, 8, w13, w2)[0] == default_tile(1024)
    # Both layouts are timed at the small batches, where either may win.
    assert {t.pair_rows for t in candidate_tiles(1, 8, w13, w2)} == {True, False}
    assert {t.pair_rows for t in candidate_tiles(16, 8, w13, w2)} == {True, False}
    assert not any(t.pair_rows for t in candidate_tiles(64, 8, w13, w2))
    # The widest pair tile also at 8 warps (at 4 its gate/up kernel spills on Hopper).
    assert MoETile(16, 64, 128, 8, 4, pair_rows=True) in candidate_tiles(1, 8, w13, w2)
    # The slot-summing down kernel beside the pair layout's, where there are slots to sum.
    assert any(t.down_block_n for t in candidate_tiles(1, 8, w13, w2))
    assert not any(t.down_block_n for t in candidate_tiles(1, 1, w13, w2))
    assert not any(t.down_block_n for t in candidate_tiles(64, 8, w13, w2))
    # The CUDA-core gate/up in the pair layout only, alone and with the slot-summing down.
    ones = candidate_tiles(1, 8, w13, w2)
    assert any(t.gate_up_block_n and not t.down_block_n for t in ones)
    assert any(t.gate_up_block_n and t.down_block_n for t in ones)
    assert all(t.pair_rows for t in ones if t.gate_up_block_n)
    assert not any(t.gate_up_block_n for t in candidate_tiles(64, 8, w13, w2))
    # Benchmarks name tiles by key: every candidate reads back as itself.
    for n in (1, 16, 64):
        for tile in candidate_tiles(n, 8, w13, w2):
            assert MoETile.from_key(tile.key()) == tile


# (experts, top_k, hidden, inter): Qwen3-30B-A3B's and Mixtral-8x7B's expert shapes.
REAL = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}


@pytest.mark.parametrize("shape, pair_tokens, sorted_tokens", [
    ("qwen3-30b-a3b", (1, 2, 4, 8), (16, 32, 256)),
    ("mixtral-8x7b", (1, 2), (3, 4, 16, 256))])
def test_few_pairs_skip_the_sort_while_rereading_experts_is_cheap(shape, pair_tokens,
                                                                  sorted_tokens):
    from archserve.kernels.moe.triton_fused_moe import choose_tile
    experts, top_k, hidden, inter = REAL[shape]
    w13, w2 = meta_experts(experts, hidden, inter)
    assert all(choose_tile(n, top_k, w13, w2).pair_rows for n in pair_tokens)
    assert not any(choose_tile(n, top_k, w13, w2).pair_rows for n in sorted_tokens)


def test_the_pair_tile_gives_every_sm_programs_at_batch_1():
    from archserve.kernels.moe.triton_fused_moe import pair_tile
    # Qwen3-30B-A3B at batch 1 on 132 SMs: 8 pairs x 768 / 16 = 384 gate/up programs.
    tile = pair_tile(8, 768, 132)
    assert tile.pair_rows and tile.block_m == 16 and tile.block_n == 16
    assert 8 * 768 // tile.block_n >= 2 * 132
    assert pair_tile(64, 768, 132).block_n == 64      # 64 pairs fill the GPU at any width
    assert pair_tile(8, 768, 1).block_n == 64


def test_cached_moe_tiles_are_installed_without_timing(tmp_path):
    import json

    from archserve.kernels.moe.triton_fused_impl import TritonFusedMoEImpl
    from archserve.kernels.moe.triton_fused_moe import MoETile
    from archserve.kernels.moe.tuning import _CACHE_VERSION, MoEShape, tune_moe
    _, _, w13, w2 = operands(1, 8, 32, 16, torch.float16)
    impls = [TritonFusedMoEImpl(), TritonFusedMoEImpl()]
    shape = MoEShape(impls, w13, w2, 2, True)
    tile = MoETile(16, 32, 128, 4, 4)
    path = tmp_path / "moe_tiles.json"
    path.write_text(json.dumps({"version": _CACHE_VERSION, "shapes": {
        shape.key(1): {"default_us": 9.0, "best_us": 6.0, "chosen": json.dumps(vars(tile)),
                       "calls": 2, "note": ""},
        shape.key(2): {"default_us": 9.0, "best_us": 9.0, "chosen": "default", "calls": 2,
                       "note": ""}}}))

    def no_timing(*_):
        raise AssertionError("a cached bucket must not be timed")
    report = tune_moe([shape], [1, 2], str(path), timer=no_timing)
    assert report.from_cache and "1 of 2" in report.summary()
    assert all(impl.tiles == {1: tile} for impl in impls)


# ---------------------------------------------------------------- compiled for real GPUs

@pytest.mark.skipif(INTERPRETED, reason="the interpreter does not compile")
@pytest.mark.parametrize("target, dtype", [  # cold compiles are slow on CI: three pairs
    (("cuda", 80, 32), torch.bfloat16), (("cuda", 90, 32), torch.float16),
    (("cuda", 90, 32), torch.float32)], ids=["sm80-bf16", "sm90-fp16", "sm90-fp32"])
def test_kernel_launches_compile_for_gpu_targets(target, dtype):
    pytest.importorskip("triton")
    from triton_compile import compiled_launches

    from archserve.kernels.moe.triton_fused_moe import DEFAULT_TILES, fused_moe, pair_tile
    from archserve.kernels.moe.triton_routing import triton_route
    x, logits, w13, w2 = operands(4, 8, 64, 48, dtype)
    tiles = [DEFAULT_TILES[0][1], DEFAULT_TILES[-1][1], pair_tile(8, 48, 132)] \
        if dtype != torch.float32 else [DEFAULT_TILES[0][1]]
    # Compiled launches leave their outputs unwritten: routed by torch, so the sort of the
    # sorted layout gets real expert ids.
    routed = route(logits, 2, True)
    for tile in tiles:
        with compiled_launches(target) as launches:
            fused_moe(x, logits, w13, w2, 2, True, tile, routed)
        assert [launch.kernel for launch in launches] == ["_gate_up_kernel", "_down_kernel",
                                                          "_sum_slots_kernel"]
        for launch in launches[:2]:
            code = launch.code()
            assert code and launch.constexprs["BLOCK_M"] == tile.block_m
            assert launch.constexprs["PAIR_ROWS"] == tile.pair_rows
            # Tensor-core MMAs, not a scalar loop (fp32 asks for exact IEEE products).
            if dtype != torch.float32:
                assert "mma" in code
        assert launches[2].code()
    # The residual added where the slots are summed (FusedMoE.forward_add): the sum kernel
    # and the slot-summing down kernel, with their ADD epilogue.
    residual = torch.randn_like(x)
    summing = dataclasses.replace(pair_tile(8, 48, 132), down_block_n=4, down_block_k=64)
    for tile, last in ((DEFAULT_TILES[0][1], "_sum_slots_kernel"),
                       (summing, "_down_sum_slots_kernel")):
        with compiled_launches(target) as launches:
            fused_moe(x, logits, w13, w2, 2, True, tile, routed, add=residual)
        assert launches[-1].kernel == last and launches[-1].constexprs["ADD"]
        assert launches[-1].code()
    with compiled_launches(target) as launches:   # fp32 logits whatever the model dtype
        triton_route(torch.randn(3, 512), 8, True)
        logits, top_k, keywords, renormalize = grouped_case("v3", 3)
        triton_route(logits, top_k, renormalize, **keywords)
        # DeepSeek V4's hash layers: sqrt(softplus) scores of the table's experts.
        triton_route(torch.randn(3, 256), 6, True, scoring="sqrtsoftplus",
                     fixed_ids=torch.randint(0, 256, (3, 6)))
    assert [launch.kernel for launch in launches] == ["_route_kernel"] * 3
    assert launches[0].code() and launches[0].constexprs["BLOCK_P"] == 512
    assert launches[1].code() and launches[1].constexprs["GROUPS"] == 8
    assert launches[2].code() and launches[2].constexprs["FIXED"]


# ---------------------------------------------------------------- CPU: the interpreter

F32, F16 = torch.float32, torch.float16
CASES = [  # tokens, experts, top_k, hidden, inter, renormalize, dtype (interpreter time: fp16
           # on the cases where its rounding differs most from fp32's)
    (1, 8, 2, 32, 48, True, F32),        # decode, M = 1
    (1, 128, 8, 64, 32, True, F16),      # 128 experts, top-8, one token: 120 experts idle
    (13, 16, 1, 40, 24, False, F32),     # top-1, odd sizes
    (5, 8, 8, 32, 48, True, F16),        # top-8 of 8: every expert on every token
    (21, 32, 4, 48, 40, False, F32),     # odd tokens, most experts with few or no tokens
    (70, 8, 2, 24, 72, True, F32),       # several row tiles per expert
]

if INTERPRETED:   # the rest runs under Triton's interpreter (tests/kernels/conftest.py)
    from archserve.kernels.moe.triton_fused_impl import TritonFusedMoEImpl
    from archserve.kernels.moe.triton_fused_moe import (
        MoETile,
        choose_tile,
        fused_moe,
        pair_tile,
    )
    from archserve.kernels.moe.triton_routing import triton_route

    @pytest.mark.parametrize("tokens, experts, top_k, renormalize", [
        (5, 128, 8, True), (3, 512, 8, False), (4, 60, 1, False), (2, 8, 8, True)])
    def test_routing_kernel_matches_route(tokens, experts, top_k, renormalize):
        logits = distinct_logits(tokens, experts, seed=experts)
        weights, ids = triton_route(logits, top_k, renormalize)
        ref_weights, ref_ids = route(logits, top_k, renormalize)
        assert ids.dtype == torch.int32 and weights.dtype == torch.float32
        assert ids.tolist() == ref_ids.tolist()            # same experts, same slot order
        torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)

    @pytest.mark.parametrize("experts", [64, 128, 512])   # ranked lanes; argmax passes
    def test_routing_kernel_breaks_ties_by_index_and_survives_nan(experts):
        # Ties: equal logits in runs of four, so the top 8 holds whole runs and parts of
        # them; the lower expert wins a tie (a stable descending sort), in both top-k forms.
        logits = (torch.arange(experts) // 4).flip(0).float()[None].repeat(2, 1)
        logits[1] = logits[1].roll(37)
        weights, ids = triton_route(logits, 8, True)
        expected = torch.sort(logits, dim=1, descending=True, stable=True).indices[:, :8]
        assert ids.tolist() == expected.tolist()
        torch.testing.assert_close(weights, route(logits, 8, True)[0], atol=1e-6, rtol=1e-5)
        # A NaN logit makes the row's scores NaN: the ids must still be k distinct real
        # experts (they index the expert weights), whichever they are.
        logits[0, 5] = float("nan")
        _, ids = triton_route(logits, 8, False)
        assert all(len(set(row)) == 8 and all(0 <= e < experts for e in row)
                   for row in ids.tolist())

    @pytest.mark.parametrize("experts, dtype", [(128, torch.bfloat16), (512, torch.bfloat16),
                                                (256, torch.float16)])
    def test_routing_kernel_keys_16_bit_logits(experts, dtype):
        # Past the ranked lanes, softmax logits of 16 bits are keyed as they are, the lane in
        # an int32's free low bits: rounding to 16 bits ties some (rows 0-1), row 2 ties in
        # runs of four; the lower expert wins a tie, as a stable descending sort.
        logits = distinct_logits(3, experts, seed=experts).to(dtype)
        logits[2] = (torch.arange(experts) // 4).flip(0).roll(37).to(dtype)
        expected = torch.sort(logits.float(), dim=1, descending=True, stable=True).indices
        for renormalize in (True, False):
            weights, ids = triton_route(logits, 8, renormalize)
            assert ids.tolist() == expected[:, :8].tolist()
            torch.testing.assert_close(weights, route(logits, 8, renormalize)[0], atol=1e-6,
                                       rtol=1e-5)
        logits[0, 5] = float("nan")                  # k distinct real experts still
        logits[1, :] = float("nan")
        _, ids = triton_route(logits, 8, False)
        assert all(len(set(row)) == 8 and all(0 <= e < experts for e in row)
                   for row in ids.tolist())
        assert 5 not in ids[0].tolist()              # a NaN logit ranks below the others

    @pytest.mark.parametrize("name", sorted(GROUPINGS))
    def test_grouped_routing_kernel_survives_nan(name):
        # A NaN logit in a grouped routing: still k distinct real experts, from no more
        # groups than it keeps (V3 sums a group's best two: the NaN stand-in stays finite).
        logits, top_k, keywords, renormalize = grouped_case(name, 2, seed=3)
        logits[0, 3] = float("nan")
        logits[1] = float("nan")
        _, ids = triton_route(logits, top_k, renormalize, **keywords)
        experts = logits.shape[1]
        per_group = experts // keywords.get("num_groups", 1)
        for row in ids.tolist():
            assert len(set(row)) == top_k and all(0 <= e < experts for e in row)
            assert len({e // per_group for e in row}) <= keywords.get("topk_groups", 1) or \
                keywords.get("num_groups", 1) == 1

    def test_routing_kernel_reads_strided_low_precision_logits():
        # The router's output in the model dtype; a column slice is strided in rows.
        wide = torch.zeros(3, 40, dtype=torch.float16)
        wide[:, 4:36] = distinct_logits(3, 32).half()      # steps of 6/32: exact in fp16
        logits = wide[:, 4:36]
        weights, ids = triton_route(logits, 4, True)
        ref_weights, ref_ids = route(logits, 4, True)
        assert ids.tolist() == ref_ids.tolist()
        torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)

    @pytest.mark.parametrize("shared", [0, 2])
    @pytest.mark.parametrize("name", sorted(GROUPINGS))
    def test_routing_kernel_matches_grouped_route(name, shared):
        # shared: two shared experts stacked after the routed ones, two more slots.
        from archserve.kernels.moe.routing import grouped_route
        logits, top_k, keywords, renormalize = grouped_case(name, 5, seed=3)
        keywords["shared_experts"] = shared
        weights, ids = triton_route(logits, top_k, renormalize, **keywords)
        ref_weights, ref_ids = grouped_route(logits, top_k, renormalize=renormalize, **keywords)
        assert ids.tolist() == ref_ids.tolist()            # same experts, same slot order
        torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)

    def test_routing_kernel_refuses_groups_it_cannot_fill():
        with pytest.raises(ValueError, match="within 1 of 8 groups"):
            triton_route(torch.randn(2, 64), 9, False, num_groups=8, topk_groups=1)
        with pytest.raises(ValueError, match="not 'relu'"):
            triton_route(torch.randn(2, 64), 2, False, scoring="relu")

    @pytest.mark.parametrize("scoring", ["sqrtsoftplus", "softmax"])
    def test_routing_kernel_weighs_given_experts(scoring):
        # DeepSeek V4's hash layers: the experts come from a token table (a row may repeat
        # one), the kernel computes their renormalised, scaled scores.
        from archserve.kernels.moe.routing import grouped_route
        gen = torch.Generator().manual_seed(5)
        logits = torch.randn(6, 24, generator=gen) * 3
        logits[0, :4] = torch.tensor([30.0, -30.0, 0.0, 25.0])   # softplus's two regimes
        ids = torch.stack([torch.randperm(24, generator=gen)[:3] for _ in range(6)])
        ids[5] = torch.tensor([7, 7, 2])
        keywords = dict(scoring=scoring, scaling=1.5, shared_experts=1, fixed_ids=ids)
        weights, got = triton_route(logits, 3, True, **keywords)
        ref_weights, ref_ids = grouped_route(logits, 3, renormalize=True, **keywords)
        assert got.tolist() == ref_ids.tolist()
        torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)

    PAIR_CASES = [  # tokens, experts, top_k, hidden, inter, renormalize, dtype, block_n
        (1, 8, 1, 32, 48, False, F32, 16),   # decode, top-1, 3 column tiles of 16
        (1, 128, 8, 48, 40, True, F16, 64),  # decode, top-8 of 128: 120 experts idle
        (3, 16, 4, 40, 24, True, F32, 64),   # odd sizes, experts shared between tokens
        (1, 8, 8, 24, 40, False, F32, 64),   # top-8 of 8: every expert
    ]

    @pytest.mark.parametrize(
        "tokens, experts, top_k, hidden, inter, renormalize, dtype, block_n", PAIR_CASES)
    def test_pair_rows_match_torch_moe(tokens, experts, top_k, hidden, inter, renormalize,
                                       dtype, block_n):
        x, logits, w13, w2 = operands(tokens, experts, hidden, inter, dtype, seed=3)
        tile = pair_tile(tokens * top_k, min(hidden, inter), 1, block_n)
        got = fused_moe(x, logits, w13, w2, top_k, renormalize, tile)
        assert got.dtype == dtype and got.shape == x.shape
        expected = reference(x, logits, w13, w2, top_k, renormalize)
        tol = 1e-5 if dtype == torch.float32 else 4e-3
        torch.testing.assert_close(got.double(), expected, atol=tol, rtol=tol)

    @pytest.mark.parametrize("down", [(4, 16), (2, 32), (8, 64)])
    @pytest.mark.parametrize(
        "tokens, experts, top_k, hidden, inter, renormalize, dtype, block_n", PAIR_CASES)
    def test_slot_summing_down_matches_the_down_then_the_sum(tokens, experts, top_k, hidden,
                                                              inter, renormalize, dtype,
                                                              block_n, down):
        """The down projection as a GEMV per slot, summed in registers (MoETile.down_block_n):
        the same experts and rows as the pair layout's down kernel then the slot sum; a K
        step of 16 or 32 leaves partial steps at these sizes, 64 one step."""
        x, logits, w13, w2 = operands(tokens, experts, hidden, inter, dtype, seed=3)
        tile = pair_tile(tokens * top_k, min(hidden, inter), 1, block_n)
        summing = dataclasses.replace(tile, down_block_n=down[0], down_block_k=down[1])
        assert summing.key() != tile.key()
        got = fused_moe(x, logits, w13, w2, top_k, renormalize, summing)
        separate = fused_moe(x, logits, w13, w2, top_k, renormalize, tile)
        assert got.dtype == dtype and got.shape == x.shape
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(got, separate, atol=tol, rtol=tol)
        expected = reference(x, logits, w13, w2, top_k, renormalize)
        tol = 1e-5 if dtype == torch.float32 else 4e-3
        torch.testing.assert_close(got.double(), expected, atol=tol, rtol=tol)

    @pytest.mark.parametrize("gate_up", [(4, 16), (2, 64)])
    @pytest.mark.parametrize(
        "tokens, experts, top_k, hidden, inter, renormalize, dtype, block_n", PAIR_CASES)
    def test_gemv_gate_up_matches_the_dot_kernel(tokens, experts, top_k, hidden, inter,
                                                 renormalize, dtype, block_n, gate_up):
        """gate/up as GEMVs on the CUDA cores (MoETile.gate_up_block_n), alone and with the
        slot-summing down: the pair layout's result to rounding. A K step of 16 divides
        these hiddens or leaves a partial step; 64 is one (masked) step."""
        x, logits, w13, w2 = operands(tokens, experts, hidden, inter, dtype, seed=5)
        tile = pair_tile(tokens * top_k, min(hidden, inter), 1, block_n)
        expected = fused_moe(x, logits, w13, w2, top_k, renormalize, tile)
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        for down in ((0, 0), (4, 16)):
            gemv = dataclasses.replace(tile, gate_up_block_n=gate_up[0],
                                       gate_up_block_k=gate_up[1], down_block_n=down[0],
                                       down_block_k=down[1])
            got = fused_moe(x, logits, w13, w2, top_k, renormalize, gemv)
            assert got.dtype == dtype and got.shape == x.shape
            torch.testing.assert_close(got, expected, atol=tol, rtol=tol)

    @pytest.mark.parametrize("top_k, tile", [
        (2, MoETile(16, 16, 16, 4, 2, pair_rows=True, down_block_n=4, down_block_k=16)),
        (2, MoETile(16, 16, 16, 4, 2, pair_rows=True)),
        (2, MoETile(16, 16, 16, 4, 2)),
        (1, MoETile(16, 16, 16, 4, 2, pair_rows=True))],
        ids=["slot-summing-down", "pair-sum", "sorted-sum", "top-1"])
    def test_the_residual_add_is_the_sum_plus_it(top_k, tile):
        """``add`` (a decoder block's residual, FusedMoE.forward_add): the result rounded,
        plus it, rounded again, in whichever kernel sums the slots (a torch add at top 1):
        the result without it, plus it, to a unit (the interpreter's own 16-bit casts may
        round otherwise than round_to_dtype)."""
        x, logits, w13, w2 = operands(3, 8, 40, 24, torch.float16, seed=9)
        residual = torch.randn(3, 40).to(torch.float16)
        plain = fused_moe(x, logits, w13, w2, top_k, True, tile)
        got = fused_moe(x, logits, w13, w2, top_k, True, tile, add=residual)
        expected = plain + residual
        torch.testing.assert_close(got, expected, rtol=0,
                                   atol=2 ** -10 * expected.abs().max().item())

    @pytest.mark.parametrize("gate_up", [(4, 16), (8, 64)])
    def test_gemv_gate_up_partial_column_tiles(gate_up):
        """Intermediate 30 and hidden 70: the last column tile and the last K step partial."""
        x, logits, w13, w2 = operands(2, 8, 70, 30, F32, seed=6)
        tile = pair_tile(4, 30, 1, 16)
        expected = fused_moe(x, logits, w13, w2, 2, True, tile)
        gemv = dataclasses.replace(tile, gate_up_block_n=gate_up[0], gate_up_block_k=gate_up[1])
        torch.testing.assert_close(fused_moe(x, logits, w13, w2, 2, True, gemv), expected,
                                   atol=1e-5, rtol=1e-5)

    @pytest.mark.parametrize("tokens, experts, top_k, hidden, inter, renormalize, dtype", CASES)
    def test_matches_torch_moe(tokens, experts, top_k, hidden, inter, renormalize, dtype):
        x, logits, w13, w2 = operands(tokens, experts, hidden, inter, dtype)
        tile = MoETile(16, 32, 32) if tokens < 64 else MoETile(32, 32, 16)
        got = fused_moe(x, logits, w13, w2, top_k, renormalize, tile)
        assert got.dtype == dtype and got.shape == x.shape
        expected = reference(x, logits, w13, w2, top_k, renormalize)
        tol = 1e-5 if dtype == torch.float32 else 4e-3
        torch.testing.assert_close(got.double(), expected, atol=tol, rtol=tol)
        if dtype == torch.float32:   # and TORCH_MOE itself, as the model would run it
            loop = TorchMoEImpl().forward(x, logits, w13, w2, top_k, renormalize)
            torch.testing.assert_close(got, loop, atol=1e-5, rtol=1e-5)

    def test_the_impl_uses_the_default_tiles():
        x, logits, w13, w2 = operands(3, 8, 32, 32, torch.float32)
        # 3 tokens x 2 slots run a pair each (the sorted layout: test_matches_torch_moe).
        assert choose_tile(3, 2, w13, w2).pair_rows
        assert not choose_tile(40, 2, w13, w2).pair_rows
        got = TritonFusedMoEImpl().forward(x, logits, w13, w2, 2, True)
        torch.testing.assert_close(got.double(), reference(x, logits, w13, w2, 2, True),
                                   atol=1e-5, rtol=1e-5)

    def test_the_tuner_installs_the_fastest_agreeing_tile(tmp_path):
        from archserve.kernels.moe.triton_fused_moe import candidate_tiles
        from archserve.kernels.moe.tuning import MoEShape, tune_moe
        _, _, w13, w2 = operands(1, 4, 32, 16, torch.float32)
        impl = TritonFusedMoEImpl()
        shape = MoEShape([impl], w13, w2, 2, True)
        fastest = candidate_tiles(2, 2, w13, w2)[2]
        timed = []

        def timer(_shape, tokens, tile):
            timed.append((tokens, tile))
            return 5.0 if tile == fastest else 10.0
        path = str(tmp_path / "moe_tiles.json")
        report = tune_moe([shape], [2], path, timer=timer)
        assert not report.from_cache and impl.tiles == {2: fastest}
        assert [t for t, _ in timed] == [2] * len(candidate_tiles(2, 2, w13, w2))
        again = tune_moe([MoEShape([TritonFusedMoEImpl()], w13, w2, 2, True)], [2], path,
                         timer=lambda *_: 1 / 0)
        assert again.from_cache

    def test_a_wrong_expert_weight_shows():
        """The comparison can fail: one expert's weight changed moves its tokens' rows."""
        x, logits, w13, w2 = operands(9, 8, 32, 32, torch.float32)
        _, experts = route(logits, 2, True)
        e = int(experts[0, 0])
        tile = MoETile(16, 32, 32)
        good = fused_moe(x, logits, w13, w2, 2, True, tile)
        w2_bad = w2.clone()
        w2_bad[e] *= 1.5
        bad = fused_moe(x, logits, w13, w2_bad, 2, True, tile)
        touched = (experts == e).any(dim=1)
        assert (bad - good)[touched].abs().max() > 1e-3
        assert (bad - good)[~touched].abs().max() == 0


# ---------------------------------------------------------------- GPU, real shapes


@gpu
@pytest.mark.parametrize("shape", sorted(REAL))
@pytest.mark.parametrize("tokens", [1, 16, 64, 256, 1024])
def test_gpu_real_shapes_match_torch_moe(shape, tokens):
    from archserve.kernels.moe.triton_fused_moe import fused_moe
    experts, top_k, hidden, inter = REAL[shape]
    x, logits, w13, w2 = operands(tokens, experts, hidden, inter, torch.bfloat16, "cuda")
    got = fused_moe(x, logits, w13, w2, top_k, True)
    expected = TorchMoEImpl().forward(x.float(), logits, w13.float(), w2.float(), top_k, True)
    # bf16 operands and output: a few bf16 ulps of the output's scale.
    torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=3e-2)


@gpu
@pytest.mark.parametrize("shape", sorted(REAL))
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_gpu_both_layouts_match_torch_moe_at_small_batches(shape, tokens):
    """The pair layout and the sorted one at every pair-tile width, against the loop."""
    from archserve.kernels.moe.triton_fused_moe import default_tile, fused_moe, pair_tile
    experts, top_k, hidden, inter = REAL[shape]
    x, logits, w13, w2 = operands(tokens, experts, hidden, inter, torch.bfloat16, "cuda", 5)
    expected = TorchMoEImpl().forward(x.float(), logits, w13.float(), w2.float(), top_k, True)
    pairs = tokens * top_k
    tiles = [default_tile(tokens)] + [pair_tile(pairs, min(hidden, inter), 132, n)
                                      for n in (16, 32, 64)]
    tiles.append(pair_tile(pairs, min(hidden, inter), 132, 32, 256, 3))
    for tile in tiles:
        got = fused_moe(x, logits, w13, w2, top_k, True, tile)
        torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=3e-2,
                                   msg=lambda m, tile=tile: f"{tile.key()}: {m}")


@gpu
@pytest.mark.parametrize("shape", sorted(REAL))
@pytest.mark.parametrize("tokens", [1, 8])
def test_gpu_pair_layout_alternatives_match_in_a_graph(shape, tokens):
    """The pair layout's alternative kernels at every tile the tuner times, at real sizes:
    the slot-summing down, and the CUDA-core gate/up alone and with it. Each gives the pair
    layout's down and sum to a bf16 unit or two, eagerly and in every replay of a graph."""
    from archserve.kernels.moe.triton_fused_moe import (
        GATE_UP_GEMV_TILES,
        SUM_DOWN_TILES,
        fused_moe,
        pair_tile,
    )
    experts, top_k, hidden, inter = REAL[shape]
    x, logits, w13, w2 = operands(tokens, experts, hidden, inter, torch.bfloat16, "cuda", 7)
    routed = route(logits, top_k, True)
    tile = pair_tile(tokens * top_k, min(hidden, inter), 132)
    expected = fused_moe(x, logits, w13, w2, top_k, True, tile, routed).float()
    scale = expected.abs().max().item()
    variants = [dataclasses.replace(tile, gate_up_block_n=gate_up[0], gate_up_block_k=gate_up[1],
                                    down_block_n=down[0], down_block_k=down[1])
                for gate_up, down in itertools.product(((0, 0),) + GATE_UP_GEMV_TILES,
                                                       ((0, 0),) + SUM_DOWN_TILES)][1:]
    for variant in variants:
        got = fused_moe(x, logits, w13, w2, top_k, True, variant, routed)
        torch.testing.assert_close(got.float(), expected, atol=2 ** -6 * scale, rtol=2 ** -7,
                                   msg=lambda m, variant=variant: f"{variant.key()}: {m}")
        assert_graph_replays_give(
            lambda variant=variant: fused_moe(x, logits, w13, w2, top_k, True, variant, routed),
            got, 3)


def assert_graph_replays_give(run, expected: torch.Tensor, replays: int) -> None:
    """``run()`` captured in a CUDA graph gives ``expected`` bit for bit in every replay
    (its output zeroed before each, so a replay that writes nothing shows)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for _ in range(replays):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)


@gpu
@pytest.mark.parametrize("experts, top_k", [(8, 2), (64, 6), (128, 8), (256, 8), (512, 8)])
@pytest.mark.parametrize("tokens", [1, 37, 4096])
def test_gpu_routing_kernel_matches_route(experts, top_k, tokens):
    """Ranked lanes (up to MAX_RANKED_LANES experts) and argmax passes (past them)."""
    from archserve.kernels.moe.triton_routing import triton_route
    # fp32: 512 steps in [-3, 3) are closer than bf16 resolves.
    logits = distinct_logits(tokens, experts, seed=tokens).to("cuda")
    for renormalize in (True, False):
        weights, ids = triton_route(logits, top_k, renormalize)
        ref_weights, ref_ids = route(logits, top_k, renormalize)
        assert torch.equal(ids.long(), ref_ids), "the routing kernel chose other experts"
        torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)
    # Ties (runs of four equal logits, rolled per row): the lower expert first, as a
    # stable descending sort.
    tied = (torch.arange(experts, device="cuda") // 4).flip(0).float()[None].repeat(tokens, 1)
    tied = torch.stack([row.roll(37 * r) for r, row in enumerate(tied)])
    _, ids = triton_route(tied, top_k, True)
    expected = torch.sort(tied, dim=1, descending=True, stable=True).indices[:, :top_k]
    assert torch.equal(ids.long(), expected)


@gpu
@pytest.mark.parametrize("experts", [128, 256, 512])
@pytest.mark.parametrize("tokens", [1, 37])
def test_gpu_routing_kernel_keys_bf16_logits(experts, tokens):
    """The passes keyed on bf16 logits (the router's output in a bf16 model): rounding ties
    some logits; the lower expert first, as a stable descending sort."""
    from archserve.kernels.moe.triton_routing import triton_route
    logits = distinct_logits(tokens, experts, seed=tokens).to("cuda", torch.bfloat16)
    expected = torch.sort(logits.float(), dim=1, descending=True, stable=True).indices[:, :8]
    for renormalize in (True, False):
        weights, ids = triton_route(logits, 8, renormalize)
        assert torch.equal(ids.long(), expected), "the routing kernel chose other experts"
        torch.testing.assert_close(weights, route(logits, 8, renormalize)[0], atol=1e-6,
                                   rtol=1e-5)


@gpu
@pytest.mark.parametrize("name", sorted(GROUPINGS))
@pytest.mark.parametrize("tokens", [1, 37, 4096])
def test_gpu_grouped_routing_kernel_matches_grouped_route(name, tokens):
    from archserve.kernels.moe.routing import grouped_route
    from archserve.kernels.moe.triton_routing import triton_route
    logits, top_k, keywords, renormalize = grouped_case(name, tokens, seed=tokens)
    logits = logits.to("cuda")
    keywords = {k: v.to("cuda") if isinstance(v, torch.Tensor) else v
                for k, v in keywords.items()}
    weights, ids = triton_route(logits, top_k, renormalize, **keywords)
    ref_weights, ref_ids = grouped_route(logits, top_k, renormalize=renormalize, **keywords)
    assert torch.equal(ids.long(), ref_ids), "the routing kernel chose other experts"
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)


@gpu
def test_gpu_fp32_is_exact_to_rounding():
    from archserve.kernels.moe.triton_fused_moe import fused_moe
    x, logits, w13, w2 = operands(37, 64, 256, 96, torch.float32, "cuda")
    got = fused_moe(x, logits, w13, w2, 4, False)
    expected = reference(x, logits, w13, w2, 4, False)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


@gpu
@pytest.mark.parametrize("tokens", [8, 32], ids=["pair-rows", "sorted"])
def test_gpu_decode_step_replays_in_a_cuda_graph(tokens):
    """Capture once, then replay with other tokens and other routing: the graph holds no
    value read back to the host, so the replay computes the new batch."""
    from archserve.kernels.moe.triton_fused_impl import TritonFusedMoEImpl
    experts, top_k, hidden, inter = REAL["qwen3-30b-a3b"]
    x, logits, w13, w2 = operands(tokens, experts, hidden, inter, torch.bfloat16, "cuda")
    impl = TritonFusedMoEImpl()
    assert impl.tile_for(tokens, top_k, w13, w2).pair_rows == (tokens == 8)
    impl.forward(x, logits, w13, w2, top_k, True)          # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = impl.forward(x, logits, w13, w2, top_k, True)
    for seed in (1, 2):
        x2, logits2, _, _ = operands(tokens, experts, hidden, inter, torch.bfloat16, "cuda",
                                     seed)
        x.copy_(x2)
        logits.copy_(logits2)
        graph.replay()
        expected = impl.forward(x, logits, w13, w2, top_k, True)
        torch.testing.assert_close(out, expected, atol=0, rtol=0)
