"""A device's per-layer table fitted from whole networks measured on it (bounded least squares), with its own
held-out validation.

Model: latency(a) = c + sum_l u[l, a_l], c >= 0, u >= 0 (``layertable.LayerTable``). With x(a) the one-hot row
(1 for the fixed term, 1 at (l, a_l) for every layer) the fit is

    min_{c, u >= 0}  sum_k ((x(a_k) . [c, u] - y_k) / y_k)^2   (+ ridge * sum (u - mean)^2, default 0)

on *relative* errors (a 1 ms miss on a 10 ms network counts as much as 10 ms on a 100 ms one), solved by
``scipy.optimize.lsq_linear`` (method ``bvls``, bounds [0, inf)). The per-layer additive constant is not
identified by whole-network sums (moving d ms from the fixed term into every entry of one layer changes no
prediction); the bounds pick one solution and no prediction depends on which.

Validation: the last ``holdout`` share of the networks (in the order given) is left out of the fit and the fitted
table is scored on it (``accuracy.report``); the report goes in the table's ``validation`` together with how
many networks the fit used. The table stored is the one that was validated (fitted without the held-out part).
A (layer, op) cell that no fitted network uses is an error (nothing says what it costs).
"""
from __future__ import annotations

import math

import numpy as np
from scipy.optimize import lsq_linear

from jmsnas.cost import accuracy
from jmsnas.cost import layertable as LT
from jmsnas.cost import networks as NW


def design(archs: np.ndarray, num_ops: int) -> np.ndarray:
    """float64[K, 1 + N * R]: the fixed term's column, then one column per (layer, op) cell, row-major."""
    k, n = archs.shape
    x = np.zeros((k, 1 + n * num_ops))
    x[:, 0] = 1.0
    x[np.arange(k)[:, None], 1 + np.arange(n)[None] * num_ops + archs] = 1.0
    return x


def solve(archs: np.ndarray, ms: np.ndarray, num_ops: int, ridge: float = 0.0) -> np.ndarray:
    """float64[1 + N * R] >= 0: the fixed term and the cells (``design``'s order) minimising the relative squared
    error (module docstring)."""
    x = design(archs, num_ops) / ms[:, None]
    b = np.ones(len(ms))
    if ridge > 0:
        j = x.shape[1]
        x = np.vstack([x, math.sqrt(ridge) * np.eye(j)[1:]])
        b = np.concatenate([b, np.zeros(j - 1)])
    return np.maximum(lsq_linear(x, b, bounds=(0.0, np.inf), method="bvls").x, 0.0)


def fit(measured: NW.Measured, *, holdout: float = 0.1, device: str | None = None, ridge: float = 0.0,
        source: str | None = None) -> LT.LayerTable:
    """The per-layer table of ``measured.device`` fitted on the first (1 - holdout) of ``measured``'s networks and
    validated on the rest (module docstring). TableError (one line) on too few networks or an unused cell."""
    if not 0.0 <= holdout < 1.0 or not math.isfinite(holdout):
        raise LT.TableError(f"holdout must be a share in [0, 1), got {holdout!r}")
    k = len(measured.ms)
    n_fit = k - int(round(holdout * k))
    if k == 0 or measured.archs.ndim != 2 or measured.archs.shape[1] == 0:
        raise LT.TableError("no measured networks to fit a table from")
    if holdout > 0 and (k - n_fit < 2 or n_fit < 1):
        raise LT.TableError(f"holdout {holdout:g} of {k} networks leaves {k - n_fit} to validate on (need >= 2) "
                            f"and {n_fit} to fit")
    r = len(measured.op_names)
    a, y = measured.archs, measured.ms
    n = a.shape[1]
    used = np.zeros((n, r), bool)
    used[np.arange(n)[None], a[:n_fit]] = True
    if not used.all():
        l, o = (int(i) for i in np.argwhere(~used)[0])
        raise LT.TableError(f"op {measured.op_names[o]!r} at layer {l} is in none of the {n_fit} networks fitted "
                            f"({int((~used).sum())} of {n * r} cells unused): measure more (random) networks")
    theta = solve(a[:n_fit], y[:n_fit], r, ridge)
    info = {"method": "bounded least squares on relative errors (scipy lsq_linear, bvls), jmsnas.cost.layerfit",
            "networks_fitted": int(n_fit), "networks_held_out": int(k - n_fit), "ridge": float(ridge)}
    table = LT.make(theta[0], theta[1:].reshape(n, r), measured.op_names, space=measured.space,
                    device=device or measured.device,
                    source=source or f"fitted on {n_fit} networks measured on {measured.device}")
    val = None
    if k > n_fit:
        val = accuracy.report(LT.predict_ms(table, a[n_fit:]), y[n_fit:])
        val["against"] = f"the last {k - n_fit} of the {k} networks, held out of the fit"
    return table._replace(validation=val, adaptation={"fit": info})
