"""Optimal split of a network with parallel branches over a mesh topology (eq. (2) of paper 003).

The network (``MeshNet``) is a prefix of P sequential layers, B parallel branches of L_b sequential layers
that all read the prefix output (the "fork" tensor), and a suffix of S sequential layers whose first layer reads
every branch output. Layers are numbered prefix, branch 0, ..., branch B-1, suffix. The mesh topology has a
chain ``pre`` before the root r, B branch devices and a chain ``post`` whose first device is the aggregator.

Which assignments are allowed (branch b of the network belongs to ``topo.branches[b]``):

* prefix layers: contiguous ranges over ``pre + (root,)``; the fork tensor always reaches the root (devices
  that run nothing relay), and the root sends it to every branch device over its own link;
* branch b: its first u_b layers on branch device b, the other L_b - u_b on the aggregator; branch device b sends
  its last output to the aggregator (the fork tensor itself when u_b = 0, i.e. it relays);
* suffix layers: contiguous ranges over ``post``; the suffix input (all branch outputs) is what crosses when the
  aggregator runs no suffix layer; the network output stays where it is computed.

Latency, eq. (2) with per-link costs:
  T = sum_{m in pre} (tau_m + eps_m) + tau_root + max_b (eps_{root->b} + tau_b + eps_{b->agg})
      + sum_{m in post} (tau_m + eps_m).
``mesh_split`` is exact: the prefix and suffix by the chain DP, the branches by enumerating the value t of the
max term (min over t of t + sum_b min{h_b(u) : g_b(u) <= t}, g_b the branch's term, h_b the time its tail adds
to the aggregator), which finds the optimum because the optimal split's max term is one of the candidates.
When the aggregator has a memory limit its layer set couples the branches and the suffix, so the solver then
enumerates every (u_1, ..., u_B) and solves the suffix for each (exact, Prod(L_b + 1) DPs; refused above 2e5).
"""
from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import numpy as np

from jmsnas.split.solvers import (InfeasibleSplitError, SplitResult, chain_dp_core, check_costs, check_peak,
                                  memory_limits_array, memory_within_limits, path_links, peak_feasibility, peak_of,
                                  range_costs)
from jmsnas.topology import Topology, transfer_ms

MAX_ENUMERATION = 200_000


class MeshNet(NamedTuple):
    """Layer counts of a branched network: ``prefix``, ``branches`` (one count per branch), ``suffix``."""

    prefix: int
    branches: tuple
    suffix: int

    @property
    def num_layers(self) -> int:
        return self.prefix + sum(self.branches) + self.suffix

    def branch_start(self, b: int) -> int:
        return self.prefix + sum(self.branches[:b])

    @property
    def suffix_start(self) -> int:
        return self.prefix + sum(self.branches)


def _check_net(net: MeshNet, topo: Topology, n: int) -> MeshNet:
    if topo.kind != "mesh":
        raise ValueError(f"mesh solvers need a mesh topology, got {topo.kind!r} topology {topo.name!r}")
    counts = (net.prefix, *net.branches, net.suffix)
    if not all(isinstance(x, (int, np.integer)) and x >= 0 for x in counts):
        raise ValueError(f"MeshNet counts must be integers >= 0, got {net!r}")
    if len(net.branches) != len(topo.branches):
        raise ValueError(f"network has {len(net.branches)} branches but topology {topo.name!r} has "
                         f"{len(topo.branches)} branch devices")
    if net.num_layers != n:
        raise ValueError(f"MeshNet {net!r} has {net.num_layers} layers but compute_ms has {n} rows")
    return MeshNet(int(net.prefix), tuple(int(x) for x in net.branches), int(net.suffix))


def _sizes(net: MeshNet, b: np.ndarray, inb: float):
    """(fork bytes, per-branch float[L_b+1] head-output bytes, suffix cut float[S+1])."""
    fork = b[net.prefix - 1] if net.prefix else inb
    heads = [np.concatenate([[fork], b[net.branch_start(i): net.branch_start(i) + L]])
             for i, L in enumerate(net.branches)]
    s0 = net.suffix_start
    cut = np.concatenate([[sum(h[-1] for h in heads)], b[s0: s0 + net.suffix]])
    return fork, heads, cut


def _positions(assignment, lo, hi, devices, what):
    """Positions in ``devices`` of layers [lo, hi); they must be nondecreasing (data flows forward)."""
    seg = [int(d) for d in assignment[lo:hi]]
    bad = [d for d in seg if d not in devices]
    if bad:
        raise ValueError(f"{what} layers [{lo}, {hi}) may only run on devices {list(devices)}, got {sorted(set(bad))}")
    pos = np.array([devices.index(d) for d in seg], dtype=int)
    if (np.diff(pos) < 0).any():
        raise ValueError(f"{what} layers [{lo}, {hi}) must run in device order {list(devices)}, got {seg}")
    return pos


