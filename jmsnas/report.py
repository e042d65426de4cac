"""Text summary and plots of a search result (``result.json``) and its per-epoch history.

``result`` schema (latencies in ms, accuracies as fractions in [0, 1])::

    {"topology": "chain", "t_const_ms": 10.0,
     "architecture": [{"layer": 0, "device": "ue", "op": "mbconv_k3_e3"}, ...],
     "latency_ms": {"total": 9.1, "per_device": {"ue": 1.2, ...}, "per_link": {"ue->sbs": 3.3, ...}},
     "accuracy": {"val": 0.95, "test": 0.94}, "params": 12345,
     "budget": {"met": true, "repaired": false, "min_reachable_ms": 7.0, "note": "..."}}   # budget optional

``history``: a list of per-epoch dicts ``{"epoch", "stage" ("warmup" | "search" | "retrain"), "train_loss",
"train_acc", "val_acc", "expected_latency_ms" (E[T], None outside the search), "derived_latency_ms"}``.

The order of ``per_device`` is the device order used everywhere (tables, bars, rows). ``total`` is the
end-to-end latency; in a mesh the branch devices run in parallel, so it is less than the sum of the parts.
Plots use matplotlib's object API (``Figure`` + Agg), never pyplot, so nothing needs a display. Every
``plot_*`` function returns the Figure it saved, for inspection.
"""
from __future__ import annotations

import math
import os
from numbers import Real

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from jmsnas import safeio
from jmsnas.space import OPS, op_index

STAGES = ("warmup", "search", "retrain")
_STAGE_COLORS = {"warmup": "#eeeeee", "search": "#e3eefa", "retrain": "#e8f5e3"}
_KERNEL_COLORS = {3: "#8ecae6", 5: "#90be6d", 7: "#c77dff", 0: "#d9d9d9"}  # 0: identity
_LINK_COLORS = ("#6d597a", "#b56576", "#355070", "#e56b6f", "#8d99ae")
_GROUP_STYLES = (("#1f77b4", "o"), ("#d62728", "s"), ("#2ca02c", "^"), ("#9467bd", "D"), ("#ff7f0e", "v"),
                 ("#8c564b", "P"))
_DEVICE_COLORS = ("#2a9d8f", "#e9c46a", "#457b9d", "#f4a261", "#a8dadc", "#90be6d", "#bc6c25", "#cdb4db")


# ----------------------------------------------------------------------------------------------- validation

def _get(obj, key: str, where: str):
    """``obj[key]``, or ValueError naming the dotted key when obj is not a dict or lacks it."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where or 'result'} must be a dict, got {type(obj).__name__}")
    if key not in obj:
        raise ValueError(f"result is missing key {(where + '.' if where else '') + key!r}")
    return obj[key]


def _number(value, name: str, *, allow_none: bool = False, minimum: float | None = 0.0):
    """A finite real number (>= minimum), or None when allowed; ValueError naming ``name`` otherwise."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return float(value)


def _ms_map(obj: dict, name: str) -> dict:
    if not isinstance(obj, dict):
        raise ValueError(f"{name} must be a dict of name -> ms, got {type(obj).__name__}")
    return {str(k): _number(v, f"{name}[{k!r}]") for k, v in obj.items()}


def validate_result(result) -> None:
    """Check ``result`` against the schema above; ValueError names the first missing or bad key."""
    _get(result, "topology", "")
    _number(_get(result, "t_const_ms", ""), "t_const_ms", allow_none=True)
    lat = _get(result, "latency_ms", "")
    _number(_get(lat, "total", "latency_ms"), "latency_ms.total")
    devices = _ms_map(_get(lat, "per_device", "latency_ms"), "latency_ms.per_device")
    links = _ms_map(_get(lat, "per_link", "latency_ms"), "latency_ms.per_link")
    for link in links:
        src, _, dst = link.partition("->")
        if not (src in devices and dst in devices):
            raise ValueError(f"latency_ms.per_link key {link!r} must be 'a->b' with a and b in "
                             f"latency_ms.per_device {list(devices)}")
    acc = _get(result, "accuracy", "")
    for split in ("val", "test"):
        _number(_get(acc, split, "accuracy"), f"accuracy.{split}", allow_none=True)
        if acc[split] is not None and acc[split] > 1.0:
            raise ValueError(f"accuracy.{split} must be a fraction in [0, 1], got {acc[split]!r}")
    _number(_get(result, "params", ""), "params")
    arch = _get(result, "architecture", "")
    if not isinstance(arch, list) or not arch:
        raise ValueError(f"architecture must be a non-empty list of layers, got {arch!r}")
    for i, entry in enumerate(arch):
        for key in ("layer", "device", "op"):
            _get(entry, key, f"architecture[{i}]")
        if entry["device"] not in devices:
            raise ValueError(f"architecture[{i}].device {entry['device']!r} is not in latency_ms.per_device "
                             f"{list(devices)}")
        op_index(entry["op"])
    if "budget" in result:
        _get(result["budget"], "met", "budget")


