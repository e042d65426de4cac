"""The README's main job run twice in a row with an empty compilation cache: the second run loads its executables.

Usage:
  python benchmarks/bench_main_twice.py [--config experiments/configs/default.py] [--keep DIR] [--json FILE]
      [overrides ...]
  python benchmarks/bench_main_twice.py --pair COMMIT [--pairs 3] [--keep DIR] [--json FILE] [overrides ...]

Runs ``python -m jmsnas.cli search --config CONFIG --workdir <tmp>/run{1,2} --no-progress`` twice with
``JMSNAS_CACHE_DIR`` pointing at a fresh directory (so the first run compiles everything, the native kernels
included, and fills the cache, and the second finds it there), measures each process's wall time and CPU time
(user + system, children included), reads the compile/run split each run wrote into ``result.json`` ("time"),
checks that the two ``result.json`` are identical apart from "time" (and ``history.json`` too), and prints a
markdown table with the load average. Extra arguments (``--config.KEY=VALUE``) go to every run.

``--pair COMMIT`` compares this checkout's code with the code of COMMIT (``git archive`` of it, run with
``PYTHONPATH`` pointing at it) on the same machine: ``--pairs`` times, COMMIT's first run and this code's first run,
each with an empty cache of its own, one right after the other (which goes first alternates from pair to pair),
then this code's second run on its cache. It prints every run, the ratio of the first runs (this code / COMMIT)
per pair and their median, this code's second / first, and whether this code's ``result.json`` (apart from
"time") and ``history.json`` are identical in all its runs and agree with COMMIT's: every entry COMMIT's result
also writes (apart from "space", whose format a later code may extend) equal, and the same history data. Exit
status 1 when any differs.
``--json FILE`` also writes the runs' times, the ratios and the checks. ``--xla-flags FLAGS`` sets ``XLA_FLAGS`` for
this code's runs only (with ``--pair HEAD``: the same code with and without the XLA options, see
``benchmarks/compile_flags.py``). ``--prefill N`` puts N entries of other programs (JAX's file layout, 18 kB each,
this machine's mean) into every first run's cache before it starts, so that the first runs compile against a used
cache rather than an empty one (none of them is a hit).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_once(config: str, workdir: str, env: dict, extra, code: str | None = None) -> dict:
    """One ``jmsnas search`` process; ``code`` is the directory its jmsnas package is imported from (default:
    this checkout)."""
    env = dict(env, PYTHONPATH=os.pathsep.join([code or REPO] + [p for p in [env.get("PYTHONPATH")] if p]))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "jmsnas.cli", "search", "--config", config, "--workdir", workdir,
                           "--no-progress", *extra], env=env, capture_output=True, text=True, cwd=code or REPO)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"run in {workdir} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    with open(os.path.join(workdir, "result.json")) as f:
        result = json.load(f)
    with open(os.path.join(workdir, "history.json")) as f:
        history = f.read()
    return {"wall_s": wall, "cpu_s": cpu, "result": result, "history": history}


def base_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.pop("JMSNAS_COMPILE_CACHE", None)
    return env


def with_xla_flags(env: dict, flags) -> dict:
    """``env`` with ``XLA_FLAGS=flags`` (None: unchanged)."""
    return env if flags is None else dict(env, XLA_FLAGS=flags)


def fresh_cache(path: str) -> str:
    if os.path.exists(path) and os.listdir(path):
        raise SystemExit(f"{path} is not empty: a first run must start with an empty cache")
    os.makedirs(path, exist_ok=True)
    return path


def prefill(cache: str, n: int, entry_bytes: int = 18_000) -> str:
    """``n`` entries of other programs in ``cache``'s JAX folder (``xla/<key>-cache`` and the ``-atime`` stamp JAX's
    own bound reads), older than anything a run writes."""
    xla = os.path.join(cache, "xla")
    os.makedirs(xla, exist_ok=True)
    blob, stamp = os.urandom(entry_bytes), (time.time_ns() - 10 ** 12).to_bytes(8, "little")
    for i in range(n):
        for suffix, data in (("-cache", blob), ("-atime", stamp)):
            with open(os.path.join(xla, f"prefill{i:06d}{suffix}"), "wb") as f:
                f.write(data)
    return cache


def strip(result: dict) -> dict:
    return {k: v for k, v in result.items() if k != "time"}


def shared(result: dict, other: dict) -> dict:
    """The entries of ``result`` that ``other`` (another code's result.json) also writes, apart from "time" and
    "space" (whose format a later code extends): what two codes' results must agree on."""
    return {k: v for k, v in result.items() if k in other and k not in ("time", "space")}


def row(label: str, r: dict) -> str:
    t = r["result"]["time"]
    return (f"| {label} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {t['compile']['wall_s']:.1f} / "
            f"{t['compile']['cpu_s']:.1f} | {t['run']['wall_s']:.1f} / {t['run']['cpu_s']:.1f} | "
            f"{t['cache_hits']} of {t['compilations']} |")


HEADER = ("| run | wall s | CPU s | compiling wall / CPU s | running wall / CPU s | executables from the cache |\n"
          "|---|---:|---:|---:|---:|---:|")


def checkout(commit: str, into: str) -> str:
    """COMMIT's tree (``git archive``) under ``into``; returns that directory."""
    os.makedirs(into, exist_ok=True)
    archive = subprocess.run(["git", "-C", REPO, "archive", commit], capture_output=True, check=False)
    if archive.returncode != 0:
        raise SystemExit(f"--pair: git archive {commit} failed: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", into], input=archive.stdout, check=True)
    return into