def mesh_latency(assignment, compute_ms, out_bytes, input_bytes, topo: Topology, net: MeshNet, *, peak=None,
                 memory_limits=None, method: str = "given") -> SplitResult:
    """Eq. (2) latency breakdown of an assignment (int[N] device indices) of the branched network ``net``."""
    c, b, inb = check_costs(compute_ms, out_bytes, input_bytes, topo)
    net = _check_net(net, topo, c.shape[0])
    check_peak(peak, memory_limits)
    a = np.asarray(assignment)
    if a.shape != (c.shape[0],) or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"assignment must be int[{c.shape[0]}], got {a.dtype} {a.shape}")
    limits = memory_limits_array(topo, memory_limits)
    pre, post, agg = tuple(topo.pre) + (topo.root,), tuple(topo.post), topo.post[0]
    fork, heads, scut = _sizes(net, b, inb)
    lb = {ln: 0.0 for ln in topo.link_names}
    lm = dict(lb)

    def send(src, dst, nbytes):
        ln = topo.link_names[topo.link_index(src, dst)]
        link = topo.links[topo.link_index(src, dst)]
        lb[ln], lm[ln] = float(nbytes), float(transfer_ms(nbytes, link.bandwidth_mbps, link.latency_ms))
        return lm[ln]

    ppos = _positions(a, 0, net.prefix, pre, "prefix")
    for p in range(len(pre) - 1):
        send(pre[p], pre[p + 1], ([inb] + list(b[: net.prefix]))[int((ppos <= p).sum())])
    branch_terms = []
    for i, L in enumerate(net.branches):
        s, dev = net.branch_start(i), topo.branches[i]
        bpos = _positions(a, s, s + L, (dev, agg), f"branch {i}")
        u = int((bpos == 0).sum())
        branch_terms.append(send(topo.root, dev, fork) + c[s: s + u, dev].sum() + send(dev, agg, heads[i][u]))
    spos = _positions(a, net.suffix_start, net.num_layers, post, "suffix")
    for p in range(len(post) - 1):
        k = int((spos <= p).sum())
        if k < net.suffix:
            send(post[p], post[p + 1], scut[k])
    per_dev = {d: float(c[a == m, m].sum()) for m, d in enumerate(topo.device_names)}
    chain_links = sum(lm[topo.link_names[topo.link_index(x, y)]] for seq in (pre, post) for x, y in zip(seq, seq[1:]))
    total = (sum(per_dev[topo.device_names[d]] for d in pre + post) + chain_links + max(branch_terms))
    ok, pk = memory_within_limits(a, topo, peak, limits)
    return SplitResult(method, a.astype(int), float(total), per_dev, lm, lb, ok, pk)


def _branch_tables(c, net, topo, fork, heads, peak, limits):
    """Per branch: g[u] (root->b link + head compute + b->agg link, inf if the head breaks memory), h[u] tail ms."""
    agg, root = topo.post[0], topo.root
    g, h = [], []
    for i, L in enumerate(net.branches):
        s, dev = net.branch_start(i), topo.branches[i]
        l_in, l_out = topo.links[topo.link_index(root, dev)], topo.links[topo.link_index(dev, agg)]
        head = np.concatenate([[0.0], np.cumsum(c[s: s + L, dev])])
        gi = (transfer_ms(fork, l_in.bandwidth_mbps, l_in.latency_ms) + head
              + transfer_ms(heads[i], l_out.bandwidth_mbps, l_out.latency_ms))
        if peak is not None:
            gi = np.array([np.inf if peak_of(peak, tuple(range(s, s + u))) > limits[dev] else x
                           for u, x in enumerate(gi)])
        tail = np.concatenate([[0.0], np.cumsum(c[s: s + L, agg])])
        g.append(gi)
        h.append(tail[-1] - tail)
    return g, h


def _best_branches(g, h):
    """min over (u_b) of max_b g_b[u_b] + sum_b h_b[u_b], by enumerating the max term's value t."""
    best, choice = np.inf, None
    for t in np.unique(np.concatenate(g)):
        if not math.isfinite(t):
            continue
        us = []
        for gb, hb in zip(g, h):
            ok = np.flatnonzero(gb <= t)
            if not len(ok):
                break
            us.append(int(ok[np.argmin(hb[ok])]))
        else:
            val = max(gb[u] for gb, u in zip(g, us)) + sum(hb[u] for hb, u in zip(h, us))
            if val < best:
                best, choice = val, us
    return best, choice


