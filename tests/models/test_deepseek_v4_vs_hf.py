"""DeepSeek V4 against transformers (5.25's DeepseekV4ForCausalLM, eager, fp32) with the same
tiny random weights, on CPU: every prompt position, prefill then decode, chunked prefill whose
chunks end inside compression groups, the whole engine's 32 greedy tokens and prompt
log-probs, the window's ring wrapping under chunked prefill, prefix reuse (the ring restored
from a snapshot) and preemption, DeepSeek's release layout, dummy weights.

The tiny model has every V4 part at odd sizes: 7 layers of the three kinds (sliding window
only, compressed sparse with 4-token entries, heavily compressed with 8-token ones, each kind
at least twice), a window of 6 (prompts reach past it and past several groups), top-3 of the
indexer's 9 heads (the selection matters from the 16th token; with 2-3 heads many keys score
0 after the ReLU and top-k ties break arbitrarily), 3 hyper-connection streams, two hash-routed
MoE layers with a random token table, sqrt(softplus) routing with a selection bias, a grouped
output projection of 2 groups, a ``swiglu_limit`` of 1 (the routed and shared experts' gate
and up pre-activations pass it: the clamp matters).
"""

from __future__ import annotations

import pytest
import torch
from tiny_checkpoints import build_tiny_checkpoint

from archserve.kernels.compressed_attention.layout import CSA, HCA, SLIDING
from models.helpers import (
    PREFIX_TAILS,
    PROMPTS,
    SHARED_PREFIX,
    TEXT_PROMPTS,
    PagedSequences,
    assert_chunked_prefix_and_preemption_equal_hf,
    assert_dummy_weights_run,
    assert_gpu_chunked_prefix_tracks_one_prefill,
    assert_llm_greedy_and_prompt_logprobs_equal_hf,
    assert_prefill_then_decode_match_hf,
    assert_prompt_positions_match_hf,
    bf16_greedy_params,
    bf16_logprob_drift,
    hf_last_logits,
    prompt_logprob_gaps,
    saved_and_loaded,
    tiny_hf_model,
    without_activation_quantization,
)

ATOL = 1e-4
KINDS = [SLIDING, CSA, HCA, CSA, SLIDING, HCA, CSA]
# (intermediate_size is transformers' alias of moe_intermediate_size for V4: set both, as
# build_tiny_checkpoint's defaults would set the alias.)
V4 = dict(hidden_size=72, moe_intermediate_size=40, intermediate_size=40,
          num_hidden_layers=len(KINDS),
          num_attention_heads=4, num_key_value_heads=1, head_dim=48, q_lora_rank=40,
          partial_rotary_factor=16 / 48, n_routed_experts=8, num_experts_per_tok=2,
          n_shared_experts=1, layer_types=KINDS,
          mlp_layer_types=["hash_moe"] * 2 + ["moe"] * (len(KINDS) - 2),
          compress_rates={CSA: 4, HCA: 8}, sliding_window=6, o_groups=2, o_lora_rank=24,
          index_n_heads=9, index_head_dim=16, index_topk=3, hc_mult=3, hc_sinkhorn_iters=5,
          max_position_embeddings=256, routed_scaling_factor=1.5, swiglu_limit=1.0,
          tie_word_embeddings=False,
          # The compressed layers' rope as the release sets it: YaRN over compress_rope_theta.
          rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64,
                               beta_fast=32, beta_slow=1))


