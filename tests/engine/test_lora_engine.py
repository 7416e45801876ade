"""LoRA adapters through the whole engine against transformers + peft (fp32, CPU).

Adapters made by peft with random weights, of several ranks and target modules (all seven
linears, q/v only, rsLoRA on o/gate/down, rank and alpha patterns): greedy tokens equal
for 24 tokens and top-5 log-probs within 1e-4; a batch that mixes four adapters and the
base model gives every row what it gets alone; adapters never share prefix-cache blocks;
fewer slots (max_loras) or host copies (max_cpu_loras) than adapters changes nothing but
the copying; a bad adapter is a ValueError that leaves the engine serving.
"""

from __future__ import annotations

import os

import pytest
import torch
from lora_adapters import (
    ALL_LINEARS,
    greedy_reference,
    lora_pair,
    peft_model,
    save_peft_adapter,
    write_adapter,
)

from archserve import LLM, LoRARequest, SamplingParams

PROMPTS = ["Hello world! How are you", "The capital of France is Paris. The capital of",
           "1 2 3 4 5 6 7"]
NUM_TOKENS = 24
ADAPTERS = {
    "all_r8": dict(target_modules=ALL_LINEARS, r=8, lora_alpha=16, seed=1),
    "qv_r4": dict(target_modules=["q_proj", "v_proj"], r=4, lora_alpha=8, seed=2),
    "rslora_r16": dict(target_modules=["o_proj", "gate_proj", "down_proj"], r=16,
                       lora_alpha=8, use_rslora=True, seed=3),
    "patterns": dict(target_modules=ALL_LINEARS, r=8, lora_alpha=16, seed=4,
                     rank_pattern={"q_proj": 4}, alpha_pattern={"down_proj": 32}),
}


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint, tmp_path_factory) -> dict[str, LoRARequest]:
    base = tiny_checkpoint("llama")
    root = tmp_path_factory.mktemp("adapters")
    return {name: LoRARequest(name, i + 1, save_peft_adapter(base, str(root / name), **kw))
            for i, (name, kw) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def llm(tiny_checkpoint) -> LLM:
    # float32: compared with transformers + peft in float32, and with engines of other
    # batch shapes (bfloat16's rounding moves with the rows a step holds)
    return LLM(tiny_checkpoint("llama"), enable_lora=True, max_loras=4, max_lora_rank=16,
               max_cpu_loras=4, dtype="float32")


def greedy(logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True,
                          logprobs=logprobs)


def assert_matches_peft(outputs, model, tokenizer) -> None:
    for out in outputs:
        tokens, logprobs = greedy_reference(model, tokenizer.encode(out.prompt), NUM_TOKENS)
        completion = out.outputs[0]
        assert completion.token_ids == tokens, out.prompt
        for step, entry in enumerate(completion.logprobs):
            top5 = torch.topk(logprobs[step], 5)
            for value, token in zip(top5.values.tolist(), top5.indices.tolist(), strict=True):
                assert token in entry, f"step {step}: top-5 token {token} missing"
                assert abs(entry[token].logprob - value) < 1e-4


def adapters_per_step(llm: LLM, monkeypatch) -> list[int]:
    """The number of distinct adapters of every step ``llm`` runs from now on (filled as
    the steps run)."""
    step = llm.llm_engine.runner.lora
    counts: list[int] = []
    pack = step.pack

    def counting_pack(seqs, num_tokens):
        counts.append(len({s.lora.id for s in seqs if s.lora is not None}))
        return pack(seqs, num_tokens)

    monkeypatch.setattr(step, "pack", counting_pack)
    return counts


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_greedy_and_logprobs_match_transformers_peft(llm, adapters, tiny_checkpoint, name):
    outputs = llm.generate(PROMPTS, greedy(logprobs=5), lora_request=adapters[name])
    assert all(out.lora_request is adapters[name] for out in outputs)
    reference = peft_model(tiny_checkpoint("llama"), adapters[name].lora_path)
    assert_matches_peft(outputs, reference, llm.get_tokenizer())
    base = llm.generate(PROMPTS[:1], greedy())[0].outputs[0].token_ids
    assert outputs[0].outputs[0].token_ids != base     # the adapter changes the model


def test_a_batch_mixing_four_adapters_and_the_base_gives_each_row_its_own_tokens(
        llm, adapters, monkeypatch):
    choices = [*adapters.values(), None]
    alone = {(p, None if a is None else a.lora_name):
             llm.generate([p], greedy(), lora_request=a)[0].outputs[0].token_ids
             for p in PROMPTS for a in choices}
    most = adapters_per_step(llm, monkeypatch)
    prompts = [p for p in PROMPTS for _ in choices]
    requests = [a for _ in PROMPTS for a in choices]
    outputs = llm.generate(prompts, greedy(), lora_request=requests)
    assert max(most) == 4                      # the four adapters ran in the same steps
    for out, request in zip(outputs, requests, strict=True):
        key = (out.prompt, None if request is None else request.lora_name)
        assert out.outputs[0].token_ids == alone[key], key
    assert len({tuple(alone[PROMPTS[1], a and a.lora_name]) for a in choices}) == 5


@pytest.mark.parametrize("options", [
    dict(max_num_batched_tokens=7),                                   # chunked prefill
    dict(num_kv_blocks=24, block_size=4, max_model_len=64),           # preemption
    dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                             "prompt_lookup_max": 2, "prompt_lookup_min": 1}),
], ids=["chunked-7", "tiny-pool", "ngram-drafts"])
def test_batching_features_do_not_change_adapter_outputs(llm, adapters, tiny_checkpoint,
                                                         options):
    """Chunks of a prompt, recomputation after preemption and verified draft tokens run
    with their sequence's adapter: the tokens of a mixed batch stay the same."""
    requests = [adapters["all_r8"], adapters["rslora_r16"], None]
    prompts = [p for p in PROMPTS[1:] for _ in requests]
    requests = requests * len(PROMPTS[1:])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                             lora_request=requests)]
    other = LLM(tiny_checkpoint("llama"), enable_lora=True, max_loras=2, max_lora_rank=16,
                dtype="float32", **options)
    got = [o.outputs[0].token_ids for o in other.generate(prompts, params,
                                                          lora_request=requests)]
    assert got == expected
    assert other.llm_engine.block_pool.num_used_blocks == 0


