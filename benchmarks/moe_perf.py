"""MoE speed on one GPU: the engine on Qwen3-30B-A3B, Mixtral-8x7B and gpt-oss-20b shapes
with dummy weights (gpt-oss-20b in OpenAI's MXFP4 form, and gpt-oss-20b-bf16 with 16-bit
experts), and a kernel table of the fused MoE.

Engine rows (``--part engine``), one engine per model, several workloads on it:

- batch-1 decode: 1 request, 128 tokens in, 256 out. The decode step's mean time against
  its floor: the bytes a step reads (dense weights, LM head, the k experts per layer one
  token touches, the KV cache) over the measured copy bandwidth (engine/ceilings.py).
- 256 x 256/128 (both shapes; --skip-mixtral-throughput leaves Mixtral's out, and its
  engine then holds one sequence: one decode graph to capture and tune): output tok/s and
  MBU, with each decode step charged the experts its batch touches (expected distinct
  experts under uniform routing, kernels/moe/routing.experts_touched).
- transformers on a small workload (16 x 128/64, Qwen3 shape): ours, then transformers
  with the same dummy-initialised architecture, after our engine is freed. transformers
  loops over the experts in Python; --peer-layers N runs both on the first N layers only
  (a config copy), for when the whole model is too slow for the device call; the row
  records the layers it ran. ``--part peer`` runs this comparison alone (with
  --peer-layers, the whole model is then never built).

gpt-oss (``--models gpt-oss-20b,gpt-oss-20b-bf16``): the same engine rows. The floor of an
MXFP4 step counts the experts' packed bytes (values and scales) as they are held. Its
kernel table (``--models gpt-oss-20b --part kernels``) times, at 1, 16, 256 and 4096
tokens, the fused MoE on MXFP4 experts beside the same layer with bf16 experts (both with
gpt-oss's clamped SwiGLU and biases, each with its tuned tile), against each one's floor.

Kernel table (``--part kernels``), per expert shape and token count (1, 16, 64, 256, 1024):
the fused Triton MoE with its tuned tile (the engine's tuner and cache, so a later engine
start reads the result; "_pairs" in the tile: the unsorted pair layout), the TORCH_MOE loop,
and dense cuBLAS GEMMs of the same FLOPs (T*k rows through one expert's gate/up and down
matrices). µs, TFLOP/s and GB/s of the expert weights the tokens touch, the fused MoE's
floor (those bytes over the measured copy bandwidth), and the routing alone: the Triton
routing kernel against routing.route's torch ops.

    python3 benchmarks/moe_perf.py [--part engine|peer|kernels|all] [--models qwen3-30b-a3b,..]
    python3 benchmarks/moe_perf.py --models gpt-oss-20b,gpt-oss-20b-bf16 --skip-peer
        [--skip-peer] [--peer-layers N] [--skip-mixtral-throughput] [--out F.json]
    python3 benchmarks/moe_perf.py --tiny          # CPU smoke run: tiny shapes, no GPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from archserve.bench.offline import run_offline  # noqa: E402
from archserve.bench.roofline import analyze, model_facts  # noqa: E402
from archserve.bench.workload import random_requests  # noqa: E402
from archserve.engine.ceilings import load_or_measure  # noqa: E402
from archserve.engine.heap import free_dropped_engines  # noqa: E402
from archserve.engine.step_weights import experts_touched  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = {name: os.path.join(HERE, "models", name)
          for name in ("qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-20b", "gpt-oss-20b-bf16")}
# experts, top_k, hidden, expert intermediate
KERNEL_SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336),
                 "gpt-oss-20b": (32, 4, 2880, 2880), "gpt-oss-20b-bf16": (32, 4, 2880, 2880)}
TOKENS = (1, 16, 64, 256, 1024)
# gpt-oss's kernel table: MXFP4 experts beside bf16 ones at these token counts.
GPT_OSS_TOKENS = (1, 16, 256, 4096)
TINY_CONFIG = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
               "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
               "num_experts": 16, "num_experts_per_tok": 4, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
               "vocab_size": 256, "max_position_embeddings": 512, "norm_topk_prob": True,
               "rms_norm_eps": 1e-6, "tie_word_embeddings": False}


# ---------------------------------------------------------------- engine rows

def _engine(model: str, dtype: str, max_num_seqs: int):
    from archserve.engine.config import EngineConfig
    from archserve.engine.llm_engine import LLMEngine
    return LLMEngine(EngineConfig(model=model, dtype=dtype, load_format="dummy",
                                  max_model_len=1024, max_num_seqs=max_num_seqs,
                                  skip_tokenizer_init=True))


def _workload(engine, ceilings, num: int, input_len: int, output_len: int) -> dict:
    from archserve.kernels.jit_watch import compiled_after_startup, compiled_since
    requests = random_requests(num, input_len, output_len, engine.model_config.vocab_size,
                               seed=num)
    before = compiled_after_startup()
    throughput, trace = run_offline(engine, requests, True, show_progress=False)
    # Variants the start-up did not compile: their compile time is in this row's time.
    compiled = compiled_since(before)
    roof = analyze(trace, model_facts(engine), ceilings)
    step_ms, floor_ms = roof.decode_step_s_mean * 1e3, roof.decode_floor_s_mean * 1e3
    return {"requests": num, "input_len": input_len, "output_len": output_len,
            "output_tok_s": throughput.output_tokens_per_s, "elapsed_s": throughput.elapsed_s,
            "decode_step_ms": step_ms, "decode_floor_ms": floor_ms,
            "step_over_floor": step_ms / floor_ms if floor_ms else None, "mbu": roof.mbu,
            "compiled_while_running": compiled}


def engine_rows(name: str, path: str, args, throughput: bool, peer: bool) -> dict:  # noqa: ANN001
    """``throughput``: the batch-1 and 256 x 256/128 rows on the whole model; ``peer``: the
    transformers comparison (Qwen3 shape only), on the same engine when it runs every layer,
    else on an engine of the first --peer-layers layers (the whole one is never built for a
    cut comparison alone)."""
    dtype = "float32" if args.tiny else "bfloat16"
    scale = 8 if args.tiny else 1
    small = (16, 128 // scale, 64 // scale)
    peer = peer and name == "qwen3-30b-a3b"
    layers = peer_layers = _num_layers(path)
    peer_path = path
    if peer and args.peer_layers and args.peer_layers < layers:
        peer_path, peer_layers = _first_layers(path, args.peer_layers), args.peer_layers
    result: dict = {"model": name}
    engine = None
    if throughput:
        wide = name != "mixtral-8x7b" or not args.skip_mixtral_throughput
        t0 = time.perf_counter()
        # Batch 1 alone needs one decode graph and one MoE tile bucket: a shorter start.
        engine = _engine(path, dtype, 256 if wide else 1)
        ceilings = load_or_measure(engine.runner.device)
        facts = model_facts(engine)
        result.update(
            start_s=time.perf_counter() - t0, max_num_seqs=256 if wide else 1,
            moe_backend=sorted({m.backend_name for m in engine.model.moe_layers()}),
            decisions=[d.to_dict() for d in engine.report.decisions
                       if d.what in ("MoE tiles", "decode GEMMs")],
            ceilings=ceilings.describe(), active_bytes_b1=facts.weights().bytes_per_step,
            all_weight_bytes=facts.weight_bytes + facts.expert_bytes)
        result["b1"] = _workload(engine, ceilings, 1, 128 // scale, 256 // scale)
        _print_row(name, "b1 128/256", result["b1"])
        if wide:
            result["256x256/128"] = _workload(engine, ceilings, 256 // scale, 256 // scale,
                                              128 // scale)
            _print_row(name, "256x256/128", result["256x256/128"])
        if peer_path != path or not peer:
            device, engine = engine.runner.device, None   # the only reference: freed here
            free_dropped_engines(device.type)
    if not peer:
        return result
    if engine is None:
        engine = _engine(peer_path, dtype, small[0])
    device, engine_dtype = engine.runner.device, engine.report.dtype
    ours = _workload(engine, load_or_measure(device), *small)
    print(f"{name:16s} ours {'x'.join(map(str, small))} ({peer_layers} layers): "
          f"{ours['output_tok_s']:.1f} tok/s{_compiled_note(ours)}; transformers next",
          flush=True)
    engine = None   # the only reference: freed before transformers takes the memory
    free_dropped_engines(device.type)
    from archserve.bench.peer_transformers import run_peer
    requests = random_requests(small[0], small[1], small[2], facts_vocab(path), seed=small[0])
    other, method = run_peer(peer_path, "dummy", engine_dtype, device, requests,
                             max_num_seqs=small[0], show_progress=False)
    row = {"workload": "x".join(map(str, small)), "layers": peer_layers,
           "ours_tok_s": ours["output_tok_s"], "transformers_tok_s": other.output_tokens_per_s,
           "method": method, "speedup": ours["output_tok_s"] / other.output_tokens_per_s}
    result["vs_transformers"] = row
    print(f"{name:16s} vs transformers {row['workload']} ({peer_layers} layers): ours "
          f"{row['ours_tok_s']:.1f} tok/s, transformers {row['transformers_tok_s']:.1f} tok/s "
          f"({method}): {row['speedup']:.1f}x", flush=True)
    return result


def _num_layers(path: str) -> int:
    with open(os.path.join(path, "config.json")) as f:
        return int(json.load(f)["num_hidden_layers"])


def _first_layers(path: str, layers: int) -> str:
    """A config folder of the model cut to its first ``layers`` layers."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["num_hidden_layers"] = layers
    folder = tempfile.mkdtemp(prefix=f"moe_perf_{layers}l_")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


