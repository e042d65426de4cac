"""Every device's limits inside the search: memory (bytes) and energy (mJ per inference) per device.

A device's memory M_m (``cost.memory``: parameters + link buffers + largest activation working set) must stay
within its ``memory_bytes``, and its energy E_m (``cost.energy``: compute + its share of its links' radio energy)
within its ``energy_budget_mj`` (none by default). The limits enter

* the search objective as a hinge penalty per device on the expectations (``objectives.limits_penalty``),
* evolve's fitness (an architecture over a limit is infeasible, as one over T_const),
* the budget repair (``budget.repair``): the most probable architecture within T_const AND every limit, exact,
* and the boundary check (``budget.check_feasible``): when no architecture of the space can meet them together, one line
  naming the device and the least it would need, before anything is written.

For a fixed split the devices' constraints are separable: device m's memory is W_m (a sum over its layers) +
B_m (fixed) + max_k A_k, and its energy a sum over its layers plus a constant. ``device_frontier`` enumerates the
value a of the largest working set (every candidate's A on the device), keeps for each the candidates with A <= a
and runs a dynamic programme over the device's layers that keeps every point not dominated in (latency, -log p,
weight bytes, energy); a point dominated in all four can be replaced by its dominator in any completion, so
nothing optimal is pruned. Points with W <= room - a and E <= budget survive; the union over a, pruned to the
(latency, -log p) Pareto frontier, is the device's exact frontier, and the frontiers of consecutive devices add
(Minkowski sum, pruned again): exact over all architectures of the space.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np

from jmsnas.cost import energy as E
from jmsnas.cost import memory as M
from jmsnas.cost.latency import eps_ms


class LimitsError(ValueError):
    """No architecture of the space meets the limits (with T_const): the message names the device and its need."""


class DeviceLimits(NamedTuple):
    """memory_bytes / energy_mj: float64[M] (inf: no limit); mem: the memory table the search's space uses."""

    memory_bytes: np.ndarray
    energy_mj: np.ndarray
    mem: M.SpaceMemory


def device_limits(space, activation_bits: int = 32) -> DeviceLimits:
    """The limits of ``space``'s devices (their memory_bytes and energy_budget_mj) with its memory table."""
    topo = space.topology
    return DeviceLimits(M.memory_limits(topo), E.energy_budgets(topo), M.space_memory(space, activation_bits))


_arch_memory = jax.jit(M.arch_memory, static_argnums=0)  # one executable per space instead of ~100 dispatches
_arch_energy = jax.jit(lambda space, table, ops, assignment: E.energy(
    space, table, jax.nn.one_hot(ops, table.compute_ms.shape[-1]), assignment), static_argnums=0)


def expected_penalty(space, table, limits: DeviceLimits, alpha, assignment=None):
    """The objective's limits term (``objectives.limits_penalty``) of E[M_m] and E[E_m] under alpha (and the split
    ``assignment``, D^m by default): differentiable in alpha."""
    from jmsnas.gates import probabilities
    from jmsnas.objectives import limits_penalty
    probs = probabilities(alpha, jax.numpy.asarray(space.mask()))
    mem = M.device_memory(space, limits.mem, table, probs, assignment).total
    en = E.energy(space, table, probs, assignment).per_device
    return limits_penalty(mem, limits.memory_bytes) + limits_penalty(en, limits.energy_mj)


def mib(b: float) -> str:
    return f"{b:,.0f} bytes ({b / 2 ** 20:.3f} MiB)"


class _Device(NamedTuple):
    """The repair's view of one device under a fixed split: its layers and per-candidate terms, float64."""

    layers: np.ndarray  # int[K] layer indices, ascending
    weight: np.ndarray  # [N, R] bytes
    act: np.ndarray  # [N, R] bytes
    energy: np.ndarray  # [N, R] mJ of computing candidate i at layer n on this device
    mem_const: float  # buffers + stem/head weights
    act_floor: float  # stem/head working set (0 when the device holds neither)
    energy_const: float  # stem/head compute energy + link energy charged to the device
    mem_limit: float
    energy_limit: float


