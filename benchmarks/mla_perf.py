"""MLA speed and memory on one GPU: the Triton MLA decode kernel, DeepSeek-V2-Lite
through the engine with dummy bf16 weights, and what the latent cache buys in sequences.

- ``--part kernel``: the MLA decode kernel at batch 64 x context 4096 (16 heads, V2-Lite;
  128 heads, V3), bf16 and e4m3 latent, timed as CUDA-graph replays: GB/s of latent read
  (batch x context x 576 values, once) against the measured copy bandwidth
  (engine/ceilings.py; ~4.3 TB/s on an H200). Target: >= 70% at 16 heads. At 128 heads the
  kernel does 128 x 2 x (576 + 512) FLOPs per latent row of 1152 bytes, about the H200's
  FLOP/byte ridge, so its row also shows TFLOP/s. A split and tile sweep follows (the rule's
  choice is marked), to tune ``mla_decode_tiles`` / the split rule from.
- ``--part engine``: V2-Lite (benchmarks/models/deepseek-v2-lite, the real config): batch-1
  decode (128 in, 256 out) step time against its floor (dense weights, the 6 routed experts
  per layer one token touches, LM head, the latent cache, over the copy bandwidth; as
  moe_perf.py), and 256 x 1024/128 output tok/s and MBU.
- ``--part kv``: KV bytes per token and the concurrent 4096-token sequences the engine's KV
  pool holds, against the same model with an MHA-sized cache (per head K of nope + rope and
  V of v_head_dim, bf16) in the same bytes; for V2-Lite (the running engine's pool) and the
  DeepSeek-V3 shape (benchmarks/models/deepseek-v3-4l: V3 with 4 layers; per-token numbers
  are scaled to V3's 61 layers).

    python3 benchmarks/mla_perf.py [--part kernel|engine|kv|all] [--sweep] [--out F.json]
    TRITON_INTERPRET=1 python3 benchmarks/mla_perf.py --tiny   # CPU smoke run, tiny shapes
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from archserve.bench.offline import run_offline  # noqa: E402
from archserve.bench.roofline import analyze, model_facts  # noqa: E402
from archserve.bench.workload import random_requests  # noqa: E402
from archserve.engine.ceilings import load_or_measure  # noqa: E402
from archserve.engine.kv_cache import bytes_per_block  # noqa: E402
from archserve.kernels.mla.cases import make_mla_case  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
V2_LITE = os.path.join(HERE, "models", "deepseek-v2-lite")
V3_4L = os.path.join(HERE, "models", "deepseek-v3-4l")
V3_LAYERS = 61
SEQ_4K = 4096


@dataclass(frozen=True)
class Plan:
    """The sizes one run measures: DeepSeek's on a GPU, or tiny ones for a CPU smoke run
    (--tiny: a V2-Lite config shrunk, the kernel under Triton's interpreter) that goes
    through every line the GPU run does, so an argument error costs no device time."""
    v2_path: str
    dtype: torch.dtype                   # the kernel's
    engine_dtype: str = "bfloat16"
    batch: int = 64                      # kernel: sequences x context tokens
    context: int = 4096
    heads: tuple[int, ...] = (16, 128)   # V2-Lite, V3
    kv_lora_rank: int = 512
    rope: int = 64
    nope: int = 128
    v_head: int = 128
    max_model_len: int = 4096 + 128
    workloads: tuple[tuple[int, int, int], ...] = ((1, 128, 256), (256, 1024, 128))


def tiny_plan(folder: str) -> Plan:
    with open(os.path.join(V2_LITE, "config.json")) as f:
        config = json.load(f)
    config.update(hidden_size=64, intermediate_size=96, num_attention_heads=16,
                  num_key_value_heads=16, kv_lora_rank=32, qk_rope_head_dim=16,
                  qk_nope_head_dim=16, v_head_dim=24, moe_intermediate_size=32,
                  n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                  num_hidden_layers=2, vocab_size=256, bos_token_id=0, eos_token_id=1,
                  max_position_embeddings=256,
                  rope_scaling={**config["rope_scaling"], "original_max_position_embeddings": 64,
                                "factor": 4})
    path = os.path.join(folder, "tiny-deepseek-v2-lite")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return Plan(v2_path=path, dtype=torch.float16, engine_dtype="float32", batch=2, context=64, heads=(16,),
                kv_lora_rank=32, rope=16, nope=16, v_head=24, max_model_len=256,
                workloads=((1, 16, 32), (8, 64, 16)))




# ---------------------------------------------------------------- kernel

def kernel_rows(ceilings, sweep: bool, plan: Plan, device: torch.device,
                tiles_only: list[tuple] = (), splits_only: list[int] = ()) -> list[dict]:
    """The kernel table; with ``tiles_only`` or ``splits_only``, a quick comparison: the
    rule, the rule's tiles at those splits and those tiles alone, bf16 latent, the model's
    first head count."""
    from archserve.kernels.mla.triton_mla_decode import (
        mla_decode,
        mla_decode_tiles,
        mla_num_splits,
    )

    cuda = device.type == "cuda"
    sms = torch.cuda.get_device_properties(0).multi_processor_count if cuda else 4
    batch, context, rank = plan.batch, plan.context, plan.kv_lora_rank
    width = rank + plan.rope
    rows = []
    quick = bool(tiles_only or splits_only)
    for heads in plan.heads[:1] if quick else plan.heads:
        for kv in ("auto",) if quick else ("auto", "fp8_e4m3"):
            case = make_mla_case([(1, context)] * batch, num_heads=heads, kv_lora_rank=rank,
                                 rope=plan.rope, nope=plan.nope, v_head=plan.v_head,
                                 block_size=16, dtype=plan.dtype, kv_cache_dtype=kv,
                                 device=device.type, seed=0, fp8_exact_kv=False)
            meta, query = case.meta, case.absorbed_query.contiguous()
            out = torch.empty(batch, heads, rank, dtype=plan.dtype, device=device)
            latent_bytes = batch * context * width * case.kv_cache.element_size()
            flops = 2.0 * batch * context * heads * (width + rank)
            rule_splits = mla_num_splits(batch, heads, context, sms,
                                         mla_decode_tiles(heads)[0])
            variants = [(None, None)]
            if sweep:
                variants += [(s, None) for s in (1, 2, 4, 8, 16) if s != rule_splits]
                variants += [(None, t) for t in ((16, 16, 4, 2, False), (16, 64, 4, 2, False),
                                                 (16, 32, 8, 2, False), (16, 32, 4, 3, False),
                                                 (32, 32, 8, 2, False))]
            if quick:
                variants += [(s, None) for s in splits_only]
                variants += [(None, t) for t in tiles_only]
            else:   # keys as rows (wgmma-sized operands), until one is chosen
                variants += [(None, t) for t in ((16, 64, 4, 2, True), (16, 64, 8, 2, True),
                                                 (16, 32, 4, 2, True), (16, 128, 8, 2, True))]
            for splits, tiles in variants:
                shown = list(tiles or mla_decode_tiles(heads, splits or rule_splits, context))
                run = functools.partial(
                    mla_decode, query, case.kv_cache, meta.block_tables, meta.seq_lens,
                    meta.query_start_loc, out, num_seqs=batch, max_seq_len=context,
                    scale=case.scale, k_scale=case.k_scale, num_sms=sms, num_splits=splits,
                    tiles=tiles)
                try:
                    us, how = _time_us(run, cuda)
                except Exception as exc:  # noqa: BLE001 - a tile that does not fit is a row too
                    print(f"mla decode H={heads:3d} {kv:8s} tiles {shown}: "
                          f"does not run here ({type(exc).__name__}: {str(exc)[:80]})", flush=True)
                    rows.append({"heads": heads, "kv": kv, "tiles": shown,
                                 "error": f"{type(exc).__name__}: {exc}"})
                    continue
                row = {"heads": heads, "kv": kv, "splits": splits or rule_splits,
                       "rule": splits is None and tiles is None,
                       "tiles": shown, "us": us, "how": how,
                       "latent_gb_s": latent_bytes / us / 1e3,
                       "of_copy": latent_bytes / us / 1e-6 / ceilings.copy_bytes_per_s,
                       "tflops": flops / us / 1e6}
                rows.append(row)
                print(f"mla decode H={heads:3d} {kv:8s} splits {row['splits']:2d} tiles "
                      f"{row['tiles']}{' (rule)' if row['rule'] else ''}: {us:8.1f} us, "
                      f"{row['latent_gb_s']:7.0f} GB/s = {row['of_copy']:.0%} of copy, "
                      f"{row['tflops']:.0f} TFLOP/s", flush=True)
            del case, meta, query, out
            _release(device)
    return rows


def _time_us(run, cuda: bool) -> tuple[float, str]:  # noqa: ANN001
    if cuda:
        from archserve.kernels.cuda_timing import graph_median_us
        return graph_median_us(run, 20)
    run()   # the smoke run's interpreter: one call, timed only to fill the row
    t0 = time.perf_counter()
    run()
    return (time.perf_counter() - t0) * 1e6, "interpreted"


# ---------------------------------------------------------------- engine

def _engine(plan: Plan, max_num_seqs: int):
    from archserve.engine.config import EngineConfig
    from archserve.engine.llm_engine import LLMEngine
    return LLMEngine(EngineConfig(model=plan.v2_path, dtype=plan.engine_dtype, load_format="dummy", max_model_len=plan.max_model_len,
                                  max_num_seqs=max_num_seqs, skip_tokenizer_init=True))


def _workload(engine, ceilings, num: int, input_len: int, output_len: int) -> dict:
    requests = random_requests(num, input_len, output_len, engine.model_config.vocab_size,
                               seed=num)
    throughput, trace = run_offline(engine, requests, True, show_progress=False)
    roof = analyze(trace, model_facts(engine), ceilings)
    step_ms, floor_ms = roof.decode_step_s_mean * 1e3, roof.decode_floor_s_mean * 1e3
    row = {"requests": num, "input_len": input_len, "output_len": output_len,
           "output_tok_s": throughput.output_tokens_per_s, "elapsed_s": throughput.elapsed_s,
           "decode_step_ms": step_ms, "decode_floor_ms": floor_ms,
           "step_over_floor": step_ms / floor_ms if floor_ms else None, "mbu": roof.mbu}
    print(f"deepseek-v2-lite {num}x{input_len}/{output_len}: step {step_ms:.3f} ms / floor "
          f"{floor_ms:.3f} ms = {row['step_over_floor']:.2f}x; {row['output_tok_s']:.1f} out "
          f"tok/s; MBU {row['mbu']:.1%}", flush=True)
    return row


def engine_rows(ceilings, plan: Plan, save) -> tuple[dict, object]:  # noqa: ANN001
    """V2-Lite's rows; ``save(result)`` after each, so a run cut short keeps them."""
    t0 = time.perf_counter()
    engine = _engine(plan, 256)
    facts = model_facts(engine)
    routes = {r.layer: r.backend for r in engine.report.routes}
    result = {"model": "deepseek-v2-lite", "start_s": time.perf_counter() - t0,
              "routes": routes, "graphs": engine.report.graph_sizes,
              "canary": engine.report.canary,
              "active_bytes_b1": facts.weights().bytes_per_step,
              "all_weight_bytes": facts.weight_bytes + facts.expert_bytes}
    print(f"deepseek-v2-lite routes: {routes}", flush=True)
    for num, input_len, output_len in plan.workloads:
        name = f"b1 {input_len}/{output_len}" if num == 1 else f"{num}x{input_len}/{output_len}"
        result[name] = _workload(engine, ceilings, num, input_len, output_len)
        save(result)
    return result, engine


# ---------------------------------------------------------------- KV sizing

def kv_rows(engine, plan: Plan) -> list[dict]:
    """Per-token KV bytes from the engine's own sizing rule (kv_cache.bytes_per_block), MLA
    against MHA, and the 4096-token sequences a pool of the same bytes holds."""
    from archserve.loader.config import load_hf_model_config

    rows = []
    for name, path, layers in (("deepseek-v2-lite", plan.v2_path, None),
                               ("deepseek-v3", V3_4L, V3_LAYERS)):
        mc = load_hf_model_config(path)
        m, n_layers = mc.mla, layers or mc.num_layers
        mla_token = bytes_per_block(n_layers, 1, mc.kv_cache_heads, mc.kv_cache_head_size,
                                    torch.bfloat16, mc.kv_cache_planes)
        # MHA: per head, keys of nope + rope and values of v_head_dim.
        mha_token = (bytes_per_block(n_layers, 1, mc.num_heads, m.qk_nope_head_dim
                                     + m.qk_rope_head_dim, torch.bfloat16, 1)
                     + bytes_per_block(n_layers, 1, mc.num_heads, m.v_head_dim,
                                       torch.bfloat16, 1))
        row = {"model": name, "layers": n_layers, "mla_bytes_per_token": mla_token,
               "mha_bytes_per_token": mha_token, "ratio": mha_token / mla_token}
        if engine is not None and name == "deepseek-v2-lite":
            block = engine.report.block_size
            pool = engine.report.num_blocks * block
            pool_bytes = engine.report.num_blocks * bytes_per_block(
                n_layers, block, mc.kv_cache_heads, mc.kv_cache_head_size, torch.bfloat16,
                mc.kv_cache_planes)
            per_seq_blocks = -(-SEQ_4K // block)
            row.update(pool_tokens=pool, pool_bytes=pool_bytes,
                       max_4k_seqs_mla=engine.report.num_blocks // per_seq_blocks,
                       max_4k_seqs_mha=pool_bytes // (mha_token * per_seq_blocks * block))
        rows.append(row)
        extra = (f"; pool {row['pool_bytes'] / 2**30:.1f} GiB holds {row['max_4k_seqs_mla']} "
                 f"4k-token sequences (MHA-sized: {row['max_4k_seqs_mha']})"
                 if "pool_bytes" in row else "")
        print(f"{name} ({n_layers} layers): KV {mla_token / 1024:.1f} KiB/token MLA vs "
              f"{mha_token / 1024:.1f} KiB/token MHA = {row['ratio']:.1f}x{extra}", flush=True)
    return rows


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", default="all", choices=("kernel", "engine", "kv", "all"))
    parser.add_argument("--sweep", action="store_true", help="kernel: splits and tiles sweep")
    parser.add_argument("--tiles", nargs="+", default=None,
                        help="kernel: time the rule and these tiles only, each "
                             "BLOCK_H,BLOCK_N,warps,stages[,keys_as_rows]")
    parser.add_argument("--splits", default="",
                        help="kernel: time the rule and the rule's tiles at these splits "
                             "only (with --tiles: those too)")
    parser.add_argument("--tiny", action="store_true",
                        help="CPU smoke run on tiny shapes (the kernel part needs "
                             "TRITON_INTERPRET=1, else it is left out)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.tiny:
        device, plan = torch.device("cpu"), tiny_plan(tempfile.mkdtemp(prefix="mla_perf_"))
    elif torch.cuda.is_available():
        device, plan = torch.device("cuda"), Plan(v2_path=V2_LITE, dtype=torch.bfloat16)
    else:
        sys.exit("mla_perf.py needs a CUDA GPU (or --tiny for a CPU smoke run)")
    ceilings = load_or_measure(device)
    result: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "ceilings": ceilings.describe(), "kernel": [], "engine": None, "kv": []}

    def save(engine_result: dict | None = None) -> None:
        if engine_result is not None:
            result["engine"] = engine_result
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1, default=str)

    print(ceilings.describe(), flush=True)
    if args.part in ("kernel", "all"):
        if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
            tiles = [tuple(int(v) for v in t.split(",")) for t in args.tiles or ()]
            if any(len(t) not in (4, 5) for t in tiles):
                parser.error("--tiles: BLOCK_H,BLOCK_N,warps,stages[,keys_as_rows] each")
            tiles = [t[:4] + (bool(t[4]) if len(t) == 5 else False,) for t in tiles]
            splits = [int(n) for n in args.splits.split(",") if n]
            result["kernel"] = kernel_rows(ceilings, args.sweep, plan, device, tiles, splits)
            save()
        else:
            print("kernel part left out: on a CPU it runs under TRITON_INTERPRET=1", flush=True)
    engine = None
    if args.part in ("engine", "all"):
        result["engine"], engine = engine_rows(ceilings, plan, save)
    elif args.part == "kv":
        engine = _engine(plan, 256)
    if args.part in ("kv", "engine", "all"):
        result["kv"] = kv_rows(engine, plan)
    save()


if __name__ == "__main__":
    main()
