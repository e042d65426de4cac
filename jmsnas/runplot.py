"""Figures over several runs (``jmsnas plot``): the accuracy-latency front and per-device/link stacked latency bars.

* **Front** (JMSNAS Fig. 5 style): one point per run at its end-to-end latency T (ms) and test accuracy after
  stage 2, points of one group (default: the topology) joined in latency order; where the run's history.json has
  search epochs, a hollow point at the stage-1 derived latency and validation accuracy of its last search epoch
  (what ``experiments/fig5.py`` draws). ``pareto`` marks the runs no other run of the group beats on both
  latency and accuracy (lower or equal T and higher or equal accuracy, one of them strictly).
* **Bars** (SplitNets Figs. 7/9 style): one stacked bar per run, each device's compute then its outgoing links
  in pipeline order (``report.latency_segments``), with the end-to-end total and T_const
  (``report.plot_latency_breakdown``).

Inputs are the ``result.json`` of ``jmsnas search`` / ``evolve`` runs (SplitNets' included), or their workdirs.
``load_runs`` checks every input before anything is drawn; ``front_data`` and ``bar_data`` are the JSON the
command prints with ``--json``.
"""
from __future__ import annotations

import os

from matplotlib.figure import Figure

from jmsnas import report
from jmsnas.run import directory

GROUP_KEYS = ("topology", "dataset", "flow", "none")


def load_runs(paths, labels=None) -> list:
    """[{"label", "path", "result", "history" (list or None)}] for each run directory or result.json in
    ``paths``; ``labels`` default to the run directory's name. ValueError (one line) names the first bad input."""
    paths = list(paths)
    if not paths:
        raise ValueError("no run given: pass result.json files or run directories")
    if labels is not None and len(labels) != len(paths):
        raise ValueError(f"--labels has {len(labels)} names for {len(paths)} runs")
    runs = []
    for i, p in enumerate(paths):
        file = os.path.join(p, "result.json") if os.path.isdir(p) else p
        if not os.path.isfile(file):
            raise ValueError(f"{p!r} is neither a result.json file nor a run directory holding one")
        try:
            result = directory.read_json(file, "result")
        except directory.RunDirError as e:
            raise ValueError(f"cannot read {file!r}: {e}") from None
        try:
            report.validate_result(result)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{file}: not the result.json of jmsnas search or evolve ({e})") from None
        history = None
        hist_file = os.path.join(os.path.dirname(file), "history.json")
        if os.path.isfile(hist_file):
            try:
                history = directory.read_json(hist_file, "history")
                report.validate_history(history)
            except (ValueError, TypeError) as e:
                raise ValueError(f"{hist_file}: bad history ({e})") from None
        name = labels[i] if labels is not None else os.path.basename(os.path.dirname(os.path.abspath(file)))
        runs.append({"label": name, "path": file, "result": result, "history": history})
    return runs


def _group(run, group_by: str) -> str:
    if group_by == "none":
        return ""
    value = run["result"].get(group_by)
    return "" if value is None else str(value)


def stage1_point(history):
    """(derived T in ms, validation accuracy) of the last search-stage epoch, or None without one."""
    search = [h for h in history or () if h.get("stage") == "search"]
    if not search or search[-1].get("derived_latency_ms") is None or search[-1].get("val_acc") is None:
        return None
    return float(search[-1]["derived_latency_ms"]), float(search[-1]["val_acc"])


def pareto(points) -> list:
    """For (latency, accuracy) pairs: True where no other pair has latency <= and accuracy >= with one strict."""
    return [not any(lo <= l and ao >= a and (lo < l or ao > a) for lo, ao in points) for l, a in points]


