"""Plots of a separable run: the controller's and the random sampler's reward over the controller steps (the
paper's Fig. 4), and transmitted bytes per image against accuracy; written atomically by process 0 (a kill while
writing leaves the previous file or none)."""
from __future__ import annotations

import os

import numpy as np
from matplotlib.figure import Figure

from jmsnas import safeio
from jmsnas.run import directory

_COLORS = {"controller": "#1f77b4", "random": "#ff7f0e", "control": "#999999", "reference": "#555555"}


def reward_curve(history) -> Figure:
    """Mean validation reward of each controller step, both arms and the control group, round boundaries dotted."""
    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    for arm in ("controller", "random"):
        r = [v for h in history for v in h[arm]["rewards"]]
        label = "LSTM controller" if arm == "controller" else "random sampler"
        ax.plot(np.arange(1, len(r) + 1), r, "-", color=_COLORS[arm], label=label, lw=1.2)
    if all("random_on_controller_weights" in h["controller"] for h in history):
        r = [v for h in history for v in h["controller"]["random_on_controller_weights"]]
        ax.plot(np.arange(1, len(r) + 1), r, "-", color=_COLORS["control"], lw=1.2,
                label="random decisions on the controller's network (control group)")
    per = len(history[0]["controller"]["rewards"])
    for i in range(1, len(history)):
        ax.axvline(i * per + 0.5, color="k", lw=0.5, ls=":")
    ax.set_xlabel("controller step (dotted: rounds of network training)")
    ax.set_ylabel("mean validation reward")
    ax.legend(loc="lower right")
    fig.suptitle("Controller vs random sampler (same network init, data and evaluations)")
    return fig


def bytes_accuracy(result, history) -> Figure:
    """Last round's sampled decisions (validation accuracy vs bytes relative to the non-separated network) and the
    fine-tuned best decision of each arm (test accuracy)."""
    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    for arm in ("controller", "random"):
        h = history[-1][arm]
        ax.scatter(100 * np.asarray(h["sample_bytes_ratio"]), 100 * np.asarray(h["sample_acc"]), s=12, alpha=0.5,
                   color=_COLORS[arm], label=f"{arm}: last round's samples (val)")
        best = result[arm]
        ax.scatter([100 * best["cost"]["bytes_ratio"]], [100 * best["test_acc"]], marker="*", s=160,
                   color=_COLORS[arm], edgecolor="k", label=f"{arm}: best, fine-tuned (test)")
    if "reference" in result:
        ax.scatter([100.0], [100 * result["reference"]["test_acc"]], marker="D", s=60, color=_COLORS["reference"],
                   label="non-separated (ring all-reduce, test)")
    ax.set_xlabel("transmitted bytes per image (% of the non-separated network)")
    ax.set_ylabel("accuracy (%)")
    ax.legend(fontsize=7, loc="lower right")
    n = result["network"]
    fig.suptitle(f"G={n['G']}, alpha={n['alpha']}, K={n['K']}, float16={n['float16']}")
    return fig


def write(result, history, workdir) -> list:
    """reward_curve.png and bytes_accuracy.png in ``workdir``; their paths (none in processes other than 0)."""
    if not directory.writes():
        return []
    figures = {"reward_curve.png": reward_curve(history), "bytes_accuracy.png": bytes_accuracy(result, history)}
    with directory.output_errors(workdir):
        for name, fig in figures.items():
            with safeio.atomic_write(os.path.join(workdir, name), "wb") as f:
                fig.savefig(f, dpi=120, format="png")
    return [os.path.join(workdir, name) for name in figures]
