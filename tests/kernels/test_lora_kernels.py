"""LoRA deltas (kernels/lora/): the torch path and the grouped Triton kernels against the
token-by-token reference, on random slots and mappings that mix slots, tokens without an
adapter and empty slots; the packed mapping; the backend rules per GPU generation.

Without a GPU one test re-runs this file under Triton's interpreter (small sizes), and the
compile tests build the kernels for SM80, SM90 (with PDL), SM100 and SM120; on a GPU the
``gpu``-marked test runs the compiled kernels at a Llama-3-8B layer's sizes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from archserve.kernels.lora.interface import (
    NO_SLOT,
    LoRAMapping,
    LoRASlots,
    ShrinkNorm,
    pack_mapping,
)
from archserve.kernels.lora.reference import add_lora_reference
from archserve.kernels.lora.torch_lora import TorchLoRA
from archserve.kernels.rules import triton_interpreted

INTERPRETED = triton_interpreted()
INTERPRETER_TIMEOUT_S = 900   # its 'else:' half runs under the interpreter (conftest.py)


def random_case(num_tokens: int, in_features: int, slice_sizes: tuple[int, ...], rank: int,
                num_slots: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0,
                empty_slot: int | None = None):
    """(y, x, slots, mapping, token_slots): random slots (``empty_slot`` left zero, as a
    slot no adapter holds) and a mapping where about a quarter of the tokens take none."""
    gen = torch.Generator().manual_seed(seed)
    slots = LoRASlots.allocate(num_slots, rank, in_features, slice_sizes, dtype, device)
    slots.a.copy_(torch.randn(slots.a.shape, generator=gen) / in_features ** 0.5)
    slots.b.copy_(torch.randn(slots.b.shape, generator=gen))
    if empty_slot is not None:
        slots.a[empty_slot].zero_()
        slots.b[:, empty_slot].zero_()
    token_slots = torch.randint(NO_SLOT, num_slots, (num_tokens,), generator=gen).numpy()
    packed = torch.from_numpy(pack_mapping(token_slots, num_slots)).to(device)
    mapping = LoRAMapping.views(packed, num_slots, num_tokens)
    x = torch.randn(num_tokens, in_features, generator=gen).to(device, dtype)
    y = torch.randn(num_tokens, sum(slice_sizes), generator=gen).to(device, dtype)
    return y, x, slots, mapping, token_slots


def check_against_reference(impl, case, tolerance: float) -> None:
    y, x, slots, mapping, token_slots = case
    expected = y.clone()
    add_lora_reference(expected, x, slots, mapping)
    got = y.clone()
    impl.add_lora(got, x, slots, mapping)
    error = (got.float() - expected.float()).abs().max().item()
    assert error <= tolerance * max(1.0, expected.float().abs().max().item()), error
    untouched = torch.from_numpy(token_slots == NO_SLOT).to(y.device)
    assert torch.equal(got[untouched], y[untouched])     # tokens without an adapter: exact


def check_silu_mul_against_reference(impl, case, tolerance: float, graph_rows: int = 0
                                     ) -> None:
    """``add_lora_silu_mul`` against the reference delta then silu(gate) * up, over every
    row; with ``graph_rows`` the forward runs that many rows past the step's (a CUDA graph's
    padding: their mapping entries hold another step's slots), which must take no delta."""
    from archserve.kernels.elementwise.reference import silu_and_mul_reference
    y, x, slots, mapping, token_slots = case
    expected = y.clone()
    add_lora_reference(expected, x, slots, mapping)
    expected = silu_and_mul_reference(expected)
    if graph_rows:
        rows = len(token_slots) + graph_rows
        stale = np.arange(rows) % slots.num_slots               # an earlier, longer step's
        packed = pack_mapping(stale, slots.num_slots)
        packed[:mapping.packed.numel()] = mapping.packed.cpu().numpy()
        mapping = LoRAMapping.views(torch.from_numpy(packed).to(y.device), slots.num_slots,
                                    rows)
        pad = torch.randn(graph_rows, y.shape[1]).to(y)
        x = torch.cat([x, torch.randn(graph_rows, x.shape[1]).to(x)])
        y = torch.cat([y, pad])
        expected = torch.cat([expected, silu_and_mul_reference(pad)])
    before = y.clone()
    got = impl.add_lora_silu_mul(y, x, slots, mapping)
    assert got is not None and got.shape == expected.shape
    assert torch.equal(y, before)                                 # y is read, not written
    error = (got.float() - expected.float()).abs().max().item()
    assert error <= tolerance * max(1.0, expected.float().abs().max().item()), error


