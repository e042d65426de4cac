"""Split a fixed network over a chain of devices: edge-only, cloud-only, Neurosurgeon and the exact chain DP.

Inputs are plain arrays, so zoo networks and searched architectures are split the same way:

* ``compute_ms``: float[N, M], latency in ms of layer n on device m (m indexes ``topo.devices``);
* ``out_bytes``: float[N], bytes of layer n's output; ``input_bytes``: bytes of the raw input;
* ``topo``: a :class:`jmsnas.topology.Topology`; link cost is ``transfer_ms`` (bytes*8/(Mbit/s*1e3) + latency ms);
* ``edges``: optional (producer, consumer) pairs in topological layer order, producer -1 the network input
  (``jmsnas.graph.NetSpec.edges()``); ``None`` means a plain sequence, layer n reading layer n-1;
* ``peak``: optional ``peak(layer_indices: tuple) -> bytes``, the peak memory a device needs to run exactly those
  layers; ``memory_limits``: bytes per device (a sequence over ``topo.devices`` or a dict by name; by default
  each device's ``memory_bytes``).

Conventions shared with ``mesh.py`` and ``dag.py``:

* The input starts on the first device of the path (the UE / sensor). Layers may only move forward along the
  path (a layer's device is never before its producer's), so every split is a set of contiguous ranges for a
  plain sequence, and devices may receive no layers.
* A device that runs nothing but lies between a tensor's producer and a consumer relays it: the tensor pays every
  link it crosses. Each link is used at most once per inference: everything crossing it travels as one
  transfer paying the fixed latency once and the summed bytes; a tensor read by several layers on the far side
  crosses once.
* The network's output stays on the device that computes it (no result delivery, as SplitNets' All-on-sensor
  and Neurosurgeon's edge-only assume), so devices after the last busy device cost nothing.
  Eq. (1) of paper 003 is the case in which every device runs at least one layer.
* On a mesh topology the sequential methods of this file route through the chain
  ``pre + root + first branch device + post`` (the others idle); ``mesh.mesh_split`` uses the branches.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple, Sequence

import numpy as np

from jmsnas.topology import Topology, transfer_ms


class InfeasibleSplitError(ValueError):
    """No assignment satisfies the memory limits."""


class SplitResult(NamedTuple):
    """A split and its latency breakdown.

    Attributes:
      method: solver name.
      assignment: int[N], the topology device index running each layer.
      total_ms: end-to-end latency in ms (on a mesh, parallel branches enter through eq. (2)'s max, so it can be
        less than the sum of the per-device and per-link figures).
      per_device_ms: device name -> compute ms (0 for idle devices).
      per_link_ms: link name "a->b" -> communication ms (0 for unused links).
      per_link_bytes: link name -> bytes sent over it.
      memory_ok: device name -> whether the device's peak memory is within its limit (True without ``peak``).
      peak_bytes: device name -> peak memory in bytes, or None when no ``peak`` function was given.
    """

    method: str
    assignment: np.ndarray
    total_ms: float
    per_device_ms: dict
    per_link_ms: dict
    per_link_bytes: dict
    memory_ok: dict
    peak_bytes: dict | None

    @property
    def feasible(self) -> bool:
        return all(self.memory_ok.values())

    @property
    def transmitted_bytes(self) -> float:
        return float(sum(self.per_link_bytes.values()))


# ----------------------------------------------------------------------------------------------- validation

def _finite_nonneg(name: str, arr: np.ndarray) -> None:
    bad = ~np.isfinite(arr) | (arr < 0)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{name} must be finite and >= 0, got {float(arr[idx])!r} at index {idx}")


def check_costs(compute_ms, out_bytes, input_bytes, topo: Topology):
    """Validates the cost arrays against ``topo``; returns (float[N, M], float[N], float)."""
    if not isinstance(topo, Topology):
        raise ValueError(f"topo must be a jmsnas.topology.Topology, got {type(topo).__name__}")
    c = np.asarray(compute_ms, dtype=float)
    b = np.asarray(out_bytes, dtype=float)
    m = topo.num_devices
    if c.ndim != 2 or c.shape[1] != m or c.shape[0] < 1:
        raise ValueError(f"compute_ms must have shape [N >= 1, {m}] (layers x devices of {topo.name!r}), "
                         f"got {c.shape}")
    if b.shape != (c.shape[0],):
        raise ValueError(f"out_bytes must have shape [{c.shape[0]}] (one size per layer), got {b.shape}")
    _finite_nonneg("compute_ms", c)
    _finite_nonneg("out_bytes", b)
    if isinstance(input_bytes, bool) or not np.isscalar(input_bytes):
        raise ValueError(f"input_bytes must be a number, got {input_bytes!r}")
    inb = float(input_bytes)
    if not math.isfinite(inb) or inb < 0:
        raise ValueError(f"input_bytes must be finite and >= 0, got {input_bytes!r}")
    return c, b, inb


def check_edges(edges, n: int) -> tuple:
    """Validates (producer, consumer) pairs for N layers (producer -1 = input); None -> a plain sequence."""
    if edges is None:
        return tuple((i - 1, i) for i in range(n))
    out = []
    for e in edges:
        if len(e) != 2 or not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in e):
            raise ValueError(f"an edge must be a pair of integer layer indices, got {e!r}")
        u, v = int(e[0]), int(e[1])
        if not (-1 <= u < v < n):
            raise ValueError(f"edge {e!r} must satisfy -1 <= producer < consumer < {n} (topological order)")
        out.append((u, v))
    missing = sorted(set(range(n)) - {v for _, v in out})
    if missing:
        raise ValueError(f"layers {missing} have no input edge; use producer -1 for the network input")
    return tuple(sorted(set(out)))


def memory_limits_array(topo: Topology, memory_limits=None) -> np.ndarray:
    """Bytes per device (float[M]); None -> each device's ``memory_bytes``; dict entries override by name."""
    lim = np.array([d.memory_bytes for d in topo.devices], dtype=float)
    if memory_limits is None:
        return lim
    if isinstance(memory_limits, dict):
        for name, v in memory_limits.items():
            if name not in topo.device_names:
                raise ValueError(f"memory_limits names unknown device {name!r}; known: {list(topo.device_names)}")
            lim[topo.device_names.index(name)] = v
    else:
        arr = np.asarray(memory_limits, dtype=float)
        if arr.shape != lim.shape:
            raise ValueError(f"memory_limits must have one entry per device {list(topo.device_names)}, "
                             f"got shape {arr.shape}")
        lim = arr.copy()
    if np.isnan(lim).any() or (lim <= 0).any():
        raise ValueError(f"memory limits must be > 0 bytes (inf allowed), got {lim.tolist()}")
    return lim