def front_data(runs, group_by: str = "topology") -> list:
    """Per group (in order of first appearance): {"group", "points": [...]} with the group's runs in latency
    order, each {"label", "latency_ms", "test_accuracy", "stage1_latency_ms", "stage1_val_accuracy", "pareto"}
    (accuracies as fractions; the stage-1 pair None without search epochs)."""
    if group_by not in GROUP_KEYS:
        raise ValueError(f"unknown group {group_by!r}; expected one of {list(GROUP_KEYS)}")
    groups = list(dict.fromkeys(_group(r, group_by) for r in runs))
    out = []
    for g in groups:
        members = sorted((r for r in runs if _group(r, group_by) == g),
                         key=lambda r: r["result"]["latency_ms"]["total"])
        pts = [(float(r["result"]["latency_ms"]["total"]), r["result"]["accuracy"]["test"]) for r in members]
        ok = pareto([(l, -1.0 if a is None else a) for l, a in pts])
        rows = []
        for r, (lat, acc), best in zip(members, pts, ok):
            s1 = stage1_point(r["history"])
            rows.append({"label": r["label"], "latency_ms": lat, "test_accuracy": acc,
                         "stage1_latency_ms": None if s1 is None else s1[0],
                         "stage1_val_accuracy": None if s1 is None else s1[1], "pareto": bool(best)})
        out.append({"group": g, "points": rows})
    return out


def bar_data(runs) -> list:
    """One bar per run: {"label", "segments": [{"name", "kind" ("compute"|"link"), "ms"}], "total_ms",
    "t_const_ms", "test_accuracy"}."""
    return [{"label": r["label"],
             "segments": [{"name": n, "kind": k, "ms": ms} for n, k, ms in report.latency_segments(r["result"])],
             "total_ms": float(r["result"]["latency_ms"]["total"]), "t_const_ms": r["result"].get("t_const_ms"),
             "test_accuracy": r["result"]["accuracy"]["test"]} for r in runs]


_STYLES = ("o", "s", "^", "D", "v", "P", "X")


def plot_front(front, path, title: str = "accuracy vs latency") -> Figure:
    """The front as ``experiments/fig5.py`` draws it: filled points (test accuracy, %, at T), dashed line per
    group in latency order, hollow points at the stage-1 derived latency and validation accuracy; Pareto-optimal
    runs ringed."""
    fig = Figure(figsize=(7.5, 5.5), layout="constrained")
    ax = fig.subplots()
    colors = [f"C{i}" for i in range(10)]
    for gi, g in enumerate(front):
        pts = [p for p in g["points"] if p["test_accuracy"] is not None]
        c, m = colors[gi % 10], _STYLES[gi % len(_STYLES)]
        name = g["group"] or "runs"
        if not pts:
            continue
        ax.plot([p["latency_ms"] for p in pts], [100 * p["test_accuracy"] for p in pts], "--", color="gray", lw=0.8)
        ax.scatter([p["latency_ms"] for p in pts], [100 * p["test_accuracy"] for p in pts], color=c, marker=m, s=50,
                   zorder=3, label=f"{name}: test accuracy after stage 2, final T")
        s1 = [p for p in pts if p["stage1_latency_ms"] is not None]
        if s1:
            ax.scatter([p["stage1_latency_ms"] for p in s1], [100 * p["stage1_val_accuracy"] for p in s1],
                       facecolors="none", edgecolors=c, marker=m, s=50, zorder=3,
                       label=f"{name}: stage-1 val accuracy, stage-1 T")
        best = [p for p in pts if p["pareto"]]
        ax.scatter([p["latency_ms"] for p in best], [100 * p["test_accuracy"] for p in best], facecolors="none",
                   edgecolors="k", marker="o", s=160, lw=0.8, zorder=2)
        for p in pts:
            ax.annotate(p["label"], (p["latency_ms"], 100 * p["test_accuracy"]), textcoords="offset points",
                        xytext=(4, 4), fontsize=7)
    ax.scatter([], [], facecolors="none", edgecolors="k", marker="o", s=160, lw=0.8, label="Pareto-optimal in its group")
    ax.set_xlabel("end-to-end latency T (ms)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="lower right")
    fig.savefig(os.fspath(path), dpi=110, format="png")
    return fig


def plot_bars(runs, path) -> Figure:
    """Stacked per-device/link latency bars, one per run (``report.plot_latency_breakdown``)."""
    return report.plot_latency_breakdown([r["result"] for r in runs], os.fspath(path),
                                         labels=[r["label"] for r in runs])
