"""A device's latency table from a base table and a few whole networks measured on that device (HELP, LitePred).

Model. For a base table (``layertable.LayerTable``: fixed term c, entries u[l, o] >= 0) and a grouping of the ops
into block types g(o), the target's latency of an architecture a is

    T(a) = theta_0 * c + sum_l theta_{g(a_l)} * u[l, a_l]          theta >= 0,

i.e. one scale for the fixed term and one per block type, applied to every layer's base entry (the target table is
again a LayerTable: c' = theta_0 c, u'[l, o] = theta_{g(o)} u[l, o], never negative). It is fitted to the measured
networks (a_k, y_k) by bounded least squares on *relative* errors, regularised toward the single factor s that
best rescales the whole base table:

    min_{theta >= 0}  sum_k ((T(a_k) - y_k) / y_k)^2 + lam * sum_j (theta_j - s)^2,
    s = argmin_s sum_k ((s P(a_k) - y_k) / y_k)^2 = sum_k (P_k / y_k) / sum_k (P_k / y_k)^2   (P: the base table),

solved with ``scipy.optimize.lsq_linear`` (the penalty as extra rows). lam -> infinity gives the single factor;
lam -> 0 the free per-type fit. Groupings (from the op names): ``op`` (every op its own type), ``kernel_expand``
(ops differing only in grouping/shortcut share a type, e.g. k3_e1 and k3_e1_g2), ``expand`` (by expansion ratio
only); an op whose name has no kernel/expansion (skip, identity) is its own type in each.

Selection. Every (grouping, lam) in the grid, and the single factor itself, is scored by leave-one-out over the
measured networks (fit on K - 1, relative error on the one left out, mean over the K); the lowest mean wins (ties:
the simpler model, i.e. larger lam, then fewer types). Nothing else is looked at: no test set enters the choice.
With one network only the single factor is fitted (no leave-one-out is possible).

Interval: from 3 networks on, ``adaptation["interval"]`` holds the relative half-width of a 90% prediction interval
(``interval``; ``adapt_prior.interval_ms`` applies it).
"""
from __future__ import annotations

import math
import re
from typing import NamedTuple

import numpy as np
from scipy import stats
from scipy.optimize import lsq_linear

from jmsnas.cost import layertable as LT
from jmsnas.cost import networks as NW

GROUPINGS = ("op", "kernel_expand", "expand")
LAMBDAS = (1e-3, 1e-2, 1e-1, 1.0, 10.0)
SINGLE = "single_factor"


class Fit(NamedTuple):
    """theta float64[1 + G] (fixed term, then one scale per type); groups int[R] (type of each op); s: the single
    factor the penalty pulls toward; grouping / lam: the model."""

    theta: np.ndarray
    groups: np.ndarray
    s: float
    grouping: str
    lam: float


def op_groups(op_names, grouping: str) -> np.ndarray:
    """int[R]: the block type of each op under ``grouping`` (types numbered in order of first appearance)."""
    if grouping not in GROUPINGS + (SINGLE,):
        raise ValueError(f"grouping must be one of {list(GROUPINGS + (SINGLE,))}, got {grouping!r}")
    keys = []
    for name in op_names:
        k, e = re.search(r"(?:^|_)k(\d+)(?:_|$)", name), re.search(r"(?:^|_)e(\d+)(?:_|$)", name)
        if grouping == SINGLE:
            keys.append("all")
        elif grouping == "op" or k is None or e is None:
            keys.append(name)
        elif grouping == "kernel_expand":
            keys.append(f"k{k.group(1)}_e{e.group(1)}")
        else:
            keys.append(f"e{e.group(1)}")
    order = list(dict.fromkeys(keys))
    return np.array([order.index(k) for k in keys], np.int64)


