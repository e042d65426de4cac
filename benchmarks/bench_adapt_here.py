"""Adaptation on this machine's own measurements: an FBNet table profiled at one XLA CPU configuration, adapted
to another from 10 measured networks, checked on 50 held-out ones.

    python benchmarks/bench_adapt_here.py [--target-cpus 0] [--reps 15] [--width 1.0]

Base: ``jmsnas.fbnet.measure.profile_table`` here with every core (the default configuration). Target: the same
processes pinned to one core (``os.sched_setaffinity``, as ``taskset -c 0``) with XLA's CPU backend told to use
one thread (``XLA_FLAGS=--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1``), in a child process,
measuring 60 random networks of the space: the first 10 adapt, the other 50 test. Reports, on the 50: the base
table unadapted, the base rescaled by one factor fitted on the 10, and ``jmsnas.cost.adapt.adapt``. Timings on
a loaded machine move; the script prints the load average.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)


def _child(args) -> int:
    """Measure the networks of --archs in this (target) configuration and write them as measured networks."""
    os.sched_setaffinity(0, {int(c) for c in args.target_cpus.split(",")})
    from jmsnas.cost import networks as NW
    from jmsnas.fbnet import measure, space as SP
    sp = SP.scaled(SP.fbnet_c100(), width=args.width)
    archs = np.array(json.load(open(args.archs)), np.int64)
    ms = measure.measure_networks(sp, archs, reps=args.reps, seed=1)
    NW.save(NW.make(archs, ms, sp.op_names, space=sp.name, device="one_core"), args.out)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target-cpus", default="0", help="cores the target configuration may use (default 0)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--width", type=float, default=1.0)
    ap.add_argument("--networks", type=int, default=60, help="10 adapt + the rest held out")
    ap.add_argument("--json", default=None)
    ap.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--archs", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._child:
        return _child(args)
    from jmsnas.cost import accuracy, adapt
    from jmsnas.cost import layertable as LT
    from jmsnas.cost import networks as NW
    from jmsnas.fbnet import measure, space as SP
    print(f"load average before: {os.getloadavg()}", flush=True)
    sp = SP.scaled(SP.fbnet_c100(), width=args.width)
    archs = np.random.default_rng(0).integers(0, len(sp.op_names), (args.networks, sp.num_layers))
    with tempfile.TemporaryDirectory() as tmp:
        path, out = os.path.join(tmp, "archs.json"), os.path.join(tmp, "target.json")
        json.dump(archs.tolist(), open(path, "w"))
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false "
                                          "intra_op_parallelism_threads=1").strip(), PYTHONPATH=ROOT)
        child = subprocess.Popen([sys.executable, __file__, "--_child", "--archs", path, "--out", out,
                                  "--target-cpus", args.target_cpus, "--reps", str(args.reps),
                                  "--width", str(args.width)], env=env)
        if child.wait() != 0:  # one configuration at a time: the two would compete for the cores
            raise SystemExit("target measurement failed")
        base = measure.profile_table(sp, device="all_cores", reps=args.reps)
        base_here = measure.measure_networks(sp, archs[10:], reps=args.reps, seed=2)
        target = NW.load(out)
    print(f"load average after: {os.getloadavg()}")
    samples = NW.make(target.archs[:10], target.ms[:10], sp.op_names, space=sp.name, device="one_core")
    held = NW.make(target.archs[10:], target.ms[10:], sp.op_names, space=sp.name, device="one_core")
    tables = {"(a) base": base, "(b) one factor": adapt.rescale(base, samples), "(c) adapt": adapt.adapt(base, samples)}
    res = {"base_on_its_own_configuration": accuracy.report(LT.predict_ms(base, archs[10:]), base_here)}
    print(f"base table vs {len(base_here)} whole networks in its own configuration: "
          f"MAPE {res['base_on_its_own_configuration']['mape_pct']:.2f}%")
    print(f"{'table':16s} {'MAPE %':>8s} {'±10% %':>8s} {'Spearman':>9s}   (target: one core, {len(held.ms)} held out)")
    for name, t in tables.items():
        r = accuracy.report(LT.predict_ms(t, held.archs), held.ms)
        res[name] = r
        print(f"{name:16s} {r['mape_pct']:8.2f} {r['within_10pct']:8.1f} {r['spearman']:9.3f}")
    a = tables["(c) adapt"].adaptation
    print(f"chosen: {a['grouping']} lambda={a['lambda']} (leave-one-out MAPE {a['loo_mape_pct']:.2f}% on the 10); "
          f"single factor {a['single_factor']:.3f}")
    res["chosen"] = {k: a[k] for k in ("grouping", "lambda", "loo_mape_pct", "theta_const", "theta")}
    res["target_ms"] = target.ms.tolist()
    if args.json:
        json.dump(res, open(args.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