def check_peak(peak, memory_limits):
    if peak is not None and not callable(peak):
        raise ValueError(f"peak must be a function peak(layer_indices) -> bytes, got {type(peak).__name__}")
    if peak is None and memory_limits is not None:
        raise ValueError("memory_limits given without a peak(layer_indices) -> bytes function")


def peak_of(peak: Callable, layers: tuple) -> float:
    if not layers:
        return 0.0
    v = float(peak(layers))
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"peak({layers}) must return finite bytes >= 0, got {v!r}")
    return v


# ----------------------------------------------------------------------------------------------- paths, cuts

def chain_path(topo: Topology) -> tuple:
    """Device indices in the order data flows through a chain (mesh: pre, root, first branch, post; star: the
    first source, then the aggregator's chain)."""
    if topo.kind == "chain":
        return tuple(topo.pre)
    if topo.kind == "cluster":
        from jmsnas.topology import TopologyError
        raise TopologyError(f"topology {topo.name!r} links every pair of its {topo.num_devices} devices (a cluster): "
                            "it has no path for data to flow along; splitting needs a chain, a mesh or a star")
    if topo.kind == "star":
        return (topo.branches[0],) + tuple(topo.post)
    return tuple(topo.pre) + (topo.root, topo.branches[0]) + tuple(topo.post)


def path_links(topo: Topology, path: Sequence[int]):
    """(names, bandwidth Mbit/s float[P-1], latency ms float[P-1]) of the links between consecutive devices."""
    idx = [topo.link_index(a, b) for a, b in zip(path, path[1:])]
    links = [topo.links[i] for i in idx]
    return ([f"{l.src}->{l.dst}" for l in links], np.array([l.bandwidth_mbps for l in links], float),
            np.array([l.latency_ms for l in links], float))


def cut_bytes(out_bytes: np.ndarray, input_bytes: float, edges: tuple) -> np.ndarray:
    """float[N+1]: bytes crossing a cut between layers k-1 and k (tensors made before k, read at or after k).

    Each tensor counts once however many of its consumers lie beyond the cut; cut[N] = 0.
    """
    n = len(out_bytes)
    last = np.full(n + 1, -1)  # last consumer of producer u, stored at u + 1 (input at 0)
    for u, v in edges:
        last[u + 1] = max(last[u + 1], v)
    diff = np.zeros(n + 2)
    sizes = np.concatenate([[input_bytes], out_bytes])
    for u1 in range(n + 1):  # tensor u = u1 - 1 crosses cuts u1 .. last consumer
        if last[u1] >= 0:
            diff[u1] += sizes[u1]
            diff[last[u1] + 1] -= sizes[u1]
    return np.cumsum(diff)[: n + 1]