def _devices(space, table, limits: DeviceLimits, assignment=None) -> list:
    topo = space.topology
    dev = space.layer_devices() if assignment is None else np.asarray(assignment)
    mask = space.mask()
    base = np.array([int(np.flatnonzero(mask[n])[0]) for n in range(space.num_layers)], np.int32)
    w, a = np.asarray(limits.mem.weight_bytes, np.float64), np.asarray(limits.mem.act_bytes, np.float64)
    mem0 = _arch_memory(space, limits.mem, table, base, assignment)
    en0 = np.asarray(_arch_energy(space, table, base, assignment).per_device, np.float64)
    active = E.powers(topo)[0]
    order = topo.path_order()
    out = []
    for m in range(topo.num_devices):
        layers = np.flatnonzero(dev == m)
        e = active[m] * np.asarray(table.compute_ms, np.float64)[m]
        floor = max([float(limits.mem.stem_act_bytes)] * (m == order[0])
                    + [float(limits.mem.head_act_bytes)] * (m == order[-1]) + [0.0])
        mem_const = float(mem0.weights[m]) - w[layers, base[layers]].sum() + float(mem0.buffers[m])
        out.append(_Device(layers, w, a, e, mem_const, floor, float(en0[m]) - e[layers, base[layers]].sum(),
                           float(limits.memory_bytes[m]), float(limits.energy_mj[m])))
    return out


def _prune(points, picks):
    """Rows of ``points`` float[K, D] not dominated (<= in every column) by another row; ties keep the first."""
    order = np.lexsort(points.T[::-1])
    points, picks = points[order], picks[order]
    keep = np.ones(len(points), bool)
    for i in range(1, len(points)):
        earlier = points[:i][keep[:i]]
        if len(earlier) and np.any(np.all(earlier <= points[i], axis=1)):
            keep[i] = False
    return points[keep], picks[keep]


def device_frontier(d: _Device, lat, cost, valid):
    """(latency, cost, picks[K, len(d.layers)]) of the device's layer choices within its memory and energy limits,
    Pareto in (latency, cost), sorted by latency; empty arrays when none fits."""
    layers = list(d.layers)
    values = np.unique(np.concatenate([[d.act_floor], d.act[layers][valid[layers]]]))
    found_p, found_k = [], []
    fits = lambda top, pts: ((d.mem_const + top + pts[:, 2] <= d.mem_limit)
                             & (d.energy_const + pts[:, 3] <= d.energy_limit))
    for top in values[values >= d.act_floor]:
        pts, picks = np.zeros((1, 4)), np.zeros((1, 0), np.int64)
        ok = fits(top, pts)  # the device's constants alone (all a device with no layer, a relay, has)
        pts, picks = pts[ok], picks[ok]
        for n in layers:
            ops = np.flatnonzero(valid[n] & (d.act[n] <= top))
            if not len(ops):
                pts = np.zeros((0, 4))
                break
            add = np.stack([lat[n, ops], cost[n, ops], d.weight[n, ops], d.energy[n, ops]], 1)
            pts = (pts[:, None, :] + add[None]).reshape(-1, 4)
            picks = np.concatenate([np.repeat(picks, len(ops), 0), np.tile(ops, len(picks))[:, None]], 1)
            ok = fits(top, pts)
            pts, picks = _prune(pts[ok], picks[ok])  # both sums only grow: a point over a limit stays over it
        if len(pts):
            found_p.append(pts[:, :2])
            found_k.append(picks)
    if not found_p:
        return np.zeros(0), np.zeros(0), np.zeros((0, len(layers)), np.int64)
    pts, picks = _prune(np.concatenate(found_p), np.concatenate(found_k))
    return pts[:, 0], pts[:, 1], picks


def _add(f, g):
    """Minkowski sum of two (latency, cost, picks) frontiers, pruned; picks side by side."""
    pts = np.stack([(f[0][:, None] + g[0][None]).ravel(), (f[1][:, None] + g[1][None]).ravel()], 1)
    picks = np.concatenate([np.repeat(f[2], len(g[0]), 0), np.tile(g[2], (len(f[0]), 1))], 1)
    pts, picks = _prune(pts, picks)
    return pts[:, 0], pts[:, 1], picks


