"""Accuracy and latency against the UE's memory limit, on the paper's chain and mesh.

For each topology (the ``chain`` and ``mesh`` presets with the main job's configs), the UE's memory limit is swept
from just above the least any architecture of the space needs on the UE up to the most any needs (where the
limit no longer binds), plus no limit; every point is a full ``jmsnas search`` run (search with the limits'
hinge penalty, repair within T_const and every device's memory, retrain) on a topology file that differs only in
the UE's ``memory_bytes``. Writes into ``<out>``:

* ``<topology>_ue<bytes>/``: each run's workdir (a finished run is skipped, so the command can be restarted);
* ``memory_limit.png``: test accuracy, end-to-end latency and the UE's memory used against the UE's limit;
* ``memory_limit.md``: one row per run.

Usage:
  python experiments/memory_limit.py [--out runs/memory_limit] [--points 4] [--quick] [--only chain]

``--quick``: 1 warm-up + 2 search epochs, 4 retrain epochs (instead of 2 + 8 and 15; default out
``runs/memory_limit_quick``).
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np
from matplotlib.figure import Figure


def _config(topology: str, quick: bool):
    from jmsnas import configs
    cfg = configs.mesh_config() if topology == "mesh" else configs.default_config()
    if quick:
        cfg.search.warmup_epochs, cfg.search.epochs, cfg.retrain.epochs = 1, 2, 4
    return cfg


def ue_range(topology: str, quick: bool) -> tuple:
    """(least, most) bytes any architecture of the space needs on the UE (device 0) under D^m."""
    from jmsnas import limits, pipeline
    cfg = _config(topology, quick)
    space, table = pipeline.build(cfg, pipeline.load_data(cfg))
    lim = limits.device_limits(space, cfg.cost.activation_bits)
    return limits.least_need(space, table, lim, 0)[0], float(limits.upper_bounds(space, table, lim)[0][0])


def run_point(topology: str, ue_bytes, out: str, quick: bool, progress: bool) -> dict:
    from jmsnas import pipeline, topology as T
    topo = T.resolve(topology)
    if ue_bytes is not None:
        topo = topo._replace(devices=(topo.devices[0]._replace(memory_bytes=float(ue_bytes)),) + topo.devices[1:])
    tag = "free" if ue_bytes is None else f"{int(ue_bytes)}"
    workdir = os.path.join(out, f"{topology}_ue{tag}")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{topology}_ue{tag}.yaml")
    T.dump(topo, path)
    if not os.path.isfile(os.path.join(workdir, "result.json")):
        cfg = _config(topology, quick)
        cfg.topology = path
        ckpt = os.path.join(workdir, "checkpoints")
        pipeline.search(cfg, workdir, resume=os.path.isdir(ckpt) and any(os.scandir(ckpt)), progress=progress)
    with open(os.path.join(workdir, "result.json")) as f:
        r = json.load(f)
    return {"topology": topology, "ue_limit": ue_bytes, "ue_bytes": r["memory"]["ue"]["bytes"],
            "within": all(m["within"] for m in r["memory"].values()), "test_acc": r["accuracy"]["test"],
            "latency_ms": r["latency_ms"]["total"], "t_const_ms": r["t_const_ms"], "params": r["params"],
            "repaired": r["budget"]["repaired"]}


def plot(rows, path) -> None:
    fig = Figure(figsize=(12, 3.8), layout="constrained")
    axes = fig.subplots(1, 3)
    for topology, marker in (("chain", "o-"), ("mesh", "s--")):
        pts = [r for r in rows if r["topology"] == topology and r["ue_limit"] is not None]
        free = [r for r in rows if r["topology"] == topology and r["ue_limit"] is None]
        if not pts:
            continue
        x = np.array([r["ue_limit"] for r in pts]) / 1024
        for ax, key, scale in zip(axes, ("test_acc", "latency_ms", "ue_bytes"), (100, 1, 1 / 1024)):
            line, = ax.plot(x, [r[key] * scale for r in pts], marker, label=topology)
            if free:
                ax.axhline(free[0][key] * scale, color=line.get_color(), lw=0.8, ls=":",
                           label=f"{topology}, no limit")
    axes[2].plot(axes[2].get_xlim(), axes[2].get_xlim(), color="#d62828", lw=0.8, label="= limit")
    for ax, label in zip(axes, ("test accuracy (%)", "end-to-end latency T (ms)", "UE memory used (KiB)")):
        ax.set_xlabel("UE memory limit (KiB)")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    fig.suptitle("JMSNAS under the UE's memory limit (digits; chain and mesh presets, T_const 2.8 ms)")
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--points", type=int, default=4, help="limits per topology between the least and the most")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", nargs="*", default=["chain", "mesh"], choices=["chain", "mesh"])
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.points < 1:
        p.error(f"--points must be >= 1, got {args.points}")
    out = args.out or ("runs/memory_limit_quick" if args.quick else "runs/memory_limit")
    rows = []
    for topology in args.only:
        least, most = ue_range(topology, args.quick)
        limits = [least + f * (most - least) for f in np.linspace(0.02, 1.0, args.points)]
        for ue in [None] + [float(np.ceil(v)) for v in limits]:
            rows.append(run_point(topology, ue, out, args.quick, not args.no_progress))
            print(json.dumps(rows[-1]), flush=True)
    plot(rows, os.path.join(out, "memory_limit.png"))
    lines = ["| topology | UE limit (bytes) | UE used (bytes) | all devices within | T (ms) | T_const | test acc | "
             "params | repaired |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lim = "none" if r["ue_limit"] is None else f"{r['ue_limit']:,.0f}"
        lines.append(f"| {r['topology']} | {lim} | {r['ue_bytes']:,} | {r['within']} | {r['latency_ms']:.3f} | "
                     f"{r['t_const_ms']:.3f} | {100 * r['test_acc']:.2f}% | {r['params']:,} | {r['repaired']} |")
    with open(os.path.join(out, "memory_limit.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
