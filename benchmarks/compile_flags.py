"""XLA:CPU compile options against the main job's step programs: compile time, step time, identical outputs.

Usage:
  python benchmarks/compile_flags.py --programs CACHE/programs [--reps 5] [--only NAME ...] \
      --flags "" --flags "--xla_cpu_parallel_codegen_split_count=8" ...

``CACHE`` is a ``JMSNAS_CACHE_DIR`` that a first run of the main job filled (``jmsnas search --config
experiments/configs/default.py --workdir W`` with ``JMSNAS_CACHE_DIR=CACHE``): its ``programs/`` folder holds the
steps' lowered programs (``jmsnas.programs``, ``jax.export`` flatbuffers). For each ``--flags`` value (an
``XLA_FLAGS`` string; the first is the reference, normally empty), a fresh process (XLA reads ``XLA_FLAGS`` once,
when its CPU client starts) with the ``jmsnas`` command's host settings (``jmsnas.hostmem.apply``), the native
kernels registered and the persistent compilation cache off, compiles every program (``jax.jit(exported.call)
.lower(...).compile()``), timing the compile's wall and process CPU (all threads), then runs it ``--reps`` times on
the same deterministic inputs (NumPy seed 0: floats |N(0, 1)| so that variances are positive, signed integers in
[0, 10), unsigned integers random bits) and hashes every output byte. The table gives per program and setting
the compile wall / CPU seconds, the median step in ms and whether the outputs are bit-for-bit the reference's.
``--json FILE`` writes the figures. (``benchmarks/profile_compile.py`` attributes a whole run's compile events to
programs under one setting; this compares settings on the same programs.) Results: benchmarks/README.md, section
"XLA:CPU compile options for the five steps".
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _inputs(avals):
    import numpy as np
    rng = np.random.default_rng(0)
    out = []
    for a in avals:
        dt = np.dtype(a.dtype)
        if dt.kind == "f":
            out.append(np.abs(rng.standard_normal(a.shape)).astype(dt))
        elif dt.kind == "i":
            out.append(rng.integers(0, 10, a.shape).astype(dt))
        elif dt.kind == "u":
            out.append(rng.integers(0, 2 ** (8 * dt.itemsize), a.shape, dtype=dt))
        elif dt.kind == "b":
            out.append(rng.integers(0, 2, a.shape).astype(bool))
        else:
            raise SystemExit(f"compile_flags: no input rule for dtype {dt}")
    return out


def _deserialize(data: bytes):
    """``jax.export.deserialize``, registering each NamedTuple type the program's tree names (the steps' states,
    optax's states) as ``jmsnas.programs`` did when it stored it."""
    import importlib
    import re
    from jax import export
    for _ in range(64):
        try:
            return export.deserialize(bytearray(data))
        except ValueError as e:
            m = re.search(r"unregistered type `([\w.]+)`", str(e))
            if not m:
                raise
            module, _, name = m.group(1).rpartition(".")
            while module and "." in module and not _importable(module):
                module, _, outer = module.rpartition(".")
                name = f"{outer}.{name}"
            cls = importlib.import_module(module)
            for part in name.split("."):
                cls = getattr(cls, part)
            export.register_namedtuple_serialization(cls, serialized_name=m.group(1))
    raise SystemExit("compile_flags: too many unregistered types")


def _importable(module: str) -> bool:
    import importlib
    try:
        importlib.import_module(module)
        return True
    except ImportError:
        return False


