"""PNG plots of a bench result (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import os


def _pyplot():
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    return plt



def _save(plt, fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

def _cdf(ax, values_ms: list[float], label: str) -> None:
    if not values_ms:
        return
    xs = sorted(values_ms)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=label)


def latency_cdfs(runs: list[dict], latencies: dict[str, list[list[float]]], path: str) -> str:
    """One panel per metric (TTFT, TPOT, ITL, E2E), one curve per concurrency."""
    plt = _pyplot()
    names = ("ttft", "tpot", "itl", "e2e")
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.4))
    for ax, name in zip(axes, names, strict=True):
        for run, raw in zip(runs, latencies[name], strict=True):
            _cdf(ax, raw, f"c={run['concurrency']}")
        ax.set_xlabel(f"{name.upper()} (ms)")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests")
    axes[-1].legend(fontsize=8)
    return _save(plt, fig, path)


def throughput_vs_concurrency(runs: list[dict], path: str) -> str:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.4))
    xs = [r["concurrency"] for r in runs]
    ax.plot(xs, [r["output_tokens_per_s"] for r in runs], "o-", label="output tok/s")
    ax.plot(xs, [r["total_tokens_per_s"] for r in runs], "s--", label="total tok/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("tokens / s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def memory_and_kv_over_time(runs: list[dict], path: str) -> str:
    """Device memory (GiB) and KV cache usage (%) against time, one line per run."""
    plt = _pyplot()
    fig, (mem_ax, kv_ax) = plt.subplots(2, 1, figsize=(6, 5), sharex=True)
    for run in runs:
        timeline = run["server"]["timeline"]
        label = f"c={run['concurrency']}"
        ts = [s["t"] for s in timeline]
        mem_ax.plot(ts, [(s["memory_used_bytes"] or 0) / 2**30 for s in timeline],
                    marker=".", label=label)
        kv_ax.plot(ts, [100 * (s["kv_cache_usage"] or 0) for s in timeline], marker=".",
                   label=label)
    mem_ax.set_ylabel("device memory (GiB)")
    kv_ax.set_ylabel("KV cache used (%)")
    kv_ax.set_xlabel("time since run start (s)")
    for ax in (mem_ax, kv_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(plt, fig, path)


def step_times(step_seconds: list[float], floor_seconds: list[float], path: str) -> str:
    """Offline runs: each step's measured time against its roofline floor."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.4))
    ax.plot([s * 1000 for s in step_seconds], label="measured")
    ax.plot([s * 1000 for s in floor_seconds], label="roofline floor")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("ms")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def budget_tradeoff(points: list[dict], path: str, title: str = "") -> str:
    """Serving at one load over step token budgets: TTFT P50 against ITL P99, one labelled
    point per budget (``label``, ``ttft_p50_ms``, ``itl_p99_ms``; numeric labels joined in
    budget order, the others marked apart)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    fixed = sorted((p for p in points if str(p["label"]).isdigit()), key=lambda p: int(p["label"]))
    other = [p for p in points if not str(p["label"]).isdigit()]
    ax.plot([p["itl_p99_ms"] for p in fixed], [p["ttft_p50_ms"] for p in fixed], "o-",
            label="--max-num-batched-tokens")
    for p in other:
        ax.plot(p["itl_p99_ms"], p["ttft_p50_ms"], "*", markersize=12, label=str(p["label"]))
    for p in points:
        ax.annotate(str(p["label"]), (p["itl_p99_ms"], p["ttft_p50_ms"]),
                    textcoords="offset points", xytext=(5, 5), fontsize=8)
    ax.set_xlabel("ITL P99 (ms)")
    ax.set_ylabel("TTFT P50 (ms)")
    if title:
        ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def serving_plots(runs: list[dict], latencies: dict[str, list[list[float]]], directory: str
                  ) -> list[str]:
    os.makedirs(directory, exist_ok=True)
    paths = [latency_cdfs(runs, latencies, os.path.join(directory, "latency_cdf.png")),
             memory_and_kv_over_time(runs, os.path.join(directory, "memory_kv_over_time.png"))]
    if len(runs) > 1:
        paths.append(throughput_vs_concurrency(
            runs, os.path.join(directory, "throughput_vs_concurrency.png")))
    return paths