def mesh_split(compute_ms, out_bytes, input_bytes, topo: Topology, net: MeshNet, *, peak=None,
               memory_limits=None, monotone_peak: bool = False) -> SplitResult:
    """The assignment of ``net`` over the mesh ``topo`` with the least eq. (2) latency (exact; see module doc).

    ``monotone_peak``: as in ``solvers.chain_dp``, for the prefix and suffix chains."""
    c, b, inb = check_costs(compute_ms, out_bytes, input_bytes, topo)
    net = _check_net(net, topo, c.shape[0])
    check_peak(peak, memory_limits)
    limits = memory_limits_array(topo, memory_limits)
    pre, post, agg = tuple(topo.pre) + (topo.root,), tuple(topo.post), topo.post[0]
    fork, heads, scut = _sizes(net, b, inb)
    # prefix over pre + root; the fork tensor always reaches the root
    P, cache = net.prefix, {}
    segs = [range_costs(c[:P, d], peak_feasibility(peak, P, limits[d], cache, 0, monotone_peak)) for d in pre]
    pcut = np.concatenate([[inb], b[:P]])
    _, bw, lat = path_links(topo, pre)
    pre_cost, pbounds = chain_dp_core(segs[0][0], segs[1:], [transfer_ms(pcut, bw[i], lat[i]) for i in range(len(bw))])
    # suffix over post[1:]; the aggregator's own cost is f0
    S, s0, cache = net.suffix, net.suffix_start, {}
    ssegs = [range_costs(c[s0:, d], peak_feasibility(peak, S, limits[d], cache, s0, monotone_peak))
             for d in post[1:]]
    _, bw, lat = path_links(topo, post)
    slinks = [np.where(np.arange(S + 1) < S, transfer_ms(scut, bw[i], lat[i]), 0.0) for i in range(len(bw))]
    agg_suffix = range_costs(c[s0:, agg])[0]
    g, h = _branch_tables(c, net, topo, fork, heads, peak, limits)
    if peak is None or not math.isfinite(limits[agg]):
        mid, us = _best_branches(g, h)
        post_cost, sbounds = chain_dp_core(agg_suffix, ssegs, slinks)
    else:
        mid, us, post_cost, sbounds = _enumerate_branches(g, h, net, agg_suffix, ssegs, slinks, peak, limits[agg])
    if not math.isfinite(pre_cost + mid + post_cost):
        raise InfeasibleSplitError(f"no mesh split of {net!r} over {topo.name!r} meets the memory limits "
                                   f"{limits.tolist()} bytes")
    a = np.concatenate([np.repeat(np.array(pre), np.diff(pbounds))]
                       + [np.array([topo.branches[i]] * u + [agg] * (L - u)) for i, (u, L) in enumerate(zip(us, net.branches))]
                       + [np.repeat(np.array(post), np.diff(sbounds))]).astype(int)
    return mesh_latency(a, c, b, inb, topo, net, peak=peak, memory_limits=memory_limits, method="mesh_split")


def _enumerate_branches(g, h, net, agg_suffix, ssegs, slinks, peak, limit):
    """Exact search when the aggregator's memory couples the branch tails and the suffix head."""
    options = [np.flatnonzero(np.isfinite(gb)) for gb in g]
    count = math.prod(len(o) for o in options)
    if count > MAX_ENUMERATION:
        raise ValueError(f"{count} branch splits to enumerate under the aggregator memory limit exceeds "
                         f"{MAX_ENUMERATION}; drop the aggregator's limit or shorten the branches")
    s0, S = net.suffix_start, net.suffix
    best = (np.inf, None, np.inf, None)
    for us in itertools.product(*options):
        tails = tuple(i for k, (u, L) in enumerate(zip(us, net.branches))
                      for i in range(net.branch_start(k) + u, net.branch_start(k) + L))
        f0 = np.array([agg_suffix[k] if peak_of(peak, tails + tuple(range(s0, s0 + k))) <= limit else np.inf
                       for k in range(S + 1)])
        mid = max(gb[u] for gb, u in zip(g, us)) + sum(hb[u] for hb, u in zip(h, us))
        post_cost, bounds = chain_dp_core(f0, ssegs, slinks)
        if mid + post_cost < best[0] + best[2]:
            best = (mid, list(us), post_cost, bounds)
    if best[1] is None:
        return np.inf, [0] * len(g), np.inf, None
    return best
