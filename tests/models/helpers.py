"""Test helpers: tiny HF checkpoints, a hand-built paged KV cache, model stepping, and
comparisons of whole-engine outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from archserve.engine.block_pool import token_slot
from archserve.engine.kv_cache import cache_row_format, kv_dtype_of, model_kv_caches, ring_rows
from archserve.kernels.attention.interface import AttentionMetadata
from archserve.kernels.attention.reference import ReferenceAttentionImpl
from archserve.kernels.mla.torch_mla import TorchMlaImpl
from archserve.kernels.sparse_mla.layout import SparseMlaLayout
from archserve.models.layers.forward_context import ForwardContext, set_forward_context

TINY = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=96, vocab_size=256, max_position_embeddings=64)


def tiny_hf_model(model_type: str, seed: int = 0, random_buffers: tuple[str, ...] = (),
                  **overrides):
    """A random HF causal LM of ``model_type`` with every weight (biases, norms) non-trivial,
    and the buffers named by ``random_buffers`` (name endings) too."""
    from tiny_checkpoints import randomize_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **{**TINY, **overrides})
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config).eval()
    randomize_weights(model, random_buffers)
    return model


def attention_impl_for(config, dtype: torch.dtype = torch.float32, kv_cache_dtype: str = "auto",
                       index_cache_dtype: str = "auto"):
    """The plain-PyTorch attention of the model's kind (MLA, sparse MLA, DeepSeek V4's or
    standard)."""
    mla, sparse = getattr(config, "mla", None), getattr(config, "sparse_attention", None)
    if getattr(config, "compressed_attention", None) is not None:
        return TorchMlaImpl()       # DeepSeek V4: forward_compressed
    if mla is None:
        return ReferenceAttentionImpl()
    if sparse is None:
        return TorchMlaImpl()
    return TorchMlaImpl(layout=SparseMlaLayout.for_cache(
        mla.kv_lora_rank, mla.qk_rope_head_dim, sparse.index_head_dim, dtype, kv_cache_dtype,
        index_cache_dtype))


# Token-id prompts for model-level comparisons, text prompts for the engine's.
PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 8, 9], [200, 1, 2], [33, 34, 35, 36, 37, 38]]
TEXT_PROMPTS = ["Hello world! How are you", "The capital of France is Paris. The capital of",
                "1 2 3", "A paged KV cache stores keys and values in fixed-size blocks."]


def saved_and_loaded(hf_model, path):
    """Save ``hf_model`` under ``path`` and load it back as archserve's fp32 CPU model:
    (hf_model, model, config)."""
    from archserve.loader.loader import load_model

    hf_model.save_pretrained(path)
    model, config = load_model(str(path), dtype=torch.float32, device="cpu")
    return hf_model, model, config


def assert_dummy_weights_run(hf_model, path, prompt: list[int] | None = None, **cache):
    """``hf_model``'s checkpoint under ``path`` loaded with dummy weights in bfloat16
    (load_format="dummy"), then a prefill of ``prompt`` (PROMPTS[0]) through the paged cache
    (``cache``: PagedSequences.for_config's sizes) gives finite logits. Returns the model."""
    from archserve.loader.loader import load_model

    hf_model.save_pretrained(path)
    model, config = load_model(str(path), torch.bfloat16, load_format="dummy")
    logits = PagedSequences.for_config(config, dtype=torch.bfloat16, **cache).run(
        model, {0: PROMPTS[0] if prompt is None else prompt})
    assert torch.isfinite(logits).all()
    return model


def variant_pair(variants: dict, name: str, sizes: dict, path, **kwargs) -> tuple:
    """(name, hf_model, model, config) of ``variants[name]``, a (model_type, overrides)
    pair: its tiny model over ``sizes`` (``kwargs``: more of tiny_hf_model's arguments)
    saved under ``path`` and loaded back (``saved_and_loaded``)."""
    model_type, overrides = variants[name]
    return name, *saved_and_loaded(tiny_hf_model(model_type, **kwargs, **{**sizes, **overrides}),
                                   path)


MAX_SEQUENCES = 16      # sequence ids of a PagedSequences (a window ring each, where kept)


@dataclass
class PagedSequences:
    """A minimal block allocator: enough of the engine to drive a model by hand."""

    kv_caches: list[torch.Tensor]
    block_size: int
    attn_impl: object = field(default_factory=ReferenceAttentionImpl)
    kv_cache_dtype: str = "auto"           # fp8_e4m3 / fp8_e5m2 with caches of that dtype
    next_block: int = 0
    blocks: dict[int, list[int]] = field(default_factory=dict)
    lengths: dict[int, int] = field(default_factory=dict)
    ring_rows: int = 0                     # DeepSeek V4: sequence i's window keys in ring i

    @classmethod
    def for_config(cls, config, num_blocks: int = 64, block_size: int | None = None,
                   dtype: torch.dtype = torch.float32, kv_cache_dtype: str = "auto",
                   index_cache_dtype: str = "auto") -> PagedSequences:
        """``block_size`` None: 4 tokens, or a DeepSeek V4 model's largest compress rate (a
        group must not straddle blocks)."""
        compressed = getattr(config, "compressed_attention", None)
        if block_size is None:
            block_size = max(compressed.compress_rates.values()) if compressed else 4
        impl = attention_impl_for(config, dtype, kv_cache_dtype, index_cache_dtype)
        row_dtype, head_size = cache_row_format(config, impl, kv_dtype_of(kv_cache_dtype, dtype))
        caches = model_kv_caches(config, num_blocks, block_size, row_dtype,
                                 torch.device("cpu"), head_size, num_rings=MAX_SEQUENCES)
        return cls(caches, block_size, impl, kv_cache_dtype, ring_rows=ring_rows(config))

    def _slot(self, seq: int, position: int) -> int:
        table = self.blocks.setdefault(seq, [])
        while len(table) * self.block_size <= position:
            table.append(self.next_block)
            self.next_block += 1
        assert seq < MAX_SEQUENCES
        return token_slot(table, (seq * self.ring_rows, self.ring_rows) if self.ring_rows
                          else None, self.block_size, position)

    def step(self, new_tokens: dict[int, list[int]]
             ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Schedule ``new_tokens`` per sequence id; -> ids, positions, metadata, last rows."""
        ids, positions, slots, starts, seq_lens, query_lens, last_rows = [], [], [], [0], [], [], []
        for seq, tokens in new_tokens.items():
            start = self.lengths.get(seq, 0)
            for offset, token in enumerate(tokens):
                ids.append(token)
                positions.append(start + offset)
                slots.append(self._slot(seq, start + offset))
            self.lengths[seq] = start + len(tokens)
            starts.append(starts[-1] + len(tokens))
            seq_lens.append(self.lengths[seq])
            query_lens.append(len(tokens))
            last_rows.append(starts[-1] - 1)
        width = max(len(self.blocks[s]) for s in new_tokens)
        tables = [self.blocks[s] + [0] * (width - len(self.blocks[s])) for s in new_tokens]
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            max_query_len=max(query_lens), max_seq_len=max(seq_lens),
            num_seqs=len(new_tokens), query_lens_cpu=query_lens, seq_lens_cpu=seq_lens)
        return (torch.tensor(ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long),
                meta, last_rows)

    def run(self, model, new_tokens: dict[int, list[int]], calibrate_kv_scales: bool = False
            ) -> torch.Tensor:
        """One model step; float32 logits [num_seqs, vocab] at each sequence's last token."""
        ids, positions, meta, last_rows = self.step(new_tokens)
        ctx = ForwardContext(attn_metadata=meta, kv_caches=self.kv_caches,
                             attn_impl=self.attn_impl, kv_cache_dtype=self.kv_cache_dtype,
                             calibrate_kv_scales=calibrate_kv_scales)
        with set_forward_context(ctx):
            hidden = model(ids, positions)
        return model.compute_logits(hidden[last_rows])


def hf_last_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0, -1].float()


def assert_prompt_positions_match_hf(model, hf_model, config, prompt: list[int],
                                     tol: float = 1e-4) -> None:
    """The logits of every position of one prompt (a single prefill) equal transformers'."""
    cache = PagedSequences.for_config(config)
    ids, positions, meta, _ = cache.step({0: prompt})
    with set_forward_context(ForwardContext(meta, cache.kv_caches, cache.attn_impl)):
        logits = model.compute_logits(model(ids, positions))
    with torch.no_grad():
        expected = hf_model(ids[None]).logits[0]
    torch.testing.assert_close(logits, expected, atol=tol, rtol=tol)


def assert_prefill_then_decode_match_hf(model, hf_model, config, prompts: list[list[int]],
                                        tol: float = 1e-4) -> None:
    """A batched prefill of ``prompts``, then one decode step of each greedy next token:
    the last logits of each sequence equal transformers' on the same tokens."""
    cache = PagedSequences.for_config(config)
    prefill = cache.run(model, dict(enumerate(prompts)))
    for i, prompt in enumerate(prompts):
        torch.testing.assert_close(prefill[i], hf_last_logits(hf_model, prompt),
                                   atol=tol, rtol=tol)
    next_tokens = {i: [int(prefill[i].argmax())] for i in range(len(prompts))}
    decode = cache.run(model, next_tokens)
    for i, prompt in enumerate(prompts):
        torch.testing.assert_close(decode[i], hf_last_logits(hf_model, prompt + next_tokens[i]),
                                   atol=tol, rtol=tol)


def assert_llm_greedy_and_prompt_logprobs_equal_hf(path: str, prompts: list[str],
                                                  num_tokens: int = 32, tol: float = 1e-4,
                                                  prompt_logprobs: bool = True,
                                                  hf_kwargs: dict | None = None,
                                                  warm_up: list[str] = (),
                                                  output_logprobs: bool = False,
                                                  **llm_kwargs) -> list:
    """The whole engine (archserve.LLM, fp32) against transformers from the same checkpoint
    (``hf_kwargs``: more arguments of its ``from_pretrained``): token-identical greedy
    output and prompt log-probabilities within ``tol`` (unless ``prompt_logprobs`` is off:
    a request asking for them computes its whole prompt, never reading the prefix cache),
    with ``output_logprobs`` the generated tokens' too. ``warm_up``: prompts the engine
    generates first (their prefixes cached). Returns the engine's outputs."""
    from transformers import AutoModelForCausalLM

    from archserve import LLM, SamplingParams

    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                    **(hf_kwargs or {})).eval()
    hf_model.generation_config.eos_token_id = None
    llm = LLM(path, dtype="float32", **{"max_num_seqs": 4, **llm_kwargs})
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True,
                            prompt_logprobs=1 if prompt_logprobs else None,
                            logprobs=1 if output_logprobs else None)
    seen: set[int] = set()
    if warm_up:
        llm.generate(list(warm_up), params)
    outputs = llm.generate(prompts, params)
    for out in outputs:
        ids = out.prompt_token_ids
        with torch.no_grad():
            expected = hf_model.generate(torch.tensor([ids]), max_new_tokens=num_tokens,
                                         do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
            scored = ids + expected if output_logprobs else ids
            ref = torch.log_softmax(hf_model(torch.tensor([scored])).logits[0].float(), -1)
        assert list(out.outputs[0].token_ids) == expected, out.prompt
        seen.update(expected)
        for i, token in enumerate(expected if output_logprobs else ()):
            got = out.outputs[0].logprobs[i][token].logprob
            assert abs(got - ref[len(ids) - 1 + i, token].item()) < tol
        for pos in range(1, len(ids) if prompt_logprobs else 0):
            got = out.prompt_logprobs[pos][ids[pos]].logprob
            assert abs(got - ref[pos - 1, ids[pos]].item()) < tol
    assert len(seen) > 6      # real sequences, not one token repeated everywhere
    return outputs


def assert_greedy_outputs_track(got: list, want: list, min_agreeing: int = 4,
                                logprob_tol: float | None = 0.05,
                                near_tie: float | None = None) -> None:
    """Greedy ``got`` (e.g. a float16 GPU run) follows ``want`` (the float32 CPU run of the
    same prompts): each pair of completions agrees on at least its first ``min_agreeing``
    tokens (after that a near-tie may flip), and up to where they part the chosen tokens'
    log-probs are within ``logprob_tol`` (None: not compared). With ``near_tie``, where
    they part ``got``'s token is among ``want``'s top log-probs there, at most ``near_tie``
    below ``want``'s own: runs that sum in other orders part only at near-ties. Both runs
    asked for ``logprobs`` (a few, for ``near_tie``: ``got``'s token must be listed)."""
    for g, w in zip(got, want, strict=True):
        ours, theirs = g.outputs[0], w.outputs[0]
        n = next((i for i, (a, b) in enumerate(zip(ours.token_ids, theirs.token_ids,
                                                  strict=True)) if a != b), len(ours.token_ids))
        assert n >= min_agreeing, (ours.token_ids, theirs.token_ids)
        if near_tie is not None and n < len(ours.token_ids):
            step, chosen, other = theirs.logprobs[n], theirs.token_ids[n], ours.token_ids[n]
            assert other in step and step[chosen].logprob - step[other].logprob < near_tie, \
                (n, ours.token_ids, theirs.token_ids, step)
        for i in range(n if logprob_tol is not None else 0):
            a = ours.logprobs[i][ours.token_ids[i]].logprob
            b = theirs.logprobs[i][theirs.token_ids[i]].logprob
            assert abs(a - b) < logprob_tol


# Prompts that share a cached prefix, for the engine's harder paths.
SHARED_PREFIX = "A paged KV cache stores keys and values in fixed-size blocks. "
PREFIX_TAILS = ("The capital of", "1 2 3", "Hello world")


def assert_chunked_prefix_and_preemption_equal_hf(path: str, monkeypatch, num_tokens: int = 32,
                                                  hf_kwargs: dict | None = None,
                                                  min_cached_tokens: int = 8,
                                                  **engine) -> list:
    """The engine's harder paths on CPU in fp32 against transformers (``hf_kwargs``: more
    arguments of its ``from_pretrained``): prompts sharing a cached prefix, prefills
    chunked over several steps (8-token budget), and a pool too small for every sequence at
    once, so some are preempted and recomputed (both asserted to happen; a prefix hit of
    ``min_cached_tokens`` at least). ``engine``: other sizes (DeepSeek V4's blocks hold
    whole compression groups)."""
    from archserve.engine.scheduler import Scheduler

    prompts = [SHARED_PREFIX + tail for tail in PREFIX_TAILS]
    preempted = []
    original = Scheduler._preempt

    def counting(self, seq, *args):
        preempted.append(seq.seq_id)
        return original(self, seq, *args)

    monkeypatch.setattr(Scheduler, "_preempt", counting)
    outputs = assert_llm_greedy_and_prompt_logprobs_equal_hf(
        path, prompts, num_tokens, prompt_logprobs=False, hf_kwargs=hf_kwargs,
        enable_prefix_caching=True, enable_chunked_prefill=True,
        **{"max_num_batched_tokens": 8, "block_size": 4, "num_kv_blocks": 24,
           "max_model_len": 80, **engine})
    assert preempted, "the pool was large enough for every sequence: nothing was preempted"
    assert max(out.num_cached_tokens for out in outputs) >= min_cached_tokens
    return outputs


def assert_gpu_chunked_prefix_tracks_one_prefill(path: str, engine: dict,
                                                 min_cached_tokens: int = 16) -> None:
    """On the GPU in bf16: prompts sharing a cached prefix, chunked 16 tokens a step beside
    decodes, give the greedy tokens of the engine without prefix caching or chunking, up
    to a near-tie. Chunks sum in another order: a continuation may part from the plain
    engine's where bf16 holds a near-tie (these prompts' greedy steps hold an exact one,
    and 1-ulp ones, measured on the CPU). 0.2, not the dense tests' 0.1: a routing
    near-tie swapped in a prompt moves the later log-probs; the stray logprobs are why they
    are not compared either."""
    from archserve import LLM, SamplingParams

    prompts = [SHARED_PREFIX * 3 + tail for tail in PREFIX_TAILS]
    # 20 log-probs (the most a request may ask): these random models' distributions are
    # flat (five tokens within 0.2 at a step), so a near-tie's other side may rank past
    # fifth.
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=20)
    plain = LLM(path, dtype="bfloat16", device="cuda", enable_prefix_caching=False,
                enable_chunked_prefill=False, **engine)
    expected = plain.generate(prompts, params)
    del plain
    torch.cuda.empty_cache()
    llm = LLM(path, dtype="bfloat16", device="cuda", enable_prefix_caching=True,
              enable_chunked_prefill=True, max_num_batched_tokens=16, **engine)
    llm.generate(prompts[:1], params)            # the shared prefix is cached
    outputs = llm.generate(prompts, params)
    assert max(o.num_cached_tokens for o in outputs) >= min_cached_tokens
    assert_greedy_outputs_track(outputs, expected, min_agreeing=0, logprob_tol=None,
                                near_tie=0.2)


