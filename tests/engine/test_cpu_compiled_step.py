"""Compiled decode steps on a CPU (engine/cpu_compiled_step.py): the eager step's logits at
every context length from one compile per batch size, the engine's tokens unchanged, eager
where asked, and a size whose compiled step differs from eager demoted with its reason."""

from __future__ import annotations

import pytest
import torch

from archserve import LLM, SamplingParams
from archserve.engine.cpu_compiled_step import decode_meta, trace_decode_step, traced_inputs
from archserve.models.layers.embedding import LMHead
from archserve.models.layers.forward_context import set_forward_context

COMPILE = {"level": 3, "cudagraph_capture_sizes": [1, 2]}
PROMPTS = ["hello world", "The capital of France is"]


@pytest.fixture(autouse=True)
def private_inductor_cache(tmp_path, monkeypatch):
    """Inductor's cache: a test's own, not the user's."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))


def decode_steps_decision(llm: LLM) -> str:
    (line,) = [line for line in llm.llm_engine.describe_route().splitlines()
               if line.startswith("decision: decode steps")]
    return line


def counted(runner) -> list[int]:
    """Wrap each compiled step so that the runs of each size are counted."""
    runs = []
    for size, step in list(runner.compiled_steps.steps.items()):
        def run(ids, positions, step=step, size=size):
            runs.append(size)
            return step(ids, positions)
        runner.compiled_steps.steps[size] = run
    return runs


def decode_step(runner, lengths: list[int], compiled: bool) -> torch.Tensor:
    """The logits of a decode step of sequences at ``lengths`` over the cache a run wrote
    (sequence i reads the blocks after sequence i - 1's, from block 0), each writing its
    key and value at its last position: compiled, or eager."""
    blocks = -(-max(lengths) // runner.block_size)
    tables = torch.stack([torch.arange(blocks, dtype=torch.int32) + i * blocks
                          for i in range(len(lengths))])
    meta = decode_meta(lengths, tables, runner.block_size, runner.device)
    ids = torch.tensor([5, 9][:len(lengths)])
    positions = torch.tensor(lengths) - 1
    with torch.inference_mode():
        if not compiled:
            return runner._forward_logits(ids, positions, meta).float()
        with set_forward_context(runner._context(meta, len(lengths))):
            return runner.compiled_steps.steps[len(lengths)](ids, positions).float()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_steps_give_the_eager_logits_and_tokens(tiny_checkpoint, dtype):
    path = tiny_checkpoint("llama")
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=1)
    llm = LLM(path, dtype=dtype, max_num_seqs=2, compilation_config=COMPILE)
    runner = llm.llm_engine.runner
    assert runner.compiled_steps.sizes == [1, 2], runner.compiled_steps.demoted
    assert decode_steps_decision(llm).startswith(
        "decision: decode steps: compiled (level 3) -> compiled at batch sizes 1, 2")
    runs = counted(runner)
    outputs = llm.generate(PROMPTS, params)
    assert 2 in runs                      # both decoded together, then the longer alone
    runs.clear()
    single = llm.generate(PROMPTS[:1], params)[0].outputs[0]
    assert runs and set(runs) == {1}
    assert single.token_ids == outputs[0].outputs[0].token_ids

    # Compiled against eager logits over the cache the run wrote, at lengths and block
    # tables unlike the trace's (one graph serves every length).
    tolerance = 2e-3 if dtype == "float32" else 2e-2   # the engine's canary's bound
    for lengths in ([7], [3, 19], [24, 1], [30]):
        compiled = decode_step(runner, lengths, compiled=True)
        eager = decode_step(runner, lengths, compiled=False)
        assert (eager - compiled).abs().max().item() <= tolerance * eager.abs().max().item()

    eager = LLM(path, dtype=dtype, max_num_seqs=2, enforce_eager=True).generate(PROMPTS, params)
    # Inductor rounds 16-bit intermediates as eager does: the same tokens and log-probs.
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in eager]
    assert logprob_drift(outputs, eager) < (1e-3 if dtype == "float32" else 2e-2)


def logprob_drift(outputs, reference) -> float:
    """The largest difference of the chosen tokens' log-probs, over each pair's common
    prefix of tokens (after the first different token the contexts differ)."""
    drift = 0.0
    for got, want in zip(outputs, reference, strict=True):
        got, want = got.outputs[0], want.outputs[0]
        for g, w, token, other in zip(got.logprobs, want.logprobs, got.token_ids,
                                      want.token_ids, strict=False):
            if token != other:
                break
            drift = max(drift, abs(g[token].logprob - w[token].logprob))
    return drift


@pytest.mark.parametrize("options, requested, reason", [
    (dict(enforce_eager=True, compilation_config=COMPILE), "compiled (level 3)",
     "enforce_eager=True"),
    (dict(compilation_config=0), "eager", "level 0: -O 1-3 compiles"),
    (dict(), "eager", "level 0 ($ARCHSERVE_COMPILATION_LEVEL): -O 1-3 compiles"),
])
def test_decode_steps_stay_eager_where_asked(tiny_checkpoint, options, requested, reason):
    llm = LLM(tiny_checkpoint("llama"), max_num_seqs=2, **options)
    assert llm.llm_engine.runner.compiled_steps is None
    assert decode_steps_decision(llm).startswith(
        f"decision: decode steps: {requested} -> eager ({reason}")


def test_a_cpu_engine_compiles_by_default_and_a_second_start_loads_torchs_caches(
        tiny_checkpoint, monkeypatch):
    """Where no level is given (the default: tests set level 0 in conftest.py), a CPU
    engine compiles its batch-1 decode step; a second start of the same model finds the
    compiled step in AOTAutograd's cache (the weights are the graph's inputs, not
    constants hashed by value) and inductor's, and compiles nothing again."""
    from torch._dynamo.utils import counters
    monkeypatch.delenv("ARCHSERVE_COMPILATION_LEVEL")
    path = tiny_checkpoint("llama")
    params = SamplingParams(max_tokens=8, temperature=0)
    tokens = []
    for start in range(2):
        counters.clear()
        llm = LLM(path, dtype="float32", max_num_seqs=2)
        steps = llm.llm_engine.runner.compiled_steps
        assert steps.sizes == [1]
        assert steps.from_cache == ({1} if start else set())
        cached = " (loaded from torch's caches)" if start else ""
        assert decode_steps_decision(llm).startswith(
            "decision: decode steps: compiled (level 3 (the default)) -> compiled at batch "
            f"sizes 1 (inductor{cached}, attention in the graph")
        tokens.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS[:1], params)])
        if start == 0:
            assert counters["aot_autograd"]["autograd_cache_miss"] == 1
        else:
            assert counters["aot_autograd"]["autograd_cache_hit"] == 1
            assert counters["inductor"]["fxgraph_cache_hit"] == 1
    assert tokens[0] == tokens[1]
    eager = LLM(path, dtype="float32", max_num_seqs=2, compilation_config=0)
    assert [o.outputs[0].token_ids for o in eager.generate(PROMPTS[:1], params)] == tokens[0]