def validate_history(history) -> None:
    """Check the per-epoch history; ValueError names the first bad entry and key."""
    if not isinstance(history, list):
        raise ValueError(f"history must be a list of per-epoch dicts, got {type(history).__name__}")
    for i, row in enumerate(history):
        where = f"history[{i}]"
        if _get(row, "stage", where) not in STAGES:
            raise ValueError(f"{where}.stage must be one of {STAGES}, got {row['stage']!r}")
        _number(_get(row, "epoch", where), f"{where}.epoch")
        for key in ("train_acc", "val_acc"):
            _number(_get(row, key, where), f"{where}.{key}", allow_none=True)
        _number(_get(row, "train_loss", where), f"{where}.train_loss", allow_none=True, minimum=None)
        _number(_get(row, "expected_latency_ms", where), f"{where}.expected_latency_ms", allow_none=True)
        _number(_get(row, "derived_latency_ms", where), f"{where}.derived_latency_ms", allow_none=True)


# ----------------------------------------------------------------------------------------------- plot data

def device_order(result) -> list:
    """Device names in ``latency_ms.per_device`` order."""
    return list(result["latency_ms"]["per_device"])


def latency_segments(result) -> list:
    """``(name, kind, ms)`` in pipeline order: each device's compute followed by its outgoing links.

    ``kind`` is "compute" or "link". Used for the stacked bar and the summary table.
    """
    lat = result["latency_ms"]
    links = list(lat["per_link"].items())
    segments = []
    for dev in device_order(result):
        segments.append((dev, "compute", float(lat["per_device"][dev])))
        segments += [(name, "link", float(ms)) for name, ms in links if name.partition("->")[0] == dev]
    return segments


def layers_by_device(result) -> dict:
    """Device name -> list of (layer index, op name), layers ascending, devices in device order."""
    out = {dev: [] for dev in device_order(result)}
    for entry in sorted(result["architecture"], key=lambda e: e["layer"]):
        out[entry["device"]].append((int(entry["layer"]), entry["op"]))
    return out


def architecture_cells(result) -> list:
    """One cell per layer: dict(layer, row (device position), device, kernel, expand, residual, label)."""
    rows = {dev: i for i, dev in enumerate(device_order(result))}
    cells = []
    for dev, layers in layers_by_device(result).items():
        for layer, op_name in layers:
            op = OPS[op_index(op_name)]
            label = "id" if op.is_identity else f"e{op.expand}"
            cells.append(dict(layer=layer, row=rows[dev], device=dev, kernel=op.kernel, expand=op.expand,
                              residual=op.residual, label=label))
    return cells


def history_series(history) -> dict:
    """Arrays for plot_history: ``x`` (epoch, or running index when epochs restart per stage), the metric
    series (NaN where missing) and ``stages``: a list of (stage, first x, last x) spans."""
    epochs = [float(r["epoch"]) for r in history]
    increasing = all(b > a for a, b in zip(epochs, epochs[1:]))
    x = np.array(epochs if increasing else range(1, len(history) + 1), dtype=float)

    def series(key):
        return np.array([np.nan if r.get(key) is None else float(r[key]) for r in history], dtype=float)

    stages = []
    for xi, row in zip(x, history):
        if stages and stages[-1][0] == row["stage"]:
            stages[-1][2] = xi
        else:
            stages.append([row["stage"], xi, xi])
    return dict(x=x, train_acc=series("train_acc"), val_acc=series("val_acc"), train_loss=series("train_loss"),
                expected=series("expected_latency_ms"), derived=series("derived_latency_ms"),
                stages=[tuple(s) for s in stages], epoch_is_global=increasing)