def bf16_greedy_params():
    """16 greedy tokens with their log-probs and the prompt's (the GPU tests' drift)."""
    from archserve import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1,
                          prompt_logprobs=1)


def engine_logprobs(out) -> tuple[list[int], list[float]]:
    """(the prompt and generated ids, the engine's log-prob of each after the first)."""
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    n = len(out.prompt_token_ids)
    got = [out.prompt_logprobs[p][ids[p]].logprob for p in range(1, n)]
    got += [step[ids[n + i]].logprob for i, step in enumerate(out.outputs[0].logprobs)]
    return ids, got


def model_logprobs(model, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=model.device)).logits[0].float()
    ref = torch.log_softmax(logits, -1)
    return [ref[p - 1, ids[p]].item() for p in range(1, len(ids))]


def bf16_logprob_drift(path: str, outputs, **hf_kwargs) -> tuple[float, float]:
    """(mean |ours - transformers fp32|, mean |transformers bf16 - transformers fp32|) of
    the log-probs of the engine's prompt and generated tokens: our drift beside
    transformers' own bf16 drift on the same tokens (``hf_kwargs`` to from_pretrained)."""
    from transformers import AutoModelForCausalLM

    ours, theirs = [], []
    models = {dtype: AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **hf_kwargs).cuda().eval()
              for dtype in (torch.float32, torch.bfloat16)}
    for out in outputs:
        ids, got = engine_logprobs(out)
        exact = model_logprobs(models[torch.float32], ids)
        rounded = model_logprobs(models[torch.bfloat16], ids)
        ours += [abs(a - b) for a, b in zip(got, exact, strict=True)]
        theirs += [abs(a - b) for a, b in zip(rounded, exact, strict=True)]
    del models
    torch.cuda.empty_cache()
    return sum(ours) / len(ours), sum(theirs) / len(theirs)