def test_a_bad_default_level_is_refused_by_name(tiny_checkpoint, monkeypatch):
    monkeypatch.setenv("ARCHSERVE_COMPILATION_LEVEL", "fast")
    with pytest.raises(ValueError, match="ARCHSERVE_COMPILATION_LEVEL='fast' is not an "
                                         "optimisation level 0-3"):
        LLM(tiny_checkpoint("llama"), max_num_seqs=2)


def test_a_size_whose_compiled_step_differs_runs_eager_with_its_reason(tiny_checkpoint,
                                                                      monkeypatch):
    """The canary compares each compiled size with the eager step: a compiled step that
    computes something else (here its logits scaled) is not kept, and the engine's tokens
    are the eager ones."""
    from archserve.engine import cpu_compiled_step
    compile_graph = cpu_compiled_step.compile_graph

    def wrong(graph, inputs, block_size):
        step = compile_graph(graph, inputs, block_size)
        return lambda ids, positions: step(ids, positions) * 1.5

    monkeypatch.setattr(cpu_compiled_step, "compile_graph", wrong)
    path = tiny_checkpoint("llama")
    llm = LLM(path, dtype="float32", max_num_seqs=2, compilation_config=COMPILE)
    steps = llm.llm_engine.runner.compiled_steps
    assert steps.sizes == []
    assert "compiled step canary (batch 1" in steps.demoted[1]
    assert "max error" in steps.demoted[2]
    assert decode_steps_decision(llm).startswith(
        "decision: decode steps: compiled (level 3) -> eager (")
    params = SamplingParams(max_tokens=8, temperature=0)
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    eager = LLM(path, dtype="float32", max_num_seqs=2, enforce_eager=True)
    assert [o.outputs[0].token_ids for o in eager.generate(PROMPTS, params)] == tokens


