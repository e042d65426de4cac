"""How well a latency table predicts measured latencies: the measures nn-Meter and HELP publish.

``report(pred_ms, measured_ms)`` -> dict: n, MAPE (%), share within +-10% (%), median and max relative error (%),
bias (mean signed relative error, %: > 0 when the table over-predicts), Spearman's rho and Kendall's tau
(``scipy.stats``) between predicted and measured. ``scatter(path, ...)`` draws predicted against measured with the
y = x line and the +-10% band.
"""
from __future__ import annotations

import numpy as np
from scipy import stats


def report(pred_ms, measured_ms) -> dict:
    p, y = np.asarray(pred_ms, np.float64), np.asarray(measured_ms, np.float64)
    if p.shape != y.shape or p.ndim != 1 or len(p) < 2:
        raise ValueError(f"need two equal-length 1-D arrays of at least 2 latencies, got shapes {p.shape}, {y.shape}")
    if not (np.isfinite(p).all() and np.isfinite(y).all() and (y > 0).all()):
        raise ValueError("latencies must be finite and the measured ones > 0 ms")
    rel = (p - y) / y
    err = np.abs(rel)
    rho = stats.spearmanr(p, y).statistic
    tau = stats.kendalltau(p, y).statistic
    return {"n": int(len(p)), "mape_pct": float(100 * err.mean()), "within_10pct": float(100 * (err <= 0.1).mean()),
            "median_error_pct": float(100 * np.median(err)), "rms_error_pct": float(100 * np.sqrt(np.mean(err ** 2))), "max_error_pct": float(100 * err.max()),
            "bias_pct": float(100 * rel.mean()), "spearman": float(rho), "kendall": float(tau)}


def scatter(path: str, pred_ms, measured_ms, title: str) -> None:
    """Predicted vs measured (ms) as a PNG at ``path`` (matplotlib's Agg canvas, no global state touched)."""
    from matplotlib.figure import Figure
    p, y = np.asarray(pred_ms), np.asarray(measured_ms)
    fig = Figure(figsize=(4.5, 4.5))
    ax = fig.subplots()
    lo, hi = float(min(p.min(), y.min())) * 0.9, float(max(p.max(), y.max())) * 1.1
    xs = np.array([lo, hi])
    ax.fill_between(xs, xs * 0.9, xs * 1.1, color="0.9", label="±10%")
    ax.plot(xs, xs, "k-", lw=0.8)
    ax.scatter(y, p, s=8)
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured (ms)")
    ax.set_ylabel("table (ms)")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
