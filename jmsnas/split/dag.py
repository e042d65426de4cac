"""Min-cut splits of networks with skip connections (DAGs) over devices on a chain (DADS / QDMP style).

Two devices (``devices=(a, b)``): the layers on ``a`` form a set closed under producers (data never flows back),
and the cost is compute on each side plus, once per tensor, the transfer of every tensor made on ``a`` (or the
input) that some layer on ``b`` reads. Public reimplementations put the tensor's size on every producer->consumer
edge, so a tensor read by k layers on the far side is paid k times; here each tensor gets an auxiliary node x_u
(edge u -> x_u with the tensor's cost, x_u -> each consumer infinite), so cutting it once is enough.

More devices (default: every device of ``solvers.chain_path(topo)``): the same construction is stacked in
levels, one binary variable per (layer, level k) meaning "beyond the k-th selected device", chained so the
levels nest (Ishikawa's construction for ordered labels). Compute costs are unary terms, dependencies and
nesting are infinite edges, each level has once-per-tensor auxiliary nodes for the link(s) between selected
devices k and k+1, and an auxiliary node per level charges that link's fixed latency once if anything crosses.
Every term is submodular, so one s-t min cut gives the EXACT optimum over all forward-only assignments of the
DAG's layers to the selected devices, under the conventions of ``solvers`` (relaying, one transfer per link,
output stays where computed), in polynomial time (networkx max-flow). Not covered: memory limits (the result
reports ``memory_ok`` but the cut does not enforce it; use ``solvers.chain_dp`` with ``edges`` for an exact
memory-constrained optimum among contiguous splits) and mesh-parallel branches (``mesh.mesh_split``).
"""
from __future__ import annotations

import networkx as nx
import numpy as np

from jmsnas.split.solvers import (SplitResult, device_index, chain_path, check_costs, check_edges, check_peak,
                                  path_latency, path_links)
from jmsnas.topology import Topology


def _levels(topo: Topology, sel: list, path: tuple):
    """Per level k (between selected devices k and k+1): (ms per byte, fixed latency ms) over the relay links."""
    _, bw, lat = path_links(topo, path)
    out = []
    for a, b in zip(sel, sel[1:]):
        span = range(path.index(a), path.index(b))
        out.append((sum(8.0 / (bw[p] * 1e3) for p in span), sum(lat[p] for p in span)))
    return out


def _graph(c, b, inb, edges, sel, levels) -> nx.DiGraph:
    n = c.shape[0]
    g = nx.DiGraph()
    g.add_nodes_from(["s", "t"])
    consumers = {}
    for u, v in edges:
        consumers.setdefault(u, set()).add(v)
    for k, (per_byte, latency) in enumerate(levels):
        for i in range(n):
            y = ("y", i, k)
            g.add_node(y)
            d = c[i, sel[k + 1]] - c[i, sel[k]]
            if d > 0:
                g.add_edge("s", y, capacity=float(d))  # paid when layer i is beyond level k
            elif d < 0:
                g.add_edge(y, "t", capacity=float(-d))  # paid when it is not (plus the constant d)
            if k + 1 < len(levels):
                g.add_edge(y, ("y", i, k + 1))  # infinite: beyond level k+1 implies beyond level k
        for u, vs in consumers.items():
            for v in vs:
                if u >= 0:
                    g.add_edge(("y", v, k), ("y", u, k))  # infinite: consumer never before its producer
            cap = per_byte * (inb if u < 0 else b[u])
            if cap > 0:
                x = ("x", u, k)
                g.add_edge("s" if u < 0 else ("y", u, k), x, capacity=float(cap))
                for v in vs:
                    g.add_edge(x, ("y", v, k))  # infinite: x is beyond the level if any consumer is
        if latency > 0:
            g.add_edge("s", ("z", k), capacity=float(latency))
            for i in range(n):
                g.add_edge(("z", k), ("y", i, k))
    return g


def dag_min_cut(compute_ms, out_bytes, input_bytes, edges, topo: Topology, *, devices=None, peak=None,
                memory_limits=None) -> SplitResult:
    """Exact min-cut split of a DAG (``edges``: (producer, consumer), producer -1 = input) over ``devices``.

    ``devices``: names or indices on the path, in path order (default: all of it; two for the DADS split).
    Unselected path devices relay. Returns the assignment evaluated by ``solvers.path_latency``.
    """
    c, b, inb = check_costs(compute_ms, out_bytes, input_bytes, topo)
    n = c.shape[0]
    e = check_edges(edges, n)
    check_peak(peak, memory_limits)
    path = chain_path(topo)
    sel = list(path) if devices is None else [device_index(topo, d) for d in devices]
    if not sel or any(d not in path for d in sel) or [path.index(d) for d in sel] != sorted({path.index(d) for d in sel}):
        raise ValueError(f"devices {devices!r} must be distinct devices of the path {list(path)}, in path order")
    levels = _levels(topo, sel, path)
    label = np.zeros(n, dtype=int)
    if levels:
        _, (_, beyond) = nx.minimum_cut(_graph(c, b, inb, e, sel, levels), "s", "t")
        for node in beyond:
            if node[0] == "y":
                label[node[1]] += 1
    a = np.array(sel, dtype=int)[label]
    return path_latency(a, c, b, inb, topo, edges=e, peak=peak, memory_limits=memory_limits, method="dag_min_cut")