def test_the_embedded_gguf_compiled_stays_within_the_eager_bound(embedded_model_path):
    """The embedded model (30 layers; int4 weights, bfloat16 where the CPU multiplies it
    natively) at batch 1: the compiled step's logits are as near the float32 model's as the
    eager step's are (a step reading a stale length, a wrong cache row or a wrong weight
    is as far off as the logits' scale), and its greedy tokens are the eager ones."""
    options = dict(max_num_seqs=1, max_model_len=256)
    llm = LLM(embedded_model_path, compilation_config={"level": 3}, **options)
    runner = llm.llm_engine.runner
    assert runner.compiled_steps.sizes == [1], runner.compiled_steps.demoted
    params = SamplingParams(max_tokens=20, temperature=0)
    prompt = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles "
              "begins with a single step, and every step counts.")
    tokens = llm.generate([prompt], params)[0].outputs[0].token_ids
    assert_head_traced_as_routed(runner)
    eager = LLM(embedded_model_path, **options)
    assert eager.generate([prompt], params)[0].outputs[0].token_ids == tokens
    reference = LLM(embedded_model_path, dtype="float32", **options)
    reference.generate([prompt], params)
    # Within the prompt, whose cache rows the three engines wrote alike.
    for length in (5, 23):
        compiled = decode_step(runner, [length], compiled=True)
        eager_logits = decode_step(eager.llm_engine.runner, [length], compiled=False)
        exact = decode_step(reference.llm_engine.runner, [length], compiled=False)
        eager_error = (eager_logits - exact).abs().max().item()
        compiled_error = (compiled - exact).abs().max().item()
        assert compiled_error <= max(2 * eager_error, 0.5), (length, compiled_error,
                                                              eager_error)


def assert_head_traced_as_routed(runner) -> None:
    """Where start-up gave the LM head its int8 copy at one row (kernels/linear/
    cpu_lm_head.py), the compiled step multiplies by it: one int8 product per group."""
    (head,) = [m for m in runner.model.modules() if isinstance(m, LMHead)]
    route = head.low_precision
    if route is None or 1 not in route.rows:
        return
    meta = decode_meta([1], torch.zeros((1, 1), dtype=torch.int32), runner.block_size,
                       runner.device)
    graph = trace_decode_step(runner.model, runner._context(meta, 1),
                              traced_inputs(1, runner.kv_caches, runner.device))
    products = [n for n in graph.graph.nodes
                if n.target is torch.ops.aten._weight_int8pack_mm.default]
    assert len(products) == route.stored.q.shape[0]


def test_compiled_steps_attend_in_the_graph_not_through_python(tiny_checkpoint, monkeypatch):
    """The compiled step's attention (cache write, gather, SDPA) is tensor ops of the graph
    with the step's slots, rows and lengths as inputs: no layer calls back into the
    attention backend's Python while a compiled decode step runs, at any context length."""
    llm = LLM(tiny_checkpoint("llama"), dtype="float32", max_num_seqs=2,
              compilation_config=COMPILE)
    runner = llm.llm_engine.runner
    assert runner.compiled_steps.opaque_layers == {1: 0, 2: 0}
    assert "attention in the graph" in decode_steps_decision(llm)
    compiled_running, calls_in_compiled = [False], []
    forward = runner.attn_impl.forward

    def counted_forward(*args, **kwargs):
        calls_in_compiled.append(compiled_running[0])
        return forward(*args, **kwargs)

    monkeypatch.setattr(runner.attn_impl, "forward", counted_forward)
    runs = []
    for size, step in list(runner.compiled_steps.steps.items()):
        def run(ids, positions, step=step, size=size):
            runs.append(size)
            compiled_running[0] = True
            try:
                return step(ids, positions)
            finally:
                compiled_running[0] = False
        runner.compiled_steps.steps[size] = run
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    llm.generate(PROMPTS, params)
    llm.generate(PROMPTS[:1], params)
    assert set(runs) == {1, 2}
    # The prompts' steps ran eager, through the backend; no compiled step did.
    assert calls_in_compiled and not any(calls_in_compiled)