def segment_frontiers(space, table, limits: DeviceLimits, lat, cost, assignment=None):
    """``seg_front(devices)`` for ``budget.repair``: the exact frontier of the layers of ``devices`` (picks in
    device order, each device's layers ascending) within every device's limits. Raises ``LimitsError`` naming a
    device that no choice of its layers fits."""
    devs, valid = _devices(space, table, limits, assignment), space.mask()
    fronts = {}
    for m, d in enumerate(devs):
        fronts[m] = device_frontier(d, lat, cost, valid)
        if not len(fronts[m][0]):
            raise LimitsError(least_need_message(space, table, limits, m, assignment))

    def seg_front(devices):
        f = (np.zeros(1), np.zeros(1), np.zeros((1, 0), np.int64))
        for m in devices:
            f = _add(f, fronts[m])
        return f

    return seg_front


def least_need(space, table, limits: DeviceLimits, m: int, assignment=None) -> tuple:
    """(least memory in bytes, least energy in mJ) device ``m`` needs over all architectures (each minimised on
    its own) under the split."""
    d = _devices(space, table, limits, assignment)[m]
    valid = space.mask()
    layers = list(d.layers)
    values = np.unique(np.concatenate([[d.act_floor], d.act[layers][valid[layers]]]))
    best_mem = np.inf
    for top in values[values >= d.act_floor]:
        ok = [valid[n] & (d.act[n] <= top) for n in layers]
        if all(o.any() for o in ok):
            best_mem = min(best_mem, d.mem_const + top + sum(d.weight[n, o].min() for n, o in zip(layers, ok)))
    least_e = d.energy_const + sum(d.energy[n, valid[n]].min() for n in layers)
    return float(best_mem), float(least_e)


def least_need_message(space, table, limits, m, assignment=None) -> str:
    name = space.topology.device_names[m]
    mem, en = least_need(space, table, limits, m, assignment)
    if mem > limits.memory_bytes[m]:
        return (f"device {name!r} needs at least {mib(mem)} of memory for any architecture of this space (its "
                f"memory_bytes is {mib(limits.memory_bytes[m])}): raise its memory or give it fewer layers")
    if en > limits.energy_mj[m]:
        return (f"device {name!r} needs at least {en:.4g} mJ per inference for any architecture of this space (its "
                f"energy_budget_mj is {limits.energy_mj[m]:.4g}): raise its budget or give it fewer layers")
    return (f"device {name!r} cannot meet its memory ({mib(limits.memory_bytes[m])}) and energy "
            f"({limits.energy_mj[m]:.4g} mJ) limits together: it needs at least {mib(mem)} and {en:.4g} mJ, "
            "not with one architecture")


def usage(space, table, limits: DeviceLimits, ops, assignment=None) -> tuple:
    """(DeviceMemory, Energy) of one architecture, as float64 numpy arrays."""
    ops = np.asarray(ops, np.int32)
    mem, en = _arch_memory(space, limits.mem, table, ops, assignment), _arch_energy(space, table, ops, assignment)
    return (M.DeviceMemory(*(np.asarray(x, np.float64) for x in mem)),
            E.Energy(*(np.asarray(x, np.float64) for x in en)))


def _close(x, limit):
    """x <= limit up to float32 rounding (the memory and energy are summed in float32)."""
    return np.asarray(x) <= np.asarray(limit) * (1 + 1e-6) + 1e-6


def within_limits(space, table, limits: DeviceLimits, ops, assignment=None) -> bool:
    mem, en = usage(space, table, limits, ops, assignment)
    return bool(np.all(_close(mem.total, limits.memory_bytes)) and np.all(_close(en.per_device, limits.energy_mj)))


