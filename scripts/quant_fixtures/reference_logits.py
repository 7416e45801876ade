"""Reference logits of the quantized fixtures, computed by each format's own tool on CPU.

    python reference_logits.py ROOT [NAME ...] [--base BASE_DIR]

Writes ROOT/references/NAME.safetensors for every fixture under ROOT (or the NAMEs given)
whose loader is importable in the running venv, and skips the others, so run it once in the
llm-compressor venv and once in the GPTQModel venv:

  compressed-tensors (ct-*) and HF fp8 (hf-fp8-block): transformers
      AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), float32 compute
  gptq / awq (gptq-*, awq-*): GPTQModel.load(path, device="cpu", dtype=torch.bfloat16),
      bf16 compute (none of GPTQModel 7.6's CPU kernels accepts float32)

--base BASE_DIR also writes ROOT/references/base.safetensors: the unquantized bf16 base model
(base_model.build) loaded by transformers with dtype=torch.float32.

Each file: `input_ids` int64 [3, 16] (the same in every file), `logits` float32 [3, 16, vocab],
and string metadata (tool + version, loader call, dtype, kernel/backend, activation handling).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file

TEXTS = (
    "The quick brown fox jumps over the lazy dog. A paged KV cache stores keys",
    "Continuous batching lets new requests join the running batch while",
    "Hello world! How are you today? I am fine, thank you. The capital of France",
)
SEQ = 16
# Beside, not inside, the checkpoints: a loader reads every *.safetensors of a model folder.
REFERENCES = "references"
# Fixtures whose generator writes their reference itself (transformers cannot load them).
OWN_REFERENCE = {"hf-deepseek-v3-fp8-block": "deepseek_v3_fp8.py"}
BASE_FILE = os.path.join(REFERENCES, "base.safetensors")


def input_ids(path: str) -> torch.Tensor:
    """tokenizer(text).input_ids[:16] per text (this BPE tokenizer adds no BOS)."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(path)
    rows = [tokenizer(text).input_ids[:SEQ] for text in TEXTS]
    assert all(len(r) == SEQ for r in rows), [len(r) for r in rows]
    return torch.tensor(rows, dtype=torch.int64)


def fixture_format(path: str) -> str | None:
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        return None
    with open(config_path) as f:
        method = json.load(f).get("quantization_config", {}).get("quant_method")
    return {"compressed-tensors": "ct", "fp8": "hf-fp8", "gptq": "gptqmodel",
            "awq": "gptqmodel"}.get(method)


def _versions(*names: str) -> str:
    import importlib.metadata as md
    return ", ".join(f"{n} {md.version(n)}" for n in names)


def _forward(model, ids: torch.Tensor, meta: dict) -> torch.Tensor:
    meta["attention"] = (f"{model.config._attn_implementation}, full causal, attention_mask of "
                         f"ones, no KV cache")
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    return out.logits.float().contiguous()