def facts_vocab(path: str) -> int:
    with open(os.path.join(path, "config.json")) as f:
        return int(json.load(f)["vocab_size"])


def _print_row(name: str, what: str, row: dict) -> None:
    ratio = row["step_over_floor"]
    print(f"{name:16s} {what:12s} step {row['decode_step_ms']:.3f} ms / floor "
          f"{row['decode_floor_ms']:.3f} ms = {ratio:.2f}x; {row['output_tok_s']:.1f} out tok/s;"
          f" MBU {row['mbu']:.1%}{_compiled_note(row)}", flush=True)


def _compiled_note(row: dict) -> str:
    compiled = row.get("compiled_while_running") or {}
    return f"; compiled while running: {compiled}" if compiled else ""


# ---------------------------------------------------------------- kernel table

def _time_us(fn, device: torch.device, graph: bool = True) -> tuple[float, str]:  # noqa: ANN001
    """``graph=False``: CUDA events around eager calls, for code that reads device values on
    the host (TORCH_MOE's per-expert counts) and so cannot be captured."""
    if device.type == "cuda" and not graph:
        from archserve.kernels.cuda_timing import median_ms
        return 1e3 * median_ms(fn, 10, warmup=2), "eager"
    if device.type == "cuda":
        from archserve.kernels.cuda_timing import graph_median_us
        return graph_median_us(fn, 10, warmup=2, reps=4)
    fn()
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    return (time.perf_counter() - t0) / 3 * 1e6, "cpu"


