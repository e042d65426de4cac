"""Predicted vs measured: the text table and the plot of one or more pipeline runs (``pipeline.analyze`` output).

Per setting, one row per term of eq. (1)/(2): every device's compute, every link, the coordinator's camera and
result hand-offs where the prediction has them, the hand-offs that no term covers (``unexplained_ms``), and the
total; then the throughput and every link's measured Mbit/s. The plot puts a predicted and a measured stacked bar
side by side per setting (segments: devices, links, camera and result, hand-offs), so the term that misses is the
segment that differs.
"""
from __future__ import annotations

import math

from matplotlib.figure import Figure

_COLORS = ("#2a9d8f", "#e9c46a", "#457b9d", "#f4a261", "#a8dadc", "#90be6d", "#bc6c25", "#cdb4db", "#6d597a",
           "#b56576", "#355070", "#e56b6f", "#8d99ae", "#264653")


def unexplained_ms(a: dict) -> float:
    """The measured time no predicted term covers: the measured total less eq. (1)/(2) of the measured terms, less
    the coordinator's measured ends where the prediction has them."""
    m = a["measured"]
    return m["overhead_ms"] - (sum(m.get("ends", {}).values()) if "ends" in a["predicted"] else 0.0)


def format_table(analyses: list, manifest: dict) -> str:
    """The predicted-vs-measured table (ms, images/s, Mbit/s) of every analysed setting."""
    eq = equation(manifest)
    lines = []
    for a in analyses:
        p, m, s = a["predicted"], a.get("measured", {}), a["settings"]
        lines.append(f"bandwidth x{s['bandwidth_scale']:g}, compute {s['compute']}  ({s['images']} images)")
        lines.append(f"  {'term':<24}{'predicted':>11}{'measured':>11}{'diff':>9}")
        rows = [(d, p["per_device"][d], m.get("per_device", {}).get(d)) for d in manifest["order"]]
        rows += [(k, v, m.get("per_link", {}).get(k)) for k, v in p["per_link"].items()]
        rows += [(f"{k} (coordinator)", v, m.get("ends", {}).get(k)) for k, v in p.get("ends", {}).items()]
        for name, pv, mv in rows:
            diff = "" if mv is None else f"{mv - pv:+9.3f}"
            lines.append(f"  {name:<24}{pv:11.3f}{'' if mv is None else f'{mv:11.3f}'}{diff}")
        if "overhead_ms" in m:
            lines.append(f"  {'hand-offs (no term)':<24}{'':>11}{unexplained_ms(a):11.3f}")
        if "total" in m:
            label = f"total, {eq}{' + ends' if 'ends' in p else ''} ms"
            lines.append(f"  {label:<24}{p['total']:11.3f}{m['total']:11.3f}"
                         f"{a['error_pct']:+8.1f}%   (end to end at the coordinator; p10 {m['total_p10']:.3f}, "
                         f"p90 {m['total_p90']:.3f})")
        if "throughput_per_s" in m:
            lines.append(f"  {'throughput, images/s':<24}{p['throughput_per_s']:11.1f}{m['throughput_per_s']:11.1f}"
                         f"   (bottleneck: {p['bottleneck']})")
        wire = "link_wire_mbps" in m  # a kernel shaper counts bytes on the wire
        for l in manifest["links"]:
            k = f"{l['src']}->{l['dst']}"
            got = m.get("link_wire_mbps" if wire else "link_mbps", {}).get(k)
            if got is not None and math.isfinite(got):
                want = l["bandwidth_mbps"] * s["bandwidth_scale"]
                lines.append(f"  {('wire Mbit/s ' if wire else 'Mbit/s ') + k:<24}{want:11.2f}{got:11.2f}"
                             f"{100 * (got / want - 1):+8.1f}%")
        for d, c in a.get("clock", {}).items():
            if a.get("where", {}).get(d, "127.0.0.1") != "127.0.0.1":
                lines.append(f"  clock {d:<18} offset {c['offset_ms']:+.3f} ms +- {c['uncertainty_ms']:.3f} ms "
                             f"({a['where'][d]})")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def equation(manifest: dict) -> str:
    """The name of the latency equation of the manifest's topology (``predict.total_ms``)."""
    return {"chain": "eq. (1)", "mesh": "eq. (2)", "separable": "separable.cost"}.get(
        manifest["kind"], "bus: max(sensor + link) + aggregator")


def plot(analyses: list, manifest: dict, path: str) -> Figure:
    """One panel per setting: a predicted and a measured stacked bar (devices, links, hand-offs); PNG at ``path``."""
    terms = list(manifest["order"]) + [f"{l['src']}->{l['dst']}" for l in manifest["links"]]
    colors = {t: _COLORS[i % len(_COLORS)] for i, t in enumerate(terms)}
    colors.update({"camera": "#999999", "result": "#bbbbbb", "hand-offs": "#222222"})
    fig = Figure(figsize=(2.2 * len(analyses) + 2.2, 4.2))
    eq = equation(manifest)
    for k, a in enumerate(analyses):
        ax = fig.add_subplot(1, len(analyses), k + 1)
        for j, (what, src) in enumerate((("predicted", a["predicted"]), ("measured", a.get("measured", {})))):
            if "per_device" not in src:
                continue
            ends = list(a["predicted"].get("ends", {})) if "ends" in src else []  # camera, result: both bars
            vals = {**src["per_device"], **src["per_link"], **src.get("ends", {})}
            names = terms + ends + (["hand-offs"] if what == "measured" and "overhead_ms" in src else [])
            if "hand-offs" in names:
                vals["hand-offs"] = max(0.0, unexplained_ms(a))
            bottom = 0.0
            for t in names:
                ax.bar(j, vals[t], bottom=bottom, color=colors[t], edgecolor="white", linewidth=0.5,
                       label=t if k == 0 and j == 1 else None)
                bottom += vals[t]
            ax.text(j, bottom, f"T={src['total']:.2f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks([0, 1])
        ax.set_xticklabels(["predicted", "measured"], fontsize=7)
        ax.set_title(f"bandwidth x{a['settings']['bandwidth_scale']:g}", fontsize=8)
        ax.tick_params(labelsize=7)
        if k == 0:
            ax.set_ylabel("ms per image (stacked terms; in a mesh the branches overlap)", fontsize=7)
    name = (manifest.get("topology") or {}).get("name") or manifest.get("system") or "pipeline"
    fig.suptitle(f"{name}: {eq} predicted vs measured, compute "
                 f"{analyses[0]['settings']['compute']}", fontsize=9)
    handles, names = fig.axes[0].get_legend_handles_labels()
    fig.legend(handles, names, fontsize=6, loc="center right")
    fig.tight_layout(rect=(0, 0, 0.82, 0.95))
    fig.savefig(path, dpi=120)
    return fig