def _hf_load(path: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def run_transformers(path: str, ids: torch.Tensor, fmt: str) -> tuple[torch.Tensor, dict]:
    """ct-* and hf-fp8-block, with transformers (+ compressed-tensors for ct)."""
    meta = {"loader": 'AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)',
            "dtype": "float32 (weights dequantized to float32, float32 compute)"}
    if fmt == "hf-fp8":
        meta["tool"] = _versions("transformers", "torch")
        model = _hf_load(path)
        linear = model.model.layers[0].self_attn.q_proj
        # Without CUDA/XPU the FineGrainedFP8 quantizer forces dequantize=True: Fp8Dequantize
        # multiplies each fp8 block by its weight_scale_inv at load time and the model ends up
        # a plain unquantized one (quantization_config dropped).
        meta["backend"] = (f"FineGrainedFP8 quantizer, dequantize forced True (no CUDA/XPU): "
                           f"fp8 * weight_scale_inv at load -> plain {type(linear).__name__} "
                           f"{linear.weight.dtype} weight, nn.Linear matmul")
        meta["activations"] = "not quantized"
        return _forward(model, ids, meta), meta

    import compressed_tensors.quantization.lifecycle.forward as ct_forward
    meta["tool"] = _versions("transformers", "compressed-tensors", "torch")
    model = _hf_load(path)
    qc = model.config.quantization_config
    linear = model.model.layers[0].self_attn.q_proj
    before = (f"{type(linear).__name__} params "
              f"{sorted(n for n, _ in linear.named_parameters(recurse=False))}")
    # Count the fake-quantization calls the compressed-tensors forward wrapper makes.
    calls: dict[str, int] = {}
    original = ct_forward.forward_quantize

    def counting(module, value, base_name, args):
        key = f"{base_name}:{args.type}{args.num_bits}/{args.strategy}/" \
              f"{'dynamic' if args.dynamic else 'static'}"
        calls[key] = calls.get(key, 0) + 1
        return original(module, value, base_name, args)

    ct_forward.forward_quantize = counting
    try:
        logits = _forward(model, ids, meta)
    finally:
        ct_forward.forward_quantize = original
    status = getattr(linear, "quantization_status", None)
    scheme = getattr(linear, "quantization_scheme", None)
    acts = scheme.input_activations if scheme is not None else None
    n_linear = sum(1 for m in model.modules() if getattr(m, "quantization_scheme", None))
    meta["backend"] = (
        f"compressed-tensors dequantize={qc.dequantize} (run_compressed default): "
        f"compress_model() layout at load ({before}), decompressed on the first forward by "
        f"its pre-forward hook -> dense {linear.weight.dtype} weight, nn.Linear matmul; "
        f"module status after forward {getattr(status, 'value', status)}")
    meta["activations"] = (
        "not quantized" if acts is None else
        f"fake-quantized (quantize-dequantize in float32) by the compressed-tensors forward "
        f"wrapper: {acts.type}{acts.num_bits} {acts.strategy} "
        f"{'dynamic' if acts.dynamic else 'static input_scale'}; "
        f"calls per forward {json.dumps(calls, sort_keys=True)} over {n_linear} Linear")
    return logits, meta


def run_gptqmodel(path: str, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS",
                          str(max(2, ((os.cpu_count() or 1) + 1) // 2)))
    from gptqmodel import GPTQModel
    model = GPTQModel.load(path, device="cpu", dtype=torch.bfloat16)
    kernels = sorted({type(m).__name__ for m in model.model.modules() if hasattr(m, "qweight")})
    meta = {"tool": _versions("gptqmodel", "transformers", "torch"),
            "loader": 'GPTQModel.load(path, device="cpu", dtype=torch.bfloat16)',
            "dtype": "bfloat16 compute (GPTQModel CPU kernels support only fp16/bf16); "
                     "logits cast to float32",
            "backend": f"BACKEND.AUTO -> {', '.join(kernels)}",
            "activations": "not quantized"}
    return _forward(model.model, ids, meta), meta


def save(out: str, ids: torch.Tensor, logits: torch.Tensor, meta: dict) -> None:
    meta = dict(meta, texts=json.dumps(TEXTS),
                input_ids="tokenizer(text).input_ids[:16], no BOS added by this tokenizer")
    save_file({"input_ids": ids.contiguous(), "logits": logits}, out,
              metadata={"format": "pt", **{k: str(v) for k, v in meta.items()}})


def main(argv) -> int:
    base = None
    if "--base" in argv:
        i = argv.index("--base")
        base, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    root, names = argv[0], argv[1:]
    # hf-fp8 goes with ct: the llm-compressor venv (transformers 5.17) does both, so every
    # fixture gets its file from exactly one of the two venvs.
    have = {"ct": importlib.util.find_spec("compressed_tensors") is not None,
            "hf-fp8": importlib.util.find_spec("compressed_tensors") is not None,
            "gptqmodel": importlib.util.find_spec("gptqmodel") is not None}
    base_path = os.path.join(root, BASE_FILE)
    ok = True
    if base:
        ids = input_ids(base)
        meta = {"tool": _versions("transformers", "torch"),
                "loader": 'AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)',
                "dtype": "float32 compute from the bf16 checkpoint of base_model.build()",
                "backend": "unquantized nn.Linear", "activations": "not quantized"}
        save(base_path, ids, _forward(_hf_load(base), ids, meta), meta)
        print(f"{BASE_FILE}: written")
    expected = load_file(base_path)["input_ids"] if os.path.isfile(base_path) else None
    for name in names or sorted(os.listdir(root)):
        path = os.path.join(root, name)
        fmt = fixture_format(path)
        if fmt is None or not have[fmt] or name in OWN_REFERENCE:
            continue
        try:
            ids = input_ids(path)
            if expected is not None and not torch.equal(ids, expected):
                raise ValueError(f"input_ids differ from {BASE_FILE}")
            if fmt == "gptqmodel":
                logits, meta = run_gptqmodel(path, ids)
            else:
                logits, meta = run_transformers(path, ids, fmt)
            os.makedirs(os.path.join(root, REFERENCES), exist_ok=True)
            save(os.path.join(root, REFERENCES, f"{name}.safetensors"), ids, logits, meta)
            line = f"{meta['backend']}, {meta['dtype'].split(' (')[0]}"
            if expected is not None:
                diff = (logits - load_file(base_path)["logits"]).abs().max().item()
                line += f", max|logits - base| {diff:.4f}"
            print(f"{name}: reference logits: {line}")
        except Exception as exc:  # report and go on with the others
            ok = False
            print(f"{name}: reference logits FAILED: {type(exc).__name__}: {exc}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