def init_v4_buffers(model, seed: int = 1) -> None:
    """What transformers leaves zero: the selection bias, and the token-to-expert table of
    the hash layers (distinct experts per token)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.05)
            elif name.endswith("tid2eid"):
                experts = model.config.n_routed_experts
                rows = [torch.randperm(experts, generator=generator)[:buffer.shape[1]]
                        for _ in range(buffer.shape[0])]
                buffer.copy_(torch.stack(rows))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf_model = tiny_hf_model("deepseek_v4", **{**V4, "vocab_size": 256})
    init_v4_buffers(hf_model)
    return saved_and_loaded(hf_model, tmp_path_factory.mktemp("v4"))


def test_config_and_cache_blocks_follow_the_layer_kinds(pair):
    _, model, config = pair
    dims = config.compressed_attention
    assert dims.layer_kinds == tuple(KINDS) and dims.kinds == (SLIDING, CSA, HCA)
    assert [dims.rate(i) for i in range(len(KINDS))] == [0, 4, 8, 4, 0, 8, 4]
    assert (dims.sliding_window, dims.index_topk, dims.index_n_heads) == (6, 3, 9)
    attention = [layer.self_attn for layer in model.model.layers]
    assert [a.compressor is not None for a in attention] == [k != SLIDING for k in KINDS]
    assert [hasattr(a.compressor, "indexer") for a in attention if a.compressor] == [
        k == CSA for k in KINDS if k != SLIDING]
    assert [layer.mlp.hashed for layer in model.model.layers] == [True, True] + [False] * 5
    caches = PagedSequences.for_config(config, block_size=8).kv_caches
    blocks, rings = caches[:len(KINDS)], caches[len(KINDS):]
    widths = [c.shape[-1] for c in blocks]
    # A block of 8 tokens: CSA 2 entries + 2 index keys + three accumulators of 64 channels;
    # HCA one entry + one accumulator of 48; a sliding-window-only layer nothing (16 bytes).
    assert widths[0] == widths[4] and widths[1] == widths[3] == widths[6] > widths[2] > widths[0]
    assert widths[0] * 8 == 16
    # Each layer's window keys: a ring of 6 rows of 48 per sequence, whatever its length.
    assert all(tuple(r.shape) == (1, 16, 6, 1, 48) and r.dtype == torch.float32 for r in rings)


def test_prompt_positions_and_prefill_then_decode_match_hf(pair):
    """Every position of a 26-token prompt (past the window, past several groups of both
    rates, past top-3), then a batched prefill and a decode step through the paged cache."""
    hf_model, model, config = pair
    assert_prompt_positions_match_hf(model, hf_model, config, PROMPTS[0] + PROMPTS[2] * 2 + [1],
                                     ATOL)
    assert_prefill_then_decode_match_hf(model, hf_model, config, PROMPTS, ATOL)


@pytest.mark.parametrize("block_size", [8, 24])
def test_chunks_ending_inside_groups_match_hf(pair, block_size):
    """Two sequences prefilled in chunks of 5, 7, 3, 11, 1, 1, 9 tokens (and 2 more for the
    second), so a chunk ends inside a 4- and an 8-token group and the open accumulators carry
    it; blocks of 8 tokens (window rows 6 < 8) and of 24 (three HCA groups a block)."""
    hf_model, model, config = pair
    first = [(7 * i + 3) % 256 for i in range(45)]
    second = [(5 * i + 1) % 256 for i in range(60)]
    with torch.no_grad():     # causal: position n - 1's logits are those of the first n
        want = [hf_model(torch.tensor([tokens])).logits[0] for tokens in (first, second)]
    cache = PagedSequences.for_config(config, block_size=block_size)
    done = [0, 0]
    for chunk in (5, 7, 3, 11, 1, 1, 9):
        step = {0: first[done[0]:done[0] + chunk], 1: second[done[1]:done[1] + chunk + 2]}
        logits = cache.run(model, step)
        done = [done[0] + chunk, done[1] + chunk + 2]
        for row in (0, 1):
            torch.testing.assert_close(logits[row], want[row][done[row] - 1], atol=ATOL,
                                       rtol=ATOL)


def test_the_comparison_can_fail(pair):
    """The parts matter: attending every compressed entry (no top-k), or dropping the sinks,
    moves the logits of a prompt long enough to select."""
    hf_model, model, config = pair
    prompt = [(11 * i + 5) % 256 for i in range(30)]
    want = hf_last_logits(hf_model, prompt)
    attention = [layer.self_attn for layer in model.model.layers]
    for change in ("topk", "sinks"):
        saved = [(a.index_topk, a.sinks.clone()) for a in attention]
        for a in attention:
            if change == "topk" and a.index_topk:
                a.index_topk = 100
            elif change == "sinks":
                a.sinks.fill_(-1e4)
        try:
            got = PagedSequences.for_config(config, block_size=8).run(model, {0: prompt})[0]
        finally:
            for a, (topk, sinks) in zip(attention, saved, strict=True):
                a.index_topk = topk
                a.sinks.copy_(sinks)
        assert (got - want).abs().max() > 1e-3, change


def test_release_layout_loads_the_same_weights(pair, tmp_path):
    """DeepSeek's release names (no ``model.`` prefix, ``embed``/``head``, ``hc_head_fn``) load
    the same model as transformers' names; the MTP layers are skipped."""
    from safetensors.torch import load_file, save_file

    from archserve.loader.loader import load_model
    _, model, config = pair
    hf_dir = tmp_path / "hf"
    pair[0].save_pretrained(hf_dir)
    state = load_file(str(hf_dir / "model.safetensors"))
    release = {name.removeprefix("model.").replace("hc_head.hc_", "hc_head_"): t
               for name, t in state.items()}
    release["embed.weight"] = release.pop("embed_tokens.weight")
    release["mtp.0.attn.wq_a.weight"] = torch.zeros(3, 3)
    (tmp_path / "release").mkdir()
    save_file(release, str(tmp_path / "release" / "model.safetensors"))
    (tmp_path / "release" / "config.json").write_text((hf_dir / "config.json").read_text())
    loaded, _ = load_model(str(tmp_path / "release"), dtype=torch.float32)
    theirs = dict(loaded.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(theirs[name], param, rtol=0, atol=0)


def test_dummy_weights_run(pair, tmp_path):
    assert_dummy_weights_run(pair[0], tmp_path, PROMPTS[0] * 3, block_size=8)


def _checkpoint(path) -> str:
    return build_tiny_checkpoint(str(path), "deepseek_v4", init_model=init_v4_buffers, **V4)


def test_llm_greedy_and_prompt_logprobs_equal_transformers(tmp_path):
    assert_llm_greedy_and_prompt_logprobs_equal_hf(_checkpoint(tmp_path), TEXT_PROMPTS, 32,
                                                   block_size=8)


@pytest.mark.parametrize("budget", [6, 7, 11])
def test_llm_chunked_prefill_ring_wrap_prefix_and_preemption(tmp_path, monkeypatch, budget):
    """Prompts of 20+ tokens and 32 greedy tokens over a window of 6 (each sequence's ring
    of 6 rows wraps 9 times and more), prefills chunked 6, 7 or 11 tokens a step (ending
    inside groups of 4 and 8; 7 and 11 move a chunk's end around the ring, across its wrap,
    11 is longer than the ring), prompts that reuse the shared prefix a first prompt left
    cached (its blocks, and the snapshot of its ring at the last one), and a pool too small
    for every sequence at once, so some are preempted and recomputed in a fresh ring.

    One thread, engine and transformers alike: this tiny model routes one token ("Hello
    world"'s position 51, layer 5) with its second and third experts' scores 1-2 fp32 ulps
    apart; at 2 threads, recomputed after preemption in a 6-token chunk, they round to an
    exact tie that takes the other expert, and the tokens after it that read its keys and
    entries move by up to 1.1e-3 in a log-prob (greedy tokens equal). Rounding, not the
    chunk path: run in float64, every budget's log-probs are the whole prompt's to 3e-15;
    at one thread every budget is within 2e-6 of transformers."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")      # the engine's thread governor stays off
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        outputs = assert_chunked_prefix_and_preemption_equal_hf(
            _checkpoint(tmp_path), monkeypatch, max_num_batched_tokens=budget, block_size=8,
            num_kv_blocks=14, warm_up=[SHARED_PREFIX], output_logprobs=True)
    finally:
        torch.set_num_threads(threads)
    assert all(len(o.prompt_token_ids) > 3 * 6 for o in outputs)


def test_llm_prefix_reuse_restores_the_window(tmp_path):
    """Prompts continuing a long cached prompt (4 rings' worth past the window) start from
    a copy of the ring snapshot taken where its prefill was cut at its last full block:
    every one hits the cache, and greedy tokens and their log-probs are transformers'."""
    prefix = SHARED_PREFIX * 2
    outputs = assert_llm_greedy_and_prompt_logprobs_equal_hf(
        _checkpoint(tmp_path), [prefix + tail for tail in PREFIX_TAILS] + [prefix], 16,
        prompt_logprobs=False, warm_up=[prefix], output_logprobs=True, block_size=8,
        max_num_batched_tokens=7, enable_prefix_caching=True)
    assert all(o.num_cached_tokens >= 24 for o in outputs), [o.num_cached_tokens
                                                              for o in outputs]


def test_speculation_refuses_draft_networks_it_cannot_run(pair, tmp_path):
    """V4 has no MTP layers archserve runs, and a V4 draft model's ring would be missing
    from a draft network's cache."""
    from archserve.engine.spec_decode.setup import plan_speculation
    from archserve.engine.speculative_config import parse_speculative_config
    with pytest.raises(ValueError, match="multi-token-prediction"):
        plan_speculation(parse_speculative_config({"method": "mtp"}), pair[2])
    draft = {"method": "draft_model", "model": _checkpoint(tmp_path),
             "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="ring per sequence"):
        plan_speculation(parse_speculative_config(draft), pair[2])


class ScriptedDrafts:
    """Drafts transformers' own greedy continuation (``expected``: prompt ids -> every
    token), each draft at a position divisible by ``period`` made wrong: verification
    meets runs accepted whole, runs cut after every draft position, and first drafts
    rejected (each rejection rewinds the sequence's ring rows and compressor sums)."""

    def __init__(self, expected: dict[tuple[int, ...], list[int]], k: int, period: int = 5):
        self.expected, self.k, self.period = expected, k, period
        self.block_pool = None     # the engine's, handed over by Speculator.attach

    def propose(self, spans, target_hidden=None) -> None:  # noqa: ANN001
        for span in spans:
            if not span.sampled:
                continue
            seq = span.seq
            full = self.expected[tuple(seq.token_ids[:seq.num_prompt_tokens])]
            n = seq.num_tokens
            drafts = full[n:n + min(self.k, span.limit)]
            seq.spec_token_ids = [(t + 1) % 256 if (n + j) % self.period == 0 else t
                                  for j, t in enumerate(drafts)]


@pytest.mark.parametrize("method", ["scripted", "ngram"])
def test_speculation_is_lossless_through_rollbacks(tmp_path, monkeypatch, method):
    """Greedy tokens and their log-probs under speculative decoding are transformers',
    through the ring-wrap test's chunked prefill (7 tokens a step), prefix reuse and
    preemption: a verification's drafts write the window ring (a draft takes the row of
    the key one window before it, which the steps after a rejection still read) and join
    the compressors' open sums, which a rejection must undo. Drafts: n-gram lookup (most
    rejected), or transformers' continuation made wrong every 5th position (most accepted,
    every rejection pattern). One thread, as the ring-wrap test: a rejection's recompute is
    another chunk split. Today's code without the rollback parts from transformers within
    a dozen tokens."""
    from archserve import LLM, SamplingParams
    from archserve.engine.runner_setup import build_speculator

    path = _checkpoint(tmp_path)
    k = 3
    config = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3,
              "prompt_lookup_min": 1}
    built = []
    scripted: dict[tuple[int, ...], list[int]] = {}

    def speculator(spec, max_model_len, runner=None):  # noqa: ANN001
        made = build_speculator(spec, max_model_len, runner)
        if method == "scripted":
            made.proposer = ScriptedDrafts(scripted, k)
        built.append(made)
        return made

    monkeypatch.setattr("archserve.engine.runner_setup.build_speculator", speculator)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if method == "scripted":
            plain = LLM(path, dtype="float32", block_size=8)
            params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
            prompts = [SHARED_PREFIX] + [SHARED_PREFIX + tail for tail in PREFIX_TAILS]
            for out in plain.generate(prompts, params):
                ids = list(out.prompt_token_ids)
                scripted[tuple(ids)] = ids + list(out.outputs[0].token_ids)
        assert_chunked_prefix_and_preemption_equal_hf(
            path, monkeypatch, max_num_batched_tokens=7, block_size=8, num_kv_blocks=14,
            warm_up=[SHARED_PREFIX], output_logprobs=True, speculative_config=config)
    finally:
        torch.set_num_threads(threads)
    [spec] = built
    stats = spec.stats
    rejected = stats.num_draft_tokens - stats.num_accepted_tokens
    assert stats.num_drafts > 20 and rejected > 10, stats.as_dict()
    if method == "scripted":
        assert stats.num_accepted_tokens > rejected, stats.as_dict()
        assert spec.proposer.block_pool.num_used_blocks == 0


CHILD = r"""
import json, sys
from archserve import LLM, SamplingParams
result = {}
for run, spec in (("plain", None), ("ngram", {"method": "ngram", "num_speculative_tokens": 3,
                                               "prompt_lookup_max": 3, "prompt_lookup_min": 1})):
    llm = LLM(sys.argv[1], attention_backend="TRITON_MLA_SPARSE_DSV4", dtype="float32",
              block_size=8, max_num_batched_tokens=12, enable_prefix_caching=True,
              speculative_config=spec)
    outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0.0, max_tokens=8,
                                                                ignore_eos=True))
    result[run] = [o.outputs[0].token_ids for o in outs]
    result["backend"] = llm.llm_engine.report.attention.name
    if spec is not None:
        result["stats"] = llm.llm_engine.speculator.stats.as_dict()
print(json.dumps(result))
"""


def test_triton_route_under_the_interpreter_matches_transformers(tmp_path):
    """TRITON_MLA_SPARSE_DSV4 serving the engine on CPU through Triton's interpreter (in a
    child process: it must be on before triton is imported): prompts sharing a prefix,
    prefilled 12 tokens a step, 8 greedy tokens each as transformers', and so with n-gram
    drafts (a rejected one's ring rows and compressor sums restored)."""
    import json
    import os
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = _checkpoint(tmp_path)
    prompts = [SHARED_PREFIX + "The capital of", SHARED_PREFIX + "1 2 3"]
    tok = AutoTokenizer.from_pretrained(path)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = []
    for prompt in prompts:
        ids = tok.encode(prompt)
        with torch.no_grad():
            seq = hf_model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                                    pad_token_id=0, eos_token_id=None)
        expected.append(seq[0, len(ids):].tolist())
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", CHILD, path, json.dumps(prompts)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["backend"] == "TRITON_MLA_SPARSE_DSV4"
    assert result["plain"] == expected and result["ngram"] == expected
    stats = result["stats"]
    assert stats["num_draft_tokens"] > stats["num_accepted_tokens"], stats


# ---------------------------------------------------------------- GPU (bf16, the Triton route)

# Head size 128 with 64 rope channels, hidden 256, 16 heads, window 32, rates 4 and 16 (the
# 16-token blocks hold whole groups), 16 indexer heads of 64, top-8.
GPU_V4 = dict(V4, hidden_size=256, moe_intermediate_size=128, intermediate_size=128,
              num_attention_heads=16,
              head_dim=128, partial_rotary_factor=0.5, q_lora_rank=96, o_lora_rank=64,
              o_groups=4, index_n_heads=16, index_head_dim=64, index_topk=8, sliding_window=32,
              compress_rates={CSA: 4, HCA: 16}, max_position_embeddings=1024)
GPU_ENGINE = dict(kv_cache_memory_bytes=1 << 28, max_num_seqs=8, self_check=False,
                  block_size=16)


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_gpu_bf16_engine_is_within_transformers_bf16_drift(tmp_path, enforce_eager):
    """The engine on the GPU in bf16 (TRITON_MLA_SPARSE_DSV4; decode in CUDA graphs unless
    eager; async scheduling; the hyper-connection and rope kernels) against transformers in
    fp32: the log-probs of the prompt and generated tokens drift from it no more than
    transformers' own bf16 run does (twice its mean)."""
    from archserve import LLM
    path = build_tiny_checkpoint(str(tmp_path), "deepseek_v4", init_model=init_v4_buffers,
                                 **GPU_V4)
    llm = LLM(path, dtype="bfloat16", device="cuda", enforce_eager=enforce_eager,
              **GPU_ENGINE)
    engine = llm.llm_engine
    routes = {r.layer: r.backend for r in engine.report.routes if r.op == "mla_attention"}
    assert set(routes.values()) == {"TRITON_MLA_SPARSE_DSV4"}, routes
    assert engine.report.attention.name == "TRITON_MLA_SPARSE_DSV4"
    assert bool(engine.report.graph_sizes) != enforce_eager, engine.report.graphs_off
    assert engine.report.canary and all("passed" in c for c in engine.report.canary), \
        engine.report.canary
    assert any(d.what == "scheduling" and d.chosen == "async" for d in engine.report.decisions)
    prompts = [p * 3 for p in TEXT_PROMPTS]       # past the window and top-8 of the entries
    outputs = llm.generate(prompts, bf16_greedy_params())
    del llm, engine
    ours, theirs = bf16_logprob_drift(path, outputs)
    print(f"mean |delta logprob| against fp32: archserve bf16 {ours:.4f}, transformers bf16 "
          f"{theirs:.4f}")
    assert ours <= max(2 * theirs, 0.02), (ours, theirs)


@pytest.mark.gpu
def test_gpu_speculation_rewinds_rejected_drafts(tmp_path):
    """n-gram drafts over V4 on the GPU (bf16, TRITON_MLA_SPARSE_DSV4, decode steps in CUDA
    graphs, verification and recompute steps eager): plain decoding's tokens up to bf16
    near-ties through the window ring's wraps, most drafts rejected (each restoring the
    sequence's ring rows and compressor sums), no block leaked."""
    from engine.test_spec_decode_gpu import GREEDY, PROMPTS, partings_beyond_near_ties

    from archserve import LLM
    path = build_tiny_checkpoint(str(tmp_path), "deepseek_v4", init_model=init_v4_buffers,
                                 **GPU_V4)
    plain = LLM(path, dtype="bfloat16", device="cuda", **GPU_ENGINE)
    want = plain.generate(PROMPTS, GREEDY)
    del plain
    torch.cuda.empty_cache()
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
            "prompt_lookup_min": 1}
    llm = LLM(path, dtype="bfloat16", device="cuda", speculative_config=spec, **GPU_ENGINE)
    engine = llm.llm_engine
    assert engine.report.attention.name == "TRITON_MLA_SPARSE_DSV4"
    got = llm.generate(PROMPTS, GREEDY)
    partings = partings_beyond_near_ties(got, want)
    assert not partings, "\n".join(partings)
    assert engine.block_pool.num_used_blocks == 0, engine.block_pool.num_used_blocks
    stats = engine.speculator.stats.as_dict()
    assert stats["num_drafts"] > 20, stats
    assert stats["num_draft_tokens"] > stats["num_accepted_tokens"], stats