def test_prefix_cache_blocks_are_never_shared_across_adapters(llm, adapters):
    prompt = "A paged KV cache stores keys and values in fixed-size blocks. " * 3
    params = SamplingParams(temperature=0.0, max_tokens=2)
    first = llm.generate([prompt], params, lora_request=adapters["all_r8"])[0]
    again = llm.generate([prompt], params, lora_request=adapters["all_r8"])[0]
    other = llm.generate([prompt], params, lora_request=adapters["qv_r4"])[0]
    base = llm.generate([prompt], params)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0
    assert other.num_cached_tokens == 0
    assert base.num_cached_tokens == 0


def test_fewer_slots_and_host_copies_than_adapters(tiny_checkpoint, adapters, llm, monkeypatch):
    """Two slots for four adapters: the scheduler runs at most two at once, slots are
    refilled as requests finish; one host copy: adapters are read again as they return."""
    expected = {a.lora_name: llm.generate(PROMPTS[:2], greedy(), lora_request=a)
                for a in adapters.values()}
    small = LLM(tiny_checkpoint("llama"), enable_lora=True, max_loras=2, max_lora_rank=16,
                max_cpu_loras=2, dtype="float32")
    seen = adapters_per_step(small, monkeypatch)
    requests = [a for a in adapters.values() for _ in PROMPTS[:2]]
    outputs = small.generate(PROMPTS[:2] * 4, greedy(), lora_request=requests)
    assert max(seen) == 2
    assert small.llm_engine.lora.slot_loads >= 4
    assert len(small.llm_engine.lora.list_ids()) <= 2
    for out, request in zip(outputs, requests, strict=True):
        want = next(e for e in expected[request.lora_name] if e.prompt == out.prompt)
        assert out.outputs[0].token_ids == want.outputs[0].token_ids