def features(table: LT.LayerTable, archs: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """float64[K, 1 + G]: the fixed term and, per type, the sum of the base entries of the layers using it."""
    a = LT.check_archs(table, archs)
    f = np.zeros((a.shape[0], 1 + int(groups.max()) + 1))
    f[:, 0] = table.const_ms
    rows = np.arange(a.shape[0])
    for n in range(table.num_layers):
        np.add.at(f, (rows, 1 + groups[a[:, n]]), table.entry_ms[n, a[:, n]])
    return f


def single_factor(p: np.ndarray, y: np.ndarray) -> float:
    """The s >= 0 minimising sum ((s p - y) / y)^2."""
    r = p / y
    return float(r.sum() / (r @ r)) if (r @ r) > 0 else 1.0


def fit_features(f: np.ndarray, y: np.ndarray, lam: float) -> tuple:
    """(theta, s) for features f[K, J] and latencies y[K] (see the module docstring); lam = inf: theta = s."""
    s = single_factor(f.sum(axis=1), y)
    if math.isinf(lam):
        return np.full(f.shape[1], s), s
    fw, yw = f / y[:, None], np.ones_like(y)
    j = f.shape[1]
    a = np.vstack([fw, math.sqrt(lam) * np.eye(j)])
    b = np.concatenate([yw, np.full(j, math.sqrt(lam) * s)])
    return lsq_linear(a, b, bounds=(0.0, np.inf), method="bvls").x, s


def loo_errors(f: np.ndarray, y: np.ndarray, lam: float) -> np.ndarray:
    """float64[K]: relative error |T - y| / y of each network when the model is fitted on the others."""
    out = np.empty(len(y))
    for k in range(len(y)):
        keep = np.arange(len(y)) != k
        theta, _ = fit_features(f[keep], y[keep], lam)
        out[k] = abs(f[k] @ theta - y[k]) / y[k]
    return out


def interval(loo, level: float = 0.9) -> dict | None:
    """The relative half-width h of a ``level`` prediction interval [p (1 - h), p (1 + h)] from the chosen model's
    leave-one-out relative errors: Student's t_{(1 + level) / 2, K - 1} times their RMS (None below 3 networks)."""
    if loo is None or len(loo) < 3:
        return None
    sigma = float(np.sqrt(np.mean(np.asarray(loo) ** 2)))
    factor = float(stats.t.ppf(0.5 + level / 2, len(loo) - 1))
    return {"level": level, "rel_halfwidth": factor * sigma, "loo_rms_rel": sigma, "factor": factor,
            "factor_from": f"Student t, {len(loo) - 1} degrees of freedom"}


def adapt(table: LT.LayerTable, measured: NW.Measured, *, groupings=GROUPINGS, lambdas=LAMBDAS,
          device: str | None = None) -> LT.LayerTable:
    """The target device's table fitted from ``table`` and ``measured`` (module docstring), carrying in
    ``adaptation`` the chosen model, its parameters and every candidate's leave-one-out error (%)."""
    archs = NW.for_table(measured, table)
    y = measured.ms
    if len(y) == 0:
        raise LT.TableError("no measured networks to adapt from: give at least 1 (10 recommended)")
    candidates = [(SINGLE, math.inf)] + [(g, float(l)) for g in groupings for l in sorted(lambdas, reverse=True)]
    scores = []
    for grouping, lam in candidates:
        groups = op_groups(table.op_names, grouping)
        f = features(table, archs, groups)
        loo = loo_errors(f, y, lam) if len(y) >= 2 else None
        scores.append({"grouping": grouping, "lambda": None if math.isinf(lam) else lam,
                       "loo_mape_pct": None if loo is None else float(100 * loo.mean()),
                       "loo_max_pct": None if loo is None else float(100 * loo.max()), "_f": f, "_g": groups,
                       "_lam": lam, "_loo": loo})
        if loo is None:
            break
    best = min(scores, key=lambda c: (c["loo_mape_pct"] if c["loo_mape_pct"] is not None else 0.0,
                                      -c["_lam"], int(c["_g"].max())))
    theta, s = fit_features(best["_f"], y, best["_lam"])
    groups = best["_g"]
    entry = table.entry_ms * theta[1 + groups][None, :]
    names = list(table.op_names)
    types = {}
    for i, g in enumerate(groups.tolist()):
        types.setdefault(str(g), []).append(names[i])
    info = {"model": "T(a) = theta_0 * const + sum_l theta_type(a_l) * base_entry[l, a_l], theta >= 0, relative "
                     "least squares + lambda * sum (theta - s)^2 (jmsnas.cost.adapt)",
            "base": {"device": table.device, "source": table.source},
            "networks": int(len(y)), "measured_device": measured.device,
            "grouping": best["grouping"], "lambda": best["lambda"], "single_factor": s,
            "theta_const": float(theta[0]),
            "theta": {"+".join(types[str(g)]): float(theta[1 + g]) for g in range(int(groups.max()) + 1)},
            "loo_mape_pct": best["loo_mape_pct"], "loo_max_pct": best["loo_max_pct"],
            "interval": interval(best["_loo"]),
            "candidates": [{k: v for k, v in c.items() if not k.startswith("_")} for c in scores]}
    return LT.make(theta[0] * table.const_ms, entry, table.op_names, space=table.space,
                   device=device or measured.device, source=f"adapted from {table.source} with {len(y)} networks "
                                                          f"measured on {measured.device}", adaptation=info)


def rescale(table: LT.LayerTable, measured: NW.Measured) -> LT.LayerTable:
    """The base table times the single factor s fitted on ``measured`` (the baseline the adaptation must beat)."""
    archs = NW.for_table(measured, table)
    s = single_factor(LT.predict_ms(table, archs), measured.ms)
    return LT.make(s * table.const_ms, s * table.entry_ms, table.op_names, space=table.space,
                   device=measured.device, source=f"{table.source} x {s:.6g}")
