"""Parallel loading of balanced children against the monolithic checkpoint (paper 002, Tables 1 and 3).

    python benchmarks/bench_loading.py [--nets resnet50 mobilenet_v2 RUN_DIR] [--config CFG] [--reps 5]
                                       [--kmax 8] [--json out.json] [--no-agent]

For every network and k = 1..kmax (k = 1 is the monolith): the exact min-max split under the load model measured
here, written as k orbax children; then ``reps`` rounds, each loading every k once in a shuffled order, cold
(fsync + POSIX_FADV_DONTNEED before each load), with min(k, hardware threads) threads and streaming inference of a
batch of one (compiled beforehand: the programs depend on shapes only). Reported per k: median load time and time
to first prediction, and the monolith/k ratio of each round (paired in time), as median and [min, max]; the
process's CPU time per load (all threads, inference included); the overlap, sum of the children's restore times
over the load time (1.0: no two restores ran side by side; 2.0: two threads busy all the time). Also: the
fitted load model, the raw cold read time of the same bytes (is loading disk- or CPU-bound?), the model's
prediction for this machine's threads and for a device with k loading threads, and the Q-learning agent against
the exact optimum for k = 2..kmax. The machine's load average is printed before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jmsnas.modular import api, blocks as B, loadmodel as L, partition as P, store  # noqa: E402


def loadavg() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def precompile(directory: str, x) -> None:
    m = store.read_manifest(directory)
    h = x
    for c in m["children"]:
        a, b = c["blocks"]
        zeros = [jax.tree_util.tree_map(np.zeros_like, store.template(
            {kk[len(store.block_key(j)) + 1:]: v for kk, v in c["leaves"].items()
             if kk.startswith(store.block_key(j) + "/")})) for j in range(a, b)]
        h = B.forward([bl["spec"] for bl in m["blocks"][a:b]])(zeros, h)
    np.asarray(h)


def bench_net(net, lm, kmax: int, reps: int, root: str, hw: int, rng) -> dict:
    costs = L.block_ms(lm, net.blocks)
    ks = list(range(1, min(kmax, len(net.blocks)) + 1))
    dirs, cuts = {}, {}
    for k in ks:
        cuts[k] = P.exact(costs, k)
        dirs[k] = os.path.join(root, f"{net.name.replace(':', '_')}_k{k}")
        store.write(net, cuts[k], dirs[k])
    x = np.random.default_rng(0).standard_normal((1,) + tuple(net.input_shape)).astype(np.float32)
    for k in ks:
        precompile(dirs[k], x)
    ref = None
    load = {k: [] for k in ks}
    first = {k: [] for k in ks}
    cpu = {k: [] for k in ks}
    overlap = {k: [] for k in ks}
    for _ in range(reps):
        for k in rng.permutation(ks):
            k = int(k)
            L.drop_cache(dirs[k])
            c0 = time.process_time()
            res = store.load(dirs[k], parallel=min(k, hw), x=x)
            cpu[k].append(1e3 * (time.process_time() - c0))
            overlap[k].append(sum(res.child_restore_s) / res.load_s)  # 2.0 = two restores always side by side
            load[k].append(1e3 * res.load_s)
            first[k].append(1e3 * res.first_prediction_s)
            if ref is None:
                ref = res.output
            assert np.array_equal(res.output, ref), "children disagree with the monolith"
    rows = []
    for k in ks:
        ratio_load = np.array(load[1]) / np.array(load[k])
        ratio_first = np.array(first[1]) / np.array(first[k])
        child = lm.overhead_ms + P.child_costs(costs, cuts[k])
        rows.append({"k": k, "cuts": cuts[k], "load_ms_median": float(np.median(load[k])),
                     "first_prediction_ms_median": float(np.median(first[k])),
                     "speedup_load": [float(np.median(ratio_load)), float(ratio_load.min()), float(ratio_load.max())],
                     "speedup_first": [float(np.median(ratio_first)), float(ratio_first.min()),
                                       float(ratio_first.max())],
                     "predicted_ms_here": L.makespan_ms(child, min(k, hw)),
                     "predicted_ms_k_threads": L.makespan_ms(child, k),
                     "cpu_ms_median": float(np.median(cpu[k])),
                     "overlap_median": float(np.median(overlap[k])),
                     "load_runs_ms": load[k], "first_runs_ms": first[k], "cpu_runs_ms": cpu[k]})
    for d in dirs.values():
        shutil.rmtree(d, ignore_errors=True)
    return {"network": net.name, "blocks": len(net.blocks),
            "mb": sum(B.block_bytes(b) for b in net.blocks) / 1e6, "rows": rows}


def agent_table(net, lm, kmax: int) -> list:
    costs = L.block_ms(lm, net.blocks)
    out = []
    for k in range(2, min(kmax, len(net.blocks)) + 1):
        t = time.perf_counter()
        opt = P.max_child(costs, P.exact(costs, k))
        t_exact = time.perf_counter() - t
        r = P.qlearning(jax.random.key(k), costs, k, reference_ms=opt)
        out.append({"k": k, "exact_ms": opt + lm.overhead_ms, "agent_ms": r.max_ms + lm.overhead_ms,
                    "equal_ms": P.max_child(costs, P.equal(len(costs), k)) + lm.overhead_ms,
                    "agent_over_exact": (r.max_ms + lm.overhead_ms) / (opt + lm.overhead_ms),
                    "episodes_to_10pct": r.episodes_to_10pct, "episodes": r.episodes, "agent_s": r.seconds,
                    "exact_s": t_exact})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nets", nargs="+", default=["resnet50", "mobilenet_v2"])
    ap.add_argument("--config", default=None, help="config of a run directory without config.json")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kmax", type=int, default=8)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-agent", action="store_true", help="skip the Q-learning vs exact table")
    ap.add_argument("--dir", default=None, help="where the children are written (default: a temporary directory)")
    args = ap.parse_args(argv)
    hw = os.cpu_count() or 1
    config = None
    if args.config:
        from jmsnas.configs import load_config
        config = load_config(args.config)
    out = {"loadavg_start": loadavg(), "hardware_threads": hw}
    print(f"load average at start: {out['loadavg_start']}; hardware threads {hw}", flush=True)
    root = tempfile.mkdtemp(prefix="jmsnas-bench-loading-", dir=args.dir)
    try:
        samples = L.measure(sizes_bytes=(2**16, 2**20, 2**23, 2**25), arrays=(1, 16, 128), reps=3, directory=root)
        lm = L.fit(samples)
        out["load_model"] = lm.to_json()
        print(f"load model: {lm.overhead_ms:.2f} ms/child + {lm.per_array_ms:.3f} ms/array + {lm.ms_per_mb:.2f} "
              f"ms/MB (rmse {lm.rmse_ms:.2f} ms)", flush=True)
        raw = {mb: L.raw_read_ms(mb * 2**20, 1, directory=root) for mb in (8, 32)}
        s32 = [s for s in samples if s["bytes"] == 2**25 and s["arrays"] == 1][0]
        orbax32 = s32["ms"]
        out["raw_read_ms"] = raw
        print(f"cold raw read: 8 MiB {raw[8]:.1f} ms, 32 MiB {raw[32]:.1f} ms ({32 * 1.048576 / raw[32] * 1e3:.0f} "
              f"MB/s); cold orbax restore of 32 MiB in 1 array {orbax32:.1f} ms wall, {s32['cpu_ms']:.1f} ms CPU",
              flush=True)
        rng = np.random.default_rng(0)
        out["networks"] = []
        for name in args.nets:
            net = api.load_network(name, config)
            t = time.perf_counter()
            r = bench_net(net, lm, args.kmax, args.reps, root, hw, rng)
            r["agent"] = [] if args.no_agent else agent_table(net, lm, args.kmax)
            r["seconds"] = time.perf_counter() - t
            r["loadavg"] = loadavg()
            out["networks"].append(r)
            print(f"\n{net.name}: {r['blocks']} blocks, {r['mb']:.1f} MB  (load average now {loadavg()})")
            print("| k | load ms | speed-up (median [min, max]) | first prediction ms | speed-up | CPU ms | "
                  "overlap | model here | model, k threads |")
            print("|---|---|---|---|---|---|---|---|---|")
            for row in r["rows"]:
                sl, sf = row["speedup_load"], row["speedup_first"]
                print(f"| {row['k']} | {row['load_ms_median']:.0f} | {sl[0]:.2f} [{sl[1]:.2f}, {sl[2]:.2f}] | "
                      f"{row['first_prediction_ms_median']:.0f} | {sf[0]:.2f} [{sf[1]:.2f}, {sf[2]:.2f}] | "
                      f"{row['cpu_ms_median']:.0f} | {row['overlap_median']:.2f} | {row['predicted_ms_here']:.0f} | "
                      f"{row['predicted_ms_k_threads']:.0f} |")
            if r["agent"]:
                print("| k | exact max child ms | Q-learning | ratio | episodes to within 10% | agent s | "
                      "equal layers |")
                print("|---|---|---|---|---|---|---|")
            for a in r["agent"]:
                print(f"| {a['k']} | {a['exact_ms']:.1f} | {a['agent_ms']:.1f} | {a['agent_over_exact']:.3f} | "
                      f"{a['episodes_to_10pct']} / {a['episodes']} | {a['agent_s']:.1f} | {a['equal_ms']:.1f} |",
                      flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out["loadavg_end"] = loadavg()
    print(f"\nload average at end: {out['loadavg_end']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