def test_bad_adapters_are_clear_errors_and_the_engine_keeps_serving(llm, adapters, tmp_path,
                                                                  tiny_checkpoint):
    base = tiny_checkpoint("llama")
    q = "model.layers.0.self_attn.q_proj"
    cases = {
        "no such directory": str(tmp_path / "missing"),
        "LoRA rank 32 is greater than max_lora_rank 16": save_peft_adapter(
            base, str(tmp_path / "r32"), ["q_proj"], r=32),
        "DoRA": save_peft_adapter(base, str(tmp_path / "dora"), ["q_proj"], use_dora=True),
        "modules_to_save": save_peft_adapter(base, str(tmp_path / "save"), ["q_proj"],
                                             modules_to_save=["lm_head"]),
        "no adapter_config.json": write_adapter(tmp_path / "noconfig", lora_pair(q, 4, 64, 64)),
        "do not fit this model's layer": write_adapter(
            tmp_path / "shape", lora_pair(q, 4, 32, 64), {}),
        "no such linear layer in this model": write_adapter(
            tmp_path / "unknown", lora_pair("model.layers.0.self_attn.x_proj", 4, 64, 64), {}),
        "has no lora_B matrix": write_adapter(
            tmp_path / "half", dict(list(lora_pair(q, 4, 64, 64).items())[:1]), {}),
        "not a LoRA matrix": write_adapter(
            tmp_path / "embedding", {"base_model.model.model.embed_tokens.lora_embedding_A":
                                     torch.zeros(4, 384)}, {}),
    }
    for i, (message, path) in enumerate(cases.items()):
        with pytest.raises(ValueError, match=message):
            llm.generate(PROMPTS[:1], greedy(), lora_request=LoRARequest(f"bad{i}", 100 + i, path))
        with pytest.raises(ValueError, match=message):
            llm.llm_engine.add_lora(LoRARequest(f"bad{i}", 100 + i, path))
    with pytest.raises(ValueError, match="already loaded from"):
        llm.generate(PROMPTS[:1], greedy(), lora_request=LoRARequest(
            "other", adapters["all_r8"].lora_int_id, adapters["qv_r4"].lora_path))
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate(PROMPTS[:1], greedy(), lora_request=adapters["qv_r4"])[0]
    assert len(out.outputs[0].token_ids) == NUM_TOKENS


def test_lora_requests_need_enable_lora(tiny_checkpoint, adapters):
    llm = LLM(tiny_checkpoint("llama"))
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.generate(PROMPTS[:1], greedy(), lora_request=adapters["all_r8"])
    assert llm.llm_engine.runner.lora is None


def test_lora_config_is_checked():
    from archserve.engine.config import EngineConfig
    for fields, message in ((dict(max_lora_rank=12), "max_lora_rank must be one of"),
                            (dict(max_loras=0), "max_loras must be >= 1"),
                            (dict(max_loras=4, max_cpu_loras=2), "must be >= max_loras"),
                            (dict(tensor_parallel_size=2), "tensor_parallel_size > 1")):
        with pytest.raises(ValueError, match=message):
            EngineConfig(enable_lora=True, **fields).validate()


_TRITON_RUN = """
import json, sys
from archserve import LLM, LoRARequest, SamplingParams
base, requests, prompts = json.loads(sys.argv[1])
llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=16, device="cpu")
route = [r.backend for r in llm.llm_engine.report.routes if r.op == "lora"]
requests = [None if r is None else LoRARequest(*r) for r in requests]
outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                    lora_request=requests)
print(json.dumps([route, [o.outputs[0].token_ids for o in outs]]))
"""


def test_the_triton_kernels_serve_the_engine_under_the_interpreter(llm, adapters):
    """TRITON_LORA forced, on CPU through Triton's interpreter: a step mixing two adapters
    and the base model gives the torch path's tokens (the engine's own mapping buffer,
    strides and slots, not a kernel test's)."""
    import json
    import subprocess
    import sys
    pytest.importorskip("triton")
    picked = [adapters["all_r8"], adapters["qv_r4"], None]
    prompts = [PROMPTS[1]] * len(picked)
    requests = picked
    expected = [o.outputs[0].token_ids for o in llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
        lora_request=requests)]
    args = [llm.llm_engine.config.model,
            [None if a is None else [a.lora_name, a.lora_int_id, a.lora_path] for a in requests],
            prompts]
    env = {**os.environ, "TRITON_INTERPRET": "1", "ARCHSERVE_LORA_BACKEND": "TRITON_LORA"}
    result = subprocess.run([sys.executable, "-c", _TRITON_RUN, json.dumps(args)], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    route, tokens = json.loads(result.stdout.strip().splitlines()[-1])
    assert route == ["TRITON_LORA"]
    assert tokens == expected and len({tuple(t) for t in tokens}) == 3