# (tokens, in_features, output blocks, rank, slots): one block, q/k/v-like three of unequal
# sizes, gate/up-like two; a rank below the kernels' 16-wide tiles; one slot.
CASES = [(1, 64, (64,), 8, 4), (7, 96, (64, 32, 32), 16, 3), (40, 64, (48, 48), 4, 2),
         (5, 128, (80,), 16, 1)]


def test_packed_mapping_groups_tokens_by_slot():
    packed = pack_mapping(np.array([2, -1, 0, 2, 0, -1, 1]), 4)
    mapping = LoRAMapping.views(torch.from_numpy(packed), 4, 7)
    assert mapping.slot_counts.tolist() == [2, 1, 2, 0]
    assert mapping.slot_starts.tolist() == [0, 2, 3, 5]
    assert mapping.sorted_tokens.tolist()[:5] == [2, 4, 6, 0, 3]   # slot 0, 1, 2, in order
    assert mapping.token_slots.tolist() == [2, -1, 0, 2, 0, -1, 1]


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("case", CASES)
def test_torch_path_matches_the_reference(case, dtype, tolerance):
    check_against_reference(TorchLoRA(), random_case(*case, dtype, empty_slot=0), tolerance)


def test_backend_rules_per_gpu_generation():
    from archserve.kernels.catalog import select_lora_backend
    from archserve.kernels.specs import LoRASpec
    from archserve.platform import get_profile

    def route(profile: str, dtype: torch.dtype) -> tuple[str, str]:
        device = get_profile(profile)
        selection = select_lora_backend(device, LoRASpec(dtype=dtype), libraries="all")
        return selection.name, selection.backend.detail(device, LoRASpec(dtype=dtype))

    assert route("cpu", torch.float32)[0] == "TORCH_LORA"
    assert route("v100", torch.float16)[0] == "TRITON_LORA"
    assert route("v100", torch.bfloat16)[0] == "TORCH_LORA"      # bf16 needs SM80
    assert route("a100", torch.bfloat16) == ("TRITON_LORA", "")
    for hopper_or_later in ("h100", "b200"):
        assert route(hopper_or_later, torch.bfloat16) == ("TRITON_LORA", "PDL launches")
    assert route("mi300x", torch.bfloat16) == ("TRITON_LORA", "")