def twice(args, extra, root: str) -> int:
    env = dict(with_xla_flags(base_env(), args.xla_flags), JMSNAS_CACHE_DIR=fresh_cache(os.path.join(root, "cache")))
    load0 = os.getloadavg()
    runs = [run_once(args.config, os.path.join(root, f"run{i}"), env, extra) for i in (1, 2)]
    load1 = os.getloadavg()
    same = strip(runs[0]["result"]) == strip(runs[1]["result"])
    print(HEADER)
    for i, r in enumerate(runs, 1):
        print(row(str(i), r))
    print(f"\nsecond / first: wall {runs[1]['wall_s'] / runs[0]['wall_s']:.2f}, CPU "
          f"{runs[1]['cpu_s'] / runs[0]['cpu_s']:.2f}; result.json identical apart from 'time': {same}; "
          f"history.json identical: {runs[0]['history'] == runs[1]['history']}")
    r = runs[0]["result"]
    print(f"result: test accuracy {r['accuracy']['test']:.4f}, T = {r['latency_ms']['total']:.4f} ms, "
          f"{r['params']:,} parameters")
    print(f"load average before {load0}, after {load1}; runs under {root}")
    write_json(args.json, {"runs": [times(r) for r in runs], "second_over_first": runs[1]["wall_s"] / runs[0]["wall_s"],
                           "result_identical": same, "history_identical": runs[0]["history"] == runs[1]["history"],
                           "load": [load0, load1]})
    return 0 if same else 1


def times(r: dict) -> dict:
    return {"wall_s": r["wall_s"], "cpu_s": r["cpu_s"], "time": r["result"]["time"]}