def upper_bounds(space, table, limits: DeviceLimits, assignment=None) -> tuple:
    """(memory bytes float64[M], energy mJ float64[M]): at least the most any architecture needs on each device."""
    devs, valid = _devices(space, table, limits, assignment), space.mask()
    mem = np.array([d.mem_const + max([d.act_floor] + [d.act[n, valid[n]].max() for n in d.layers])
                    + sum(d.weight[n, valid[n]].max() for n in d.layers) for d in devs])
    en = np.array([d.energy_const + sum(d.energy[n, valid[n]].max() for n in d.layers) for d in devs])
    return mem, en


def upper_bounds_any_split(space, table, limits: DeviceLimits) -> tuple:
    """(memory bytes, energy mJ) float64[M]: at least the most any architecture needs on each device under any
    split (every layer's largest candidate, the stem and the head on it, the largest tensor in and out)."""
    topo, valid = space.topology, space.mask()
    w, a = np.asarray(limits.mem.weight_bytes, np.float64), np.asarray(limits.mem.act_bytes, np.float64)
    big = max(float(table.stem_bytes), float(np.max(table.out_bytes)), float(table.input_bytes))
    sh = float(limits.mem.stem_weight_bytes + limits.mem.head_weight_bytes)
    acts = max(float(limits.mem.stem_act_bytes), float(limits.mem.head_act_bytes), float(a[valid].max()))
    deg = np.array([sum(name in (l.src, l.dst) for l in topo.links) for name in topo.device_names])
    mem = sh + w.max(axis=1).sum() + acts + big * (1 + deg)
    active, tx, rx = E.powers(topo)
    c = np.asarray(table.compute_ms, np.float64)
    air = np.array([big * 8.0 / (l.bandwidth_mbps * 1e3) for l in topo.links])
    en = active * (c.max(axis=2).sum(axis=1) + np.asarray(table.stem_ms) + np.asarray(table.head_ms))
    for i, l in enumerate(topo.links):
        en[topo.device_names.index(l.src)] += tx[i] * air[i]
        en[topo.device_names.index(l.dst)] += rx[i] * air[i]
    return mem, en


def binding(space, table, limits: DeviceLimits, assignment=None, any_split: bool = False) -> bool:
    """Whether some architecture of the space may exceed some device's limit (else the limits change nothing),
    under ``assignment`` (D^m by default) or, with ``any_split``, under any split."""
    mem, en = (upper_bounds_any_split(space, table, limits) if any_split
               else upper_bounds(space, table, limits, assignment))
    return bool(np.any(mem > limits.memory_bytes) or np.any(en > limits.energy_mj))


def population_within(space, table, limits: DeviceLimits, ops, split: str = "fixed") -> np.ndarray:
    """bool[P]: whether each architecture of ops int[P, N] keeps every device within its limits, under D^m or
    (``"searched"``) its own best chain split of eq. (1) (the split evolve's latency uses; chain or mesh)."""
    return np.asarray(_population_within(space, table, limits.mem, jax.numpy.asarray(ops, jax.numpy.int32),
                                         jax.numpy.asarray(limits.memory_bytes * (1 + 1e-6) + 1e-6, jax.numpy.float32),
                                         jax.numpy.asarray(limits.energy_mj * (1 + 1e-6) + 1e-6, jax.numpy.float32),
                                         split))


def _population_within_impl(space, table, mem, ops, mem_lim, en_lim, split):
    from jmsnas.cost.latency import best_assignment

    def one(o):
        onehot = jax.nn.one_hot(o, table.compute_ms.shape[-1])
        assignment = best_assignment(space, table, onehot) if split == "searched" else None
        m = M.device_memory(space, mem, table, onehot, assignment).total
        e = E.energy(space, table, onehot, assignment).per_device
        return jax.numpy.all(m <= mem_lim) & jax.numpy.all(e <= en_lim)

    return jax.vmap(one)(ops)


_population_within = jax.jit(_population_within_impl, static_argnames=("space", "split"))


def report(space, table, limits: DeviceLimits, ops, assignment=None) -> dict:
    """result.json's ``memory`` and ``energy`` entries: per device (and link) against the limits."""
    mem, en = usage(space, table, limits, ops, assignment)
    return format_report(space.topology, limits, mem, en)


