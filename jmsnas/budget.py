"""A latency guarantee on top of the penalty: repair the derived architecture so that T <= T_const.

With a fixed split, T is the sum of per-layer compute latencies plus terms that do not depend on the ops (stem,
head, communication of fixed-shape tensors) inside the chain part, and a max over branches in a mesh. The repair
picks, among all architectures with T <= T_const, the one that loses the least log-probability under alpha:
minimise sum_n -log p_n(op_n) subject to T(ops) <= T_const.

Exact method: per segment of additive layers, a dynamic programme over layers keeps the Pareto frontier of
(latency, cost) pairs (no pair is dropped unless another is at least as fast and at least as cheap, so the optimum
is never pruned). For a chain the whole network is one segment. For a mesh the chain part and the root form one
additive segment and each branch another; T = const + A + max_b B_b, so every candidate value c of the max (a
frontier latency of some branch) is tried: each branch takes its cheapest point with B_b <= c and the additive
segment its cheapest point within T_const - const - c. This is exact over all architectures of the space.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np

from jmsnas import limits as L
from jmsnas.cost.latency import arch_latency
from jmsnas.cost.tables import CostTable
from jmsnas.gates import probabilities
from jmsnas.limits import DeviceLimits, LimitsError  # noqa: F401  (re-exported: the repair raises LimitsError)
from jmsnas.space import SearchSpace


class Repair(NamedTuple):
    ops: np.ndarray  # int32[N], the repaired (or unchanged) architecture
    latency_ms: float  # its T
    repaired: bool  # True if the derived architecture exceeded the budget and was changed
    feasible: bool  # False if no architecture of the space meets the budget (ops is then the fastest one)
    min_latency_ms: float  # smallest T reachable in the space
    logprob_loss: float  # sum_n log p(derived) - log p(ops) >= 0


def within(t_ms, limit_ms):
    """t <= limit up to float32 rounding (latencies are summed in float32 by cost.latency and in float64 here,
    so an architecture exactly at the budget may differ by ~1e-7 relative between the two)."""
    return np.asarray(t_ms) <= limit_ms + 1e-6 * max(1.0, abs(float(limit_ms)))


def _frontier(layers, lat, cost, valid):
    """Pareto frontier over ``layers``: arrays (latency, cost, choices[K, len(layers)]) sorted by latency."""
    lats, costs, picks = np.zeros(1), np.zeros(1), np.zeros((1, 0), np.int64)
    for n in layers:
        ops = np.flatnonzero(valid[n])
        l = (lats[:, None] + lat[n, ops][None]).ravel()
        c = (costs[:, None] + cost[n, ops][None]).ravel()
        p = np.concatenate([np.repeat(picks, len(ops), 0), np.tile(ops, len(lats))[:, None]], 1)
        order = np.lexsort((c, l))
        l, c, p = l[order], c[order], p[order]
        keep = c < np.minimum.accumulate(np.concatenate([[np.inf], c[:-1]]))  # strictly cheaper than all faster
        lats, costs, picks = l[keep], c[keep], p[keep]
    return lats, costs, picks


def _cheapest_within(front, limit):
    lats, costs, picks = front
    ok = np.flatnonzero(within(lats, limit))
    if ok.size == 0:
        return None
    j = ok[np.argmin(costs[ok])]
    return lats[j], costs[j], picks[j]


def repair(space: SearchSpace, table: CostTable, alpha, derived_ops, t_const_ms: float,
           assignment=None, limits: DeviceLimits | None = None) -> Repair:
    """The cheapest (in -log p) architecture with T <= t_const_ms and every device within ``limits`` (memory and
    energy, see ``jmsnas.limits``); ``derived_ops`` is kept if it already fits.

    ``assignment`` fixes another layer->device split than D^m (a searched one; on a mesh, see
    ``cost.latency.MeshSegments``). Raises
    ``LimitsError`` (one line naming the device and the least it needs) when no architecture is within the limits.
    """
    derived_ops = np.asarray(derived_ops, np.int32)
    if not np.all(np.isfinite(np.asarray(alpha))):
        raise ValueError("alpha holds NaN or inf: the architecture probabilities are undefined, so no repair can "
                         "be chosen (expected finite architecture parameters)")
    mask = space.mask()
    logp = np.log(np.maximum(np.asarray(probabilities(alpha, mask), np.float64), 1e-30))
    cost = -logp
    topo = space.topology
    dev = space.layer_devices() if assignment is None else np.asarray(assignment)
    lat = np.asarray(table.compute_ms, np.float64)[dev, np.arange(space.num_layers)]  # [N, R] on own device
    t_derived = float(arch_latency(space, table, derived_ops, assignment).total)
    zero = np.zeros(space.num_layers, np.int32)
    zero[:] = [int(np.flatnonzero(mask[n])[0]) for n in range(space.num_layers)]
    # constant part: T of an architecture minus its per-layer compute (exact since T is affine in the layer terms)
    base_ops = zero
    if limits is not None and L.binding(space, table, limits, assignment):
        seg_front = L.segment_frontiers(space, table, limits, lat, cost, assignment)
    else:
        limits = None
        seg_front = lambda devices: _frontier([n for m in devices for n in np.flatnonzero(dev == m)], lat, cost, mask)
    if topo.kind == "chain":
        const = float(arch_latency(space, table, base_ops, assignment).total) - lat[np.arange(space.num_layers), base_ops].sum()
        front = seg_front(list(topo.pre))
        best = _cheapest_within(front, t_const_ms - const)
        t_min = const + front[0][0]
        ops = None if best is None else np.asarray(best[2], np.int32)
        fastest = np.asarray(front[2][0], np.int32)
    else:
        ops, t_min, fastest = _repair_mesh(space, table, lat, cost, mask, t_const_ms, seg_front, assignment, dev)
    derived_ok = limits is None or L.within_limits(space, table, limits, derived_ops, assignment)
    if within(t_derived, t_const_ms) and derived_ok:
        return Repair(derived_ops, t_derived, False, True, t_min, 0.0)
    feasible = ops is not None
    ops = ops if feasible else fastest
    t = float(arch_latency(space, table, ops, assignment).total)
    loss = float(cost[np.arange(space.num_layers), ops].sum() - cost[np.arange(space.num_layers), derived_ops].sum())
    return Repair(ops, t, True, feasible, t_min, loss)


def _repair_mesh(space, table, lat, cost, mask, t_const_ms, seg_front, assignment, dev):
    topo = space.topology
    additive = [n for m in list(topo.pre) + [topo.root] + list(topo.post) for n in np.flatnonzero(dev == m)]
    branch_layers = [list(np.flatnonzero(dev == b)) for b in topo.branches]
    base = np.array([int(np.flatnonzero(mask[n])[0]) for n in range(space.num_layers)], np.int32)
    n_all = np.arange(space.num_layers)
    # T(ops) = const + sum_additive lat + max_b (sum_branch_b lat + comm_b); comm_b is op-independent
    br_const = []
    lat_b = np.asarray(_branch_terms(space, table, base, assignment))
    for b, layers in enumerate(branch_layers):
        br_const.append(lat_b[b] - lat[layers, base[layers]].sum())
    const = (float(arch_latency(space, table, base, assignment).total) - lat[additive, base[additive]].sum()
             - lat_b.max())
    fa = seg_front(list(topo.pre) + [topo.root] + list(topo.post))
    fbs = [seg_front([b]) for b in topo.branches]
    caps = sorted({float(l + k) for f, k in zip(fbs, br_const) for l in f[0]})
    best, fastest = None, None
    t_min = const + fa[0][0] + max(f[0][0] + k for f, k in zip(fbs, br_const))
    for cap in caps:
        picks = [_cheapest_within(f, cap - k) for f, k in zip(fbs, br_const)]
        if any(p is None for p in picks):
            continue
        a = _cheapest_within(fa, t_const_ms - const - cap)
        if a is None:
            continue
        total_cost = a[1] + sum(p[1] for p in picks)
        if best is None or total_cost < best[0]:
            best = (total_cost, a, picks)
    ops_fast = base.copy()
    ops_fast[additive] = fa[2][0]
    for layers, f in zip(branch_layers, fbs):
        ops_fast[layers] = f[2][0]
    if best is None:
        return None, t_min, ops_fast
    ops = base.copy()
    ops[additive] = best[1][2]
    for layers, p in zip(branch_layers, best[2]):
        ops[layers] = p[2]
    return ops, t_min, ops_fast


def _branch_terms(space, table, ops, assignment=None):
    """Per branch: its compute plus its two links' communication (the root's compute excluded), ms."""
    lat = arch_latency(space, table, ops, assignment)
    topo = space.topology
    agg = topo.post[0]
    out = []
    for b in topo.branches:
        down, up = topo.link_index(topo.root, b), topo.link_index(b, agg)
        out.append(float(lat.per_device[b] + lat.per_link[down] + lat.per_link[up]))
    return out


def check_feasible(space, table, limits: DeviceLimits, t_const_ms: float, assignment=None) -> None:
    """``LimitsError`` with one line when no architecture meets T_const and every device's limits together:
    the device that has no architecture within its limits and the least it needs; else (the limits only bind
    together with T_const) the fastest T within the limits, and the device whose limit, raised to the least
    value that admits an architecture within T_const, would make the combination feasible. A T_const that no
    architecture meets even without limits is not refused (the repair takes the fastest within the limits and the
    report says so, as without limits)."""
    if not L.binding(space, table, limits, assignment):
        return
    alpha = np.zeros(space.mask().shape, np.float32)
    ops = np.array([int(np.flatnonzero(space.mask()[n])[0]) for n in range(space.num_layers)], np.int32)
    fix = repair(space, table, alpha, ops, t_const_ms, assignment, limits)  # raises for a single device
    if fix.feasible:
        return
    free = repair(space, table, alpha, ops, t_const_ms, assignment, None)
    if not free.feasible:  # T_const is out of reach without any limit: as without limits, the run goes on with
        return             # the fastest architecture (here: within the limits) and its report says so
    msg = (f"no architecture meets T_const={t_const_ms:.4g} ms with every device within its memory and energy: the "
           f"fastest within them takes {fix.min_latency_ms:.4g} ms")
    for m in space.topology.path_order():
        for kind, field in (("memory", "memory_bytes"), ("energy", "energy_mj")):
            lim = getattr(limits, field)
            if not np.isfinite(lim[m]):
                continue
            need = _least_limit(space, table, limits, field, m, t_const_ms, assignment)
            if need is not None:
                name = space.topology.device_names[m]
                what = L.mib(need) if kind == "memory" else f"{need:.4g} mJ"
                raise LimitsError(msg + f"; device {name!r} would need {what} of {kind} (it has "
                                        f"{L.mib(lim[m]) if kind == 'memory' else f'{lim[m]:.4g} mJ'}), or T_const "
                                        f">= {fix.min_latency_ms:.4g} ms")
    raise LimitsError(msg + f"; raise T_const to >= {fix.min_latency_ms:.4g} ms or several devices' limits")


def _least_limit(space, table, limits, field, m, t_const_ms, assignment, rel=1e-4):
    """The least value of device m's limit ``field`` for which an architecture meets T_const and every other
    limit (bisection on the exact feasibility, to ``rel``), or None when even no limit on m does not help."""
    alpha = np.zeros(space.mask().shape, np.float32)
    ops = np.array([int(np.flatnonzero(space.mask()[n])[0]) for n in range(space.num_layers)], np.int32)

    def ok(v):
        arr = getattr(limits, field).copy()
        arr[m] = v
        try:
            return repair(space, table, alpha, ops, t_const_ms, assignment,
                                 limits._replace(**{field: arr})).feasible
        except LimitsError:
            return False

    hi = L.upper_bounds(space, table, limits, assignment)[0 if field == "memory_bytes" else 1][m]
    lo = float(getattr(limits, field)[m])
    if not ok(hi):
        return None
    while hi - lo > rel * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi
