"""Tensor-parallel speed on one machine's GPUs (issue 15).

  python3 benchmarks/tp_perf.py allreduce [--ranks 2] [--out FILE.json]
      all-reduce latency and bus bandwidth, 4 KiB .. 256 MiB, bf16: NCCL eager, NCCL in a
      CUDA graph, and the one-shot peer-memory path (up to its 8 MiB buffer).
  python3 benchmarks/tp_perf.py engine [--tp 2] [--out DIR]
      Llama-3-8B shape, dummy bf16 weights: batch-1 decode (1 x 128/512) and throughput
      (256 x 256/128) at TP=1 and TP=N through `archserve bench`, with the ratios the
      issue sets (TP=N decode step <= 0.62x TP=1; TP=N throughput >= 1.6x TP=1).

Bus bandwidth is NCCL's convention: 2 (n-1)/n x bytes / time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SIZES = [1 << k for k in range(12, 29)]     # 4 KiB .. 256 MiB
L8 = "benchmarks/models/llama-3-8b"


def _time_us(fn, iters: int) -> float:
    from archserve.kernels.cuda_timing import mean_ms
    return 1000 * mean_ms(fn, iters, warmup=3)


def _allreduce_rank(rank: int, size: int, init: str, queue) -> None:
    import torch
    import torch.distributed as dist

    from archserve.distributed.peer_all_reduce import MAX_BYTES, PeerAllReduce
    from archserve.distributed.process_group import RankPlace, join_group

    group = join_group(RankPlace(rank, size, f"cuda:{rank}", init))
    peer = PeerAllReduce(group, torch.bfloat16)
    peer.max_bytes = MAX_BYTES
    rows = []
    for nbytes in SIZES:
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


def allreduce(args) -> None:
    import multiprocessing as mp

    from archserve.distributed.process_group import free_port
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_allreduce_rank, args=(r, args.ranks, init, queue))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=600)
    for p in procs:
        p.join()
    print(f"{'size':>10} {'NCCL eager us':>14} {'NCCL graph us':>14} {'one-shot us':>12} "
          f"{'bus GB/s':>9}")
    for r in rows:
        one = f"{r['one_shot_us']:.1f}" if r["one_shot_us"] is not None else "-"
        print(f"{r['bytes'] >> 10:>8} K {r['nccl_eager_us']:>14.1f} {r['nccl_graph_us']:>14.1f} "
              f"{one:>12} {r['nccl_bus_GBps']:>9.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)


def _bench(out_dir: str, name: str, tp: int, *extra: str) -> dict:
    path = os.path.join(out_dir, f"{name}_tp{tp}.json")
    cmd = [sys.executable, "-m", "archserve.cli.main", "bench", "--model", L8,
           "--load-format", "dummy", "--dtype", "bfloat16", "--max-model-len", "2048",
           "--max-num-seqs", "256", "--tensor-parallel-size", str(tp), "--output-json", path,
           *extra]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, timeout=900)
    with open(path) as f:
        return json.load(f)


def engine(args) -> None:
    os.makedirs(args.out, exist_ok=True)
    results = {}
    for tp in (1, args.tp):
        results[tp] = {
            "b1": _bench(args.out, "b1_128x512", tp, "--num-prompts", "1", "--input-len", "128",
                         "--output-len", "512"),
            "tput": _bench(args.out, "tput_256x256x128", tp, "--num-prompts", "256",
                           "--input-len", "256", "--output-len", "128"),
        }
    one, many = results[1], results[args.tp]
    step1 = one["b1"]["elapsed_s"] / one["b1"]["output_tokens"]
    stepn = many["b1"]["elapsed_s"] / many["b1"]["output_tokens"]
    tput1, tputn = one["tput"]["output_tokens_per_s"], many["tput"]["output_tokens_per_s"]
    summary = {"decode_step_ms_tp1": step1 * 1e3, f"decode_step_ms_tp{args.tp}": stepn * 1e3,
               "decode_step_ratio": stepn / step1, "decode_target": 0.62,
               "throughput_tok_s_tp1": tput1, f"throughput_tok_s_tp{args.tp}": tputn,
               "throughput_ratio": tputn / tput1, "throughput_target": 1.6}
    print(json.dumps(summary, indent=2))
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    a = sub.add_parser("allreduce")
    a.add_argument("--ranks", type=int, default=2)
    a.add_argument("--out")
    e = sub.add_parser("engine")
    e.add_argument("--tp", type=int, default=2)
    e.add_argument("--out", default="out/tp_perf")
    args = parser.parse_args()
    allreduce(args) if args.mode == "allreduce" else engine(args)


if __name__ == "__main__":
    main()
