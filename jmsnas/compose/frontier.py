"""Pareto frontiers of additive options, the exact repair's building block (``compose.repair``).

A frontier is a pair (points float[K, D], picks int[K, W]): every row of points sums D coordinates (latency,
-log P, ...) over the groups chosen so far, and its picks row records each group's option (-1 where a group is not
chosen yet). A point is dropped only when another is at least as good in every coordinate, so the optimum of any
objective that grows with every coordinate is never pruned.
"""
from __future__ import annotations

import numpy as np


def slack(limit):
    """limit + 1e-6 max(1, |limit|): the float32 rounding allowed above a limit (the closed form sums in float32,
    the repair in float64), the one allowance of every comparison with T_const, a memory or an energy limit."""
    limit = np.asarray(limit, np.float64)
    return limit + 1e-6 * np.maximum(1.0, np.abs(limit))


def within(t, limit):
    """t <= limit up to float32 rounding (``slack``)."""
    return np.asarray(t) <= slack(limit)


def pareto(points, picks):
    """Rows of points float[K, D] that no other row dominates (<= everywhere); ties keep one. Sorted by column 0."""
    if len(points) == 0:
        return points, picks
    order = np.lexsort(points.T[::-1])
    points, picks = points[order], picks[order]
    if points.shape[1] == 2:
        keep = points[:, 1] < np.minimum.accumulate(np.concatenate([[np.inf], points[:-1, 1]]))
        return points[keep], picks[keep]
    kept = np.zeros(len(points), bool)
    for i in range(len(points)):
        earlier = points[kept]
        kept[i] = not (len(earlier) and np.any(np.all(earlier <= points[i], axis=1)))
    return points[kept], picks[kept]


def add(f, g):
    """Minkowski sum of two (points, picks) frontiers (picks: -1 where a group is not set), pruned."""
    pts = (f[0][:, None] + g[0][None]).reshape(-1, f[0].shape[1])
    picks = np.maximum(f[1][:, None], g[1][None]).reshape(-1, f[1].shape[1])
    return pareto(pts, picks)


def union(fronts):
    """The pruned union of several frontiers (None when all are empty)."""
    fronts = [f for f in fronts if len(f[0])]
    if not fronts:
        return None
    return pareto(np.concatenate([f[0] for f in fronts]), np.concatenate([f[1] for f in fronts]))


def cheapest(front, budget, base=0.0):
    """The picks of the least last coordinate among the points whose first plus ``base`` is within ``budget``
    (``within``: the allowance is the whole budget's, not the part left after ``base``), or None."""
    if front is None:
        return None
    ok = np.flatnonzero(within(base + front[0][:, 0], budget))
    return None if not len(ok) else front[1][ok[np.argmin(front[0][ok, -1])]]