def format_report(topo, limits: DeviceLimits, mem, en) -> dict:
    """``report``'s entries from a device memory (``DeviceMemory``) and an energy (``Energy``) already computed
    (the composed search's come from ``jmsnas.compose.cost``)."""
    kn = E.known(topo)
    fin = lambda v: float(v) if np.isfinite(v) else None
    memory = {d: {"bytes": int(round(mem.total[m])), "weights": int(round(mem.weights[m])),
                  "activations": int(round(mem.activations[m])), "buffers": int(round(mem.buffers[m])),
                  "limit_bytes": fin(limits.memory_bytes[m]),
                  "within": bool(_close(mem.total[m], limits.memory_bytes[m]))}
              for m, d in enumerate(topo.device_names)}
    energy = {"unit": "mJ per inference",
              "per_device": {d: {"mj": float(en.per_device[m]) if kn["devices"][d] else None,
                                 "budget_mj": fin(limits.energy_mj[m]),
                                 "within": bool(_close(en.per_device[m], limits.energy_mj[m]))}
                             for m, d in enumerate(topo.device_names)},
              "per_link": {n: float(en.per_link[i]) if kn["links"][n] else None for i, n in enumerate(topo.link_names)},
              "total": float(en.total) if all(kn["devices"].values()) and all(kn["links"].values()) else None}
    return {"memory": memory, "energy": energy}


# ----------------------------------------------------------------------------------------------- searched split

def _segment_split(space, table, limits: DeviceLimits, ops, devices, lo, hi, boundary, first_recv, last_send,
                   stem: bool, head: bool):
    """Positions (int[hi-lo]) along ``devices`` of layers lo..hi-1 split contiguously with the least compute +
    link latency among the splits that keep each device within its memory and energy limits, or None.

    ``boundary[j]``: bytes of the tensor at segment boundary j (j = 0..hi-lo); ``first_recv``: (link or None,
    bytes) the first device receives besides its input boundary (None: the camera image); ``last_send``: (link,
    bytes) the last device sends after the segment (a root's forks); the stem runs on the first device when
    ``stem``, the head on the last when ``head``. Exact DP over the split points (an O(M n^2) table of ranges)."""
    topo, n, P = space.topology, hi - lo, len(devices)
    layer = np.arange(lo, hi)
    c_all = np.asarray(table.compute_ms, np.float64)[:, layer, ops[lo:hi]]  # [M, n]
    w = np.asarray(limits.mem.weight_bytes, np.float64)[layer, ops[lo:hi]]
    a = np.asarray(limits.mem.act_bytes, np.float64)[layer, ops[lo:hi]]
    active, tx, rx = E.powers(topo)
    air = lambda li, b: b * 8.0 / (topo.links[li].bandwidth_mbps * 1e3)
    cum_w = np.concatenate([[0.0], np.cumsum(w)])
    cost = np.full((P, n + 1, n + 1), np.inf)  # [p, j, k]: device p runs segment layers j..k-1 within its limits
    for p, m in enumerate(devices):
        cum_c = np.concatenate([[0.0], np.cumsum(c_all[m])])
        has_stem, has_head = stem and p == 0, head and p == P - 1
        fixed_ms = float(table.stem_ms[m]) * has_stem + float(table.head_ms[m]) * has_head
        floor = max([float(limits.mem.stem_act_bytes)] * has_stem + [float(limits.mem.head_act_bytes)] * has_head
                    + [0.0])
        fixed_w = float(limits.mem.stem_weight_bytes) * has_stem + float(limits.mem.head_weight_bytes) * has_head
        for j in range(n + 1):
            peak = floor
            for k in range(j, n + 1):
                if k > j:
                    peak = max(peak, a[k - 1])
                ms = cum_c[k] - cum_c[j] + fixed_ms
                mem, en = cum_w[k] - cum_w[j] + fixed_w + peak, active[m] * ms
                if p == 0:
                    for li, b in first_recv:
                        mem += b
                        en += 0.0 if li is None else rx[li] * air(li, b)
                else:
                    li = topo.link_index(devices[p - 1], m)
                    mem, en = mem + boundary[j], en + rx[li] * air(li, boundary[j])
                if p < P - 1:
                    li = topo.link_index(m, devices[p + 1])
                    mem, en = mem + boundary[k], en + tx[li] * air(li, boundary[k])
                else:
                    for li, b in last_send:
                        mem, en = mem + b, en + tx[li] * air(li, b)
                if _close(mem, limits.memory_bytes[m]) and _close(en, limits.energy_mj[m]):
                    cost[p, j, k] = cum_c[k] - cum_c[j]
    f, back = cost[0, 0].copy(), []  # f[k]: segment layers 0..k-1 done on the devices so far
    for p in range(1, P):
        li = topo.link_index(devices[p - 1], devices[p])
        link = topo.links[li]
        eps = eps_ms(boundary, link.bandwidth_mbps, link.latency_ms, _handoff(table.handoff_ms, li),
                     _handoff(table.handoff_ms_per_byte, li))  # cost.latency's link term (hand-off 0: none)
        cand = (f + eps)[:, None] + cost[p]  # [j, k]
        back.append(np.argmin(cand, axis=0))
        f = cand.min(axis=0)
    if not np.isfinite(f[n]):
        return None
    starts, k = [], n
    for p in range(P - 1, 0, -1):
        k = int(back[p - 1][k])
        starts.append(k)
    return np.sum(np.arange(n)[:, None] >= np.array(starts[::-1], int).reshape(1, -1), axis=1)