# ----------------------------------------------------------------------------------------------- text

def _fmt_pct(acc) -> str:
    return "n/a" if acc is None else f"{100.0 * acc:.2f}%"


def _layer_ranges(layers) -> str:
    """[0,1,2,5] -> '0-2, 5'."""
    out, start, prev = [], None, None
    for n in layers:
        if start is None:
            start = prev = n
        elif n == prev + 1:
            prev = n
        else:
            out.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = n
    if start is not None:
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ", ".join(out)


def _budget_lines(result) -> list:
    total, t_const = result["latency_ms"]["total"], result["t_const_ms"]
    lines = []
    if t_const is not None:
        verdict = "within" if total <= t_const + 1e-9 else "EXCEEDS"
        lines.append(f"  {'end-to-end total':<22} {total:9.3f}   {verdict} the budget T_const = {t_const:.3f} ms")
    else:
        lines.append(f"  {'end-to-end total':<22} {total:9.3f}   (no budget)")
    budget = result.get("budget")
    if budget:
        if not budget["met"]:
            reach = budget.get("min_reachable_ms")
            lines.append("Budget: NOT met - no architecture reaches T_const"
                         + (f"; smallest reachable latency {reach:.3f} ms" if reach is not None else ""))
        elif budget.get("repaired"):
            lines.append("Budget: met after repairing the derived architecture (the argmax exceeded T_const)")
        else:
            lines.append("Budget: met by the derived architecture")
        if budget.get("note"):
            lines.append(f"  note: {budget['note']}")
    return lines


def format_summary(result) -> str:
    """Human-readable summary: architecture per device, compute/communication latency tables, total vs the
    budget, accuracy and parameter count. Raises ValueError naming a missing or bad key."""
    validate_result(result)
    t_const = result["t_const_ms"]
    head = f"JMSNAS result - topology {result['topology']}"
    lines = [head + (f", T_const {t_const:.3f} ms" if t_const is not None else ""), "", "Architecture per device:"]
    width = max(len(d) for d in device_order(result))
    for dev, layers in layers_by_device(result).items():
        where = (f"layer{'s' if len(layers) > 1 else ''} {_layer_ranges([n for n, _ in layers])}"
                 if layers else "no layers")
        lines.append(f"  {dev:<{width}}  ({where}): " + ", ".join(op for _, op in layers))
    lines += ["", "Latency (ms):", f"  {'component':<22} {'ms':>9}   kind"]
    for name, kind, ms in latency_segments(result):
        lines.append(f"  {name:<22} {ms:9.3f}   {'compute' if kind == 'compute' else 'communication'}")
    parts = sum(ms for _, _, ms in latency_segments(result))
    lines.append(f"  {'sum of the parts':<22} {parts:9.3f}")
    lines += _budget_lines(result)
    if parts > result["latency_ms"]["total"] * (1 + 1e-5) + 1e-9:  # float32 sums differ in the last bits
        lines.append("  (the total is below the sum of the parts: parallel branches overlap)")
    acc = result["accuracy"]
    lines += _limits_lines(result)
    if result.get("compose"):
        lines += ["", "Composed search:"] + ["  " + line for line in composed_lines(result)]
    lines += ["", f"Accuracy: val {_fmt_pct(acc['val'])}, test {_fmt_pct(acc['test'])}",
              f"Parameters: {int(result['params']):,}"]
    lines += _time_lines(result.get("time"))
    return "\n".join(lines) + "\n"