def write_json(path, record: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(record, f, indent=2)


def paired(args, extra, root: str) -> int:
    if args.pairs < 1:
        raise SystemExit(f"--pairs must be >= 1, got {args.pairs}")
    base = checkout(args.pair, os.path.join(root, "base-code"))
    env = base_env()
    new_env = with_xla_flags(env, args.xla_flags)
    rows, ratios, seconds, runs = [], [], [], []
    load0 = os.getloadavg()
    for k in range(args.pairs):
        d = os.path.join(root, f"pair{k + 1}")
        order = ("base", "new") if k % 2 == 0 else ("new", "base")
        got = {}
        for who in order:
            cache = prefill(fresh_cache(os.path.join(d, f"{who}-cache")), args.prefill)
            got[who] = run_once(args.config, os.path.join(d, f"{who}-run1"),
                                dict(env if who == "base" else new_env, JMSNAS_CACHE_DIR=cache),
                                extra, base if who == "base" else None)
        got["again"] = run_once(args.config, os.path.join(d, "new-run2"),
                                dict(new_env, JMSNAS_CACHE_DIR=os.path.join(d, "new-cache")), extra)
        ratios.append(got["new"]["wall_s"] / got["base"]["wall_s"])
        seconds.append(got["again"]["wall_s"] / got["new"]["wall_s"])
        before = f"{args.prefill} other entries in the cache" if args.prefill else "empty cache"
        for who, label in (("base", f"{k + 1}: {args.pair} first ({before})"),
                           ("new", f"{k + 1}: this code first ({before})"), ("again", f"{k + 1}: this code second")):
            rows.append(row(label, got[who]))
            runs.append(got[who])
        print(rows[-3], rows[-2], rows[-1], sep="\n", flush=True)
    load1 = os.getloadavg()
    ours = [r for i, r in enumerate(runs) if i % 3]  # this code's first and second runs
    theirs = runs[0::3]
    same = all(strip(r["result"]) == strip(ours[0]["result"]) for r in ours) and all(
        shared(r["result"], ours[0]["result"]) == shared(ours[0]["result"], r["result"]) for r in theirs)
    same_history = all(r["history"] == ours[0]["history"] for r in ours) and all(
        json.loads(r["history"]) == json.loads(ours[0]["history"]) for r in theirs)
    print("\n" + HEADER)
    print("\n".join(rows))
    print(f"\nfirst run, this code / {args.pair}: {', '.join(f'{v:.2f}' for v in ratios)} "
          f"(median {statistics.median(ratios):.2f}); this code's second / first: "
          f"{', '.join(f'{v:.2f}' for v in seconds)} (median {statistics.median(seconds):.2f})")
    print(f"result.json identical apart from 'time' in this code's {len(ours)} runs, and in every entry "
          f"{args.pair}'s {len(theirs)} runs also write (apart from 'space', whose format may have grown): {same}; "
          f"history.json identical (the same data in {args.pair}'s runs): {same_history}")
    r = runs[0]["result"]
    print(f"result: test accuracy {r['accuracy']['test']:.4f}, T = {r['latency_ms']['total']:.4f} ms, "
          f"{r['params']:,} parameters")
    print(f"load average before {load0}, after {load1}; runs under {root}")
    write_json(args.json, {"pair": args.pair, "xla_flags": args.xla_flags, "prefill": args.prefill, "runs": [times(r) for r in runs], "first_ratio": ratios,
                           "second_over_first": seconds, "result_identical": same,
                           "history_identical": same_history, "load": [load0, load1]})
    return 0 if same and same_history else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="experiments/configs/default.py")
    ap.add_argument("--keep", default=None, help="keep the runs and the caches under this directory")
    ap.add_argument("--pair", default=None, metavar="COMMIT",
                    help="compare the first run with COMMIT's code, interleaved, on the same machine")
    ap.add_argument("--pairs", type=int, default=3, help="with --pair: how many pairs (default 3)")
    ap.add_argument("--json", default=None, help="also write the times, ratios and checks to this file")
    ap.add_argument("--xla-flags", default=None, metavar="FLAGS",
                    help="XLA_FLAGS for this code's runs only (COMMIT's runs keep the environment's)")
    ap.add_argument("--prefill", type=int, default=0, metavar="N",
                    help="with --pair: N entries of other programs in every first run's cache (default 0: empty)")
    args, extra = ap.parse_known_args(argv)
    if args.prefill < 0:
        raise SystemExit(f"--prefill must be >= 0, got {args.prefill}")
    args.config = os.path.abspath(args.config)
    root = os.path.abspath(args.keep or tempfile.mkdtemp(prefix="jmsnas-twice-"))
    os.makedirs(root, exist_ok=True)
    return paired(args, extra, root) if args.pair else twice(args, extra, root)


if __name__ == "__main__":
    raise SystemExit(main())
