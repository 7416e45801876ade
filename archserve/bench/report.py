"""Presenting a bench result: strict JSON (NaN becomes null) and a rich table."""

from __future__ import annotations

import json
import math
from typing import Any

from archserve.engine.phases import WAIT_FOR_DEVICE


def json_safe(value: Any) -> Any:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def to_json_text(result: dict) -> str:
    return json.dumps(json_safe(result), indent=2, allow_nan=False)


def write_json(result: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(to_json_text(result) + "\n")


def _num(value: Any, digits: int = 2, scale: float = 1.0, unit: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value * scale:,.{digits}f}{unit}"


def _latency_rows(run: dict) -> list[tuple[str, str]]:
    rows = []
    for key, title in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"),
                       ("e2e_ms", "E2E latency")):
        s = run[key]
        rows.append((f"{title} P50 / P90 / P99 (ms)",
                     f"{_num(s['p50'])} / {_num(s['p90'])} / {_num(s['p99'])}"))
    return rows


def _spec_decode_row(spec: dict) -> tuple[str, str]:
    per_pos = ", ".join(f"{r:.2f}" for r in spec["acceptance_rate_per_pos"])
    return ("spec decode: acceptance length, rate (per position)",
            f"{_num(spec['mean_acceptance_length'])}, "
            f"{_num(spec['acceptance_rate'], 1, 100, ' %')} ({per_pos}); "
            f"{spec['num_accepted_tokens']} of {spec['num_draft_tokens']} drafted tokens")


def summary_rows(result: dict) -> list[tuple[str, str]]:
    rows = [("mode", result["mode"]), ("model", str(result.get("model"))),
            ("requests", str(result.get("num_requests"))),
            ("output tokens/s", _num(result["output_tokens_per_s"])),
            ("total tokens/s", _num(result["total_tokens_per_s"])),
            ("requests/s", _num(result["requests_per_s"], 3))]
    if result["mode"] == "offline":
        roof = result["roofline"]
        rows += [("device", str(result.get("device"))),
                 ("roofline efficiency", _num(result["roofline_efficiency"], 1, 100, " %")),
                 ("MBU (decode steps)", _num(result["mbu"], 1, 100, " %")),
                 ("roofline floor / step time (s)",
                  f"{_num(roof['floor_s'], 3)} / {_num(roof['measured_s'], 3)}"),
                 ("decode step: mean time / floor (ms)",
                  f"{_num(roof['decode_step_s_mean'], 3, 1e3)} / "
                  f"{_num(roof['decode_floor_s_mean'], 3, 1e3)}"),
                 ("steps (decode, compute-bound)",
                  f"{roof['num_steps']} ({roof['num_decode_steps']}, "
                  f"{roof['compute_bound_steps']})")]
        if result.get("ttft_ms"):
            rows.append(("TTFT p50 / p99 (ms)", f"{_num(result['ttft_ms']['p50'])} / "
                                                f"{_num(result['ttft_ms']['p99'])}"))
        host = result.get("host_ms_per_decode_step")
        if host:
            phases = ", ".join(f"{name} {ms:.3f}" for name, ms in host.items()
                               if name not in ("busy", "step", WAIT_FOR_DEVICE))
            rows.append(("host per decode step (ms)",
                         f"busy {host['busy']:.3f} ({phases}); waiting for the device "
                         f"{host.get(WAIT_FOR_DEVICE, 0.0):.3f}"))
        if result.get("ceilings_text"):
            rows.append(("ceilings used", result["ceilings_text"]))
        if result.get("compiled_while_running"):   # warm-up misses (kernels/jit_watch.py)
            rows.append(("Triton kernels compiled while running", ", ".join(
                f"{name} x{count}" for name, count in result["compiled_while_running"].items())))
        if result.get("spec_decode"):
            rows.append(_spec_decode_row(result["spec_decode"]))
        if result.get("peer"):
            peer = result["peer"]
            name = peer.get("name", "transformers")
            rows += [(f"{name} ({peer['method']}) output tokens/s",
                      _num(peer["output_tokens_per_s"]))]
            if peer.get("ttft_ms"):
                rows.append((f"{name} TTFT p50 / p99 (ms)", f"{_num(peer['ttft_ms']['p50'])} / "
                                                            f"{_num(peer['ttft_ms']['p99'])}"))
            rows.append((f"speedup vs {name}", _num(result["speedup_vs_peer"], 2, 1, "x")))
    else:
        for run in result["runs"]:
            label = f"c={run['concurrency']}" if run["concurrency"] else f"rate={run['request_rate']}"
            rows.append((f"{label}: output tok/s, failed",
                         f"{_num(run['output_tokens_per_s'])}, {run['failed']}"))
        rows += _latency_rows(result)
        server = result["server"]
        rows += [("device memory peak (GiB)", _num(server["memory_peak_bytes"], 2, 2**-30)),
                 ("KV cache usage max / mean",
                  f"{_num(server['kv_cache_usage_max'], 1, 100, ' %')} / "
                  f"{_num(server['kv_cache_usage_mean'], 1, 100, ' %')}")]
    if result["mode"] != "offline" and result["server"].get("spec_decode"):
        rows.append(_spec_decode_row(result["server"]["spec_decode"]))
    for path in result.get("plots", []):
        rows.append(("plot", path))
    return rows


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
    table = Table(title="archserve bench", show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right", overflow="fold")
    for name, value in summary_rows(result):
        table.add_row(escape(name), escape(value))
    Console().print(table)