if not INTERPRETED:

    # Each target once at least, each dtype and step size with and without PDL (about 9 s
    # a case on a CI core).
    @pytest.mark.parametrize("target, dtype, num_tokens", [
        (80, torch.bfloat16, 3), (90, torch.bfloat16, 3), (90, torch.float32, 300),
        (100, torch.bfloat16, 300), (120, torch.bfloat16, 3)])
    def test_kernels_compile_for_gpu_targets(target, dtype, num_tokens, monkeypatch):
        """Both kernels, as the wrapper launches them (decode-sized steps split K; longer
        ones do not), for every NVIDIA family the engine serves on; with PDL on SM90+ (the
        wrapper's choice there), reading nothing another kernel writes before its wait."""
        pytest.importorskip("triton")
        from triton_compile import compiled_launches

        from archserve.kernels.lora import triton_lora
        monkeypatch.setattr(triton_lora, "pdl_enabled", lambda device: target >= 90)
        y, x, slots, mapping, _ = random_case(num_tokens, 4096, (4096, 1024, 1024), 16, 8,
                                              dtype)
        gate_up = random_case(min(num_tokens, triton_lora.ACTIVATION_ROWS), 4096,
                              (14336, 14336), 16, 8, dtype)
        down = random_case(min(num_tokens, triton_lora.ACTIVATION_ROWS), 4096, (4096,), 16, 8,
                           dtype)
        from archserve.kernels.linear import triton_skinny_gemm as skinny
        monkeypatch.setattr(skinny, "pdl_enabled", lambda device: target >= 90)
        down_weight = torch.empty(4096, 4096, dtype=dtype)
        with compiled_launches(("cuda", target, 32)) as launches:
            triton_lora.TritonLoRA().add_lora(y, x, slots, mapping)
            assert triton_lora.TritonLoRA().add_lora_silu_mul(*gate_up[:4]) is not None
            epilogue = triton_lora.TritonLoRA().expand_epilogue(down[1], down[2], down[3])
            skinny.skinny_gemm(down[1], down_weight, None, skinny.SkinnyConfig(16, 512, 4),
                               add=down[0], lora=epilogue)
            # The shrink of the normalised input, then the norm-prologue GEMV adding the
            # deltas: q/k/v's three blocks, and gate/up's before the activation.
            norm = ShrinkNorm(down[1], torch.empty(4096, dtype=dtype), 1e-5)
            for case, gated in ((random_case(down[1].shape[0], 4096, (4096, 1024, 1024), 16,
                                             8, dtype), False), (gate_up, True)):
                epilogue = triton_lora.TritonLoRA().expand_epilogue(down[1], case[2], case[3],
                                                                    norm)
                skinny.rms_norm_skinny_gemm(
                    down[1], norm.residual, norm.weight, 1e-5,
                    torch.empty(sum(case[2].slice_sizes), 4096, dtype=dtype), None,
                    skinny.SkinnyConfig(16, 512, 4), silu_mul=gated, lora=epilogue)
        # One shrink and one expand a layer, whatever its blocks; a decode-sized gate/up's
        # expand also applies the activation (no SiLU launch); at a decode step's rows,
        # the deltas in the base GEMV's epilogue (no expand launch).
        assert [c.kernel for c in launches] == [
            "_lora_shrink_kernel", "_lora_expand_kernel",
            "_lora_shrink_kernel", "_lora_expand_silu_mul_kernel",
            *["_lora_shrink_kernel", "_skinny_gemm_kernel"] * 3]
        for launch in launches:
            assert bool(launch.options.get("launch_pdl")) == (target >= 90)
            if target >= 90:
                ptx = launch.code()
                wait = ptx.index("griddepcontrol.wait")
                assert wait < ptx.index("griddepcontrol.launch_dependents")
                assert "st.global" not in ptx[:wait], launch.kernel