# ----------------------------------------------------------------------------------------------- evaluation

def memory_within_limits(assignment, topo, peak, limits):
    names = topo.device_names
    if peak is None:
        return {d: True for d in names}, None
    pk = {d: peak_of(peak, tuple(int(i) for i in np.flatnonzero(assignment == m))) for m, d in enumerate(names)}
    return {d: bool(pk[d] <= limits[m]) for m, d in enumerate(names)}, pk


def make_result(method, assignment, compute, topo, link_bytes, link_ms, peak, limits) -> SplitResult:
    """Assembles a SplitResult from per-link bytes/ms dicts (all links of topo) and the compute table."""
    names = topo.device_names
    per_dev = {d: float(compute[assignment == m, m].sum()) for m, d in enumerate(names)}
    ok, pk = memory_within_limits(assignment, topo, peak, limits)
    total = sum(per_dev.values()) + sum(link_ms.values())
    return SplitResult(method, assignment, float(total), per_dev, dict(link_ms), dict(link_bytes), ok, pk)


def path_latency(assignment, compute_ms, out_bytes, input_bytes, topo: Topology, *, edges=None, peak=None,
                 memory_limits=None, method: str = "given") -> SplitResult:
    """Latency breakdown of any forward-only assignment (int[N] device indices) along ``chain_path(topo)``.

    Link p of the path carries every tensor whose producer sits at path position <= p and some consumer beyond p
    (the input is at position 0); it costs transfer_ms(summed bytes) when it carries anything, else 0.
    The total is compute plus all link costs (eq. (1) when every device is busy).
    """
    c, b, inb = check_costs(compute_ms, out_bytes, input_bytes, topo)
    n = c.shape[0]
    edges = check_edges(edges, n)
    check_peak(peak, memory_limits)
    path = chain_path(topo)
    a = np.asarray(assignment)
    if a.shape != (n,) or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"assignment must be int[{n}], got {a.dtype} {a.shape}")
    pos_of = {d: p for p, d in enumerate(path)}
    off = sorted({int(d) for d in a if int(d) not in pos_of})
    if off:
        raise ValueError(f"assignment uses devices {off} that are not on the path {list(path)} of {topo.name!r}")
    pos = np.array([pos_of[int(d)] for d in a])
    back = [(u, v) for u, v in edges if u >= 0 and pos[u] > pos[v]]
    if back:
        raise ValueError(f"assignment sends data backwards along the path: edges {back[:5]} go from a later "
                         "device to an earlier one")
    limits = memory_limits_array(topo, memory_limits)
    names, bw, lat = path_links(topo, path)
    far = {}  # producer -> furthest consumer position
    for u, v in edges:
        far[u] = max(far.get(u, -1), pos[v])
    sizes = {u: (inb if u < 0 else b[u]) for u in far}
    src = {u: (0 if u < 0 else pos[u]) for u in far}
    lb = {ln: 0.0 for ln in topo.link_names}
    lm = {ln: 0.0 for ln in topo.link_names}
    for p, ln in enumerate(names):
        crossing = [u for u in far if src[u] <= p < far[u]]
        if crossing:
            lb[ln] = float(sum(sizes[u] for u in crossing))
            lm[ln] = float(transfer_ms(lb[ln], bw[p], lat[p]))
    return make_result(method, a.astype(int), c, topo, lb, lm, peak, limits)


# ----------------------------------------------------------------------------------------------- baselines

def device_index(topo: Topology, d) -> int:
    if isinstance(d, str):
        if d not in topo.device_names:
            raise ValueError(f"unknown device {d!r}; known: {list(topo.device_names)}")
        return topo.device_names.index(d)
    if not isinstance(d, (int, np.integer)) or not 0 <= d < topo.num_devices:
        raise ValueError(f"device must be a name or an index in [0, {topo.num_devices}), got {d!r}")
    return int(d)


def edge_only(compute_ms, out_bytes, input_bytes, topo, *, edges=None, peak=None, memory_limits=None):
    """Everything on the first device (edge-only / All-on-sensor); nothing is sent. Memory is reported, not enforced."""
    n = np.asarray(compute_ms).shape[0] if np.ndim(compute_ms) == 2 else 0
    a = np.full(n, chain_path(topo)[0], dtype=int)
    return path_latency(a, compute_ms, out_bytes, input_bytes, topo, edges=edges, peak=peak,
                        memory_limits=memory_limits, method="edge_only")