@pytest.mark.gpu
def test_gpu_chunked_prefill_over_a_cached_prefix_matches_one_prefill(tmp_path):
    """Chunks of 16 tokens (4 and 1 compression groups, half the window's ring: chunk ends
    cross its wrap) over a cached prefix (the ring restored from its snapshot), beside
    decodes, against the engine without prefix caching or chunking."""
    path = build_tiny_checkpoint(str(tmp_path), "deepseek_v4", init_model=init_v4_buffers,
                                 **GPU_V4)
    assert_gpu_chunked_prefix_tracks_one_prefill(path, GPU_ENGINE)


def write_release_checkpoint(tmp_path, fp4_experts: bool, **config) -> tuple[str, str]:
    """(a tiny V4 in transformers' layout over the release's dequantized weights, the same
    model in DeepSeek's release layout: scripts/quant_fixtures/deepseek_v4_release.py)."""
    import os
    import sys

    from safetensors.torch import load_file, save_file

    scripts = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "quant_fixtures")
    sys.path.insert(0, scripts)
    try:
        import deepseek_v4_release
    finally:
        sys.path.remove(scripts)
    base = build_tiny_checkpoint(str(tmp_path / "base"), "deepseek_v4",
                                 init_model=init_v4_buffers, **config)
    release = deepseek_v4_release.write(base, str(tmp_path / "release"), fp4_experts)
    save_file(load_file(os.path.join(base, "dense.safetensors")),
              os.path.join(base, "model.safetensors"), metadata={"format": "pt"})
    return base, release