else:

    # A K of 1,100 splits in three (decode-sized steps) and ends mid-tile.
    @pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
    @pytest.mark.parametrize("case", CASES + [(150, 64, (32, 32, 32), 8, 3),
                                              (3, 1100, (64,), 16, 8)])
    def test_triton_kernels_match_the_reference(case, dtype, tolerance):
        from archserve.kernels.lora.triton_lora import TritonLoRA
        check_against_reference(TritonLoRA(), random_case(*case, dtype, empty_slot=0),
                                tolerance)


    # (tokens, in_features, gate/up width, rank, slots): decode-sized steps only, one of
    # them with a rank below the 16-wide tiles and a width that ends mid-block.
    SILU_CASES = [(1, 64, 48, 16, 4), (3, 1100, 40, 8, 3), (4, 96, 32, 16, 1)]

    @pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
    @pytest.mark.parametrize("case", SILU_CASES)
    def test_the_activating_expand_matches_the_reference(case, dtype, tolerance):
        from archserve.kernels.lora.triton_lora import TritonLoRA
        tokens, k, inter, rank, num_slots = case
        check_silu_mul_against_reference(
            TritonLoRA(), random_case(tokens, k, (inter, inter), rank, num_slots, dtype,
                                      empty_slot=0), tolerance)

    @pytest.mark.parametrize("rows", [1, 6])
    def test_a_gate_up_layer_with_adapters_takes_the_activating_expand(rows):
        """GateUpLinear's two gated forms (after its norm, and alone) with TRITON_LORA:
        the activation in the expand at a decode step's rows, the delta then the SiLU
        kernel above them; both as TORCH_LORA's delta then the SiLU kernel computes."""
        from archserve.kernels.lora.triton_lora import ACTIVATION_ROWS, TritonLoRA
        from archserve.models.layers.forward_context import ForwardContext, set_forward_context
        from archserve.models.layers.linear import GateUpLinear
        from archserve.models.layers.norm import RMSNorm
        _, _, slots, mapping, _ = random_case(rows, 64, (32, 32), 16, 3, torch.float32, seed=5)
        layer = GateUpLinear(64, 32)
        layer.weight.copy_(torch.randn(64, 64) / 8)
        layer.lora = slots
        norm = RMSNorm(64, 1e-6)
        norm.weight.copy_(torch.rand(64) + 0.5)
        x, residual = torch.randn(rows, 64), torch.randn(rows, 64)
        separate_deltas = []

        class CountingTritonLoRA(TritonLoRA):   # counts the deltas added apart
            def add_lora(self, *args) -> None:
                separate_deltas.append(1)
                super().add_lora(*args)
        outputs = []
        for impl in (CountingTritonLoRA(), TorchLoRA()):
            ctx = ForwardContext(None, [], None, lora_mapping=mapping, lora_impl=impl)
            with set_forward_context(ctx):
                act, new_residual = layer.forward_silu_mul_after_norm(x, residual, norm)
                outputs.append((act, new_residual, layer.forward_silu_mul(x)))
        assert len(separate_deltas) == (0 if rows <= ACTIVATION_ROWS else 2)
        for got, expected in zip(*outputs, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)

    # (tokens, in_features, width, rank, slots, with the residual add): one row; three rows
    # of a K split in three, a rank below the 16-wide tiles, a width ending mid-block.
    @pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
    @pytest.mark.parametrize("case", [(1, 64, 48, 16, 4, False), (3, 1100, 40, 8, 3, True)])
    def test_the_gemv_epilogue_adds_the_delta(case, dtype, tolerance):
        """The skinny GEMV with the delta in its epilogue (after the shrink, no expand
        launch) against the product (plus the residual) and then the reference delta."""
        from archserve.kernels.linear.triton_skinny_gemm import SkinnyConfig, skinny_gemm
        from archserve.kernels.lora.triton_lora import TritonLoRA
        tokens, k, width, rank, num_slots, with_add = case
        y, x, slots, mapping, token_slots = random_case(tokens, k, (width,), rank, num_slots,
                                                        dtype, empty_slot=0)
        weight = (torch.randn(width, k) / k ** 0.5).to(dtype)
        add = y if with_add else None
        expected = x @ weight.T if add is None else x @ weight.T + add
        add_lora_reference(expected, x, slots, mapping)
        impl = TritonLoRA()
        epilogue = impl.expand_epilogue(x, slots, mapping)
        got = skinny_gemm(x, weight, None, SkinnyConfig(16, 128, 4), add=add, lora=epilogue)
        error = (got.float() - expected.float()).abs().max().item()
        assert error <= tolerance * max(1.0, expected.float().abs().max().item()), error
        plain = skinny_gemm(x, weight, None, SkinnyConfig(16, 128, 4), add=add)
        untouched = torch.from_numpy(token_slots == NO_SLOT)
        assert torch.equal(got[untouched], plain[untouched])   # no adapter: exact
        from archserve.kernels.lora.triton_lora import ACTIVATION_ROWS
        many = random_case(ACTIVATION_ROWS + 1, k, (width,), rank, 2, dtype)
        assert impl.expand_epilogue(*many[1:4]) is None   # past a decode step: no launch

    # (tokens, in_features, output blocks, rank, slots, gated, seed): q/k/v-like blocks of
    # unequal sizes, one row; gate/up with the activation, three rows (slot 0 empty, slot
    # 2, none), a rank below the tiles.
    @pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
    @pytest.mark.parametrize("case", [(1, 96, (32, 16, 16), 16, 3, False, 0),
                                      (3, 64, (24, 24), 8, 3, True, 1)])
    def test_the_norm_prologue_gemv_epilogue_adds_the_delta(case, dtype, tolerance):
        """rms_norm(x + residual) then the product in one GEMV, each row's delta (of the
        normalised rows, which the shrink normalises itself) in its epilogue, before the
        activation where gated: against the norm, the product, the reference delta (and
        silu(gate) * up)."""
        from archserve.kernels.elementwise.reference import (
            rms_norm_reference,
            silu_and_mul_reference,
        )
        from archserve.kernels.linear.triton_skinny_gemm import (
            SkinnyConfig,
            rms_norm_skinny_gemm,
        )
        from archserve.kernels.lora.interface import ShrinkNorm
        from archserve.kernels.lora.triton_lora import TritonLoRA
        tokens, k, blocks, rank, num_slots, gated, seed = case
        _, x, slots, mapping, _ = random_case(tokens, k, blocks, rank, num_slots, dtype,
                                              seed=seed, empty_slot=0)
        residual = torch.randn(tokens, k).to(dtype)
        norm_weight = (torch.rand(k) + 0.5).to(dtype)
        weight = (torch.randn(sum(blocks), k) / k ** 0.5).to(dtype)
        normed, new_residual = rms_norm_reference(x, norm_weight, 1e-6, residual)
        expected = normed @ weight.T
        add_lora_reference(expected, normed, slots, mapping)
        if gated:
            expected = silu_and_mul_reference(expected)
        epilogue = TritonLoRA().expand_epilogue(x, slots, mapping,
                                                ShrinkNorm(residual, norm_weight, 1e-6))
        got, got_residual = rms_norm_skinny_gemm(x, residual, norm_weight, 1e-6, weight, None,
                                                 SkinnyConfig(16, 64, 4), silu_mul=gated,
                                                 lora=epilogue)
        assert torch.equal(got_residual, new_residual)
        error = (got.float() - expected.float()).abs().max().item()
        assert error <= tolerance * max(1.0, expected.float().abs().max().item()), error

    def test_rows_past_the_step_take_no_stale_delta():
        from archserve.kernels.lora.triton_lora import TritonLoRA
        check_silu_mul_against_reference(
            TritonLoRA(), random_case(1, 64, (32, 32), 16, 4, torch.float32, seed=3), 1e-5,
            graph_rows=3)


