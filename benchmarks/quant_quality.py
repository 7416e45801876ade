"""Quantized checkpoints of a real model, end to end on CPU: SmolLM2-135M-Instruct quantized by
the real tools, run by archserve, compared with the tools' own forward and with the dense model.

The dense model is the embedded GGUF (`archserve.loader.default_model`, Q4_1) dequantized by
transformers' GGUF code and saved as a bf16 Hugging Face checkpoint; every quantized variant
is made from that checkpoint. Four steps, each in the interpreter that has its tool (the venvs
are the ones of scripts/quant_fixtures/make_all.sh), all sharing one work directory:

    W=/tmp/archserve_quant_quality
    python3 benchmarks/quant_quality.py dense $W                         # main interpreter
    /work/venvs/llmc/bin/python benchmarks/quant_quality.py llmc $W      # llm-compressor
    GPTQMODEL_CPU_WORKERS=2 /work/venvs/gptqm/bin/python \\
        benchmarks/quant_quality.py gptqmodel $W                         # GPTQModel
    python3 benchmarks/quant_quality.py compare $W \\
        --out benchmarks/quant_quality/results.json                      # main interpreter

  dense      writes $W/dense (bf16 safetensors + tokenizer) and $W/inputs.json: the token ids
             of the 8 teacher-forced prompts (48-64 tokens), the 4 chat prompts (chat template
             applied) and the calibration samples, tokenized once so every venv uses the same.
  llmc       quantizes with llm-compressor (oneshot, lm_head/embeddings left alone, saved
             compressed) into $W/<scheme>, then runs each checkpoint with transformers +
             compressed-tensors in float32 (dequantized weights; W8A8 schemes fake-quantize
             every Linear input as the checkpoint says) and writes $W/tool/<scheme>.json.
             Also the dense checkpoint under transformers in float32 and in bf16.
  gptqmodel  quantizes with GPTQModel (GPTQ, AWQ) and runs each checkpoint with
             GPTQModel.load(device="cpu") in bf16 (its CPU kernels take no float32).
  compare    runs archserve (dtype float32, route TORCH_DEQUANT) on every checkpoint, on the
             dense one and with online fp8 (LLM(dense, quantization="fp8")), and writes the
             metrics. Each step skips a checkpoint that is already there (--force redoes it).
  table      prints the docs table from --out.

On the 2-core development machine (shared with other jobs): dense 30 s, llmc about 25 min
(15 of them llm-compressor's GPTQModifier), gptqmodel 5 min, compare 1.5 to 10 min.

Metrics (teacher forcing over the 8 prompts, every position after the first): mean |delta
logprob| of the true next token and top-1 (argmax) agreement, archserve-quantized against the
tool's forward of the same checkpoint and against archserve-dense (the quantization error).
Two floors to read them by: the tool against itself with eager instead of SDPA attention
(float32 rounding noise only; `llmc` writes tool/<scheme>@eager.json for the dense model and
the llm-compressor schemes), and archserve-dense (float32) against transformers-dense in bf16
(the bf16 compute GPTQModel's kernels use). For int8 W8A8, `compare` also runs archserve with
llm-compressor's activation scale (absmax / 127.5 instead of / 127).
Greedy: 32 new tokens (EOS ignored) for each chat prompt; agreement = positions before the
first divergence / 32, averaged over prompts. The tools' greedy tokens come from a plain
argmax loop over their forward with its own KV cache (no generation config).

Calibration (GPTQ, AWQ, llm-compressor GPTQ) is the CALIBRATION texts below: 525 tokens of
generic English written here, no dataset download. Schemes that fail are recorded in
$W/failures.json and reported by `compare`; the others go on.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import time
import traceback

import torch

SEED = 0
MAX_PROMPT_TOKENS = 64
MIN_PROMPT_TOKENS = 48
NEW_TOKENS = 32
GROUP = 64          # hidden 576 and k/v 192 are not multiples of 128

PROMPTS = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden screw press. Books "
    "became cheaper, literacy spread across Europe, and ideas travelled faster than ever "
    "before, changing religion, science and politics.",
    "To make a simple loaf of bread, mix flour, water, salt and a little yeast in a large "
    "bowl. Knead the dough for about ten minutes until it feels smooth and elastic, then "
    "cover it and leave it somewhere warm for an hour, until it has doubled in size.",
    "Photosynthesis is the process by which green plants use sunlight to turn carbon dioxide "
    "and water into sugar and oxygen. It takes place mainly in the leaves, inside small "
    "structures called chloroplasts, which contain the pigment chlorophyll that gives "
    "plants their colour.",
    "The train left the station at seven in the morning. Maria watched the fields roll past "
    "the window, still wet with dew, and thought about the letter in her pocket. She had "
    "read it a dozen times already, but she still did not know how she would answer it.",
    "A database index works much like the index at the back of a book. Instead of scanning "
    "every row to find the records you want, the database looks up the value in a sorted "
    "structure, usually a B-tree, and jumps straight to the matching rows on disk.",
    "Regular exercise has many benefits for both body and mind. It strengthens the heart "
    "and lungs, helps to control weight, improves sleep and lowers the risk of several "
    "chronic diseases. Even a brisk walk of thirty minutes a day can make a real difference.",
    "The city council met on Tuesday evening to discuss the new plan for the old harbour. "
    "Some members wanted to build apartments and shops, while others argued that the area "
    "should become a public park with gardens, a playground and a path along the water.",
    "When you learn a new language, it helps to practise a little every day rather than "
    "a lot once a week. Listen to native speakers, repeat short phrases aloud, and do not "
    "be afraid of making mistakes, because mistakes are how the brain learns what works.",
)

CHAT_PROMPTS = (
    "What is the capital of France, and what is it famous for?",
    "Give me three tips for writing clear emails.",
    "Explain in simple words why the sky is blue.",
    "Write a short poem about the sea.",
)

CALIBRATION = (
    "The weather was mild for the time of year, and many people had come out to walk in the "
    "park. Children played on the grass while their parents sat on benches, talking and "
    "drinking coffee from paper cups. A small dog chased pigeons until they flew up into the "
    "trees.",
    "In mathematics, a prime number is a natural number greater than one that has no "
    "divisors other than one and itself. The first few primes are two, three, five, seven "
    "and eleven. Every whole number greater than one can be written as a product of primes "
    "in exactly one way.",
    "The company reported higher profits in the third quarter, driven by strong sales of its "
    "new phones and growing revenue from online services. Its shares rose by four percent in "
    "early trading, although analysts warned that rising costs could weigh on the results "
    "next year.",
    "Volcanoes form where molten rock from deep inside the Earth rises to the surface. Some "
    "erupt explosively, throwing ash high into the sky, while others release slow rivers of "
    "lava. The soil around many volcanoes is very fertile, which is why people often farm on "
    "their slopes.",
    "User: Can you help me plan a trip to the mountains?\nAssistant: Of course! First, decide "
    "how many days you have and how far you want to travel. Then choose a few trails that "
    "match your fitness, check the weather forecast, and pack warm layers, water and snacks.",
    "The old library had tall shelves that reached the ceiling, and a ladder on wheels "
    "rolled along each wall. It smelled of dust and leather. Students came there to study in "
    "silence, and the librarian knew every book by heart, or so everyone said.",
    "To install the software, download the archive, unpack it into a folder of your choice "
    "and run the setup script. The script checks the requirements, creates a configuration "
    "file and starts the service. If something goes wrong, read the log file for details.",
    "Music has been part of human life for tens of thousands of years. Archaeologists have "
    "found flutes made of bird bone and mammoth ivory, and almost every culture has songs "
    "for work, for worship, for celebration and for mourning.",
    "The recipe calls for two eggs, a cup of sugar, half a cup of butter and two cups of "
    "flour. Beat the butter and sugar together, add the eggs one at a time, then fold in the "
    "flour and bake the cake in a moderate oven for forty minutes.",
    "Good software is easy to read as well as correct. Choose clear names, keep functions "
    "short, write tests for the behaviour that matters, and explain in comments why the code "
    "does something unusual, not what it does.",
)

# scheme -> (tool step, description). Order is the table's order.
SCHEMES = {
    "ct-fp8-dynamic": ("llmc", "FP8_DYNAMIC: fp8 e4m3 weights per channel, activations "
                               "fp8 per token dynamic (QuantizationModifier, RTN)"),
    "ct-w8a8-int8": ("llmc", "W8A8: int8 weights per channel, activations int8 per token "
                             "dynamic symmetric (QuantizationModifier, RTN)"),
    "ct-w4a16-g64": ("llmc", "W4A16: int4 weights group 64 symmetric (GPTQModifier)"),
    "ct-fp8-block": ("llmc", "FP8_BLOCK: fp8 weights in 128x128 blocks (partial blocks at "
                             "576), activations fp8 per 128-group dynamic (QuantizationModifier)"),
    "gptq-w4-g64-sym": ("gptqmodel", "GPTQ 4-bit group 64 symmetric, desc_act=False"),
    "awq-w4-g64": ("gptqmodel", "AWQ 4-bit group 64 with zero point, GEMM layout"),
    "online-fp8": (None, "archserve online fp8: LLM(dense, quantization='fp8'), fp8 weights "
                         "per channel, activations per token dynamic"),
}


# Schemes whose tool forward is also run with eager attention (see step_llmc).
EAGER_FLOOR = ("ct-fp8-dynamic", "ct-w8a8-int8", "ct-w4a16-g64")


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _load_json(path: str, default=None):
    if not os.path.isfile(path):
        return default
    with open(path) as f:
        return json.load(f)


def _dump_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def _record_failure(work: str, scheme: str, stage: str, exc: BaseException) -> None:
    path = os.path.join(work, "failures.json")
    failures = _load_json(path, {})
    failures[scheme] = {"stage": stage, "error": f"{type(exc).__name__}: {exc}"[:2000]}
    _dump_json(path, failures)


def _clear_failure(work: str, scheme: str) -> None:
    path = os.path.join(work, "failures.json")
    failures = _load_json(path, {})
    if failures.pop(scheme, None) is not None:
        _dump_json(path, failures)


def _versions(*names: str) -> str:
    import importlib.metadata as md
    return ", ".join(f"{n} {md.version(n)}" for n in names)


# ------------------------------------------------------------------ dense (main interpreter)

def step_dense(work: str, force: bool) -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from archserve.loader.default_model import default_model_path
    from archserve.loader.gguf_cache import gguf_tokenizer
    from archserve.loader.transformers_gguf import transformers_model_from_gguf

    gguf = default_model_path()
    dense = os.path.join(work, "dense")
    if force or not os.path.isfile(os.path.join(dense, "config.json")):
        t0 = time.time()
        # transformers' GGUF code dequantizes Q4_1 to float32; the checkpoint is that in bf16.
        model = transformers_model_from_gguf(gguf, dtype=torch.float32).to(torch.bfloat16)
        model.config.dtype = torch.bfloat16
        shutil.rmtree(dense, ignore_errors=True)
        model.save_pretrained(dense)
        gguf_tokenizer(gguf).save_pretrained(dense)
        _log(f"dense: {gguf} -> {dense} (bf16) in {time.time() - t0:.1f}s")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(dense)
    prompts = []
    for text in PROMPTS:
        ids = tok(text, add_special_tokens=False).input_ids[:MAX_PROMPT_TOKENS]
        assert len(ids) >= MIN_PROMPT_TOKENS, (len(ids), text)
        prompts.append(ids)
    chats = []
    for text in CHAT_PROMPTS:
        rendered = tok.apply_chat_template([{"role": "user", "content": text}],
                                           tokenize=False, add_generation_prompt=True)
        chats.append(tok(rendered, add_special_tokens=False).input_ids)
    calibration = [tok(text, add_special_tokens=False).input_ids for text in CALIBRATION]
    _dump_json(os.path.join(work, "inputs.json"), {
        "gguf": gguf, "prompts": prompts, "chat_prompts": chats, "calibration": calibration,
        "note": "token ids by the dense checkpoint's tokenizer (from the GGUF), no BOS added; "
                "chat prompts through its chat template with add_generation_prompt=True"})
    _log(f"inputs: {len(prompts)} prompts ({sum(map(len, prompts))} tokens), {len(chats)} chat "
         f"prompts, calibration {len(calibration)} samples / {sum(map(len, calibration))} tokens")


# ------------------------------------------------------------------ the tools' side

@torch.no_grad()
def _tool_outputs(model, inputs: dict, meta: dict) -> dict:
    """Teacher-forced target logprobs / argmax, and greedy tokens, from a HF-style forward."""
    def logits_of(ids: list[int]) -> torch.Tensor:
        x = torch.tensor([ids], dtype=torch.long)
        out = model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False)
        return out.logits[0].float()

    t0 = time.time()
    forced = []
    for ids in inputs["prompts"]:
        logprobs = torch.log_softmax(logits_of(ids).double(), dim=-1)
        targets = torch.tensor(ids[1:])
        forced.append({"target_logprob": logprobs[:-1].gather(1, targets[:, None])[:, 0].tolist(),
                       "argmax": logprobs[:-1].argmax(-1).tolist()})
    greedy = []
    for ids in inputs["chat_prompts"]:
        x = torch.tensor([ids], dtype=torch.long)
        out = model(input_ids=x, use_cache=True)
        tokens = []
        for step in range(NEW_TOKENS):
            tokens.append(int(out.logits[0, -1].float().argmax()))
            if step + 1 < NEW_TOKENS:
                out = model(input_ids=torch.tensor([tokens[-1:]]),
                            past_key_values=out.past_key_values, use_cache=True)
        greedy.append(tokens)
    meta["forward_seconds"] = round(time.time() - t0, 1)
    meta["greedy"] = "argmax loop: prefill, then one token a step with the model's KV cache " \
                     "(no generation config), EOS not special"
    return {"meta": meta, "forced": forced, "greedy": greedy}


def _calibration_dataset(inputs: dict):
    from datasets import Dataset
    ids = inputs["calibration"]
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]})


def _llmc_recipe(scheme: str):
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    if scheme == "ct-w4a16-g64":
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
        weights = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=GROUP,
                                   symmetric=True, dynamic=False)
        groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}
        return GPTQModifier(config_groups=groups, ignore=["lm_head"])
    preset = {"ct-fp8-dynamic": "FP8_DYNAMIC", "ct-w8a8-int8": "W8A8",
              "ct-fp8-block": "FP8_BLOCK"}[scheme]
    return QuantizationModifier(targets="Linear", scheme=preset, ignore=["lm_head"])


def _llmc_quantize(work: str, scheme: str, inputs: dict) -> float:
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer
    dense, out = os.path.join(work, "dense"), os.path.join(work, scheme)
    torch.manual_seed(SEED)
    t0 = time.time()
    tokenizer = AutoTokenizer.from_pretrained(dense)
    model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.bfloat16)
    n = len(inputs["calibration"])
    oneshot(model=model, recipe=_llmc_recipe(scheme), dataset=_calibration_dataset(inputs),
            num_calibration_samples=n, max_seq_length=256, shuffle_calibration_samples=False)
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)
    del model
    gc.collect()
    return time.time() - t0


def _hf_tool(path: str, dtype: torch.dtype, inputs: dict, what: str,
             attn: str = "sdpa") -> dict:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                 attn_implementation=attn).eval()
    qc = getattr(model.config, "quantization_config", None)
    linear = model.model.layers[0].self_attn.q_proj
    scheme = getattr(linear, "quantization_scheme", None)
    acts = getattr(scheme, "input_activations", None) if scheme is not None else None
    meta = {"tool": _versions("transformers", "compressed-tensors", "torch"),
            "loader": f"AutoModelForCausalLM.from_pretrained(path, dtype={dtype})",
            "compute": str(dtype).replace("torch.", ""), "what": what, "attention": attn,
            "weights": "dequantized by compressed-tensors on the first forward"
                       if qc is not None else "dense",
            "activations": "not quantized" if acts is None else
                           f"fake-quantized {acts.type}{acts.num_bits} {acts.strategy} "
                           f"{'dynamic' if acts.dynamic else 'static'}"
                           f"{f' group {acts.group_size}' if acts.group_size else ''}"}
    result = _tool_outputs(model, inputs, meta)
    del model
    gc.collect()
    return result


def step_llmc(work: str, force: bool, only: list[str]) -> None:
    inputs = _load_json(os.path.join(work, "inputs.json"))
    _log(_versions("llmcompressor", "compressed-tensors", "transformers", "torch"))
    tool_dir = os.path.join(work, "tool")
    for name, dtype in (("dense", torch.float32), ("dense-bf16", torch.bfloat16)):
        out = os.path.join(tool_dir, f"{name}.json")
        if (only and name not in only) or (os.path.isfile(out) and not force):
            continue
        _dump_json(out, _hf_tool(os.path.join(work, "dense"), dtype, inputs,
                                 f"dense checkpoint, transformers {dtype}"))
        _log(f"{name}: transformers reference written")
    for scheme, (step, _) in SCHEMES.items():
        if step != "llmc" or (only and scheme not in only):
            continue
        _run_scheme(work, scheme, force, inputs,
                    lambda s=scheme: _llmc_quantize(work, s, inputs),
                    lambda s=scheme: _hf_tool(os.path.join(work, s), torch.float32, inputs,
                                              SCHEMES[s][1]))
    # The sensitivity floor: the same tool and checkpoint with eager attention instead of
    # SDPA (float32 rounding-level differences only). Where activations are quantized, such
    # differences flip roundings, and the flips compound over 30 layers.
    for name in ["dense", *EAGER_FLOOR]:
        out = os.path.join(tool_dir, f"{name}@eager.json")
        path = os.path.join(work, name)
        if (only and name not in only) or (os.path.isfile(out) and not force) \
                or not os.path.isfile(os.path.join(tool_dir, f"{name}.json")):
            continue
        _dump_json(out, _hf_tool(path, torch.float32, inputs, f"{name}, eager attention",
                                 attn="eager"))
        _log(f"{name}@eager: transformers reference written")


def _run_scheme(work: str, scheme: str, force: bool, inputs: dict, quantize, reference) -> None:
    ckpt = os.path.join(work, scheme)
    out = os.path.join(work, "tool", f"{scheme}.json")
    try:
        seconds = None
        if force or not os.path.isfile(os.path.join(ckpt, "config.json")):
            _log(f"{scheme}: quantizing")
            seconds = quantize()
            _log(f"{scheme}: quantized in {seconds:.0f}s")
            _dump_json(os.path.join(ckpt, "quantize_seconds.json"), {"seconds": seconds})
    except Exception as exc:
        traceback.print_exc()
        _record_failure(work, scheme, "quantize", exc)
        _log(f"{scheme}: QUANTIZE FAILED: {type(exc).__name__}: {exc}")
        return
    if os.path.isfile(out) and not force and seconds is None:
        _clear_failure(work, scheme)
        return
    try:
        result = reference()
    except Exception as exc:
        traceback.print_exc()
        _record_failure(work, scheme, "tool forward", exc)
        _log(f"{scheme}: TOOL FORWARD FAILED: {type(exc).__name__}: {exc}")
        return
    _dump_json(out, result)
    _clear_failure(work, scheme)
    _log(f"{scheme}: tool reference written ({result['meta']['forward_seconds']}s)")


def _gptqmodel_config(scheme: str):
    from gptqmodel import AWQConfig, GPTQConfig
    # offload_to_disk=False: the default writes a random temp path into the saved config.
    if scheme.startswith("awq"):
        return AWQConfig(bits=4, group_size=GROUP, sym=False, format="gemm",
                         offload_to_disk=False)
    return GPTQConfig(bits=4, group_size=GROUP, sym=True, desc_act=False, format="gptq",
                      offload_to_disk=False)


def _gptqmodel_quantize(work: str, scheme: str, inputs: dict) -> float:
    from gptqmodel import BACKEND, GPTQModel
    from transformers import AutoTokenizer
    dense, out = os.path.join(work, "dense"), os.path.join(work, scheme)
    torch.manual_seed(SEED)
    t0 = time.time()
    tokenizer = AutoTokenizer.from_pretrained(dense)
    calibration = [{"input_ids": ids, "attention_mask": [1] * len(ids)}
                   for ids in inputs["calibration"]]
    model = GPTQModel.load(dense, _gptqmodel_config(scheme), device="cpu", dtype=torch.bfloat16)
    # AWQ's default GEMM packing backend is CUDA-only; AWQ_TORCH packs the same layout.
    backend = BACKEND.AWQ_TORCH if scheme.startswith("awq") else BACKEND.AUTO
    model.quantize(calibration, batch_size=1, tokenizer=tokenizer, backend=backend)
    shutil.rmtree(out, ignore_errors=True)
    model.save(out)
    log = os.path.join(out, "quant_log.csv")
    if os.path.isfile(log):
        os.remove(log)
    del model
    gc.collect()
    return time.time() - t0


def _gptqmodel_tool(path: str, inputs: dict, what: str) -> dict:
    from gptqmodel import GPTQModel
    model = GPTQModel.load(path, device="cpu", dtype=torch.bfloat16)
    kernels = sorted({type(m).__name__ for m in model.model.modules() if hasattr(m, "qweight")})
    meta = {"tool": _versions("gptqmodel", "transformers", "torch"),
            "loader": 'GPTQModel.load(path, device="cpu", dtype=torch.bfloat16)',
            "compute": "bfloat16 (GPTQModel's CPU kernels take fp16/bf16 only)", "what": what,
            "weights": f"BACKEND.AUTO -> {', '.join(kernels)}", "activations": "not quantized"}
    result = _tool_outputs(model.model.eval(), inputs, meta)
    del model
    gc.collect()
    return result


def step_gptqmodel(work: str, force: bool, only: list[str]) -> None:
    # GPTQModel 7.6 asks 2 workers for a sub-pool of its CPU pool; on 2 cores the pool has 1.
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(max(2, ((os.cpu_count() or 1) + 1) // 2)))
    inputs = _load_json(os.path.join(work, "inputs.json"))
    _log(_versions("gptqmodel", "transformers", "torch"))
    for scheme, (step, _) in SCHEMES.items():
        if step != "gptqmodel" or (only and scheme not in only):
            continue
        _run_scheme(work, scheme, force, inputs,
                    lambda s=scheme: _gptqmodel_quantize(work, s, inputs),
                    lambda s=scheme: _gptqmodel_tool(os.path.join(work, s), inputs,
                                                     SCHEMES[s][1]))


# ------------------------------------------------------------------ archserve + metrics

def _archserve_outputs(llm, inputs: dict) -> dict:
    from archserve import SamplingParams
    t0 = time.time()
    params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in inputs["prompts"]], params)
    forced = []
    for out, ids in zip(outs, inputs["prompts"], strict=True):
        target, top = [], []
        for pos in range(1, len(ids)):
            entry = out.prompt_logprobs[pos]
            target.append(entry[ids[pos]].logprob)
            first = [t for t, lp in entry.items() if lp.rank == 1]
            top.append(first[0] if first else max(entry.items(), key=lambda kv: kv[1].logprob)[0])
        forced.append({"target_logprob": target, "argmax": top})
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in inputs["chat_prompts"]], params)
    greedy = [list(o.outputs[0].token_ids) for o in outs]
    return {"forced": forced, "greedy": greedy, "seconds": round(time.time() - t0, 1)}


def _forced_metrics(a: dict, b: dict) -> dict:
    deltas, agree, total = [], 0, 0
    for x, y in zip(a["forced"], b["forced"], strict=True):
        deltas += [abs(p - q) for p, q in zip(x["target_logprob"], y["target_logprob"],
                                              strict=True)]
        agree += sum(int(p == q) for p, q in zip(x["argmax"], y["argmax"], strict=True))
        total += len(x["argmax"])
    return {"mean_abs_dlogprob": sum(deltas) / len(deltas), "max_abs_dlogprob": max(deltas),
            "top1_agreement": agree / total, "positions": total}


def _greedy_metrics(a: dict, b: dict) -> dict:
    prefixes = []
    for x, y in zip(a["greedy"], b["greedy"], strict=True):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefixes.append(n)
    return {"agreement": sum(prefixes) / (NEW_TOKENS * len(prefixes)),
            "tokens_before_divergence": prefixes}


def _nll(run: dict) -> float:
    values = [v for f in run["forced"] for v in f["target_logprob"]]
    return -sum(values) / len(values)


def step_compare(work: str, out_path: str, only: list[str]) -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import archserve
    from archserve import LLM

    torch.manual_seed(SEED)
    inputs = _load_json(os.path.join(work, "inputs.json"))
    dense_dir = os.path.join(work, "dense")
    tool_dir = os.path.join(work, "tool")
    failures = dict(_load_json(os.path.join(work, "failures.json"), {}))

    def run(path: str, int8_max: float | None = None, **kwargs) -> tuple[dict, dict]:
        if int8_max is not None:
            # llm-compressor's int8 convention inside archserve: scale = absmax / 127.5,
            # round, clamp to [-128, 127] (archserve and vLLM: absmax / 127).
            import archserve.kernels.linear.quantized_weights as qw
            saved, qw.INT8_MAX = qw.INT8_MAX, int8_max
            try:
                return run(path, **kwargs)
            finally:
                qw.INT8_MAX = saved
        t0 = time.time()
        llm = LLM(path, dtype="float32", max_model_len=256, **kwargs)
        report = llm.llm_engine.report
        routes = {r.layer: r.backend for r in report.routes}
        decisions = [f"{d.what}: {d.requested}" for d in report.decisions
                     if d.what == "quantization"]
        load = time.time() - t0
        result = _archserve_outputs(llm, inputs)
        del llm
        gc.collect()
        return result, {"linear_route": routes.get("linear (qkv, o, mlp)"),
                        "decisions": decisions, "load_seconds": round(load, 1),
                        "run_seconds": result["seconds"]}

    _log(f"archserve: dense {dense_dir}")
    dense, dense_info = run(dense_dir)
    results = {"dense": {"tool": "transformers", "info": dense_info,
                         "description": "the bf16 checkpoint dequantized from the GGUF",
                         "nll_archserve": _nll(dense)}}
    hf_dense = _load_json(os.path.join(tool_dir, "dense.json"))
    hf_dense_bf16 = _load_json(os.path.join(tool_dir, "dense-bf16.json"))
    floor = _load_json(os.path.join(tool_dir, "dense@eager.json"))
    if hf_dense and floor:
        results["dense"]["tool_sdpa_vs_eager"] = _forced_metrics(hf_dense, floor)
        results["dense"]["greedy_tool_sdpa_vs_eager"] = _greedy_metrics(hf_dense, floor)
    if hf_dense:
        results["dense"]["vs_tool"] = _forced_metrics(dense, hf_dense)
        results["dense"]["greedy_vs_tool"] = _greedy_metrics(dense, hf_dense)
        results["dense"]["tool_meta"] = hf_dense["meta"]
    if hf_dense_bf16:
        results["dense"]["vs_transformers_bf16"] = _forced_metrics(dense, hf_dense_bf16)
        results["dense"]["greedy_vs_transformers_bf16"] = _greedy_metrics(dense, hf_dense_bf16)

    for scheme, (step, description) in SCHEMES.items():
        if only and scheme not in only:
            continue
        entry = {"tool": {"llmc": "llm-compressor", "gptqmodel": "GPTQModel",
                          None: "archserve (online)"}[step], "description": description}
        if scheme in failures:
            if failures[scheme]["stage"] != "tool forward":
                entry["failed"] = failures[scheme]
                results[scheme] = entry
                _log(f"{scheme}: skipped, {failures[scheme]['stage']} failed")
                continue
            entry["tool_failed"] = failures[scheme]   # archserve still runs the checkpoint
        path = os.path.join(work, scheme)
        if step is not None and not os.path.isfile(os.path.join(path, "config.json")):
            entry["failed"] = {"stage": "missing", "error": f"no checkpoint at {path}"}
            results[scheme] = entry
            continue
        _log(f"archserve: {scheme}")
        try:
            ours, info = (run(dense_dir, quantization="fp8") if step is None else run(path))
        except Exception as exc:
            traceback.print_exc()
            entry["failed"] = {"stage": "archserve", "error": f"{type(exc).__name__}: {exc}"}
            results[scheme] = entry
            continue
        entry["info"] = info
        if step is not None:
            qc = _load_json(os.path.join(path, "config.json"))["quantization_config"]
            entry["quant_method"] = qc.get("quant_method")
            entry["quantize_seconds"] = (_load_json(os.path.join(path, "quantize_seconds.json"),
                                                    {}) or {}).get("seconds")
        tool = _load_json(os.path.join(tool_dir, f"{scheme}.json")) if step else None
        if tool is not None:
            entry["tool_meta"] = tool["meta"]
            entry["vs_tool"] = _forced_metrics(ours, tool)
            entry["greedy_vs_tool"] = _greedy_metrics(ours, tool)
            if hf_dense:
                # the tool's own quantization error, beside archserve's
                entry["tool_vs_transformers_dense"] = _forced_metrics(tool, hf_dense)
            floor = _load_json(os.path.join(tool_dir, f"{scheme}@eager.json"))
            if floor:
                entry["tool_sdpa_vs_eager"] = _forced_metrics(tool, floor)
                entry["greedy_tool_sdpa_vs_eager"] = _greedy_metrics(tool, floor)
            groups = qc.get("config_groups") or {}
            acts = [(g.get("input_activations") or {}).get("type") for g in groups.values()]
            if "int" in acts:
                _log(f"archserve: {scheme} with llm-compressor's int8 activation scale")
                conv, _ = run(path, int8_max=127.5)
                entry["int8_127_5"] = {
                    "what": "archserve with INT8_MAX patched to 127.5 (llm-compressor's "
                            "absmax / 127.5) for the dynamic activation scale",
                    "vs_tool": _forced_metrics(conv, tool),
                    "greedy_vs_tool": _greedy_metrics(conv, tool),
                    "vs_archserve_127": _forced_metrics(conv, ours)}
        entry["vs_dense"] = _forced_metrics(ours, dense)
        entry["greedy_vs_dense"] = _greedy_metrics(ours, dense)
        entry["nll_archserve"] = _nll(ours)
        results[scheme] = entry
        _log(f"{scheme}: vs tool {entry.get('vs_tool')} vs dense {entry['vs_dense']}")

    doc = {"model": "SmolLM2-135M-Instruct (embedded Q4_1 GGUF, dequantized to a bf16 HF "
                    "checkpoint)",
           "gguf": inputs["gguf"],
           "archserve": f"archserve {getattr(archserve, '__version__', '?')}, dtype float32, "
                        f"CPU, {_versions('torch', 'transformers')}",
           "prompts": {"teacher_forced": len(inputs["prompts"]),
                       "tokens": [len(x) for x in inputs["prompts"]],
                       "chat": len(inputs["chat_prompts"]), "new_tokens": NEW_TOKENS,
                       "calibration_tokens": sum(map(len, inputs["calibration"]))},
           "metrics": "mean |delta logprob| of the true next token and top-1 (argmax) agreement "
                      "over teacher-forced positions 1..L-1; greedy agreement = tokens before "
                      "the first divergence / 32, averaged over chat prompts",
           "results": results}
    _dump_json(out_path, doc)
    _log(f"wrote {out_path}")
    print(table(doc))


def table(doc: dict) -> str:
    """The docs table: mean |delta logprob| / top-1 agreement, greedy agreement, NLL."""
    def pair(m: dict | None) -> str:
        if not m:
            return "—"
        mean = m["mean_abs_dlogprob"]
        return f"{mean:.2g} / {100 * m['top1_agreement']:.1f}%" if mean < 1e-3 else \
            f"{mean:.3f} / {100 * m['top1_agreement']:.1f}%"

    def greedy(m: dict | None) -> str:
        return "—" if not m else f"{100 * m['agreement']:.0f}%"

    lines = ["| scheme | tool | archserve vs tool | tool vs itself, eager attention | "
             "archserve vs dense | greedy agreement vs tool / vs dense | NLL (archserve) |",
             "|---|---|---|---|---|---|---|"]
    bf16 = doc["results"].get("dense", {}).get("vs_transformers_bf16")
    for scheme, e in doc["results"].items():
        floor = pair(e.get("tool_sdpa_vs_eager"))
        if bf16 and e.get("tool_meta", {}).get("compute", "").startswith("bfloat16"):
            floor = f"bf16 compute, on dense: {pair(bf16)}"
        if "failed" in e:
            why = "tool forward and archserve load failed" if "tool_failed" in e else \
                f"{e['failed']['stage']} failed"
            lines.append(f"| {scheme} | {e['tool']} | {why} (see below) | | | | |")
            continue
        vs_tool = pair(e.get("vs_tool")) if "tool_failed" not in e else "tool forward failed"
        if "int8_127_5" in e:
            vs_tool += f" ({pair(e['int8_127_5']['vs_tool'])} with absmax/127.5)"
        vs_dense = e.get("vs_dense") or {"mean_abs_dlogprob": 0.0, "top1_agreement": 1.0}
        g_dense = e.get("greedy_vs_dense") or {"agreement": 1.0}
        lines.append(f"| {scheme} | {e['tool']} | {vs_tool} | {floor} | "
                     f"{pair(vs_dense)} | {greedy(e.get('greedy_vs_tool'))} / {greedy(g_dense)} | "
                     f"{e['nll_archserve']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=("dense", "llmc", "gptqmodel", "compare", "table"))
    parser.add_argument("work", help="work directory shared by the steps")
    parser.add_argument("--force", action="store_true", help="redo what is already there")
    parser.add_argument("--only", default="", help="comma-separated schemes")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                      "quant_quality", "results.json"))
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    only = [s for s in args.only.split(",") if s]
    os.makedirs(args.work, exist_ok=True)
    if args.step == "dense":
        step_dense(args.work, args.force)
    elif args.step == "llmc":
        step_llmc(args.work, args.force, only)
    elif args.step == "gptqmodel":
        step_gptqmodel(args.work, args.force, only)
    elif args.step == "compare":
        step_compare(args.work, args.out, only)
    else:
        print(table(_load_json(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