def assert_release_quantization(model, fp4_experts: bool) -> None:
    assert model.model.layers[1].self_attn.q_b_proj.quant is not None
    experts = model.model.layers[1].mlp.experts
    assert experts.checkpoint_quant.weight_format == ("mxfp4" if fp4_experts else "fp8_block")


@pytest.mark.parametrize("fp4_experts", [False, True], ids=["fp8", "fp4-experts"])
def test_release_checkpoint_matches_its_dequantized_weights(tmp_path, fp4_experts):
    """DeepSeek's release layout and FP8 (scripts/quant_fixtures/deepseek_v4_release.py):
    the attention's, the shared and routed experts' projections e4m3 with ue8m0 block
    scales named ``scale``; the compressors' projections, the router, the norms, the sinks
    and the hyper-connections 16-bit. Or, as V4 ships, the routed experts FP4
    (``expert_dtype: fp4``: e2m1 pairs a byte, a ue8m0 scale per 32 input channels), run
    as MXFP4 experts. With the activations' quantization off, archserve's prompt log-probs
    are transformers' over the dequantized weights (fp32)."""
    import os

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from archserve import LLM

    # Block-FP8 activations are quantized per 128 input channels: every GEMM's input a
    # multiple of 128.
    widths = dict(hidden_size=128, q_lora_rank=128, moe_intermediate_size=128,
                  intermediate_size=128, o_lora_rank=64,
                  head_dim=64, partial_rotary_factor=0.25, index_head_dim=32)
    base, release = write_release_checkpoint(tmp_path, fp4_experts, **{**V4, **widths})
    state = load_file(os.path.join(release, "model.safetensors"))
    assert state["layers.1.attn.wq_b.scale"].dtype == torch.float8_e8m0fnu
    expert = state["layers.1.ffn.experts.0.w1.weight"]
    assert expert.dtype == (torch.int8 if fp4_experts else torch.float8_e4m3fn)
    assert state["layers.1.attn.compressor.wkv.weight"].dtype != torch.float8_e4m3fn
    hf_model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()

    llm = LLM(release, dtype="float32", max_model_len=128, block_size=8)
    model = llm.llm_engine.model
    assert_release_quantization(model, fp4_experts)
    without_activation_quantization(model)
    gaps = prompt_logprob_gaps(hf_model, llm, [{"prompt_token_ids": list(range(5, 45))}])
    assert max(gaps) < ATOL