def test_the_activating_expand_declines_what_it_does_not_cover():
    """More rows than a decode step's, or a layer that is not two equal blocks: None, and
    the caller adds the delta, then runs the SiLU kernel."""
    from archserve.kernels.lora.triton_lora import ACTIVATION_ROWS, TritonLoRA
    impl = TritonLoRA()
    many = random_case(ACTIVATION_ROWS + 1, 64, (32, 32), 16, 2, torch.float32)
    assert impl.add_lora_silu_mul(*many[:4]) is None
    unequal = random_case(1, 64, (32, 16), 16, 2, torch.float32)
    assert impl.add_lora_silu_mul(*unequal[:4]) is None


def test_the_grid_holds_every_tile_of_a_step():
    """``max_tiles`` bounds the tiles of any spread of a step's tokens over the slots: the
    grid is sized by it before the mapping is known (CUDA graphs)."""
    from archserve.kernels.lora.triton_lora import max_tiles
    rng = np.random.default_rng(0)
    for _ in range(2000):
        slots, tokens, block_m = int(rng.integers(1, 17)), int(rng.integers(1, 300)), 16
        counts = np.bincount(rng.integers(0, slots, tokens), minlength=slots)
        counts[rng.random(slots) < 0.3] = 0          # some slots hold none ...
        used = int(counts.sum())                     # ... and the step fills fewer rows
        tiles = int(np.sum(-(-counts // block_m)))
        assert tiles <= max_tiles(used, slots, block_m) <= max_tiles(tokens, slots, block_m)
    assert max_tiles(1, 8, 16) == 1 and max_tiles(32, 8, 16) == 9


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 32, 300, 2048])
def test_gpu_kernels_match_the_reference_at_llama_8b_sizes(num_tokens):
    """A Llama-3-8B layer's q/k/v and down projection, rank 16, eight slots; bf16."""
    from archserve.kernels.lora.triton_lora import TritonLoRA
    for in_features, blocks in ((4096, (4096, 1024, 1024)), (14336, (4096,))):
        case = random_case(num_tokens, in_features, blocks, 16, 8, torch.bfloat16, "cuda",
                           empty_slot=3)
        if num_tokens > 64:   # the reference loops over tokens: check a slice of them
            y, x, slots, _, token_slots = case
            keep = 64
            packed = torch.from_numpy(pack_mapping(token_slots[:keep], 8)).cuda()
            case = (y[:keep], x[:keep], slots, LoRAMapping.views(packed, 8, keep),
                    token_slots[:keep])
        check_against_reference(TritonLoRA(), case, 2e-2)
        check_against_reference(TorchLoRA(), case, 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 2, 4])
