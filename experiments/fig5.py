"""Fig. 5 of the JMSNAS paper at our scale: chain and mesh, three T_const levels each, accuracy against latency.

Runs the six configurations of ``experiments/configs/fig5.py`` one after another with ``jmsnas.pipeline.search``
into ``<out>/<topology>_<level>/`` (a finished run, one with ``result.json``, is skipped; an interrupted one is
resumed from its checkpoint), then writes into ``<out>``:

* ``fig5_accuracy_latency.png``: accuracy against latency for the six runs (filled: test accuracy after stage 2
  at the final latency; hollow: stage-1 validation accuracy of the derived network at its latency before any
  budget repair), and per topology the stage-1 validation accuracy and derived latency per epoch (the paper's
  Fig. 5 shows the first-stage accuracy curves);
* ``fig5_summary.md``: one row per run (T_const, derived T, budget met/repaired, accuracies, wall time) and
  whether the derived latency falls as the budget tightens.

Usage:
  python experiments/fig5.py [--out runs/fig5] [--quick] [--only chain:tight ...] [--no-progress]

``--quick`` (1 warm-up + 2 search epochs, 1 retrain epoch) is a smoke run; it defaults to ``runs/fig5_quick``
so it never mixes with full runs (a resumed run whose config differs is refused by the checkpoint fingerprint).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
from matplotlib.figure import Figure

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG_FILE = os.path.join(HERE, "configs", "fig5.py")
TOPOLOGIES = ("chain", "mesh")
LEVELS = ("tight", "mid", "loose")  # tightest budget first
WALL_FILE = "fig5_wall.json"


def load_config(arg: str, quick: bool = False):
    """The ConfigDict of run ``arg`` ("chain:tight", ...); ``quick`` shortens every stage for a smoke run."""
    from jmsnas.configs import load_config as load
    cfg = load(f"{CONFIG_FILE}:{arg}")
    if quick:
        cfg.search.warmup_epochs, cfg.search.epochs, cfg.retrain.epochs = 1, 2, 1
    return cfg


def run_one(cfg, workdir: str, progress: bool = True, version: str = "unknown") -> dict:
    """Runs (or resumes, or skips when finished) one configuration; returns its row for the summary.
    ``version``: the code this process imported (see ``code_version``), recorded per session."""
    from jmsnas import pipeline
    done = os.path.isfile(os.path.join(workdir, "result.json"))
    if not done:
        ckpt = os.path.join(workdir, "checkpoints")
        resume = os.path.isdir(ckpt) and any(os.scandir(ckpt))
        t0 = time.time()
        pipeline.search(cfg, workdir, resume=resume, progress=progress)
        _add_wall(workdir, time.time() - t0, resumed=resume, code=version)
    return load_row(cfg, workdir)


def _add_wall(workdir: str, seconds: float, resumed: bool, code: str) -> None:
    path = os.path.join(workdir, WALL_FILE)
    wall = {"wall_s": 0.0, "sessions": 0}
    if os.path.isfile(path):
        with open(path) as f:
            wall = json.load(f)
    wall["wall_s"] += seconds
    wall["sessions"] += 1
    wall["resumed"] = wall.get("resumed", False) or resumed
    wall["code"] = wall.get("code", []) + [code]  # one entry per session (the shared tree may change between)
    with open(path, "w") as f:
        json.dump(wall, f, indent=2)


def load_row(cfg, workdir: str) -> dict:
    """The summary row of a finished run from its result.json, history.json and wall-time file."""
    with open(os.path.join(workdir, "result.json")) as f:
        result = json.load(f)
    with open(os.path.join(workdir, "history.json")) as f:
        history = json.load(f)
    wall_path = os.path.join(workdir, WALL_FILE)
    wall = json.load(open(wall_path)) if os.path.isfile(wall_path) else {}
    search = [h for h in history if h["stage"] == "search"]
    if not search:
        raise ValueError(f"{workdir}/history.json has no search-stage epoch")
    e = cfg.experiment
    return {"topology": e.topology, "level": e.level, "fraction": e.fraction,
            "t_const_ms": result["t_const_ms"], "t_min_ms": e.reachable_min_ms, "t_max_ms": e.reachable_max_ms,
            "stage1_latency_ms": search[-1]["derived_latency_ms"], "stage1_expected_ms": search[-1]["expected_latency_ms"],
            "stage1_val_acc": search[-1]["val_acc"], "latency_ms": result["latency_ms"]["total"],
            "budget": result.get("budget", {}), "val_acc": result["accuracy"]["val"],
            "test_acc": result["accuracy"]["test"], "params": result["params"],
            "wall_s": wall.get("wall_s"), "resumed": wall.get("resumed", False), "code": wall.get("code", []),
            "history": history, "workdir": workdir}


def trend(rows, topology: str, key: str = "latency_ms") -> str:
    """'falls' if ``key`` strictly decreases from loose to mid to tight, 'non-increasing' if it only does not
    increase, else 'does not fall' (with the values)."""
    by = {r["level"]: r[key] for r in rows if r["topology"] == topology}
    if set(by) != set(LEVELS):
        return "incomplete"
    v = [by[l] for l in LEVELS]  # tight, mid, loose
    if v[0] < v[1] < v[2]:
        return "falls"
    if v[0] <= v[1] <= v[2]:
        return "non-increasing (ties)"
    return "does not fall"


def code_version() -> str:
    """The git commit of the code that ran, plus the jmsnas/ files that differed from it (a shared working tree)."""
    git = lambda *a: subprocess.run(["git", *a], cwd=HERE, capture_output=True, text=True).stdout
    try:
        head = git("rev-parse", "--short", "HEAD").strip()
        dirty = [d for d in git("status", "--porcelain", "--", "../jmsnas").splitlines() if d.strip()]
    except OSError:
        return "unknown (git not available)"
    if not head:
        return "unknown (not a git checkout)"
    return head + (f" with uncommitted changes to {', '.join(d[3:] for d in dirty)}" if dirty else "")


def summary_markdown(rows, quick: bool, version: str | None = None) -> str:
    """The fig5_summary.md text; ``version`` says which code ran (see ``code_version``)."""
    lines = ["# Fig. 5 at our scale: chain and mesh, three T_const levels" + (" (QUICK smoke run)" if quick else ""),
             "", f"Code: {version}." if version else "", "", "Latencies in ms (analytic cost table of the presets); accuracies on the embedded digits data. "
             "`stage-1 T` is the derived (argmax) architecture at the end of the search, before any repair; "
             "`final T` is after the budget repair (if needed) and is what stage 2 retrains.", "",
             "| topology | level | T_const | reachable | stage-1 E[T] | stage-1 T | final T | budget | "
             "stage-1 val acc | val acc | test acc | params | wall time |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = r["budget"]
        budget = ("met" if b.get("met") else "NOT met") + (", repaired" if b.get("repaired") else "")
        wall = "?" if r["wall_s"] is None else f"{r['wall_s'] / 60:.1f} min" + (" (resumed)" if r["resumed"] else "")
        lines.append(f"| {r['topology']} | {r['level']} ({r['fraction']:.0%}) | {r['t_const_ms']:.4f} | "
                     f"{r['t_min_ms']:.4f}–{r['t_max_ms']:.4f} | {r['stage1_expected_ms']:.4f} | "
                     f"{r['stage1_latency_ms']:.4f} | {r['latency_ms']:.4f} | {budget} | "
                     f"{100 * r['stage1_val_acc']:.1f}% | {100 * r['val_acc']:.1f}% | {100 * r['test_acc']:.1f}% | "
                     f"{r['params']:,} | {wall} |")
    lines += ["", "As the budget tightens (loose → mid → tight):", ""]
    for topo in TOPOLOGIES:
        lines.append(f"- {topo}: final T {trend(rows, topo)}; stage-1 derived T "
                     f"{trend(rows, topo, 'stage1_latency_ms')}; stage-1 E[T] {trend(rows, topo, 'stage1_expected_ms')}")
    versions = sorted({v for r in rows for v in r.get("code", [])})
    if len(versions) > 1:
        lines += ["", "The runs did not all use the same code (a shared working tree changed between sessions):", ""]
        lines += [f"- {r['topology']}:{r['level']}: {'; then '.join(r['code'])}" for r in rows]
    total = sum(r["wall_s"] or 0.0 for r in rows)
    lines += ["", f"Total wall time of the runs: {total / 60:.1f} min (sum over runs; a session that was killed "
              "before finishing is not counted)."]
    return "\n".join(lines) + "\n"


_COLORS = {"tight": "#d62828", "mid": "#f77f00", "loose": "#003049"}
_MARKERS = {"chain": "o", "mesh": "s"}


def plot_fig5(rows, path: str) -> Figure:
    """Accuracy vs latency for all runs (left) and, per topology, stage-1 val accuracy and derived T per epoch."""
    fig = Figure(figsize=(14, 7), layout="constrained")
    grid = fig.add_gridspec(2, 3)
    ax = fig.add_subplot(grid[:, 0])
    for topo in TOPOLOGIES:
        mine = sorted((r for r in rows if r["topology"] == topo), key=lambda r: r["latency_ms"])
        if not mine:
            continue
        ax.plot([r["latency_ms"] for r in mine], [100 * r["test_acc"] for r in mine], "--", color="gray", lw=0.8)
        for r in mine:
            c, m = _COLORS[r["level"]], _MARKERS[topo]
            ax.scatter(r["latency_ms"], 100 * r["test_acc"], color=c, marker=m, s=50, zorder=3)
            ax.scatter(r["stage1_latency_ms"], 100 * r["stage1_val_acc"], facecolors="none", edgecolors=c,
                       marker=m, s=50, zorder=3)
            ax.annotate(f"{topo}:{r['level']}", (r["latency_ms"], 100 * r["test_acc"]), textcoords="offset points",
                        xytext=(4, 4 if topo == "chain" else -10), fontsize=7)
    for topo, m in _MARKERS.items():
        ax.scatter([], [], color="gray", marker=m, label=f"{topo}: test acc after stage 2, final T")
        ax.scatter([], [], facecolors="none", edgecolors="gray", marker=m, label=f"{topo}: stage-1 val acc, stage-1 T")
    ax.set_xlabel("latency (ms)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title("accuracy vs latency")
    ax.legend(fontsize=7, loc="lower right")
    for col, topo in enumerate(TOPOLOGIES, start=1):
        a_acc, a_lat = fig.add_subplot(grid[0, col]), fig.add_subplot(grid[1, col])
        warm = []
        for r in (r for r in rows if r["topology"] == topo):
            s1 = [h for h in r["history"] if h["stage"] in ("warmup", "search")]
            x = [h["epoch"] for h in s1]
            c = _COLORS[r["level"]]
            lab = f"{r['level']} (T_const {r['t_const_ms']:.3f})"
            a_acc.plot(x, [100 * h["val_acc"] for h in s1], "o-", ms=3, color=c, label=lab)
            a_lat.plot(x, [h["derived_latency_ms"] for h in s1], "o-", ms=3, color=c, label=f"derived T, {r['level']}")
            a_lat.plot(x, [h["expected_latency_ms"] for h in s1], ":", color=c)
            a_lat.axhline(r["t_const_ms"], ls="--", color=c, lw=0.8)
            warm = [h["epoch"] for h in s1 if h["stage"] == "warmup"]
        for a in (a_acc, a_lat):
            if warm:
                a.axvspan(min(warm) - 0.5, max(warm) + 0.5, color="#eeeeee", zorder=0, lw=0)
        a_acc.set_title(f"{topo}: stage 1, grey = warm-up (dotted: E[T], dashed: T_const)", fontsize=10)
        a_acc.set_ylabel("val accuracy of derived net (%)")
        a_acc.legend(fontsize=7, loc="lower right")
        a_lat.set_ylabel("latency (ms)")
        a_lat.set_xlabel("epoch (warm-up, then search)")
    fig.savefig(path, dpi=110, format="png")
    return fig


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="output folder (default runs/fig5, or runs/fig5_quick with --quick)")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 warm-up + 2 search epochs, 1 retrain epoch")
    p.add_argument("--only", nargs="+", default=None, metavar="TOPOLOGY:LEVEL", help="run a subset")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    wanted = [f"{t}:{l}" for t in TOPOLOGIES for l in LEVELS]
    for a in args.only or ():
        if a not in wanted:
            p.error(f"--only takes some of {wanted}, got {a!r}")
    args.runs = args.only or wanted
    args.out = args.out or ("runs/fig5_quick" if args.quick else "runs/fig5")
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.makedirs(args.out, exist_ok=True)
    version = code_version()  # taken before the runs: modules are imported once, at the first run
    print(f"code: {version}", flush=True)
    if "uncommitted" in version:  # keep what actually ran
        diff = subprocess.run(["git", "diff", "HEAD", "--", "../jmsnas"], cwd=HERE, capture_output=True, text=True)
        with open(os.path.join(args.out, time.strftime("code_%Y%m%d-%H%M%S.diff")), "w") as f:
            f.write(diff.stdout)
    rows = []
    for arg in args.runs:
        cfg = load_config(arg, args.quick)
        workdir = os.path.join(args.out, arg.replace(":", "_"))
        print(f"== {arg}: T_const = {cfg.t_const_ms} ms (reachable {cfg.experiment.reachable_min_ms:.4f}–"
              f"{cfg.experiment.reachable_max_ms:.4f}) -> {workdir}", flush=True)
        rows.append(run_one(cfg, workdir, progress=not args.no_progress, version=version))
        r = rows[-1]
        print(f"   final T {r['latency_ms']:.4f} ms, test acc {100 * r['test_acc']:.1f}%", flush=True)
    with open(os.path.join(args.out, "fig5_summary.md"), "w") as f:
        f.write(summary_markdown(rows, args.quick, version))
    plot_fig5(rows, os.path.join(args.out, "fig5_accuracy_latency.png"))
    print(summary_markdown(rows, args.quick, version))
    print(f"wrote {args.out}/fig5_summary.md and {args.out}/fig5_accuracy_latency.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