@pytest.mark.gpu
@pytest.mark.parametrize("fp4_experts", [False, True], ids=["fp8", "fp4-experts"])
def test_gpu_release_checkpoint_runs_its_triton_routes_in_graphs(tmp_path, fp4_experts):
    """The release checkpoint on the GPU as it is served: bf16, block-FP8 GEMMs with their
    activations quantized per 128 channels, the FP8 or MXFP4 experts (the clamped SwiGLU
    and their biases) in TRITON_FUSED_MOE, TRITON_MLA_SPARSE_DSV4, decode in CUDA graphs.
    Against transformers in fp32 over the dequantized weights its log-probs drift by the
    activations' e4m3 rounding on top of bf16's: at most 0.15 on average (measured 0.086
    with FP4 experts on an H100, transformers' own bf16 run 0.019); a wrong scale or
    expert moves them by whole units."""
    from archserve import LLM

    base, release = write_release_checkpoint(tmp_path, fp4_experts,
                                             **{**GPU_V4, "q_lora_rank": 128})
    llm = LLM(release, dtype="bfloat16", device="cuda", **GPU_ENGINE)
    engine = llm.llm_engine
    assert_release_quantization(engine.model, fp4_experts)
    routes = {r.layer: r.backend for r in engine.report.routes}
    assert routes["moe experts"] == "TRITON_FUSED_MOE", routes
    assert engine.report.attention.name == "TRITON_MLA_SPARSE_DSV4"
    assert engine.report.graph_sizes, engine.report.graphs_off
    outputs = llm.generate([p * 3 for p in TEXT_PROMPTS], bf16_greedy_params())
    del llm, engine
    ours, theirs = bf16_logprob_drift(base, outputs)
    print(f"mean |delta logprob| against fp32: archserve {ours:.4f}, transformers bf16 "
          f"{theirs:.4f}")
    assert ours <= 0.15, (ours, theirs)
