"""Compiled decode steps on a CPU (engine/cpu_compiled_step.py): the same logits as the eager
step, one compile per size serving every context length, off where asked, and a model
that cannot compile running eager with its reason."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from archserve import LLM, SamplingParams
from archserve.cache import cache_dir
from archserve.engine.cpu_compiled_step import CompiledDecodeRunner
from archserve.kernels.attention.interface import AttentionMetadata

COMPILE = {"level": 3, "cudagraph_capture_sizes": [1, 2]}
PROMPTS = ["hello world", "The capital of France is"]


@pytest.fixture(autouse=True)
def private_inductor_cache(tmp_path, monkeypatch):
    """Compiled steps go to the archserve cache: a test's own, not the user's."""
    monkeypatch.setenv("ARCHSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)


def compiled_lines(llm: LLM) -> list[str]:
    return [line for line in llm.llm_engine.describe_route().splitlines()
            if line.startswith("compiled decode steps")]


def decode_meta(runner, context_lens: list[int]) -> AttentionMetadata:
    """A decode step of sequences with these context lengths over blocks 0.. of the cache
    (written by earlier steps), writing nothing (slot -1)."""
    blocks = -(-max(context_lens) // runner.block_size)
    tables = torch.stack([torch.arange(blocks, dtype=torch.int32) + i * blocks
                          for i in range(len(context_lens))])
    return AttentionMetadata.from_lengths(
        [1] * len(context_lens), context_lens, tables,
        torch.full((len(context_lens),), -1, dtype=torch.long), runner.device)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_steps_match_eager_at_every_context_length_without_recompiling(
        tiny_checkpoint, dtype):
    path = tiny_checkpoint("llama")
    params = SamplingParams(max_tokens=24, temperature=0)
    llm = LLM(path, dtype=dtype, max_num_seqs=2, compilation_config=COMPILE)
    runner = llm.llm_engine.runner
    assert isinstance(runner.graphs, CompiledDecodeRunner)
    assert runner.graphs.set.sizes == [1, 2], runner.graphs.set.demoted
    assert compiled_lines(llm) == [
        "compiled decode steps: 2 decode sizes (torch.compile, inductor C++ wrapper)"]
    graphs_before = counters["stats"]["unique_graphs"]
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    # Every decode step of both lengths, 24 context lengths, ran a compiled size: no
    # recompile, and no size dropped.
    assert counters["stats"]["unique_graphs"] == graphs_before
    assert runner.graphs.set.sizes == [1, 2]
    assert runner.graphs.batch_lengths, "no decode step ran compiled"

    # The compiled step's logits against the eager step's, over the cache the run wrote.
    tolerance = 2e-3 if dtype == "float32" else 5e-2
    for lengths in ([7], [3, 19], [24, 1]):
        meta = decode_meta(runner, lengths)
        ids = torch.tensor([5, 9][:len(lengths)])
        positions = torch.tensor(lengths) - 1
        with torch.inference_mode():
            eager = runner._forward_logits(ids, positions, meta).float()
            compiled = runner.graphs.replay(len(lengths), ids, positions, meta).float()
        scale = eager.abs().max().item()
        assert (eager - compiled).abs().max().item() <= tolerance * scale, lengths
    assert counters["stats"]["unique_graphs"] == graphs_before

    if dtype == "float32":
        eager_llm = LLM(path, dtype=dtype, max_num_seqs=2, enforce_eager=True)
        assert [o.outputs[0].token_ids for o in eager_llm.generate(PROMPTS, params)] == tokens


@pytest.mark.parametrize("options, reason", [
    (dict(enforce_eager=True, compilation_config=COMPILE), "enforce_eager=True"),
    (dict(compilation_config=0), "compilation_config level 0 (-O0: no torch.compile)"),
    (dict(compilation_config={"mode": 0}), "compilation_config level 0 (-O0: no torch.compile)"),
    (dict(), "off by default on a CPU"),
])
def test_decode_steps_stay_eager_where_asked(tiny_checkpoint, options, reason):
    llm = LLM(tiny_checkpoint("llama"), max_num_seqs=2, **options)
    assert llm.llm_engine.runner.graphs is None
    (line,) = compiled_lines(llm)
    assert line.startswith(f"compiled decode steps: off ({reason}")


def test_a_model_that_cannot_compile_runs_eager_with_its_reason(tiny_checkpoint, monkeypatch):
    """A forward with a graph break (here every RMSNorm's) cannot be one graph: every size
    is demoted with dynamo's reason, and the steps run eager, correctly."""
    from archserve.models.layers.norm import RMSNorm
    forward = RMSNorm.forward

    def breaking_forward(self, *args, **kwargs):
        torch._dynamo.graph_break()
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(RMSNorm, "forward", breaking_forward)
    path = tiny_checkpoint("llama")
    llm = LLM(path, max_num_seqs=2, compilation_config={**COMPILE,
                                                        "cudagraph_capture_sizes": [2]})
    graphs = llm.llm_engine.runner.graphs
    assert graphs.set.sizes == []
    assert "graph_break" in graphs.set.demoted[2] or "graph break" in graphs.set.demoted[2]
    lines = compiled_lines(llm)
    assert lines[0] == "compiled decode steps: off (no decode size compiled)"
    assert lines[1].startswith("compiled decode steps: 0 decode sizes") and "runs eager" in lines[1]
    params = SamplingParams(max_tokens=8, temperature=0)
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    eager = LLM(path, max_num_seqs=2, enforce_eager=True)
    assert [o.outputs[0].token_ids for o in eager.generate(PROMPTS, params)] == tokens


def test_the_embedded_gguf_compiles_to_the_eager_logits(embedded_model_path):
    """The embedded model (30 layers, kept-quantized int4 weights in bfloat16) at one size
    and one thread count: one compile."""
    llm = LLM(embedded_model_path, dtype="bfloat16", max_num_seqs=1, max_model_len=256)
    runner = llm.llm_engine.runner
    llm.generate(["Once upon a time"], SamplingParams(max_tokens=20, temperature=0))
    runner.compile_decode_steps([1], cache_dir("inductor"), [torch.get_num_threads()])
    assert runner.graphs.set.sizes == [1], runner.graphs.set.demoted
    for length in (5, 23):
        meta = decode_meta(runner, [length])
        ids, positions = torch.tensor([42]), torch.tensor([length - 1])
        with torch.inference_mode():
            eager = runner._forward_logits(ids, positions, meta).float()
            compiled = runner.graphs.replay(1, ids, positions, meta).float()
        # bfloat16 through 30 layers: inductor keeps intermediates in float32.
        assert (eager - compiled).abs().max().item() <= 0.1 * eager.abs().max().item()
        assert torch.topk(compiled, 5).indices.tolist()[0][0] in torch.topk(
            eager, 5).indices.tolist()[0]
