"""The Ray executor on a local Ray cluster on CPU (gloo ranks): one engine for the
module, since a Ray cluster takes seconds to start."""

from __future__ import annotations

import pytest

from archserve import LLM
from archserve.engine.sampling_params import SamplingParams

ray = pytest.importorskip("ray")

PROMPTS = ["Hello world! How are you", "The capital of France is"]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
COMMON = dict(device="cpu", dtype="float32", max_model_len=128, max_num_seqs=8)


@pytest.fixture(scope="module")
def ray_llm(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("llama"), tensor_parallel_size=2,
              distributed_executor_backend="ray", **COMMON)
    yield llm
    llm.llm_engine.shutdown()
    ray.shutdown()


def test_ray_ranks_generate_the_tokens_one_rank_does(tiny_checkpoint, ray_llm):
    one = LLM(tiny_checkpoint("llama"), **COMMON).generate(PROMPTS, GREEDY)
    two = ray_llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in one] == [o.outputs[0].token_ids for o in two]
    layout = next(d for d in ray_llm.llm_engine.report.decisions if d.what == "tensor parallel")
    assert layout.chosen == "2 ranks, gloo, ray executor"


def test_a_lost_ray_actor_fails_the_engine(ray_llm):
    from archserve.distributed.executor import WorkerFailure

    executor = ray_llm.llm_engine.runner.executor
    executor.kill_rank(1)
    with pytest.raises(WorkerFailure, match="rank 1"):
        ray_llm.generate(PROMPTS[0], GREEDY)
    with pytest.raises(WorkerFailure):       # and stays failed
        ray_llm.generate(PROMPTS[0], GREEDY)