def composed_lines(result) -> list:
    """The composed search's choices (result.json's ``compose``): every layer's weight bits, every cut's module
    and transmitted bits; [] for a result without them."""
    comp = result.get("compose")
    if not comp:
        return []
    pairs = [f"{e['layer']}:{e.get('weight_bits', 32)}" for e in sorted(result["architecture"],
                                                                        key=lambda e: e["layer"])]
    rows = [", ".join(pairs[i:i + 12]) for i in range(0, len(pairs), 12)]  # 12 layers a line
    lines = ["Weight bits per layer (layer:bits, 32 = float): " + rows[0]] + ["  " + r for r in rows[1:]]
    lines.append("Cuts (link @ boundary: module, bits sent):")
    for c in comp["cuts"]:
        mod = "no module" if not c["module"] else (f"module r={c['module']['reduction']} "
                                                   f"({c['channels_sent']} of {c['channels']} channels)")
        what = f" ({c['tensor']})" if c.get("tensor") else ""
        lines.append(f"  {c['link']} @ {c['boundary']}{what}: {mod}, {c['activation_bits']}-bit")
    if comp.get("stem_device"):
        lines.append(f"The stem runs on {comp['stem_device']} (the links before it carry the input image)")
    return lines


def _kib(b) -> str:
    """Bytes in KiB, or MiB / GiB from 10 MiB / 10 GiB on ("no limit" for None)."""
    if b is None:
        return "no limit"
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20)):
        if b >= 10 * size:
            return f"{b / size:,.1f} {unit}"
    return f"{b / 1024:,.1f} KiB"


def per_device_memory(result) -> dict | None:
    """``result["memory"]`` when it is search/evolve's per-device entry (device -> {"bytes", ...}); None for none or
    another flow's (SplitNets records {"sensor_peak_bytes", "limit_bytes"})."""
    mem = result.get("memory")
    if isinstance(mem, dict) and mem and all(isinstance(v, dict) and "bytes" in v for v in mem.values()):
        return mem
    return None


def _limits_lines(result) -> list:
    """Memory per device against its limit and energy per device/link (``result["memory"]``/``["energy"]``,
    jmsnas.limits.report), when present."""
    mem, en = per_device_memory(result), result.get("energy")
    if not mem:
        return []
    lines = ["", "Memory per device (weights + link buffers + peak activations, one image):",
             f"  {'device':<12} {'total':>12} {'weights':>12} {'buffers':>12} {'activations':>12}   limit"]
    for dev, m in mem.items():
        lines.append(f"  {dev:<12} {_kib(m['bytes']):>12} {_kib(m['weights']):>12} {_kib(m['buffers']):>12} "
                     f"{_kib(m['activations']):>12}   {_kib(m['limit_bytes'])}"
                     + ("" if m["within"] else "   EXCEEDS"))
    if en:
        fmt = lambda v: "unknown" if v is None else f"{v:.4g}"
        lines += ["", "Energy (mJ per inference; compute + the device's share of its links):"]
        for dev, e in en["per_device"].items():
            budget = "" if e["budget_mj"] is None else f"   budget {e['budget_mj']:.4g}" + (
                "" if e["within"] else "   EXCEEDS")
            lines.append(f"  {dev:<22} {fmt(e['mj']):>9}{budget}")
        for link, v in en["per_link"].items():
            lines.append(f"  {link:<22} {fmt(v):>9}   link (both ends)")
        lines.append(f"  {'total':<22} {fmt(en['total']):>9}")
    return lines


def _time_lines(t) -> list:
    """The run's compile and run time (``result["time"]``, jmsnas.timing), when present."""
    if not t:
        return []
    hits = t.get("cache_hits", 0)
    cached = f", {hits} of {t.get('compilations', 0)} executables from the compilation cache" if hits else ""
    return ["", f"Time: {t['total']['wall_s']:.1f} s wall ({t['total']['cpu_s']:.1f} s CPU): compiling "
                f"{t['compile']['wall_s']:.1f} s ({t['compile']['cpu_s']:.1f} s CPU{cached}), running "
                f"{t['run']['wall_s']:.1f} s ({t['run']['cpu_s']:.1f} s CPU)"]


# ----------------------------------------------------------------------------------------------- plots

def _save(fig: Figure, path: str) -> Figure:
    with safeio.atomic_write(os.fspath(path), "wb") as f:  # a kill mid-write never leaves a truncated PNG
        fig.savefig(f, dpi=120, format="png")
    return fig