def child(programs: list[str], reps: int) -> dict:
    """Run in the process whose XLA_FLAGS are set: compile and run each program."""
    from jmsnas import hostmem
    hostmem.apply()
    import jax
    import numpy as np
    jax.config.update("jax_enable_compilation_cache", False)
    from jmsnas import native
    native.load()
    jax.numpy.zeros(1).block_until_ready()  # the client exists before the first timing
    rows = {}
    for path in programs:
        exported = _deserialize(Path(path).read_bytes())
        args = [jax.device_put(x) for x in _inputs(exported.in_avals)]
        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in exported.in_avals]
        def whole(*leaves, exported=exported):
            a, kw = jax.tree_util.tree_unflatten(exported.in_tree, leaves)
            return exported.call(*a, **kw)

        fn = jax.jit(whole)
        c0, t0 = _cpu(), time.perf_counter()
        compiled = fn.lower(*specs).compile()
        wall, cpu = time.perf_counter() - t0, _cpu() - c0
        flat = jax.tree_util.tree_leaves(compiled(*args))
        jax.block_until_ready(flat)
        h = hashlib.sha256()
        for leaf in flat:
            a = np.asarray(leaf)
            h.update(f"{a.dtype.str}{a.shape}".encode())
            h.update(a.tobytes())
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            times.append(time.perf_counter() - t)
        rows[Path(path).name.split("-")[0]] = {"compile_wall_s": wall, "compile_cpu_s": cpu,
                                               "step_ms": 1e3 * statistics.median(times) if times else None,
                                               "outputs": h.hexdigest()}
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--programs", help="the programs/ folder of a filled JMSNAS_CACHE_DIR")
    ap.add_argument("--flags", action="append", default=None, help="an XLA_FLAGS value (repeat; the first is "
                    "the reference)")
    ap.add_argument("--reps", type=int, default=5, help="timed calls per program after the first (default 5)")
    ap.add_argument("--only", nargs="*", default=None, help="program name prefixes to keep, e.g. search.weight_step")
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child), args.reps)))
        return 0
    if not args.programs or not os.path.isdir(args.programs):
        print(f"compile_flags: error: --programs must be a folder of .jaxprog files, got {args.programs!r}",
              file=sys.stderr)
        return 2
    if args.reps < 1:
        print(f"compile_flags: error: --reps must be at least 1, got {args.reps}", file=sys.stderr)
        return 2
    programs = sorted(str(p) for p in Path(args.programs).glob("*.jaxprog")
                      if not args.only or any(p.name.startswith(o) for o in args.only))
    if not programs:
        print(f"compile_flags: error: no .jaxprog file in {args.programs!r} matches {args.only}", file=sys.stderr)
        return 2
    settings = args.flags or [""]
    results = []
    for flags in settings:
        env = dict(os.environ, XLA_FLAGS=flags, PYTHONPATH=os.pathsep.join(
            [REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(programs),
                               "--reps", str(args.reps)], env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            results.append({"flags": flags, "error": proc.stderr.strip().splitlines()[-1:] or ["?"]})
            print(f"[{flags or 'default'}] failed: {proc.stderr[-800:]}", file=sys.stderr)
            continue
        rows = json.loads(proc.stdout.strip().splitlines()[-1])
        results.append({"flags": flags, "rows": rows, "process_s": time.perf_counter() - t0})
        print(f"[{flags or 'default'}] done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    ref = next((r for r in results if "rows" in r), None)
    print(f"load average {os.getloadavg()[0]:.1f}; compile wall / CPU s, median step ms, outputs equal to the "
          f"first setting's")
    print()
    names = sorted(ref["rows"]) if ref else []
    print("| setting | " + " | ".join(names) + " | compile CPU sum s |")
    print("|---|" + "---|" * (len(names) + 1))
    for r in results:
        if "rows" not in r:
            print(f"| `{r['flags']}` | failed: {r['error'][0][:120]} |")
            continue
        cells = []
        for n in names:
            x = r["rows"].get(n)
            same = x["outputs"] == ref["rows"][n]["outputs"]
            cells.append(f"{x['compile_wall_s']:.2f} / {x['compile_cpu_s']:.2f}, {x['step_ms']:.1f} ms, "
                         f"{'same' if same else 'DIFFERENT'}")
        total = sum(r["rows"][n]["compile_cpu_s"] for n in names)
        print(f"| `{r['flags'] or 'default'}` | " + " | ".join(cells) + f" | {total:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