def assert_greedy_agrees_with_hf(hf_model, prompt_ids: list[int], ours: list[int],
                                 near_tie: float) -> None:
    """Ours is transformers' argmax at every step, up to a near-tie (GPU kernels sum in
    other orders; where the top two are within ``near_tie`` the continuations may part)."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for step, token in enumerate(ours):
            logits = hf_model(torch.tensor([ids])).logits[0, -1].float()
            best = int(logits.argmax())
            if token != best:
                margin = float(logits[best] - logits[token])
                assert margin < near_tie, f"step {step}: ours {token}, transformers {best}"
                return
            ids.append(token)


def prompt_logprob_gaps(hf_model, llm, prompts: list) -> list[float]:
    """|ours - transformers'| of every prompt token's log-probability after the first (the
    engine's prompt_logprobs against ``hf_model``'s log-softmax, on the model's device).
    ``prompts``: texts or ``{"prompt_token_ids": ...}`` dicts, as ``LLM.generate`` takes."""
    from archserve import SamplingParams

    device = next(hf_model.parameters()).device
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    gaps = []
    for out in llm.generate(prompts, params):
        ids = out.prompt_token_ids
        with torch.no_grad():
            ref = torch.log_softmax(hf_model(torch.tensor([ids], device=device)).logits[0]
                                    .float(), -1)
        gaps += [abs(out.prompt_logprobs[p][ids[p]].logprob - ref[p - 1, ids[p]].item())
                 for p in range(1, len(ids))]
    return gaps


def without_activation_quantization(model) -> None:
    """Turns off the activation quantization of every quantized linear's and MoE layer's
    prepared weights: block-FP8 references (transformers' dequantizing loaders) are
    weight-only, so only then are the engine's logits theirs."""
    from archserve.models.layers.moe import FusedMoE
    from archserve.quant.linear_state import quantized_layers

    for _name, state in quantized_layers(model):
        state.prepared.activation = "none"
    for moe in (m for m in model.modules() if isinstance(m, FusedMoE)):
        moe.impl()                          # prepares TORCH_MOE's dequantized experts
        for weight in moe._operands:
            weight.activation = "none"
