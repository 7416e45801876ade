"""Reductions by the last program to arrive (kernels/reduce_in_kernel.py) in a whole engine:
the split-KV merge and the MoE slot sum without their second kernels, inside the decode CUDA
graphs, give the tokens of the engine with them."""

from __future__ import annotations

import gc

import pytest
import torch

from archserve.kernels.reduce_in_kernel import REDUCE_IN_KERNEL_ENV, reduce_in_kernel


def test_the_switch_is_off_unless_asked_and_bounded_by_the_counters(monkeypatch):
    monkeypatch.delenv(REDUCE_IN_KERNEL_ENV, raising=False)
    assert not reduce_in_kernel(1)
    monkeypatch.setenv(REDUCE_IN_KERNEL_ENV, "1")
    monkeypatch.setattr(torch.version, "hip", None)
    assert reduce_in_kernel(1) and reduce_in_kernel(4096) and not reduce_in_kernel(4097)
    monkeypatch.setattr(torch.version, "hip", "6.4")      # not verified on ROCm: off there
    assert not reduce_in_kernel(1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model", ["dense", "moe"])
def test_gpu_greedy_tokens_are_the_same_with_reductions_in_the_kernel(tiny_checkpoint,
                                                                      tmp_path, monkeypatch,
                                                                      model):
    """bf16, CUDA graphs, one sequence (so decode splits its context): the merge sums in
    another order (logprobs a rounding apart); the MoE slot sum is bit-identical."""
    from tiny_checkpoints import TINY_QWEN3_MOE, build_tiny_checkpoint

    from archserve import LLM, SamplingParams

    path = (tiny_checkpoint("qwen3-h64") if model == "dense"
            else build_tiny_checkpoint(str(tmp_path), "qwen3_moe", **TINY_QWEN3_MOE))
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=1)
    outs = []
    for enabled in (False, True):
        monkeypatch.setenv(REDUCE_IN_KERNEL_ENV, "1" if enabled else "0")
        llm = LLM(path, dtype="bfloat16", gpu_memory_utilization=0.2)
        outs.append(llm.generate("The quick brown fox jumps over the lazy dog " * 8,
                                 params)[0].outputs[0])
        decisions = {d.what for d in llm.llm_engine.report.decisions}
        assert ("reductions across programs" in decisions) == enabled
        del llm     # the next engine sizes its pool from the memory this one frees
        gc.collect()
        torch.cuda.empty_cache()
    off, on = outs
    assert on.token_ids == off.token_ids
    for a, b, t in zip(off.logprobs, on.logprobs, off.token_ids, strict=True):
        assert b[t].logprob == pytest.approx(a[t].logprob, abs=2e-2)