def _handoff(x, i) -> float:
    """A link's deployed hand-off term (``CostTable.handoff_ms`` / ``handoff_ms_per_byte``; a scalar 0.0 in a table
    built without them) as a float64, as ``cost.latency.link_ms`` charges it."""
    x = np.asarray(x, np.float64)
    return float(x) if x.ndim == 0 else float(x[i])


def best_split(space, table, limits: DeviceLimits, ops) -> np.ndarray | None:
    """The split of ``ops`` with the least eq. (1) / eq. (2) latency among those that keep every device within
    its memory and energy limits, exact; None when none does (a link's eps carries the table's hand-off, as eq.
    (1)/(2) do; the part call cost is the same under every split). Chain: contiguous ranges along the chain (as
    ``cost.latency.best_chain_assignment``). Mesh: the family of ``cost.latency.MeshSegments`` (the prefix over
    pre + root and the suffix over post, each contiguous; branches fixed), where eq. (2) separates into the two
    segments' chain problems (``best_mesh_assignment``), and the branch devices' usage does not depend on the
    split (they must fit on their own). int32[N] device indices."""
    from jmsnas.cost.latency import mesh_segments
    topo, n = space.topology, space.num_layers
    ops = np.asarray(ops)
    ob = np.asarray(table.out_bytes, np.float64)
    raw = [(None, float(table.input_bytes))]
    if topo.kind == "chain":
        pos = _segment_split(space, table, limits, ops, list(topo.pre), 0, n,
                             np.concatenate([[float(table.stem_bytes)], ob]), raw, [], True, True)
        return None if pos is None else np.asarray(topo.pre, np.int32)[pos]
    seg = mesh_segments(space)
    fork = [(topo.link_index(topo.root, b), ob[seg.prefix - 1]) for b in topo.branches]
    merge = [(topo.link_index(b, topo.post[0]), ob[space.layers_of(b)[-1]]) for b in topo.branches]
    pre = _segment_split(space, table, limits, ops, list(seg.prefix_devices), 0, seg.prefix,
                         np.concatenate([[float(table.stem_bytes)], ob[:seg.prefix]]), raw, fork, True, False)
    post = _segment_split(space, table, limits, ops, list(seg.post), seg.suffix_start, n, ob[seg.suffix_start - 1:],
                          merge, [], False, True)
    a = space.layer_devices().copy()
    if pre is None or post is None:
        return None
    a[:seg.prefix] = np.asarray(seg.prefix_devices)[pre]
    a[seg.suffix_start:] = np.asarray(seg.post)[post]
    if not within_limits(space, table, limits, ops, a):  # a branch device over its limits: no split helps
        return None
    return a.astype(np.int32)
