"""Tensor-parallel speed on one machine's GPUs (issues 15 and 16).

  python3 benchmarks/tp_perf.py allreduce [--ranks 2] [--out FILE.json]
      all-reduce latency and bus bandwidth, 4 KiB .. 256 MiB, bf16: NCCL eager, NCCL in a
      CUDA graph, and the one-shot peer-memory path (up to its 8 MiB buffer).
  python3 benchmarks/tp_perf.py engine [--model DIR] [--tp 1 2] [--out DIR]
      a model shape with dummy bf16 weights (default Llama-3-8B; the 70B rows:
      --model benchmarks/models/llama-3-70b --tp 4 8), each TP size in a process of its own:
      - start-up: its time, the CUDA graphs captured, the KV pool printed at start-up beside
        each rank's memory left (the gpu_memory_utilization share minus the memory in use
        once started: about zero when the pool took the memory it was given);
      - greedy output of short prompts before and after the runs below: identical;
      - batch-1 decode (1 x 128/512) and throughput (256 x 256/128), each decode step against
        its floor: one rank's bytes over the measured copy bandwidth plus 2 all-reduces per
        layer at the step's message size, measured first on as many GPUs
        (archserve/bench/tp_floor.py). Target: step <= 1.4x floor.
      With TP=1 among the sizes, every other size's ratios to it (targets at TP=2: decode
      step <= 0.62x TP=1; throughput >= 1.6x TP=1).

Bus bandwidth is NCCL's convention: 2 (n-1)/n x bytes / time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SIZES = [1 << k for k in range(12, 29)]     # 4 KiB .. 256 MiB
L8 = "benchmarks/models/llama-3-8b"
DTYPE_BYTES = 2                             # bf16 activations: the all-reduce messages
STEP_OVER_FLOOR_TARGET = 1.4                # at 4 and 8 GPUs
DECODE_RATIO_TARGET, THROUGHPUT_RATIO_TARGET = 0.62, 1.6     # TP=2 against TP=1
# A rank's unused share of its GPU after start-up, as a fraction of the GPU, within which
# the KV pool is taken to match the memory left (graphs and activations use some reserve).
KV_MATCH_TOLERANCE = 0.02
GREEDY_PROMPTS, GREEDY_TOKENS = 4, 32


def _time_us(fn, iters: int) -> float:
    from archserve.kernels.cuda_timing import mean_ms
    return 1000 * mean_ms(fn, iters, warmup=3)


def _allreduce_rank(rank: int, size: int, init: str, sizes: list[int], queue) -> None:
    import torch
    import torch.distributed as dist

    from archserve.distributed.peer_all_reduce import MAX_BYTES, PeerAllReduce
    from archserve.distributed.process_group import RankPlace, join_group

    group = join_group(RankPlace(rank, size, f"cuda:{rank}", init))
    peer = PeerAllReduce(group, torch.bfloat16)
    peer.max_bytes = MAX_BYTES
    rows = []
    for nbytes in sizes:
        x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda")
        iters = 200 if nbytes <= 1 << 20 else 20
        eager = _time_us(lambda x=x: dist.all_reduce(x), iters)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            dist.all_reduce(x)                     # warm-up on the capture stream
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(10):
                    dist.all_reduce(x)
        in_graph = _time_us(graph.replay, max(2, iters // 10)) / 10
        one_shot = _time_us(lambda x=x: peer(x), iters) if nbytes <= MAX_BYTES else None
        bus = 2 * (size - 1) / size * nbytes / (eager * 1e-6) / 1e9
        rows.append({"bytes": nbytes, "nccl_eager_us": eager, "nccl_graph_us": in_graph,
                     "one_shot_us": one_shot, "nccl_bus_GBps": bus})
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def measure_allreduce(ranks: int, sizes: list[int]) -> list[dict]:
    """The all-reduce table on ``ranks`` GPUs, one row per message size in bytes."""
    import multiprocessing as mp

    from archserve.distributed.process_group import free_port
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_allreduce_rank, args=(r, ranks, init, sizes, queue))
             for r in range(ranks)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=600)
    for p in procs:
        p.join()
    return rows


def allreduce(args) -> None:
    rows = measure_allreduce(args.ranks, SIZES)
    print(f"{'size':>10} {'NCCL eager us':>14} {'NCCL graph us':>14} {'one-shot us':>12} "
          f"{'bus GB/s':>9}")
    for r in rows:
        one = f"{r['one_shot_us']:.1f}" if r["one_shot_us"] is not None else "-"
        print(f"{r['bytes'] >> 10:>8} K {r['nccl_eager_us']:>14.1f} {r['nccl_graph_us']:>14.1f} "
              f"{one:>12} {r['nccl_bus_GBps']:>9.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)


# ---------------------------------------------------------------- engine

def workload(text: str) -> tuple[int, int, int]:
    """"256x256/128" -> (256 requests, 256 prompt tokens, 128 output tokens); "128/512"
    is one request."""
    count, _, lengths = text.rpartition("x")
    prompt, _, output = lengths.partition("/")
    try:
        shape = int(count or 1), int(prompt), int(output)
    except ValueError:
        shape = (0,)
    if min(shape) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not N x IN/OUT (e.g. 256x256/128)")
    return shape


def workload_text(shape: tuple[int, int, int]) -> str:
    return f"{shape[0]}x{shape[1]}/{shape[2]}"


def decode_message_sizes(hidden_size: int, max_tokens: int) -> list[int]:
    """Powers of two from one token's all-reduce message to ``max_tokens`` tokens'."""
    def log2_ceil(n: int) -> int:
        return (n - 1).bit_length()
    low = log2_ceil(hidden_size * DTYPE_BYTES)
    high = log2_ceil(max_tokens * hidden_size * DTYPE_BYTES)
    return [1 << k for k in range(low, high + 1)]


def engine(args) -> None:
    """Every TP size in a process of its own (each needs the GPUs to itself), after the
    all-reduce table of its decode messages on as many GPUs."""
    import torch
    on_gpus = torch.cuda.is_available()   # (creates no CUDA context in this process)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.model, "config.json")) as f:
        hidden_size = json.load(f)["hidden_size"]
    rows = {}
    for tp in args.tp:
        out = os.path.join(args.out, f"engine_tp{tp}.json")
        cmd = [sys.executable, os.path.abspath(__file__), "engine-one", "--model", args.model,
               "--tp", str(tp), "--dtype", args.dtype, "--max-model-len",
               str(args.max_model_len), "--b1", workload_text(args.b1), "--throughput",
               workload_text(args.throughput), "--out", out]
        if tp > 1 and on_gpus:     # (gloo ranks on a CPU: a floor without all-reduces)
            table = measure_allreduce(tp, decode_message_sizes(hidden_size,
                                                               args.throughput[0]))
            table_path = os.path.join(args.out, f"allreduce_decode_tp{tp}.json")
            with open(table_path, "w") as f:
                json.dump(table, f, indent=2)
            cmd += ["--allreduce", table_path]
        print("$", " ".join(cmd), flush=True)
        code = subprocess.run(cmd, timeout=args.timeout).returncode
        if code == 0:
            with open(out) as f:
                rows[tp] = json.load(f)
        else:
            rows[tp] = {"tp": tp, "started": False, "exit_code": code}
    summary = summarize(rows)
    print(json.dumps(summary, indent=2))
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)


def summarize(rows: dict[int, dict]) -> dict:
    """Each size's verdicts; with TP=1 among them, each other size's ratios to it."""
    summary = {}
    for tp, row in rows.items():
        if not row.get("started"):
            summary[f"tp{tp}"] = {"started": False, "exit_code": row.get("exit_code")}
            continue
        b1, tput = row["b1"], row["throughput"]
        summary[f"tp{tp}"] = {
            "started": True, "start_s": row["start_s"],
            "cuda_graphs": len(row["graph_sizes"]), "graphs_off": row["graphs_off"],
            "greedy_identical": row["greedy_identical"],
            "kv_matches_memory": row["kv_matches_memory"],
            "b1_step_ms": b1["decode_step_ms"], "b1_floor_ms": b1["floor_ms"],
            "b1_step_over_floor": b1["step_over_floor"],
            "throughput_tok_s": tput["output_tok_s"],
            "throughput_step_over_floor": tput["step_over_floor"],
            "step_over_floor_target": STEP_OVER_FLOOR_TARGET}
    one = rows.get(1)
    if one and one.get("started"):
        for tp, row in rows.items():
            if tp == 1 or not row.get("started"):
                continue
            summary[f"tp{tp}_vs_tp1"] = {
                "decode_step_ratio": row["b1"]["decode_step_ms"] / one["b1"]["decode_step_ms"],
                "decode_target": DECODE_RATIO_TARGET,
                "throughput_ratio": (row["throughput"]["output_tok_s"]
                                     / one["throughput"]["output_tok_s"]),
                "throughput_target": THROUGHPUT_RATIO_TARGET}
    return summary


def _greedy(engine, prompts: list[list[int]], tag: str) -> list[list[int]]:
    from archserve.bench.offline import bench_sampling_params

    for i, prompt in enumerate(prompts):
        engine.add_request(f"greedy-{tag}-{i}", prompt, bench_sampling_params(GREEDY_TOKENS))
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    return [tokens[f"greedy-{tag}-{i}"] for i in range(len(prompts))]


def _run(engine, facts, ceilings, table, hidden_size: int, shape: tuple[int, int, int]
         ) -> dict:
    from archserve.bench.offline import run_offline
    from archserve.bench.roofline import analyze
    from archserve.bench.tp_floor import mean_decode_floor
    from archserve.bench.workload import random_requests

    num, input_len, output_len = shape
    requests = random_requests(num, input_len, output_len, engine.model_config.vocab_size,
                               seed=num)
    throughput, trace = run_offline(engine, requests, True, show_progress=False)
    roof = analyze(trace, facts, ceilings)
    memory_s, reduce_s = mean_decode_floor(trace, facts, ceilings, table, hidden_size,
                                           DTYPE_BYTES)
    step_s, floor_s = roof.decode_step_s_mean, memory_s + reduce_s
    row = {"requests": num, "input_len": input_len, "output_len": output_len,
           "output_tokens": throughput.output_tokens, "elapsed_s": throughput.elapsed_s,
           "output_tok_s": throughput.output_tokens_per_s, "decode_step_ms": step_s * 1e3,
           "floor_memory_ms": memory_s * 1e3, "floor_allreduce_ms": reduce_s * 1e3,
           "floor_ms": floor_s * 1e3, "step_over_floor": step_s / floor_s, "mbu": roof.mbu}
    print(f"{num}x{input_len}/{output_len}: decode step {row['decode_step_ms']:.3f} ms, floor "
          f"{row['floor_ms']:.3f} ms ({row['floor_memory_ms']:.3f} memory + "
          f"{row['floor_allreduce_ms']:.3f} all-reduce) = {row['step_over_floor']:.2f}x; "
          f"{row['output_tok_s']:.1f} out tok/s", flush=True)
    return row


def engine_one(args) -> None:
    """One TP size: start, check, run both workloads, check again; a JSON row."""
    from archserve.bench.roofline import model_facts
    from archserve.bench.workload import random_requests
    from archserve.engine.ceilings import load_or_measure
    from archserve.engine.config import EngineConfig
    from archserve.engine.llm_engine import LLMEngine

    t0 = time.perf_counter()
    config = EngineConfig(model=args.model, dtype=args.dtype, load_format="dummy",
                          max_model_len=args.max_model_len,
                          max_num_seqs=args.throughput[0],
                          tensor_parallel_size=args.tp, skip_tokenizer_init=True)
    engine = LLMEngine(config)
    start_s = time.perf_counter() - t0
    try:
        print(engine.describe_route(), flush=True)
        report, mc = engine.report, engine.model_config
        table = None
        if args.allreduce:
            with open(args.allreduce) as f:
                table = json.load(f)
        # After start-up: its self-check has measured (and cached) the rank's ceilings.
        ceilings = load_or_measure(engine.runner.device)
        facts = model_facts(engine)
        # Shorter than a KV block: the second run computes the prompts again instead of
        # finding them in the prefix cache, so both runs do the same arithmetic.
        prompts = [r.prompt_token_ids for r in random_requests(
            GREEDY_PROMPTS, max(1, min(8, report.block_size - 1)), GREEDY_TOKENS,
            mc.vocab_size, seed=1)]
        before = _greedy(engine, prompts, "before")
        b1 = _run(engine, facts, ceilings, table, mc.hidden_size, args.b1)
        tput = _run(engine, facts, ceilings, table, mc.hidden_size, args.throughput)
        after = _greedy(engine, prompts, "after")
        utilization = engine.config.gpu_memory_utilization
        memory = [{"kv_pool_bytes": m.kv_pool_bytes, "weight_bytes": m.weight_bytes,
                   "total_bytes": m.total_bytes, "free_bytes": m.free_bytes,
                   "budget_left_bytes": m.budget_left_bytes(utilization)}
                  for m in report.rank_memory]
        lefts = [(m["budget_left_bytes"], m["total_bytes"]) for m in memory]
        row = {
            "tp": args.tp, "model": args.model, "started": True, "start_s": start_s,
            "graph_sizes": report.graph_sizes, "graphs_off": report.graphs_off,
            "kv_blocks": report.num_blocks, "kv_block_size": report.block_size,
            "kv_tokens": report.num_blocks * report.block_size, "kv_sizing": report.kv_sizing,
            "rank_memory": memory, "gpu_memory_utilization": utilization,
            # None on a CPU: its KV pool is a fixed budget, not the memory left.
            "kv_matches_memory": (None if any(left is None for left, _ in lefts) else
                                  all(abs(left) <= KV_MATCH_TOLERANCE * total
                                      for left, total in lefts)),
            "greedy_identical": before == after, "greedy_before": before,
            "greedy_after": after, "ceilings": ceilings.to_json(),
            "weight_bytes_per_rank": facts.weight_bytes, "b1": b1, "throughput": tput}
    finally:
        engine.shutdown()
    print(f"TP={args.tp}: started in {start_s:.1f} s, {len(report.graph_sizes)} CUDA graphs, "
          f"greedy identical across two runs: {row['greedy_identical']}, KV pool matches the "
          f"memory left: {row['kv_matches_memory']}", flush=True)
    with open(args.out, "w") as f:
        json.dump(row, f, indent=2)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    a = sub.add_parser("allreduce")
    a.add_argument("--ranks", type=int, default=2)
    a.add_argument("--out")
    for name in ("engine", "engine-one"):
        e = sub.add_parser(name, help="one TP size, in this process (engine runs it)"
                           if name == "engine-one" else None)
        e.add_argument("--model", default=L8)
        e.add_argument("--dtype", default="bfloat16")
        e.add_argument("--max-model-len", type=int, default=2048)
        e.add_argument("--b1", type=workload, default="128/512",
                       help="the batch-1 decode run: IN/OUT")
        e.add_argument("--throughput", type=workload, default="256x256/128",
                       help="N x IN/OUT, N also the engine's max_num_seqs")
        if name == "engine":
            e.add_argument("--tp", type=int, nargs="+", default=[1, 2])
            e.add_argument("--out", default="out/tp_perf")
            e.add_argument("--timeout", type=int, default=900, help="per TP size, seconds")
        else:
            e.add_argument("--tp", type=int, required=True)
            e.add_argument("--allreduce", help="the decode all-reduce table (JSON)")
            e.add_argument("--out", required=True)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    {"allreduce": allreduce, "engine": engine, "engine-one": engine_one}[args.mode](args)


if __name__ == "__main__":
    main()
