"""Sparse MLA speed on one GPU: the TRITON_MLA_SPARSE kernels, and DeepSeek-V3.2 cut to four
layers (benchmarks/models/deepseek-v32-4l) beside the same cut of V3 (deepseek-v3-4l, dense
MLA), both with dummy bf16 weights.

- ``--part kernel``: the indexed MLA decode kernel at batch 64, each row attending to 2048
  random positions of an 8192-token context (16 heads: one tensor-parallel rank of eight;
  128: V3.2 whole), over 16-bit and fp8_ds_mla latents, timed as CUDA-graph replays with the
  rule's tiles and each candidate the start-up tuner tries (the row: the tiles the tuner
  would choose): GB/s of the selected latent rows (64 x 2048 rows of 1152 or 656 bytes)
  against the measured copy bandwidth (engine/ceilings.py). Then the indexer (scores and
  top-k) of one decode step, batch 1 at 8k, 32k and 128k and batch 64 at 8k, 64 heads of
  128, and its top-k alone (split over the SMs as the step runs it, and one program a row).
- ``--part engine``: batch-1 decode steps (one request, 64 output tokens; the step time is
  the trace's decode mean) at contexts 2k, 8k, 32k and 128k, V3.2-4L beside V3-4L.
- ``--part throughput``: 64 prompts of 8192 tokens with 128 outputs each, output tok/s and
  the decode step, both models.

    python3 benchmarks/sparse_mla_perf.py [--part kernel|engine|throughput|all]
        [--model deepseek-v32-4l|deepseek-v3-4l] [--contexts N ...] [--out F.json]
    TRITON_INTERPRET=1 python3 benchmarks/sparse_mla_perf.py --tiny   # CPU smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, replace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from archserve.bench.offline import run_offline  # noqa: E402
from archserve.bench.roofline import analyze, model_facts  # noqa: E402
from archserve.bench.workload import random_requests  # noqa: E402
from archserve.engine.ceilings import load_or_measure  # noqa: E402
from archserve.kernels.mla.sparse_cases import make_sparse_case  # noqa: E402
from archserve.kernels.sparse_mla.triton_topk import (  # noqa: E402
    select_topk_triton,
    topk_splits,
)

HERE = os.path.dirname(os.path.abspath(__file__))
V32_4L = os.path.join(HERE, "models", "deepseek-v32-4l")
V3_4L = os.path.join(HERE, "models", "deepseek-v3-4l")


@dataclass(frozen=True)
class Plan:
    """What one run measures: V3.2's sizes on a GPU, or tiny ones on a CPU (--tiny) that go
    through every line the GPU run does, so an argument error costs no device time."""

    models: tuple[tuple[str, str], ...]       # (name, config dir): sparse first
    dtype: torch.dtype = torch.bfloat16
    engine_dtype: str = "bfloat16"
    batch: int = 64
    topk: int = 2048
    context: int = 8192
    heads: tuple[int, ...] = (16, 128)
    kv_lora_rank: int = 512
    rope: int = 64
    index_heads: int = 64
    index_dim: int = 128
    indexer_steps: tuple[tuple[int, int], ...] = ((1, 8192), (1, 32768), (1, 131072),
                                                  (64, 8192))
    decode_contexts: tuple[int, ...] = (2048, 8192, 32768, 131072)
    decode_output: int = 64
    throughput: tuple[int, int, int] = (64, 8192, 128)


def tiny_plan(folder: str) -> Plan:
    """V3.2-4L and V3-4L shrunk (hidden 64, 16 heads, latent 32 + 16, indexer 8 x 32,
    top-8), and the kernels at tiny sizes."""
    models = []
    for name, path in (("deepseek-v32-4l", V32_4L), ("deepseek-v3-4l", V3_4L)):
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        config.update(hidden_size=64, intermediate_size=96, num_attention_heads=16,
                      num_key_value_heads=16, kv_lora_rank=32, q_lora_rank=48,
                      qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24,
                      moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                      n_group=2, topk_group=1, first_k_dense_replace=1, vocab_size=256,
                      max_position_embeddings=512,
                      rope_scaling={**config["rope_scaling"],
                                    "original_max_position_embeddings": 64, "factor": 8})
        if "index_topk" in config:
            config.update(index_topk=8, index_head_dim=32, index_n_heads=8)
        tiny = os.path.join(folder, name)
        os.makedirs(tiny, exist_ok=True)
        with open(os.path.join(tiny, "config.json"), "w") as f:
            json.dump(config, f)
        models.append((name, tiny))
    return Plan(models=tuple(models), dtype=torch.float16, engine_dtype="float32", batch=2,
                topk=8, context=64, heads=(16,), kv_lora_rank=32, rope=16, index_heads=8,
                index_dim=32, indexer_steps=((1, 64), (2, 40)), decode_contexts=(8, 96),
                decode_output=4, throughput=(2, 40, 4))


# ---------------------------------------------------------------- kernel

def kernel_rows(ceilings, plan: Plan, device: torch.device) -> list[dict]:
    """The indexed decode kernel's GB/s, and the indexer's time per decode step."""
    rows = []
    for heads in plan.heads:
        for kv in ("auto", "fp8_ds_mla"):
            rows.append(_sparse_decode_row(ceilings, plan, heads, kv, device))
            _release(device)
    for batch, context in plan.indexer_steps:
        rows.append(_indexer_row(plan, batch, context, device))
        _release(device)
    return rows


def _sparse_decode_row(ceilings, plan: Plan, heads: int, kv: str, device: torch.device  # noqa: ANN001
                       ) -> dict:
    from archserve.kernels.mla.triton_mla_decode import mla_decode
    from archserve.kernels.mla.triton_sparse_mla import TritonSparseMlaImpl
    from archserve.kernels.mla.tuning import MlaShape, tune_mla_tiles

    case = _case([(1, plan.context)] * plan.batch, plan, heads, kv, device)
    impl = TritonSparseMlaImpl(layout=case.layout)
    cache, meta = case.written_cache(), case.meta
    row_seq, row_len = impl._rows(meta, plan.batch)
    indices, counts = impl._select(case.indexer, cache, meta, row_seq, row_len, plan.topk)
    query = case.absorbed_query.contiguous()
    out = torch.empty(plan.batch, heads, plan.kv_lora_rank, dtype=plan.dtype, device=device)
    starts = torch.arange(plan.batch + 1, dtype=torch.int32, device=device)
    sms = torch.cuda.get_device_properties(0).multi_processor_count if device.type == "cuda" else 4

    def run(tiles) -> None:  # noqa: ANN001
        mla_decode(query, cache, meta.block_tables, counts, starts, out, num_seqs=plan.batch,
                   max_seq_len=plan.topk, scale=case.scale, num_sms=sms, indices=indices,
                   row_seq=row_seq, layout=case.layout, tiles=tiles)

    # The start-up tuner's own choice (tuning.py, uncached), timed here as the row's other
    # timings are: the rule's tiles, then each candidate against them.
    read = plan.batch * plan.topk * case.layout.latent_bytes
    timed, how = {}, ""

    def timer(_shape, tiles) -> tuple[float, torch.Tensor]:  # noqa: ANN001
        nonlocal how
        timed[tiles], how = _time_us(lambda: run(tiles), device.type == "cuda")
        run(tiles)
        return timed[tiles], out.clone()

    shape = MlaShape(heads, plan.kv_lora_rank, plan.rope, plan.dtype, kv, 64,
                     sparse_topk=plan.topk, index_dim=plan.index_dim)
    tiles, _, _ = tune_mla_tiles(shape, None, device, timer=timer)
    us = timed[tiles]
    row = {"what": "sparse decode", "heads": heads, "kv": kv, "us": us, "how": how,
           "tiles": "rule" if tiles is None else list(tiles),
           "each_us": {"rule" if t is None else str(list(t)): v for t, v in timed.items()},
           "gb_s": read / us / 1e3, "of_copy": read / us / 1e-6 / ceilings.copy_bytes_per_s}
    print(f"sparse decode H={heads:3d} {kv:10s} {plan.batch} x top-{plan.topk}: {us:8.1f} us, "
          f"{row['gb_s']:7.0f} GB/s = {row['of_copy']:.0%} of copy ({row['tiles']}; "
          f"{', '.join(f'{k} {v:.1f}' for k, v in row['each_us'].items())} us)", flush=True)
    return row


def _indexer_row(plan: Plan, batch: int, context: int, device: torch.device) -> dict:
    from archserve.kernels.mla.triton_sparse_mla import TritonSparseMlaImpl

    case = _case([(1, context)] * batch, plan, plan.heads[0], "auto", device)
    impl = TritonSparseMlaImpl(layout=case.layout)
    cache, meta = case.written_cache(), case.meta
    row_seq, row_len = impl._rows(meta, batch)

    def select() -> None:
        impl._select(case.indexer, cache, meta, row_seq, row_len, plan.topk)

    us, how = _time_us(select, device.type == "cuda")
    keys = batch * context * case.layout.index_bytes
    # The top-k alone, as the step runs it (a row split over programs when there are few
    # rows) and one program a row: where the indexer's time goes, and what the split saves.
    scores = torch.randn(batch, context, device=device)
    lengths = torch.full((batch,), context, dtype=torch.int32, device=device)
    sms = impl._sm_count(lengths)
    splits = topk_splits(batch, context, sms)
    topk_us = {}
    for name, n in (("split", splits), ("one program a row", 1)):
        topk_us[name], _ = _time_us(
            lambda n=n: select_topk_triton(scores, lengths, plan.topk, splits=n),
            device.type == "cuda")
    print(f"indexer (scores + top-{plan.topk}) {batch} x {context}: {us:8.1f} us, "
          f"{keys / us / 1e3:6.0f} GB/s of keys; top-k alone {topk_us['split']:.1f} us "
          f"({splits} slices a row), one program a row {topk_us['one program a row']:.1f} us",
          flush=True)
    return {"what": "indexer", "batch": batch, "context": context, "us": us, "how": how,
            "key_gb_s": keys / us / 1e3, "topk_splits": splits,
            "topk_us": topk_us["split"], "topk_one_program_us": topk_us["one program a row"]}


def _case(seqs, plan: Plan, heads: int, kv: str, device: torch.device):  # noqa: ANN001, ANN202
    return make_sparse_case(seqs, topk=plan.topk, num_heads=heads,
                            kv_lora_rank=plan.kv_lora_rank, rope=plan.rope, nope=128,
                            v_head=128, index_heads=plan.index_heads, index_dim=plan.index_dim,
                            block_size=64, dtype=plan.dtype, kv_cache_dtype=kv,
                            device=device.type)


def _time_us(run, cuda: bool) -> tuple[float, str]:  # noqa: ANN001
    if cuda:
        from archserve.kernels.cuda_timing import graph_median_us
        return graph_median_us(run, 20)
    run()   # the smoke run's interpreter: one call, timed only to fill the row
    t0 = time.perf_counter()
    run()
    return (time.perf_counter() - t0) * 1e6, "interpreted"


# ---------------------------------------------------------------- engine

def _engine(path: str, plan: Plan, max_model_len: int, max_num_seqs: int):  # noqa: ANN202
    from archserve.engine.config import EngineConfig
    from archserve.engine.llm_engine import LLMEngine
    return LLMEngine(EngineConfig(model=path, dtype=plan.engine_dtype, load_format="dummy",
                                  max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                  skip_tokenizer_init=True))


def _run(engine, ceilings, name: str, num: int, input_len: int, output_len: int) -> dict:  # noqa: ANN001
    requests = random_requests(num, input_len, output_len, engine.model_config.vocab_size,
                               seed=num)
    throughput, trace = run_offline(engine, requests, True, show_progress=False)
    roof = analyze(trace, model_facts(engine), ceilings)
    row = {"model": name, "requests": num, "input_len": input_len, "output_len": output_len,
           "decode_step_ms": roof.decode_step_s_mean * 1e3,
           "decode_floor_ms": roof.decode_floor_s_mean * 1e3,
           "output_tok_s": throughput.output_tokens_per_s, "elapsed_s": throughput.elapsed_s}
    print(f"{name} {num} x {input_len}/{output_len}: decode step {row['decode_step_ms']:.3f} "
          f"ms (floor {row['decode_floor_ms']:.3f}), {row['output_tok_s']:.1f} out tok/s, "
          f"{row['elapsed_s']:.1f} s", flush=True)
    return row


def engine_rows(ceilings, plan: Plan, part: str, save) -> list[dict]:  # noqa: ANN001
    """Batch-1 decode steps by context (``part`` engine) or the throughput run, for each
    model; ``save`` after every row, so a run cut short keeps what it measured."""
    rows = []
    longest = max(plan.decode_contexts) + plan.decode_output + 64
    for name, path in plan.models:
        if part == "engine":
            engine = _engine(path, plan, longest, 8)
            routes = {r.layer: r.backend for r in engine.report.routes}
            print(f"{name}: attention {routes.get('attention')}, graphs "
                  f"{engine.report.graph_sizes[:4]}...", flush=True)
            for context in plan.decode_contexts:
                rows.append(_run(engine, ceilings, name, 1, context, plan.decode_output))
                save(rows)
        else:
            num, input_len, output_len = plan.throughput
            engine = _engine(path, plan, input_len + output_len + 64, num)
            rows.append(_run(engine, ceilings, name, num, input_len, output_len))
            save(rows)
        del engine
        _release(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    return rows


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        from archserve.engine.heap import free_dropped_engines
        free_dropped_engines("cuda")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", default="all",
                        choices=("kernel", "engine", "throughput", "all"))
    parser.add_argument("--model", action="append", default=None,
                        choices=("deepseek-v32-4l", "deepseek-v3-4l"),
                        help="engine/throughput: this model only (repeatable; default both)")
    parser.add_argument("--contexts", type=int, nargs="+", default=None,
                        help="engine: the batch-1 contexts (default 2048 8192 32768 131072)")
    parser.add_argument("--tiny", action="store_true",
                        help="CPU smoke run on tiny shapes (the kernel part needs "
                             "TRITON_INTERPRET=1, else it is left out)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.tiny:
        device, plan = torch.device("cpu"), tiny_plan(tempfile.mkdtemp(prefix="sparse_mla_"))
    elif torch.cuda.is_available():
        device = torch.device("cuda")
        plan = Plan(models=(("deepseek-v32-4l", V32_4L), ("deepseek-v3-4l", V3_4L)))
    else:
        sys.exit("sparse_mla_perf.py needs a CUDA GPU (or --tiny for a CPU smoke run)")
    if args.model:
        plan = replace(plan, models=tuple(m for m in plan.models if m[0] in args.model))
    if args.contexts:
        plan = replace(plan, decode_contexts=tuple(args.contexts))
    ceilings = load_or_measure(device)
    result: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "ceilings": ceilings.describe()}

    def save(key: str, value) -> None:  # noqa: ANN001
        result[key] = value
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1, default=str)

    print(ceilings.describe(), flush=True)
    if args.part in ("kernel", "all"):
        if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
            save("kernel", kernel_rows(ceilings, plan, device))
        else:
            print("kernel part left out: on a CPU it runs under TRITON_INTERPRET=1", flush=True)
    for part in ("engine", "throughput"):
        if args.part in (part, "all"):
            engine_rows(ceilings, plan, part, lambda rows, part=part: save(part, rows))


if __name__ == "__main__":
    main()
