"""TTFT against ITL over step token budgets: one real `archserve serve` per budget, the same
Poisson loads through `archserve bench --mode serve` against each.

    python3 benchmarks/serve_budget_sweep.py --out OUT            # on the H200, ~6-8 minutes
    python3 benchmarks/serve_budget_sweep.py --out OUT --budgets 256,512,1024,2048,auto,itl:30
    python3 benchmarks/serve_budget_sweep.py --out OUT --budgets auto,8192 --rates 8,16,24 \
        --duration 10                                             # the serving rows' loads, ~2.5 min

Default budgets: 256, 512, 1024, 2048, 8192 (the fixed default before the auto budget) and auto.
A budget is a number (`--max-num-batched-tokens N`: every step, vLLM's meaning), `auto` (the
server's default: steps with decodes get the budget from the measured step cost and the
default target ITL; idle steps get 8192) or `itl:MS` (`--target-itl-ms MS`). Each of
`--rates` (Poisson requests per second) runs for `--duration` seconds of arrivals against
the same server. Defaults: Llama-3-8B shape with dummy bf16 weights and a word tokenizer (as
benchmarks/h200_serve.sh), 16 requests/s for 20 s, 512±50% prompt and 128±50% output tokens.

Writes OUT/budget_sweep.json (per budget and rate: the budget the server chose, TTFT/TPOT/
ITL/E2E percentiles, throughput; rewritten after every run, so a sweep cut short keeps what
it measured), OUT/budget_tradeoff.png (TTFT P50 against ITL P99; one plot per rate,
budget_tradeoff_<rate>.png, when there are several), and each run's bench JSON and log
under OUT/budget_<name>/rate<rate>/ beside the budget's server.log; prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

ARCHSERVE = [sys.executable, "-m", "archserve.cli.main"]
LISTENING = re.compile(r"listening on (http://127\.0\.0\.1:\d+)")
BUDGET_DECISION = re.compile(r"decision: max_num_batched_tokens: (.*?) -> (.*?) \(")


def server_flags(budget: str) -> list[str]:
    if budget == "auto":
        return []
    if budget.startswith("itl:"):
        return ["--target-itl-ms", budget.removeprefix("itl:")]
    return ["--max-num-batched-tokens", str(int(budget))]


def start_server(args, budget: str, log_path: str) -> tuple[subprocess.Popen, str]:
    cmd = [*ARCHSERVE, "serve", "--model", args.model, "--load-format", args.load_format,
           "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
           "--max-num-seqs", str(args.max_num_seqs), "--port", "0", *server_flags(budget),
           *shlex.split(args.server_args)]
    if args.tokenizer:
        cmd += ["--tokenizer", args.tokenizer]
    with open(log_path, "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                   env=dict(os.environ, PYTHONUNBUFFERED="1"))
    deadline = time.monotonic() + args.server_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited ({process.returncode}); see {log_path}")
        with open(log_path, errors="replace") as f:
            match = LISTENING.search(f.read())
        if match:
            try:
                with urllib.request.urlopen(f"{match.group(1)}/health", timeout=2) as r:
                    if r.status == 200:
                        return process, match.group(1)
            except OSError:
                pass
        time.sleep(0.5)
    stop_server(process)
    raise RuntimeError(f"server not healthy after {args.server_timeout}s; see {log_path}")


def stop_server(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def chosen_budget(log_path: str) -> str:
    with open(log_path, errors="replace") as f:
        match = BUDGET_DECISION.search(f.read())
    return match.group(2) if match else "?"


def budget_decision_line(log_path: str) -> str | None:
    """The server's whole start-up line for its budget: the target and the step cost
    points it was chosen from, kept in the JSON (the logs may not travel back)."""
    with open(log_path, errors="replace") as f:
        for line in f:
            if BUDGET_DECISION.search(line):
                return line.strip()
    return None


def run_bench(args, url: str, rate: float, out_json: str, log_path: str) -> dict:
    cmd = [*ARCHSERVE, "bench", "--mode", "serve", "--url", url,
           "--model", args.tokenizer or args.model, "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--random-range", str(args.random_range),
           "--request-rate", str(rate), "--num-prompts", str(max(1, round(rate * args.duration))),
           "--seed", str(args.seed), "--output-json", out_json]
    with open(log_path, "w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, check=True,
                       timeout=args.duration * 6 + 120)
    with open(out_json) as f:
        return json.load(f)


def summary_row(budget: str, rate: float, chosen: str, result: dict) -> dict:
    pick = {f"{m}_{q}_ms": result[f"{m}_ms"][q] for m in ("ttft", "tpot", "itl", "e2e")
            for q in ("p50", "p90", "p99")}
    return {"budget": budget, "rate": rate, "chosen": chosen, **pick,
            "output_tokens_per_s": result["output_tokens_per_s"],
            "completed": result["completed"], "failed": result["failed"]}


def print_table(rows: list[dict]) -> None:
    head = (f"{'budget':>8} {'req/s':>6} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} "
            f"{'ITL p50':>8} {'ITL p99':>8} {'out tok/s':>9}  server's budget")
    print(head)
    for r in rows:
        print(f"{r['budget']:>8} {r['rate']:6g} {r['ttft_p50_ms']:9.1f} {r['ttft_p99_ms']:9.1f} "
              f"{r['tpot_p50_ms']:9.2f} {r['itl_p50_ms']:8.2f} {r['itl_p99_ms']:8.1f} "
              f"{r['output_tokens_per_s']:9.0f}  {r['chosen']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--budgets", default="256,512,1024,2048,8192,auto")
    p.add_argument("--model", default="benchmarks/models/llama-3-8b")
    p.add_argument("--tokenizer", default=None,
                   help="default: a word tokenizer over the model's vocabulary")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--rates", default="16",
                   help="Poisson requests per second, comma-separated: one run each per budget")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per run")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--random-range", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-timeout", type=float, default=300.0)
    p.add_argument("--server-args", default="",
                   help="more `archserve serve` flags for every server, split as a shell "
                        "would: --server-args \"--compilation-config "
                        "'{\\\"cudagraph_mode\\\":\\\"FULL\\\"}'\"")
    args = p.parse_args()
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
    for budget in budgets:   # a bad budget fails here, before any server starts
        server_flags(budget)
    os.makedirs(args.out, exist_ok=True)
    if args.tokenizer is None:
        args.tokenizer = os.path.join(tempfile.mkdtemp(), "tokenizer")
        subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "word_tokenizer.py"),
                        args.model, args.tokenizer], check=True, cwd=ROOT)
    summary = {"argv": sys.argv, "model": args.model, "rates": rates,
               "duration_s": args.duration, "input_len": args.input_len,
               "output_len": args.output_len, "random_range": args.random_range,
               "elapsed_s": 0.0, "plots": [], "runs": []}
    rows, started = summary["runs"], time.monotonic()

    def save() -> None:
        summary["elapsed_s"] = time.monotonic() - started
        with open(os.path.join(args.out, "budget_sweep.json"), "w") as f:
            json.dump(summary, f, indent=1)

    for budget in budgets:
        run_dir = os.path.join(args.out, f"budget_{budget.replace(':', '')}")
        os.makedirs(run_dir, exist_ok=True)
        server_log = os.path.join(run_dir, "server.log")
        t0 = time.monotonic()
        process, url = start_server(args, budget, server_log)
        print(f"== budget {budget}: server up after {time.monotonic() - t0:.0f}s "
              f"({chosen_budget(server_log)})", flush=True)
        decision = budget_decision_line(server_log)
        summary.setdefault("server_budget_decisions", {})[budget] = decision
        print(f"   {decision}", flush=True)
        try:
            for rate in rates:
                rate_dir = os.path.join(run_dir, f"rate{rate:g}")
                os.makedirs(rate_dir, exist_ok=True)
                result = run_bench(args, url, rate, os.path.join(rate_dir, "bench.json"),
                                   os.path.join(rate_dir, "bench.log"))
                rows.append(summary_row(budget, rate, chosen_budget(server_log), result))
                print_table(rows[-1:])
                save()
        finally:
            stop_server(process)
    summary["plots"] = tradeoff_plots(args, rows, rates)
    save()
    print(f"\nall runs ({summary['elapsed_s']:.0f}s):")
    print_table(rows)
    print(f"plots: {', '.join(summary['plots']) or 'none'}")
    return 0 if all(r["failed"] == 0 for r in rows) else 1


def tradeoff_plots(args, rows: list[dict], rates: list[float]) -> list[str]:
    """TTFT P50 against ITL P99 over the budgets, one plot per rate."""
    from archserve.bench.plots import budget_tradeoff
    model = os.path.basename(os.path.normpath(args.model))
    paths = []
    for rate in rates:
        name = "budget_tradeoff.png" if len(rates) == 1 else f"budget_tradeoff_{rate:g}.png"
        title = (f"{model}, {rate:g} req/s, {args.input_len}±{args.random_range:.0%} in / "
                 f"{args.output_len} out")
        paths.append(budget_tradeoff(
            [{"label": r["budget"], "ttft_p50_ms": r["ttft_p50_ms"], "itl_p99_ms": r["itl_p99_ms"]}
             for r in rows if r["rate"] == rate],
            os.path.join(args.out, name), title))
    return paths

if __name__ == "__main__":
    sys.exit(main())
