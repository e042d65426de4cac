"""``jmsnas plot``: from several runs, the accuracy-latency front and the per-device/link stacked latency bars.

    jmsnas plot runs/fig5/chain_* runs/fig5/mesh_* --out figures/ [--group-by topology] [--labels A B ...] [--json]

Takes result.json files of ``jmsnas search`` / ``evolve`` runs (SplitNets' too) or their workdirs. Writes
``OUT/front.png`` (JMSNAS Fig. 5 style: test accuracy against end-to-end latency, one dashed line per group, hollow
points at each run's stage-1 derived latency and validation accuracy, Pareto-optimal runs ringed) and
``OUT/latency_bars.png`` (SplitNets Figs. 7/9 style: one stacked bar of device compute and link transfer ms per
run). Prints the points, or with ``--json`` the data of both figures as one JSON object {"front": [...],
"bars": [...]} (``jmsnas.runplot.front_data`` / ``bar_data``). Bad input: one line, exit 2, nothing written.
"""
from __future__ import annotations

import json
import os

from jmsnas.commands import fail


def add_parser(sub) -> None:
    p = sub.add_parser("plot", help="accuracy-latency front and per-device/link latency bars of several runs",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", metavar="RUN", help="result.json files or run directories")
    p.add_argument("--out", default=".", help="folder for front.png and latency_bars.png (default: here)")
    p.add_argument("--group-by", default="topology", help="one line per group on the front: topology (default), "
                                                          "dataset, flow or none")
    p.add_argument("--labels", nargs="+", default=None, help="a name per run (default: its directory's name)")
    p.add_argument("--json", action="store_true", help="print the figures' data as JSON")


def run(args) -> int:
    from jmsnas import runplot, safeio
    try:
        runs = runplot.load_runs(args.runs, args.labels)
        front = runplot.front_data(runs, args.group_by)
    except ValueError as e:
        return fail("plot", safeio.clip(e, 600))
    out = args.out
    if os.path.exists(out) and not os.path.isdir(out):
        return fail("plot", f"--out {out!r} exists and is not a directory")
    try:
        os.makedirs(out, exist_ok=True)
        if not os.access(out, os.W_OK | os.X_OK):
            return fail("plot", f"--out {out!r} is not writable")
        paths = {"front": os.path.join(out, "front.png"), "bars": os.path.join(out, "latency_bars.png")}
        runplot.plot_front(front, paths["front"])
        runplot.plot_bars(runs, paths["bars"])
    except OSError as e:
        return fail("plot", f"cannot write to --out {out!r}: {e.strerror or e}")
    if args.json:
        print(json.dumps({"front": front, "bars": runplot.bar_data(runs), "files": paths}, indent=2))
        return 0
    for g in front:
        print(f"{g['group'] or 'runs'}:")
        for p in g["points"]:
            acc = "-" if p["test_accuracy"] is None else f"{100 * p['test_accuracy']:.2f}%"
            print(f"  {p['label']:<24} T = {p['latency_ms']:.4f} ms  test {acc}" + ("  (Pareto)" if p["pareto"] else ""))
    print(f"wrote {paths['front']} and {paths['bars']}")
    return 0
