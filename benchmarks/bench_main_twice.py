"""The README's main job run twice in a row with an empty compilation cache: the second run loads its executables.

Usage:
  python benchmarks/bench_main_twice.py [--config experiments/configs/default.py] [--keep DIR] [overrides ...]

Runs ``python -m jmsnas.cli search --config CONFIG --workdir <tmp>/run{1,2} --no-progress`` twice with
``JMSNAS_CACHE_DIR`` pointing at a fresh directory (so the first run compiles everything and fills the cache,
and the second finds it there), measures each process's wall time and CPU time (user + system, children
included), reads the compile/run split each run wrote into ``result.json`` ("time"), checks that the two
``result.json`` are identical apart from "time" (and ``history.json`` too), and prints a markdown table with the
load average. Extra arguments (``--config.KEY=VALUE``) go to both runs.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time


def run_once(config: str, workdir: str, env: dict, extra) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "jmsnas.cli", "search", "--config", config, "--workdir", workdir,
                           "--no-progress", *extra], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"run in {workdir} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    with open(os.path.join(workdir, "result.json")) as f:
        result = json.load(f)
    return {"wall_s": wall, "cpu_s": cpu, "result": result}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="experiments/configs/default.py")
    ap.add_argument("--keep", default=None, help="keep the runs and the cache under this directory")
    args, extra = ap.parse_known_args(argv)
    root = args.keep or tempfile.mkdtemp(prefix="jmsnas-twice-")
    os.makedirs(root, exist_ok=True)
    cache = os.path.join(root, "cache")
    if os.path.exists(cache) and os.listdir(cache):
        raise SystemExit(f"{cache} is not empty: the first run must start with an empty cache")
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.update(JMSNAS_CACHE_DIR=cache)
    env.pop("JMSNAS_COMPILE_CACHE", None)
    load0 = os.getloadavg()
    runs = [run_once(args.config, os.path.join(root, f"run{i}"), env, extra) for i in (1, 2)]
    load1 = os.getloadavg()
    strip = lambda r: {k: v for k, v in r.items() if k != "time"}
    same = strip(runs[0]["result"]) == strip(runs[1]["result"])
    hist = [open(os.path.join(root, f"run{i}", "history.json")).read() for i in (1, 2)]
    print("| run | wall s | CPU s | compiling wall / CPU s | running wall / CPU s | executables from the cache |")
    print("|---|---:|---:|---:|---:|---:|")
    for i, r in enumerate(runs, 1):
        t = r["result"]["time"]
        print(f"| {i} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {t['compile']['wall_s']:.1f} / {t['compile']['cpu_s']:.1f}"
              f" | {t['run']['wall_s']:.1f} / {t['run']['cpu_s']:.1f} | {t['cache_hits']} of {t['compilations']} |")
    print(f"\nsecond / first: wall {runs[1]['wall_s'] / runs[0]['wall_s']:.2f}, CPU "
          f"{runs[1]['cpu_s'] / runs[0]['cpu_s']:.2f}; result.json identical apart from 'time': {same}; "
          f"history.json identical: {hist[0] == hist[1]}")
    r = runs[0]["result"]
    print(f"result: test accuracy {r['accuracy']['test']:.4f}, T = {r['latency_ms']['total']:.4f} ms, "
          f"{r['params']:,} parameters")
    print(f"load average before {load0}, after {load1}; runs under {root}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