def plot_history(history, path, t_const_ms: float | None = None) -> Figure:
    """Accuracy (top) and latency (bottom: E[T] during the search, derived T every epoch, T_const) per epoch,
    stages shaded. Writes a PNG to ``path`` and returns the Figure."""
    validate_history(history)
    _number(t_const_ms, "t_const_ms", allow_none=True)
    s = history_series(history)
    fig = Figure(figsize=(8, 6), layout="constrained")
    ax_acc, ax_lat = fig.subplots(2, 1, sharex=True)
    for ax in (ax_acc, ax_lat):
        for stage, x0, x1 in s["stages"]:
            ax.axvspan(x0 - 0.5, x1 + 0.5, color=_STAGE_COLORS[stage], zorder=0, lw=0)
    ax_acc.plot(s["x"], 100 * s["train_acc"], "o-", ms=3, label="train accuracy")
    ax_acc.plot(s["x"], 100 * s["val_acc"], "s-", ms=3, label="validation accuracy (derived net)")
    ax_acc.set_ylabel("accuracy (%)")
    ax_lat.plot(s["x"], s["expected"], "o-", ms=3, color="#d62828", label="E[T] (expected, under alpha)")
    ax_lat.plot(s["x"], s["derived"], "s-", ms=3, color="#003049", label="T of the derived architecture")
    if t_const_ms is not None:
        ax_lat.axhline(t_const_ms, ls="--", color="k", lw=1, label=f"T_const = {t_const_ms:g} ms")
    ax_lat.set_ylabel("latency (ms)")
    ax_lat.set_xlabel("epoch" if s["epoch_is_global"] else "epoch (all stages in sequence)")
    stage_patches = [Patch(color=_STAGE_COLORS[st], label=st) for st in STAGES if st in
                     {x[0] for x in s["stages"]}]
    ax_acc.legend(handles=ax_acc.get_legend_handles_labels()[0] + stage_patches, fontsize=8, loc="lower right")
    ax_lat.legend(fontsize=8, loc="upper right")
    fig.suptitle("Search history")
    return _save(fig, path)


def _segment_colors(names_kinds) -> dict:
    colors, n_dev, n_link = {}, 0, 0
    for name, kind in names_kinds:
        if name in colors:
            continue
        if kind == "compute":
            colors[name] = _DEVICE_COLORS[n_dev % len(_DEVICE_COLORS)]
            n_dev += 1
        else:
            colors[name] = _LINK_COLORS[n_link % len(_LINK_COLORS)]
            n_link += 1
    return colors