def kernel_rows(name: str, shape: tuple[int, int, int, int], tokens_list, device, dtype,
                cache_path: str | None) -> list[dict]:
    from archserve.kernels.moe.routing import route
    from archserve.kernels.moe.torch_moe import TorchMoEImpl
    experts, top_k, hidden, inter = shape
    gen = torch.Generator(device=device).manual_seed(0)
    w13 = torch.randn(experts, 2 * inter, hidden, device=device, dtype=dtype,
                      generator=gen) * hidden ** -0.5
    w2 = torch.randn(experts, hidden, inter, device=device, dtype=dtype,
                     generator=gen) * inter ** -0.5
    fused, copy_bytes_per_s = None, None
    if device.type == "cuda":
        from archserve.kernels.moe.triton_fused_impl import TritonFusedMoEImpl
        from archserve.kernels.moe.triton_routing import triton_route
        copy_bytes_per_s = load_or_measure(device).copy_bytes_per_s
        from archserve.kernels.moe.tuning import MoEShape, tune_moe
        fused = TritonFusedMoEImpl()
        report = tune_moe([MoEShape([fused], w13, w2, top_k, True)], tokens_list, cache_path)
        print(f"{name}: {report.summary()}", flush=True)
    loop = TorchMoEImpl()
    expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    rows = []
    for tokens in tokens_list:
        x = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=gen)
        logits = torch.randn(tokens, experts, device=device, generator=gen)
        flops = 2.0 * tokens * top_k * 3 * hidden * inter
        touched = experts_touched(tokens, experts, top_k) * expert_bytes
        row = {"shape": name, "tokens": tokens, "flops": flops, "expert_bytes": touched}
        runs = {"torch_moe": lambda x=x, lg=logits: loop.forward(x, lg, w13, w2, top_k, True)}
        if fused is not None:
            runs["fused"] = lambda x=x, lg=logits: fused.forward(x, lg, w13, w2, top_k, True)
            row["tile"] = fused.tile_for(tokens, top_k, w13, w2).key()
            row["floor_us"] = touched / copy_bytes_per_s * 1e6
            for kind, fn in (("route_triton", triton_route), ("route_torch", route)):
                row[f"{kind}_us"] = _time_us(lambda fn=fn, lg=logits: fn(lg, top_k, True),
                                             device)[0]
        a13 = torch.randn(tokens * top_k, hidden, device=device, dtype=dtype, generator=gen)
        a2 = torch.randn(tokens * top_k, inter, device=device, dtype=dtype, generator=gen)
        runs["dense_same_flops"] = lambda a13=a13, a2=a2: (
            torch.nn.functional.linear(a13, w13[0]), torch.nn.functional.linear(a2, w2[0]))
        for kind, fn in runs.items():
            us, how = _time_us(fn, device, graph=kind != "torch_moe")
            row[kind] = {"us": us, "how": how, "tflops": flops / us / 1e6,
                         "gb_s": touched / us / 1e3 if kind != "dense_same_flops" else None}
        if fused is not None:
            ref = loop.forward(x, logits, w13, w2, top_k, True).float()
            got = fused.forward(x, logits, w13, w2, top_k, True).float()
            row["max_abs_diff_vs_torch_moe"] = float((got - ref).abs().max())
        rows.append(row)
        print(_kernel_line(row), flush=True)
    return rows