def test_gpu_activating_expand_at_llama_8b_gate_up(num_tokens):
    """A Llama-3-8B gate/up at decode sizes, rank 16, eight slots, bf16: the activation in
    the expand, also with rows past the step (a CUDA graph's padding)."""
    from archserve.kernels.lora.triton_lora import TritonLoRA
    case = random_case(num_tokens, 4096, (14336, 14336), 16, 8, torch.bfloat16, "cuda",
                       empty_slot=3)
    check_silu_mul_against_reference(TritonLoRA(), case, 2e-2)
    if num_tokens < 4:
        check_silu_mul_against_reference(TritonLoRA(), case, 2e-2, graph_rows=1)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 4])
def test_gpu_gemv_epilogues_at_llama_8b_sizes(num_tokens):
    """Every skinny GEMV config the tuner may choose at this many rows, with the deltas in
    its epilogue (rank 16, eight slots, bf16), against the norm, the product, the
    reference delta: down with the residual add; q/k/v and gated gate/up after the norm."""
    from archserve.kernels.elementwise.reference import (
        rms_norm_reference,
        silu_and_mul_reference,
    )
    from archserve.kernels.linear import triton_skinny_gemm as skinny
    from archserve.kernels.lora.triton_lora import TritonLoRA
    impl, dtype = TritonLoRA(), torch.bfloat16
    gen = torch.Generator().manual_seed(1)
    residual = torch.randn(num_tokens, 4096, generator=gen).to("cuda", dtype)
    norm_weight = (torch.rand(4096, generator=gen) + 0.5).to("cuda", dtype)

    def close(got: torch.Tensor, expected: torch.Tensor) -> None:
        error = (got.float() - expected.float()).abs().max().item()
        assert error <= 2e-2 * max(1.0, expected.float().abs().max().item()), error
    for config in skinny.candidate_configs(num_tokens):
        y, x, slots, mapping, _ = random_case(num_tokens, 14336, (4096,), 16, 8, dtype,
                                              "cuda", empty_slot=3)
        weight = (torch.randn(4096, 14336, generator=gen) / 120).to("cuda", dtype)
        expected = x @ weight.T + y
        add_lora_reference(expected, x, slots, mapping)
        close(skinny.skinny_gemm(x, weight, None, config, add=y,
                                 lora=impl.expand_epilogue(x, slots, mapping)), expected)
        for blocks, gated in (((4096, 1024, 1024), False), ((14336, 14336), True)):
            _, x, slots, mapping, _ = random_case(num_tokens, 4096, blocks, 16, 8, dtype,
                                                  "cuda", empty_slot=3)
            weight = (torch.randn(sum(blocks), 4096, generator=gen) / 64).to("cuda", dtype)
            normed, _ = rms_norm_reference(x, norm_weight, 1e-5, residual)
            expected = normed @ weight.T
            add_lora_reference(expected, normed, slots, mapping)
            if gated:
                expected = silu_and_mul_reference(expected)
            epilogue = impl.expand_epilogue(x, slots, mapping,
                                            ShrinkNorm(residual, norm_weight, 1e-5))
            got, _ = skinny.rms_norm_skinny_gemm(x, residual, norm_weight, 1e-5, weight, None,
                                                 config, silu_mul=gated, lora=epilogue)
            close(got, expected)