def test_a_moe_model_compiles_its_decode_step_around_the_expert_loop():
    """TORCH_MOE's expert loop (a token count per expert: data, not a shape) is one opaque
    op in the traced step: the MXFP4 gpt-oss fixture (dequantized experts, their biases,
    the clamped SwiGLU) decodes compiled, with eager's tokens."""
    import os
    fixture = os.path.join(os.path.dirname(__file__), "..", "fixtures", "quant",
                           "gpt-oss-mxfp4")
    params = SamplingParams(max_tokens=8, temperature=0)
    llm = LLM(fixture, dtype="float32", max_num_seqs=1,
              compilation_config={"level": 3, "cudagraph_capture_sizes": [1]})
    assert llm.llm_engine.runner.compiled_steps.sizes == [1], \
        llm.llm_engine.runner.compiled_steps.demoted
    runs = counted(llm.llm_engine.runner)
    compiled = llm.generate(PROMPTS[:1], params)[0].outputs[0].token_ids
    assert runs
    eager = LLM(fixture, dtype="float32", max_num_seqs=1, enforce_eager=True)
    assert compiled == eager.generate(PROMPTS[:1], params)[0].outputs[0].token_ids


def _latent_attention_checkpoint(kind: str, path: str) -> str:
    """Tiny checkpoints of the models whose attention keeps more than a key and value a
    token: DeepSeek-V3's MLA, GLM-5's sparse MLA (an indexer, then a layer reusing its
    selection), DeepSeek V4's window, compressed entries and indexer keys."""
    from models.test_deepseek_v4_vs_hf import V4, init_v4_buffers
    from models.test_sparse_mla_vs_hf import DSA, VARIANTS
    from tiny_checkpoints import build_tiny_checkpoint
    if kind == "deepseek_v4":
        return build_tiny_checkpoint(path, kind, init_model=init_v4_buffers, **V4)
    if kind == "deepseek_v3":
        return build_tiny_checkpoint(path, kind, **{k: v for k, v in DSA.items()
                                                    if not k.startswith("index_")})
    arch, extra = VARIANTS["glm"]
    return build_tiny_checkpoint(path, arch, **{**DSA, **extra})


@pytest.mark.parametrize("kind", ["deepseek_v3", "glm_moe_dsa", "deepseek_v4"])
def test_latent_and_compressed_attention_compile_around_their_attention(tmp_path, kind):
    """MLA, sparse MLA and V4's compressed attention loop over sequences and write
    caches whose rows depend on the step's data: each layer's is one opaque op
    (``layer_attention_op``), the rest of the step compiles, and the tokens are eager's
    past the window, the top-k and several compression groups."""
    path = _latent_attention_checkpoint(kind, str(tmp_path / kind))
    params = SamplingParams(max_tokens=12, temperature=0)
    prompt = [{"prompt_token_ids": [3 + (7 * i) % 50 for i in range(40)]}]
    llm = LLM(path, dtype="float32", max_num_seqs=1, block_size=16,
              compilation_config={"level": 3, "cudagraph_capture_sizes": [1]})
    steps = llm.llm_engine.runner.compiled_steps
    assert steps.sizes == [1], steps.demoted
    assert steps.opaque_layers[1] == llm.llm_engine.model_config.num_layers, steps.opaque_layers
    runs = counted(llm.llm_engine.runner)
    compiled = llm.generate(prompt, params)[0].outputs[0].token_ids
    assert runs
    eager = LLM(path, dtype="float32", max_num_seqs=1, block_size=16, enforce_eager=True)
    assert compiled == eager.generate(prompt, params)[0].outputs[0].token_ids