def gpt_oss_kernel_rows(name: str, shape: tuple[int, int, int, int], tokens_list, device,
                        cache_path: str | None) -> list[dict]:
    """The fused MoE on gpt-oss's experts (clamped SwiGLU, biases), MXFP4 beside bf16, each
    with its tuned tile; µs, GB/s of the expert bytes the tokens touch, and the floor (those
    bytes over the measured copy bandwidth)."""
    from archserve.kernels.linear.quantized_weights import quantize_mxfp4
    from archserve.kernels.moe.expert_activation import SWIGLU_OAI, ExpertBiases, GatedActivation
    from archserve.kernels.moe.triton_fused_impl import TritonFusedMoEImpl
    from archserve.kernels.moe.triton_fused_moe import ExpertMatrices
    from archserve.kernels.moe.tuning import MoEShape, tune_moe
    experts, top_k, hidden, inter = shape
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16
    w13 = torch.randn(experts, 2 * inter, hidden, device=device, generator=gen) * hidden ** -0.5
    w2 = torch.randn(experts, hidden, inter, device=device, generator=gen) * inter ** -0.5
    activation = GatedActivation(SWIGLU_OAI, 1.702, 7.0)
    biases = ExpertBiases(torch.randn(experts, 2 * inter, device=device, dtype=dtype) * 0.1,
                          torch.randn(experts, hidden, device=device, dtype=dtype) * 0.1)
    forms = {"bf16": (w13.to(dtype), w2.to(dtype)),
             "mxfp4": (quantize_mxfp4(w13), quantize_mxfp4(w2))}
    copy_bytes_per_s = load_or_measure(device).copy_bytes_per_s
    rows = []
    for form, (a, b) in forms.items():
        impl = TritonFusedMoEImpl()
        report = tune_moe([MoEShape([impl], a, b, top_k, True, dtype, activation, biases)],
                          tokens_list, cache_path)
        print(f"{name} {form}: {report.summary()}", flush=True)
        expert_bytes = ExpertMatrices.of(a).expert_bytes + ExpertMatrices.of(b).expert_bytes
        for tokens in tokens_list:
            x = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=gen)
            logits = torch.randn(tokens, experts, device=device, generator=gen)
            touched = experts_touched(tokens, experts, top_k) * expert_bytes
            us, how = _time_us(lambda x=x, lg=logits, a=a, b=b, impl=impl: impl.forward(
                x, lg, a, b, top_k, True, activation=activation, biases=biases), device)
            flops = 2.0 * tokens * top_k * 3 * hidden * inter
            row = {"shape": name, "experts": form, "tokens": tokens, "us": us, "how": how,
                   "tile": impl.tile_for(tokens, top_k, a, b).key(), "expert_bytes": touched,
                   "gb_s": touched / us / 1e3, "tflops": flops / us / 1e6,
                   "floor_us": touched / copy_bytes_per_s * 1e6}
            row["over_floor"] = us / row["floor_us"]
            rows.append(row)
            print(f"{name:16s} {form:5s} T={tokens:5d} {us:9.1f} us ({row['gb_s']:.0f} GB/s, "
                  f"{row['tflops']:.1f} TFLOP/s; bytes floor {row['floor_us']:.1f} us = "
                  f"{row['over_floor']:.2f}x) [{row['tile']}]", flush=True)
    return rows


