"""Which programs a first run (empty cache) spends its compile time on: per program, tracing, lowering, compiling.

Usage:
  python benchmarks/profile_compile.py [--config experiments/configs/default.py] [overrides ...]

Runs ``jmsnas search --config CONFIG --workdir <tmp> --no-progress`` in this process with ``JMSNAS_CACHE_DIR`` at
an empty directory and listens to JAX's compile events (tracing to a
jaxpr, lowering to StableHLO, XLA's compilation or cache load), which name the function and run on the thread
that compiles (``jmsnas.ahead``'s threads, or the main thread). A step kept as a program (``jmsnas.programs``)
shows up as ``jit(_trace)``, the wrapper that inlines the stored program: its events are counted in the row of
the step whose own lowering (``jax.export``, first runs only) came just before on the same thread. A trace includes what it waits for:
the first step's, the build of the native kernels. Executables of single operations (``jit(add)``, the random
draws of the initialisation) are summed in one row per name. Prints a markdown table, seconds of wall time per
event summed (events on different threads overlap), and the run's wall time.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import threading
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="experiments/configs/default.py")
    args, extra = ap.parse_known_args(argv)
    root = tempfile.mkdtemp(prefix="jmsnas-profile-")
    os.environ["JMSNAS_CACHE_DIR"] = os.path.join(root, "cache")
    import jax.monitoring as monitoring

    events, lock = [], threading.Lock()

    def on_duration(event, duration, **kw):
        if event.startswith("/jax/core/compile/"):
            with lock:
                events.append((event.rsplit("/", 1)[1], kw.get("fun_name") or "?", duration,
                               threading.current_thread().name))

    monitoring.register_event_duration_secs_listener(on_duration)
    from jmsnas.cli import main as jmsnas_main

    t0 = time.perf_counter()
    rc = jmsnas_main(["search", "--config", args.config, "--workdir", os.path.join(root, "run"), "--no-progress",
                      *extra])
    wall = time.perf_counter() - t0
    rows = collections.defaultdict(lambda: {"n": 0, "trace": 0.0, "lower": 0.0, "compile": 0.0, "threads": set()})
    current = {}  # thread -> the step whose program the next jit(_trace) events belong to
    for kind, name, seconds, thread in events:
        if kind == "jaxpr_to_mlir_module_duration" and name not in ("jit(_trace)",) and name.startswith("jit("):
            current[thread] = name
        program = current.get(thread, name) if name in ("_trace", "jit(_trace)") else name
        program = program if program.startswith("jit(") else f"jit({program})"
        row = rows[program]
        row["threads"].add("main" if thread == "MainThread" else "ahead")
        if kind.startswith("jaxpr_trace"):
            row["trace"] += seconds
        elif kind.startswith("jaxpr_to_mlir"):
            row["lower"] += seconds
        else:
            row["compile"] += seconds
            row["n"] += 1
    total = lambda r: r["trace"] + r["lower"] + r["compile"]
    print("\n| program | executables | trace s | lower s | compile s | sum s | thread |")
    print("|---|---:|---:|---:|---:|---:|---|")
    sums = [0.0, 0.0, 0.0]
    for name, r in sorted(rows.items(), key=lambda kv: -total(kv[1])):
        sums = [sums[0] + r["trace"], sums[1] + r["lower"], sums[2] + r["compile"]]
        print(f"| {name} | {r['n']} | {r['trace']:.2f} | {r['lower']:.2f} | {r['compile']:.2f} | {total(r):.2f} | "
              f"{'/'.join(sorted(r['threads']))} |")
    print(f"| all | {sum(r['n'] for r in rows.values())} | {sums[0]:.2f} | {sums[1]:.2f} | {sums[2]:.2f} | "
          f"{sum(sums):.2f} | |")
    print(f"\nrun: {wall:.1f} s wall; load average {os.getloadavg()}; cache {os.environ['JMSNAS_CACHE_DIR']}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