def cloud_only(compute_ms, out_bytes, input_bytes, topo, *, edges=None, peak=None, memory_limits=None):
    """Everything on the last device (cloud-only / All-on-aggregator): the raw input crosses every link."""
    n = np.asarray(compute_ms).shape[0] if np.ndim(compute_ms) == 2 else 0
    a = np.full(n, chain_path(topo)[-1], dtype=int)
    return path_latency(a, compute_ms, out_bytes, input_bytes, topo, edges=edges, peak=peak,
                        memory_limits=memory_limits, method="cloud_only")


def neurosurgeon(compute_ms, out_bytes, input_bytes, topo, *, devices=None, edges=None, peak=None,
                 memory_limits=None) -> SplitResult:
    """Neurosurgeon: the best single split k in [0, N] with layers [0, k) on device a and [k, N) on device b.

    ``devices=(a, b)`` (names or indices, a before b on the path; default first and last). Devices between them
    relay the cut tensor; devices before a relay the input. With ``peak``, splits over a memory limit are skipped.
    Ties go to fewer transmitted bytes, then to the smaller k. Cost O(N * links).

    As the bandwidth falls the bytes sent never increase (exchange argument: total(k) = compute(k) +
    bytes(k) * 8 / bandwidth + latency, so a split chosen at a lower bandwidth cannot send more). The split index
    moves back to an earlier layer with a smaller output only when device a runs some layer faster than b;
    when b is faster on every layer the index never decreases either (tests/split/test_solvers.py shows both).
    """
    c, b, inb = check_costs(compute_ms, out_bytes, input_bytes, topo)
    n = c.shape[0]
    e = check_edges(edges, n)
    check_peak(peak, memory_limits)
    path = chain_path(topo)
    da, db = (path[0], path[-1]) if devices is None else (device_index(topo, d) for d in devices)
    if da not in path or db not in path or path.index(da) >= path.index(db):
        raise ValueError(f"devices {devices!r} must be two devices on the path {list(path)} in path order")
    pa, pb = path.index(da), path.index(db)
    _, bw, lat = path_links(topo, path)
    cut = cut_bytes(b, inb, e)
    ks = np.arange(n + 1)
    comp = np.concatenate([[0.0], np.cumsum(c[:, da])]) + (c[:, db].sum() - np.concatenate([[0.0], np.cumsum(c[:, db])]))
    relay = sum(transfer_ms(inb, bw[p], lat[p]) for p in range(pa))
    comm = sum(transfer_ms(cut, bw[p], lat[p]) for p in range(pa, pb)) * (ks < n)
    total = comp + relay + comm
    if peak is not None:
        limits = memory_limits_array(topo, memory_limits)
        for k in ks:
            if (peak_of(peak, tuple(range(k))) > limits[da]
                    or peak_of(peak, tuple(range(k, n))) > limits[db]):
                total[k] = np.inf
    if not np.isfinite(total).any():
        raise InfeasibleSplitError(f"no single split between {topo.device_names[da]!r} and "
                                   f"{topo.device_names[db]!r} meets the memory limits")
    sent = np.where(ks < n, cut, 0.0)
    best = min(ks, key=lambda k: (total[k], sent[k], k))
    a = np.array([da] * best + [db] * (n - best), dtype=int)
    return path_latency(a, c, b, inb, topo, edges=e, peak=peak, memory_limits=memory_limits,
                        method="neurosurgeon")


# ----------------------------------------------------------------------------------------------- chain DP

def range_costs(compute_col: np.ndarray, feasible: np.ndarray | None = None) -> np.ndarray:
    """float[n+1, n+1]: ms for one device to run layers [j, k) (inf where j > k or ``feasible[j, k]`` is False)."""
    pre = np.concatenate([[0.0], np.cumsum(compute_col)])
    r = pre[None, :] - pre[:, None]
    r[np.tril_indices(len(pre), -1)] = np.inf
    if feasible is not None:
        r[~feasible] = np.inf
    return r