@pytest.mark.gpu
def test_gpu_kernel_in_a_cuda_graph_replayed_over_changing_mappings():
    """One captured launch (a decode graph's) replayed 300 times over mappings that change
    between replays, as the engine's steps do: every replay's delta matches the reference
    (the grids are sized before the mapping is known)."""
    from archserve.kernels.lora.triton_lora import TritonLoRA
    num_tokens, num_slots = 32, 8
    y, x, slots, _, _ = random_case(num_tokens, 4096, (4096, 1024, 1024), 16, num_slots,
                                    torch.bfloat16, "cuda", empty_slot=3)
    packed = torch.zeros(2 * num_slots + 2 * num_tokens, dtype=torch.int32, device="cuda")
    mapping = LoRAMapping.views(packed, num_slots, num_tokens)
    out = y.clone()
    impl = TritonLoRA()
    impl.add_lora(out, x, slots, mapping)          # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.add_lora(out, x, slots, mapping)
    rng = np.random.default_rng(0)
    for replay in range(300):
        kind = replay % 4      # all eight slots, one slot, none, a random mix
        token_slots = (np.arange(num_tokens) % num_slots if kind == 0
                       else np.full(num_tokens, replay % num_slots) if kind == 1
                       else np.full(num_tokens, NO_SLOT) if kind == 2
                       else rng.integers(NO_SLOT, num_slots, num_tokens))
        packed.copy_(torch.from_numpy(pack_mapping(token_slots, num_slots)))
        out.copy_(y)
        graph.replay()
        expected = y.clone()
        add_lora_reference(expected, x, slots, mapping)
        error = (out.float() - expected.float()).abs().max().item()
        assert error <= 2e-2 * max(1.0, expected.float().abs().max().item()), (replay, error)


def test_explain_shows_the_lora_route(tiny_checkpoint):
    from archserve.platform import get_profile
    from archserve.routing.explain import SelectionInputs, explain_model, explain_op_request
    from archserve.routing.model_summary import read_model_summary

    hopper = explain_op_request(get_profile("h100"), "lora", dtype="bfloat16").routes[0]
    assert (hopper.op, hopper.backend, hopper.detail) == ("lora", "TRITON_LORA", "PDL launches")
    cpu = explain_op_request(get_profile("cpu"), "lora", libraries="all").routes[0]
    assert cpu.backend == "TORCH_LORA" and cpu.ideal == "TORCH_LORA"
    summary = read_model_summary(tiny_checkpoint("llama"))
    plain = explain_model(get_profile("a100"), summary)
    assert not any(r.op == "lora" for r in plain.routes)
    served = explain_model(get_profile("a100"), summary,
                           inputs=SelectionInputs(enable_lora=True, max_lora_rank=64))
    assert [r.backend for r in served.routes if r.op == "lora"] == ["TRITON_LORA"]
    assert served.to_dict()["inputs"]["max_lora_rank"] == 64
