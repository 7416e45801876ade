"""Programmatic dependent launch (kernels/pdl.py): when it is on, and that it changes when
kernels start, never what they compute."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from archserve.kernels import pdl


def test_pdl_is_a_cuda_feature_and_off_with_zero(monkeypatch):
    monkeypatch.delenv(pdl.PDL_ENV, raising=False)
    assert not pdl.pdl_enabled(torch.device("cpu"))       # a CUDA feature only
    monkeypatch.setenv(pdl.PDL_ENV, "1")
    assert not pdl.pdl_enabled(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.pdl_enabled(torch.device("cuda", 0))   # the interpreter has no PDL
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv(pdl.PDL_ENV, "0")
    assert not pdl.pdl_enabled(torch.device("cuda", 0))   # off when asked, before any query


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pdl_is_on_by_default_on_nvidia_sm90(monkeypatch):
    monkeypatch.delenv(pdl.PDL_ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    hopper = torch.version.hip is None and torch.cuda.get_device_capability()[0] >= 9
    assert pdl.pdl_enabled(torch.device("cuda", 0)) == (hopper and pdl.triton is not None)
    assert pdl.pdl_launch_options(False) == {}
    assert pdl.pdl_launch_options(True) == {"launch_pdl": True}


@pytest.mark.skipif(pdl.triton_interpreted(), reason="the interpreter does not compile")
def test_decode_kernels_compile_to_wait_then_launch_on_hopper(monkeypatch):
    """The decode kernels that take PDL, as their wrappers launch them with it: attention
    decode (split, so its merge too), the q/k norm-rope-cache kernel, RMSNorm, MLA decode,
    MoE routing, the fused experts (both gate/up and both down kernels) and MLA's merge
    with W_UV. Each waits for the kernel before it, then lets the next one launch."""
    from triton_compile import compiled_launches

    from archserve.kernels.attention import triton_decode, triton_qk_norm_rope_cache
    from archserve.kernels.elementwise import triton_rms_norm
    from archserve.kernels.mla import (
        triton_mla_decode,
        triton_mla_decode_inputs,
        triton_mla_output,
    )
    from archserve.kernels.moe import triton_fused_moe, triton_routing

    for module in (triton_decode, triton_qk_norm_rope_cache, triton_rms_norm,
                   triton_mla_decode, triton_mla_decode_inputs, triton_mla_output,
                   triton_fused_moe, triton_routing):
        monkeypatch.setattr(module, "pdl_enabled", lambda device: True)
    heads, kv_heads, head = 4, 2, 64
    cache = torch.zeros(2, 4, 16, kv_heads, head, dtype=torch.bfloat16)
    tables, lens = torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    with compiled_launches(("cuda", 90, 32)) as launches:
        triton_decode.decode_attention(
            torch.zeros(2, heads, head, dtype=torch.bfloat16), cache, tables, lens,
            torch.arange(3, dtype=torch.int32), torch.zeros(2, heads, head, dtype=torch.bfloat16),
            num_seqs=2, max_seq_len=64, scale=0.1, num_splits=2)
        triton_qk_norm_rope_cache.qk_norm_rope_cache(
            torch.zeros(2, (heads + 2 * kv_heads) * head, dtype=torch.bfloat16),
            torch.zeros(2, dtype=torch.long), torch.zeros(64, head // 2),
            torch.zeros(64, head // 2), (torch.ones(head, dtype=torch.bfloat16),) * 2, 1e-6,
            cache, torch.zeros(2, dtype=torch.long), heads, kv_heads)
        triton_rms_norm.rms_norm_triton(torch.zeros(2, 256, dtype=torch.bfloat16),
                                        torch.ones(256, dtype=torch.bfloat16), 1e-6,
                                        torch.zeros(2, 256, dtype=torch.bfloat16))
        triton_mla_decode.mla_decode(
            torch.zeros(2, 16, 576, dtype=torch.bfloat16),
            torch.zeros(1, 4, 16, 1, 576, dtype=torch.bfloat16), tables, lens,
            torch.arange(3, dtype=torch.int32), torch.zeros(2, 16, 512, dtype=torch.bfloat16),
            num_seqs=2, max_seq_len=64, scale=0.1, num_splits=1)
        # Routing, then the experts of a fixed routing (the compiled routing writes nothing).
        triton_routing.triton_route(torch.zeros(1, 8), 2, True)      # ranked lanes
        triton_routing.triton_route(torch.zeros(1, 128), 8, True)    # argmax passes
        # Then the same with the pair layout's alternatives: the slot-summing down kernel,
        # and gate/up as GEMVs on the CUDA cores (its experts come from the routing, the
        # kernel right before: it reads nothing before the wait). The last two add the
        # block's residual where they sum the slots (FusedMoE.forward_add): read after it.
        pairs = triton_fused_moe.pair_tile(2, 32, 132)
        for tile, add in ((None, None),
                          (dataclasses.replace(pairs, down_block_n=4, down_block_k=32), None),
                          (dataclasses.replace(pairs, gate_up_block_n=4, gate_up_block_k=32),
                           None),
                          (None, torch.zeros(1, 64, dtype=torch.bfloat16)),
                          (dataclasses.replace(pairs, down_block_n=4, down_block_k=32),
                           torch.zeros(1, 64, dtype=torch.bfloat16))):
            triton_fused_moe.fused_experts(
                torch.zeros(1, 64, dtype=torch.bfloat16), torch.full((1, 2), 0.5),
                torch.tensor([[1, 3]], dtype=torch.int32),
                torch.zeros(8, 64, 64, dtype=torch.bfloat16),
                torch.zeros(8, 64, 32, dtype=torch.bfloat16), tile, add)
        # MLA decode's inputs (absorbed query, latent write), then MLA decode split 2 ways
        # with W_UV: its merge and W_UV in one kernel.
        triton_mla_decode_inputs.mla_decode_inputs(
            torch.zeros(1, 16 * 192, dtype=torch.bfloat16),
            torch.zeros(1, 576, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.long),
            torch.zeros(64, 32, dtype=torch.bfloat16), torch.zeros(64, 32, dtype=torch.bfloat16),
            torch.ones(512, dtype=torch.bfloat16), 1e-6,
            torch.zeros(16, 128, 512, dtype=torch.bfloat16),
            torch.zeros(1, 4, 16, 1, 576, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.long),
            True)
        triton_mla_decode.mla_decode(
            torch.zeros(2, 16, 576, dtype=torch.bfloat16),
            torch.zeros(1, 4, 16, 1, 576, dtype=torch.bfloat16), tables, lens,
            torch.arange(3, dtype=torch.int32), torch.zeros(2, 16, 512, dtype=torch.bfloat16),
            num_seqs=2, max_seq_len=64, scale=0.1, num_splits=2,
            w_uv=torch.zeros(16, 128, 512, dtype=torch.bfloat16))
    names = [launch.kernel for launch in launches]
    assert names[:5] == ["_decode_kernel", "_merge_splits_kernel", "_qk_norm_rope_cache_kernel",
                         "_rms_norm_kernel", "_mla_decode_kernel"], names
    assert {"_route_kernel", "_gate_up_kernel", "_down_kernel", "_sum_slots_kernel",
            "_down_sum_slots_kernel", "_gate_up_gemv_kernel", "_mla_decode_inputs_kernel",
            "_latent_output_to_heads_kernel"} <= set(names)
    for launch in launches:
        assert launch.options.get("launch_pdl") and launch.constexprs["PDL"], launch.kernel
        ptx = launch.code()
        assert ptx.index("griddepcontrol.wait") < ptx.index("griddepcontrol.launch_dependents")
        # Nothing is written before the (first) wait: the kernel before may still read it.
        # (The q/k and MLA-inputs kernels wait in each of two branches: only the first
        # branch's part before its wait is checked here.) What
        # that kernel cannot write is read before it, and streams while it drains: decode
        # attention's and MLA decode's metadata and first tile of cached keys, the split
        # merge's metadata (which splits hold keys), the MoE down
        # kernel's expert and its weight's first tile (L2 prefetches; the slot-summing down
        # kernel loads its experts' first K step), RMSNorm's weight, and
        # the q/k kernel's positions, rotary rows, norm weights and slots, MLA decode
        # inputs' W_UK tile (or its positions, rotary rows, slots and norm weight), the query starts
        # of MLA's merge with W_UV and W_UV's rows (an L2 prefetch when it merges splits).
        # The rest reads only after it.
        before_wait = ptx[:ptx.index("griddepcontrol.wait")]
        assert "st.global" not in before_wait and "atom." not in before_wait, launch.kernel
        prefetches = launch.kernel in ("_decode_kernel", "_mla_decode_kernel", "_down_kernel",
                                       "_latent_output_to_heads_kernel")
        assert ("prefetch.global.L2" in before_wait) == prefetches, launch.kernel
        reads_early = prefetches or launch.kernel in ("_rms_norm_kernel", "_merge_splits_kernel",
                                                      "_qk_norm_rope_cache_kernel",
                                                      "_mla_decode_inputs_kernel",
                                                      "_latent_output_to_heads_kernel",
                                                      "_down_sum_slots_kernel")
        assert ("ld.global" in before_wait) == reads_early, launch.kernel
    # The MoE sums' residual (ADD) is read after the wait: the loads before it are those of
    # the same kernel without it.
    for name in ("_sum_slots_kernel", "_down_sum_slots_kernel"):
        early = {launch.constexprs["ADD"]: launch.code().split("griddepcontrol.wait")[0]
                 for launch in launches if launch.kernel == name}
        assert set(early) == {False, True}, name
        assert early[True].count("ld.global") == early[False].count("ld.global"), name



@pytest.mark.skipif(pdl.triton_interpreted(), reason="the interpreter does not compile")
def test_wrappers_copy_nothing_their_kernel_reads_before_the_wait(monkeypatch):
    """RMSNorm reads its weight and the q/k kernel its positions before PDL's wait: a copy
    of a strided one made by the wrapper would be the kernel launched right before, writing
    what is read early. The kernels read strided ones where they lie."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton_compile import compiled_launches

    from archserve.kernels.attention import triton_qk_norm_rope_cache
    from archserve.kernels.elementwise import triton_rms_norm

    class TorchOps(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    for module in (triton_qk_norm_rope_cache, triton_rms_norm):
        monkeypatch.setattr(module, "pdl_enabled", lambda device: True)
    heads, kv_heads, head = 4, 2, 64
    x = torch.zeros(2, 3, head, dtype=torch.bfloat16)
    qkv = torch.zeros(2, (heads + 2 * kv_heads) * head, dtype=torch.bfloat16)
    cos_sin, slots = torch.zeros(64, head // 2), torch.zeros(2, dtype=torch.long)
    cache = torch.zeros(2, 4, 16, kv_heads, head, dtype=torch.bfloat16)
    norm_weights = (torch.ones(head, dtype=torch.bfloat16),) * 2
    strided_weight = torch.ones(2 * head, dtype=torch.bfloat16)[::2]
    strided_positions = torch.zeros(4, dtype=torch.long)[::2]
    with compiled_launches(("cuda", 90, 32)) as launches, TorchOps() as ops:
        triton_rms_norm.rms_norm_triton(x, strided_weight, 1e-6)
        triton_qk_norm_rope_cache.qk_norm_rope_cache(
            qkv, strided_positions, cos_sin, cos_sin, norm_weights, 1e-6, cache, slots,
            heads, kv_heads)
    assert [launch.kernel for launch in launches] == ["_rms_norm_kernel",
                                                      "_qk_norm_rope_cache_kernel"]
    assert not {"clone", "copy_", "contiguous"} & set(ops.names), ops.names


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["dense", "moe"])
def test_gpu_greedy_tokens_and_logprobs_are_the_same_with_pdl(tiny_checkpoint, tmp_path,
                                                             monkeypatch, model):
    """A tiny Qwen3 (q/k norms: the fused norm-rope-cache kernel) and a tiny Qwen3-MoE, in
    bf16 with CUDA graphs, decode and mixed steps: PDL on gives exactly the tokens and
    logprobs of PDL off."""
    from tiny_checkpoints import TINY_QWEN3_MOE, build_tiny_checkpoint

    from archserve import LLM, SamplingParams

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs SM90+")
    path = (tiny_checkpoint("qwen3-h64") if model == "dense"
            else build_tiny_checkpoint(str(tmp_path), "qwen3_moe", **TINY_QWEN3_MOE))
    prompts = ["The quick brown fox", "1 2 3", "A paged KV cache stores keys"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    outs = []
    for enabled in (False, True):
        monkeypatch.setenv(pdl.PDL_ENV, "1" if enabled else "0")
        llm = LLM(path, dtype="bfloat16", gpu_memory_utilization=0.2)
        outs.append([o.outputs[0] for o in llm.generate(prompts, params)])
        del llm     # the next engine sizes its pool from the memory this one frees
        gc.collect()
        torch.cuda.empty_cache()
    for off, on in zip(*outs, strict=True):
        assert on.token_ids == off.token_ids
        assert [lp[t].logprob for lp, t in zip(on.logprobs, on.token_ids, strict=True)] == \
            [lp[t].logprob for lp, t in zip(off.logprobs, off.token_ids, strict=True)]