def plot_latency_breakdown(results, path, labels=None) -> Figure:
    """Stacked bars of per-device compute and per-link communication latency (SplitNets Fig. 7 style).

    ``results``: one result dict or a list of them (one bar each, e.g. one per T_const), ``labels`` the bar
    names (default: T_const). Segments stack bottom to top in pipeline order; a black tick marks each
    end-to-end total (below the stack top in a mesh, whose branches overlap) and a dashed line each T_const.
    With several results the test (else validation) accuracy is drawn on a right axis.
    """
    results = [results] if isinstance(results, dict) else list(results)
    if not results:
        raise ValueError("plot_latency_breakdown needs at least one result")
    for r in results:
        validate_result(r)
    if labels is None:
        labels = [f"T_const {r['t_const_ms']:g} ms" if r["t_const_ms"] is not None else r["topology"]
                  for r in results]
    if len(labels) != len(results):
        raise ValueError(f"labels has {len(labels)} entries, expected one per result ({len(results)})")
    segs = [latency_segments(r) for r in results]
    colors = _segment_colors((n, k) for sg in segs for n, k, _ in sg)
    memory = per_device_memory(results[0]) if len(results) == 1 else None
    fig = Figure(figsize=(max(4.5, 1.3 * len(results) + 3) + (4 if memory else 0), 5), layout="constrained")
    ax, axm = fig.subplots(1, 2, width_ratios=[3, 2]) if memory else (fig.subplots(), None)
    x = np.arange(len(results))
    drawn = set()
    sums = [sum(ms for _, _, ms in sg) for sg in segs]
    tallest = max(sums) or 1.0
    overlap = any(sm > r["latency_ms"]["total"] * (1 + 1e-6) + 1e-9 for sm, r in zip(sums, results))
    total_label = "end-to-end total" + ("\n(parallel branches overlap)" if overlap else "")
    for i, sg in enumerate(segs):
        bottom = 0.0
        for name, kind, ms in sg:
            label = None if name in drawn else (name if kind == "compute" else f"{name} (comm.)")
            drawn.add(name)
            ax.bar(x[i], ms, 0.6, bottom=bottom, color=colors[name], label=label,
                   hatch="//" if kind == "link" else None, edgecolor="white", lw=0.5)
            if ms >= 0.06 * tallest:
                ax.text(x[i], bottom + ms / 2, f"{ms:.2f}", ha="center", va="center", fontsize=7,
                        bbox=dict(boxstyle="round,pad=0.1", fc="white", ec="none", alpha=0.8))
            bottom += ms
        total = results[i]["latency_ms"]["total"]
        ax.hlines(total, x[i] - 0.36, x[i] + 0.36, color="k", lw=2.5,
                  label=total_label if i == 0 else None)
        if results[i]["t_const_ms"] is not None:
            ax.hlines(results[i]["t_const_ms"], x[i] - 0.45, x[i] + 0.45, color="#d62828", ls="--", lw=1.5,
                      label="T_const" if i == 0 else None)
    ax.set_xticks(x, labels)
    ax.set_ylabel("latency (ms)")
    by_name = dict(zip(*reversed(ax.get_legend_handles_labels())))
    marks = [by_name[n] for n in (total_label, "T_const") if n in by_name]
    stack = [h for n, h in by_name.items() if n not in (total_label, "T_const")]
    handles = marks + stack[::-1]  # segment entries top to bottom, like the stack
    if len(results) > 1:
        acc = [r["accuracy"]["test"] if r["accuracy"]["test"] is not None else r["accuracy"]["val"]
               for r in results]
        ax2 = ax.twinx()
        ax2.plot(x, [np.nan if a is None else 100 * a for a in acc], "o--", color="k", label="accuracy (right)")
        ax2.set_ylabel("accuracy (%)")
        handles = ax2.get_legend_handles_labels()[0] + handles
    ax.legend(handles=handles, fontsize=8, loc="upper left",
              bbox_to_anchor=(1.02 if len(results) == 1 else 1.12, 1.0))
    ax.set_title(f"Latency breakdown ({results[0]['topology']})")
    if len(results) == 1 and results[0].get("compose"):  # below the panels: constrained layout keeps the room
        fig.supxlabel("\n".join(composed_lines(results[0])), fontsize=7, family="monospace", x=0.01, ha="left")
    if memory:
        _memory_panel(axm, memory)
    return _save(fig, path)


def _memory_panel(ax, memory: dict) -> None:
    """Horizontal bars of every device's memory (weights, link buffers, activations; log scale) and its limit."""
    devs = list(memory)
    y = np.arange(len(devs))[::-1]
    left = np.zeros(len(devs))
    for key, color in (("weights", "#457b9d"), ("buffers", "#a8dadc"), ("activations", "#e9c46a")):
        v = np.array([max(memory[d][key], 1) for d in devs], float)
        ax.barh(y, v, left=left, color=color, label=key, height=0.6)
        left = left + v
    lims = [memory[d]["limit_bytes"] for d in devs]
    for yi, lim in zip(y, lims):
        if lim is not None:
            ax.vlines(lim, yi - 0.4, yi + 0.4, color="#d62828", lw=2, label="limit" if yi == y[0] else None)
    ax.set_xscale("log")
    ax.set_yticks(y, devs)
    ax.set_xlabel("memory (bytes, log scale)")
    ax.set_title("Memory per device vs limit")
    ax.legend(fontsize=8, loc="lower right")


