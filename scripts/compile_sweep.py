"""Run the compile sweep (tests/compile_sweep.py) and write its table into
docs/compile-sweep.md.

    python scripts/compile_sweep.py [--level representative|defaults|autotuned|all]
                                    [--workers N] [--profile ID ...] [--check]

``representative`` is what CI compiles and what the table records (each kernel at its
largest tiles per target); ``defaults`` compiles every launch the engine runs, ``autotuned``
and ``all`` also every autotuner config and start-up tuner candidate, and list what the
engine would drop on each profile (not written into the table). ``--check`` only compares the table
with the one in the docs (exit 1 when they differ).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "compile-sweep.md")


def main() -> int:
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
    import compile_sweep as sweep

    from archserve.platform.profiles import get_profile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--level", choices=sweep.LEVELS, default="representative")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--profile", action="append", help="only these profiles")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    start, cpu = time.perf_counter(), time.process_time()
    profiles = [get_profile(p) for p in args.profile] if args.profile else None
    results = sweep.collect(profiles)
    collected = time.perf_counter() - start, time.process_time() - cpu
    figures = sweep.check(results, args.level, args.workers)
    print(f"collected in {collected[0]:.1f}s ({collected[1]:.1f}s of CPU); {figures}",
          file=sys.stderr)
    for result in results:
        for line in result.failures:
            print(f"FAILED {result.profile} / {result.route}: {line}", file=sys.stderr)
        for line in result.dropped:
            print(f"dropped {result.profile} / {result.route}: {line}", file=sys.stderr)
    text = sweep.table(results)
    if args.profile or args.level != "representative":
        print(text)
        return 1 if any(r.failures for r in results) else 0
    with open(DOC) as f:
        doc = f.read()
    head, rest = doc.split(sweep.TABLE_START, 1)
    tail = rest.split(sweep.TABLE_END, 1)[1]
    updated = f"{head}{sweep.TABLE_START}\n{text}\n{sweep.TABLE_END}{tail}"
    if args.check:
        return 0 if updated == doc else 1
    with open(DOC, "w") as f:
        f.write(updated)
    return 1 if any(r.failures for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
