"""MLA speed and memory on one GPU (issue 14): the Triton MLA decode kernel, DeepSeek-V2-Lite
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
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import sys
import time

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
BATCH, CONTEXT = 64, 4096
SEQ_4K = 4096


# ---------------------------------------------------------------- kernel

def kernel_rows(ceilings, sweep: bool) -> list[dict]:
    from archserve.kernels.attention.triton_decode import choose_num_splits
    from archserve.kernels.cuda_timing import graph_median_us
    from archserve.kernels.mla.triton_mla_decode import mla_decode, mla_decode_tiles

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for heads in (16, 128):
        for kv in ("auto", "fp8_e4m3"):
            case = make_mla_case([(1, CONTEXT)] * BATCH, num_heads=heads, kv_lora_rank=512,
                                 rope=64, nope=128, v_head=128, block_size=16,
                                 dtype=torch.bfloat16, kv_cache_dtype=kv, device="cuda",
                                 seed=0, fp8_exact_kv=False)
            meta, query = case.meta, case.absorbed_query.contiguous()
            out = torch.empty(BATCH, heads, 512, dtype=torch.bfloat16, device="cuda")
            latent_bytes = BATCH * CONTEXT * 576 * case.kv_cache.element_size()
            flops = 2.0 * BATCH * CONTEXT * heads * (576 + 512)
            default_tiles = mla_decode_tiles(heads)
            rule_splits = choose_num_splits(BATCH, -(-heads // default_tiles[0]), CONTEXT, sms)
            variants = [(None, None)]
            if sweep:
                variants += [(s, None) for s in (1, 2, 4, 8, 16) if s != rule_splits]
                variants += [(None, t) for t in ((16, 16, 4, 2), (16, 64, 4, 2), (16, 32, 8, 2),
                                                 (16, 32, 4, 3), (32, 32, 8, 2))]
            for splits, tiles in variants:
                run = functools.partial(
                    mla_decode, query, case.kv_cache, meta.block_tables, meta.seq_lens,
                    meta.query_start_loc, out, num_seqs=BATCH, max_seq_len=CONTEXT,
                    scale=case.scale, k_scale=case.k_scale, num_sms=sms, num_splits=splits,
                    tiles=tiles)
                us, how = graph_median_us(run, 20)
                row = {"heads": heads, "kv": kv, "splits": splits or rule_splits,
                       "rule": splits is None and tiles is None,
                       "tiles": list(tiles or default_tiles), "us": us, "how": how,
                       "latent_gb_s": latent_bytes / us / 1e3,
                       "of_copy": latent_bytes / us / 1e-6 / ceilings.copy_bytes_per_s,
                       "tflops": flops / us / 1e6}
                rows.append(row)
                print(f"mla decode H={heads:3d} {kv:8s} splits {row['splits']:2d} tiles "
                      f"{row['tiles']}{' (rule)' if row['rule'] else ''}: {us:8.1f} us, "
                      f"{row['latent_gb_s']:7.0f} GB/s = {row['of_copy']:.0%} of copy, "
                      f"{row['tflops']:.0f} TFLOP/s", flush=True)
            _release()
    return rows


# ---------------------------------------------------------------- engine

def _engine(path: str, max_num_seqs: int, max_model_len: int):
    from archserve.engine.config import EngineConfig
    from archserve.engine.llm_engine import LLMEngine
    return LLMEngine(EngineConfig(model=path, dtype="bfloat16", load_format="dummy",
                                  max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                  skip_tokenizer_init=True))


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


def engine_rows(ceilings) -> tuple[dict, object]:
    t0 = time.perf_counter()
    engine = _engine(V2_LITE, 256, 4096 + 128)
    facts = model_facts(engine)
    routes = {r.layer: r.backend for r in engine.report.routes}
    result = {"model": "deepseek-v2-lite", "start_s": time.perf_counter() - t0,
              "routes": routes, "graphs": engine.report.graph_sizes,
              "canary": engine.report.canary,
              "active_bytes_b1": facts.weights().bytes_per_step,
              "all_weight_bytes": facts.weight_bytes + facts.expert_bytes}
    print(f"deepseek-v2-lite routes: {routes}", flush=True)
    result["b1 128/256"] = _workload(engine, ceilings, 1, 128, 256)
    result["256x1024/128"] = _workload(engine, ceilings, 256, 1024, 128)
    return result, engine


# ---------------------------------------------------------------- KV sizing

def kv_rows(engine) -> list[dict]:
    """Per-token KV bytes from the engine's own sizing rule (kv_cache.bytes_per_block), MLA
    against MHA, and the 4096-token sequences a pool of the same bytes holds."""
    from archserve.loader.config import load_hf_model_config

    rows = []
    for name, path, layers in (("deepseek-v2-lite", V2_LITE, None),
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


def _release() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", default="all", choices=("kernel", "engine", "kv", "all"))
    parser.add_argument("--sweep", action="store_true", help="kernel: splits and tiles sweep")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("mla_perf.py needs a CUDA GPU")
    device = torch.device("cuda")
    ceilings = load_or_measure(device)
    result: dict = {"device": torch.cuda.get_device_name(), "ceilings": ceilings.describe(),
                    "kernel": [], "engine": None, "kv": []}
    print(ceilings.describe(), flush=True)
    if args.part in ("kernel", "all"):
        result["kernel"] = kernel_rows(ceilings, args.sweep)
    engine = None
    if args.part in ("engine", "all"):
        result["engine"], engine = engine_rows(ceilings)
    elif args.part == "kv":
        engine = _engine(V2_LITE, 256, 4096 + 128)
    if args.part in ("kv", "engine", "all"):
        result["kv"] = kv_rows(engine)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