def plot_architecture(result, path) -> Figure:
    """The chosen op of every layer: one row per device, layers on x; color = kernel size, text = expansion
    ("id" for identity), hatching = shortcut. Writes a PNG and returns the Figure."""
    validate_result(result)
    cells = architecture_cells(result)
    devices = device_order(result)
    n_layers = max(c["layer"] for c in cells) + 1
    fig = Figure(figsize=(max(6.0, 0.42 * n_layers + 2.5), 1.0 + 0.55 * len(devices)), layout="constrained")
    ax = fig.subplots()
    for c in cells:
        ax.bar(c["layer"], 0.8, 0.92, bottom=c["row"] - 0.4, color=_KERNEL_COLORS[c["kernel"]],
               hatch="///" if c["residual"] else None, edgecolor="#333333", lw=0.6)
        ax.text(c["layer"], c["row"], c["label"], ha="center", va="center", fontsize=8,
                bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.85))
    for row in range(1, len(devices)):
        ax.axhline(row - 0.5, color="#888888", lw=0.8)
    ax.set_yticks(range(len(devices)), devices)
    ax.set_ylim(len(devices) - 0.5, -0.5)
    ax.set_xlim(-0.6, n_layers - 0.4)
    ax.set_xticks(range(n_layers))
    ax.tick_params(axis="x", labelsize=7)
    ax.set_xlabel("layer")
    kernels = sorted({c["kernel"] for c in cells}, key=lambda k: (k == 0, k))
    handles = [Patch(facecolor=_KERNEL_COLORS[k], edgecolor="#333333",
                     label="identity" if k == 0 else f"kernel {k}x{k}") for k in kernels]
    handles.append(Patch(facecolor="white", edgecolor="#333333", hatch="///", label="with shortcut"))
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(f"Derived architecture per device ({result['topology']}); e3/e6 = expansion ratio")
    return _save(fig, path)


def plot_accuracy_latency(points, path, title: str, t_const_ms: float | None = None) -> Figure:
    """Scatter of accuracy against latency with each point labelled; points of one ``group`` share a color
    and are joined in latency order. ``points``: list of {"label", "latency_ms", "accuracy" (fraction),
    optional "group"}."""
    if not isinstance(points, list) or not points:
        raise ValueError("points must be a non-empty list of {label, latency_ms, accuracy} dicts")
    for i, p in enumerate(points):
        _get(p, "label", f"points[{i}]")
        _number(_get(p, "latency_ms", f"points[{i}]"), f"points[{i}].latency_ms")
        acc = _number(_get(p, "accuracy", f"points[{i}]"), f"points[{i}].accuracy")
        if acc > 1.0:
            raise ValueError(f"points[{i}].accuracy must be a fraction in [0, 1], got {acc!r}")
    groups = list(dict.fromkeys(p.get("group", "") for p in points))
    fig = Figure(figsize=(7, 5), layout="constrained")
    ax = fig.subplots()
    for gi, group in enumerate(groups):
        members = sorted((p for p in points if p.get("group", "") == group), key=lambda p: p["latency_ms"])
        xs = [p["latency_ms"] for p in members]
        ys = [100 * p["accuracy"] for p in members]
        color, marker = _GROUP_STYLES[gi % len(_GROUP_STYLES)]
        ax.plot(xs, ys, "--", color=color, lw=1, alpha=0.6)
        ax.scatter(xs, ys, color=color, marker=marker, s=40, zorder=3, label=group or None)
        for p, xv, yv in zip(members, xs, ys):
            ax.annotate(str(p["label"]), (xv, yv), textcoords="offset points", xytext=(5, 4), fontsize=8)
    if t_const_ms is not None:
        ax.axvline(t_const_ms, ls="--", color="#d62828", lw=1, label=f"T_const = {t_const_ms:g} ms")
    ax.margins(x=0.1, y=0.08)
    ax.set_xlabel("latency (ms)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(title)
    if any(groups) or t_const_ms is not None:
        ax.legend(fontsize=8)
    return _save(fig, path)


def write_report(result, history, workdir) -> list:
    """Write ``summary.txt``, ``history.png``, ``latency_breakdown.png`` and ``architecture.png`` into
    ``workdir`` (created if needed) and return their paths. Inputs are validated before anything is written."""
    validate_result(result)
    validate_history(history)
    workdir = os.fspath(workdir)
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ValueError(f"workdir {workdir!r} exists and is not a directory")
    os.makedirs(workdir, exist_ok=True)
    paths = {name: os.path.join(workdir, name) for name in
             ("summary.txt", "history.png", "latency_breakdown.png", "architecture.png")}
    with safeio.atomic_write(paths["summary.txt"], encoding="utf-8") as f:
        f.write(format_summary(result))
    plot_history(history, paths["history.png"], t_const_ms=result["t_const_ms"])
    plot_latency_breakdown(result, paths["latency_breakdown.png"])
    plot_architecture(result, paths["architecture.png"])
    return list(paths.values())