def peak_feasibility(peak, n: int, limit: float, cache: dict, offset: int = 0,
                     monotone: bool = False) -> np.ndarray | None:
    """bool[n+1, n+1]: whether layers [offset + j, offset + k) fit in ``limit`` bytes; None when unconstrained.

    ``cache`` maps (j, k) -> bytes and is shared across devices, so each range is measured once. With
    ``monotone`` (the peak of a range never drops when the range grows, as for ``cost.memory.peak_memory_bytes``:
    weights add up and live tensor sets only grow), each start j has a feasible prefix of ends found with two
    pointers, O(n) calls instead of O(n^2).
    """
    if peak is None or not math.isfinite(limit):
        return None

    def fits(j, k):
        if (j, k) not in cache:
            cache[(j, k)] = peak_of(peak, tuple(range(offset + j, offset + k)))
        return cache[(j, k)] <= limit

    ok = np.ones((n + 1, n + 1), dtype=bool)
    if monotone:
        k = 0
        for j in range(n + 1):
            k = max(k, j)
            while k < n and fits(j, k + 1):
                k += 1
            ok[j, k + 1:] = False
        return ok
    for j in range(n + 1):
        for k in range(j + 1, n + 1):
            ok[j, k] = fits(j, k)
    return ok


def chain_dp_core(f0: np.ndarray, seg: Sequence[np.ndarray], link: Sequence[np.ndarray]):
    """Exact min over contiguous splits of n layers across P path positions, O(n^2 P).

    Args:
      f0: float[n+1], cost of position 0 running layers [0, k).
      seg: P-1 arrays float[n+1, n+1], cost of position p >= 1 running layers [j, k) (inf: not allowed).
      link: P-1 arrays float[n+1], cost of link p-1 -> p when layers [0, j) are done before it.
    Returns:
      (best cost, bounds int[P+1]) with position p running layers [bounds[p], bounds[p+1]).
    """
    n = len(f0) - 1
    f, args = np.asarray(f0, float), []
    for s, l in zip(seg, link):
        tab = (f + l)[:, None] + s
        arg = np.argmin(tab, axis=0)
        f = tab[arg, np.arange(n + 1)]
        args.append(arg)
    bounds = [n]
    for arg in reversed(args):
        bounds.append(int(arg[bounds[-1]]))
    bounds.append(0)
    return float(f[n]), np.array(bounds[::-1])


def chain_dp(compute_ms, out_bytes, input_bytes, topo, *, edges=None, peak=None, memory_limits=None,
             devices=None, monotone_peak: bool = False) -> SplitResult:
    """Optimal multi-split on a chain (HiveMind-style): contiguous layer ranges to the devices in path order.

    Exact dynamic programme over the split points minimising eq. (1) with the relay convention of this module
    (devices may run nothing; skipped devices forward the tensor, paying each link). With ``edges`` (a DAG in
    topological order), a cut between layers k-1 and k sends every tensor live across it (``cut_bytes``), so
    the result is optimal among contiguous splits; ``dag.dag_split`` searches all forward-only splits.
    With ``peak``, every device's range must fit its memory limit (exact: infeasible ranges are excluded).
    ``devices`` restricts which path devices may run layers (others relay). O(N^2 M) time, O(N^2) memory per device.
    ``monotone_peak=True`` promises that ``peak`` never drops when a range grows, cutting its calls to O(N M).
    """
    c, b, inb = check_costs(compute_ms, out_bytes, input_bytes, topo)
    n = c.shape[0]
    e = check_edges(edges, n)
    check_peak(peak, memory_limits)
    path = chain_path(topo)
    allowed = set(path) if devices is None else {device_index(topo, d) for d in devices}
    if not allowed <= set(path):
        raise ValueError(f"devices {devices!r} must lie on the path {list(path)}")
    limits = memory_limits_array(topo, memory_limits)
    _, bw, lat = path_links(topo, path)
    cut = cut_bytes(b, inb, e)
    cache, segs = {}, []
    for d in path:
        s = range_costs(c[:, d], peak_feasibility(peak, n, limits[d], cache, monotone=monotone_peak))
        if d not in allowed:
            s = np.where(np.eye(n + 1, dtype=bool), s, np.inf)  # only empty ranges
        segs.append(s)
    links = [np.where(np.arange(n + 1) < n, transfer_ms(cut, bw[p], lat[p]), 0.0) for p in range(len(path) - 1)]
    best, bounds = chain_dp_core(segs[0][0], segs[1:], links)
    if not math.isfinite(best):
        raise InfeasibleSplitError(f"no contiguous split of {n} layers over {[topo.device_names[d] for d in path]} "
                                   f"meets the memory limits {limits.tolist()} bytes")
    a = np.repeat(np.array(path), np.diff(bounds))
    return path_latency(a, c, b, inb, topo, edges=e, peak=peak, memory_limits=memory_limits, method="chain_dp")