def _kernel_line(row: dict) -> str:
    def cell(kind: str) -> str:
        r = row.get(kind)
        if r is None:
            return "-"
        gb = f" / {r['gb_s']:.0f} GB/s" if r["gb_s"] else ""
        return f"{r['us']:.1f} us ({r['tflops']:.1f} TF{gb})"
    floor = (f" floor {row['floor_us']:.1f} us; route {row['route_triton_us']:.1f} us "
             f"(torch {row['route_torch_us']:.1f})" if "floor_us" in row else "")
    return (f"{row['shape']:16s} T={row['tokens']:5d} fused {cell('fused')} "
            f"[{row.get('tile', '-')}]{floor} | torch_moe {cell('torch_moe')} | dense same "
            f"FLOPs {cell('dense_same_flops')}")


# ---------------------------------------------------------------- main

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", default="all", choices=("engine", "peer", "kernels", "all"),
                        help="engine: the batch-1 and 256 x 256/128 rows, and the transformers "
                             "comparison unless --skip-peer; peer: that comparison alone")
    parser.add_argument("--models", default="qwen3-30b-a3b,mixtral-8x7b")
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--skip-mixtral-throughput", action="store_true")
    parser.add_argument("--peer-layers", type=int, default=0,
                        help="run the transformers comparison on the first N layers only")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run on tiny shapes")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    names = [n for n in args.models.split(",") if n]
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        parser.error(f"unknown model(s) {unknown}; known: {', '.join(MODELS)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "engine": [], "kernels": []}

    def save() -> None:   # after every row set: a run cut short keeps what it measured
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1, default=str)

    tmp = tempfile.mkdtemp(prefix="moe_perf_")
    paths = dict(MODELS)
    shapes = dict(KERNEL_SHAPES)
    tokens = TOKENS
    if args.tiny:
        path = os.path.join(tmp, "tiny-qwen3-moe")
        os.makedirs(path)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(TINY_CONFIG, f)
        paths = {n: path for n in names}
        shapes = {n: (16, 4, 64, 32) for n in names}
        tokens = (1, 16, 64)
    if args.part in ("kernels", "all"):
        cache = None
        if device.type == "cuda":
            from archserve.engine.kernel_cache import device_kernel_dir
            from archserve.platform import detect
            cache = os.path.join(device_kernel_dir(detect()), "moe_tiles.json")
        dtype = torch.float32 if args.tiny else torch.bfloat16
        for name in names:
            if name.startswith("gpt-oss") and device.type == "cuda":
                # One table of both expert forms (the -bf16 name adds nothing to it).
                if name == "gpt-oss-20b" or "gpt-oss-20b" not in names:
                    result["kernels"] += gpt_oss_kernel_rows(name, shapes[name],
                                                             GPT_OSS_TOKENS, device, cache)
            else:
                result["kernels"] += kernel_rows(name, shapes[name], tokens, device, dtype,
                                                 cache)
            free_dropped_engines(device.type)
            save()
    if args.part in ("engine", "peer", "all"):
        for name in names:
            result["engine"].append(engine_rows(
                name, paths[name], args, throughput=args.part != "peer",
                peer=args.part == "peer" or not args.skip_peer))
            save()
    save()

if __name__ == "__main__":
    main()
