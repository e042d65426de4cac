"""Every split method on one network and one topology: roofline costs, peak memory, results as plain data.

Used by ``jmsnas split`` and the SplitNets Table 4 experiment. Costs: ``cost.roofline.net_latency_table`` on the
topology's devices at the activation bit width (weights at ``weight_bits``); a layer's output is sent as
ceil(elements * act_bits / 8) bytes; the raw image at ``input_bits`` per value (a camera's 8-bit pixels).
Peak memory: ``cost.memory.peak_memory_bytes`` (weights + activation working set) of each device's layers.

Methods (all see the network's skip connections, so a cut sends every tensor live across it, once):

* ``edge_only`` / ``cloud_only``: everything on the first / last device (memory reported, not enforced);
* ``neurosurgeon``: best single split between the first and last device, on latency alone (as published);
* ``neurosurgeon_mem``: the same restricted to splits whose two parts fit their devices' memory;
* ``chain_dp``: optimal contiguous multi-split over every device, memory limits enforced (exact);
* ``dag_min_cut``: optimal forward-only split of the DAG over every device (exact, memory not enforced).

Zoo networks have no parallel device branches, so on the mesh preset these methods use the chain
``pre + root + first branch device + post`` (``solvers.chain_path``; on a star of sensors: the first sensor, then
the aggregator's chain, each sensor's link at its share of a shared bus); ``mesh.mesh_split`` needs a ``MeshNet``.
"""
from __future__ import annotations

import math
import os
from typing import Callable, NamedTuple

import numpy as np

from jmsnas.cost import roofline
from jmsnas.cost.memory import peak_memory_bytes
from jmsnas.graph import LayerSpec, NetSpec
from jmsnas.run import directory
from jmsnas.split import dag, derived, solvers, zoo
from jmsnas.topology import Topology

METHODS = ("edge_only", "cloud_only", "neurosurgeon", "neurosurgeon_mem", "chain_dp", "dag_min_cut")


def net_from_json(obj: dict, source: str = "<json>") -> NetSpec:
    """A NetSpec from {"name", "input_shape", "layers": [{"name", "kind", "macs", "params", "out_shape",
    "inputs"}]} (``inputs`` optional: [] reads the network input)."""
    try:
        layers = tuple(LayerSpec(str(l["name"]), str(l["kind"]), int(l["macs"]), int(l["params"]),
                                 tuple(int(x) for x in l["out_shape"]), tuple(int(x) for x in l.get("inputs", ())))
                       for l in obj["layers"])
        net = NetSpec(str(obj.get("name", source)), tuple(int(x) for x in obj["input_shape"]), layers)
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"{source}: not a network description (need input_shape and layers with name, kind, "
                         f"macs, params, out_shape, inputs): {e!r}") from None
    if not layers:
        raise ValueError(f"{source}: the network has no layers")
    net.validate()
    return net


def load_net(name_or_path: str) -> NetSpec:
    """A zoo network by name, a model reference ``pkg.module:factory`` (``jmsnas.traced``: the traced layer graph
    of your own JAX model), else a JSON network file (see ``net_from_json``) or a search run's result.json (its
    derived network, ``split.derived``)."""
    if name_or_path in zoo.NAMES:
        return zoo.get(name_or_path)
    from jmsnas.traced import ref
    if ref.is_reference(name_or_path) and not os.path.isfile(name_or_path):
        from jmsnas.traced.trace import net_spec
        return net_spec(name_or_path)  # your own model, traced (docs/your_model.md)
    if not os.path.isfile(name_or_path):
        raise ValueError(f"--model {name_or_path!r} is neither a zoo network {list(zoo.NAMES)} nor a file")
    try:
        obj = directory.read_json(name_or_path, "network file")
    except (directory.RunDirError, RecursionError) as e:
        raise ValueError(f"cannot read network file {name_or_path!r}: {e}") from None
    if directory.is_result(obj):
        return derived.from_result(obj, name_or_path)[0]
    return net_from_json(obj, name_or_path)


class SplitSetup(NamedTuple):
    """Everything the solvers need for one network on one topology (shapes as in ``solvers``)."""

    net: NetSpec
    topo: Topology
    compute_ms: np.ndarray  # float[N, M]
    out_bytes: np.ndarray  # float[N]
    input_bytes: float
    edges: tuple
    peak: Callable  # peak(layer_indices) -> bytes


def make_setup(net: NetSpec, topo: Topology, *, act_bits: int = 32, weight_bits: int = 32,
               input_bits: int = 8) -> SplitSetup:
    solvers.chain_path(topo)  # TopologyError for a topology data cannot flow along (a cluster), before any method
    compute = roofline.net_latency_table(net, topo.devices, bits=act_bits, weight_bits=weight_bits)
    out_b = np.array([math.ceil(l.out_elems * act_bits / 8) for l in net.layers], dtype=float)
    inb = float(math.ceil(net.input_elems * input_bits / 8))
    edges = tuple((-1, i) if not l.inputs else (p, i) for i, l in enumerate(net.layers) for p in (l.inputs or (-1,)))
    peak = lambda layers: float(peak_memory_bytes(net, list(layers), weight_bits, act_bits))
    return SplitSetup(net, topo, compute, out_b, inb, edges, peak)


def run_method(s: SplitSetup, method: str) -> solvers.SplitResult:
    """One method's result; raises solvers.InfeasibleSplitError when memory limits cannot be met."""
    args = (s.compute_ms, s.out_bytes, s.input_bytes)
    kw = dict(edges=s.edges, peak=s.peak)
    if method == "edge_only":
        return solvers.edge_only(*args, s.topo, **kw)
    if method == "cloud_only":
        return solvers.cloud_only(*args, s.topo, **kw)
    if method == "neurosurgeon":
        return _with_memory(solvers.neurosurgeon(*args, s.topo, edges=s.edges), s)
    if method == "neurosurgeon_mem":
        return solvers.neurosurgeon(*args, s.topo, **kw)._replace(method="neurosurgeon_mem")
    if method == "chain_dp":
        return solvers.chain_dp(*args, s.topo, monotone_peak=True, **kw)
    if method == "dag_min_cut":
        return _with_memory(dag.dag_min_cut(*args, s.edges, s.topo), s)
    raise ValueError(f"unknown method {method!r}; expected one of {list(METHODS)}")


def _with_memory(r: solvers.SplitResult, s: SplitSetup) -> solvers.SplitResult:
    """Re-evaluates a result with the peak function so memory is reported (not enforced)."""
    return solvers.path_latency(r.assignment, s.compute_ms, s.out_bytes, s.input_bytes, s.topo, edges=s.edges,
                                peak=s.peak, method=r.method)


def run_all(s: SplitSetup, methods=METHODS) -> dict:
    """method -> SplitResult, or the error message when it has no feasible split."""
    out = {}
    for m in methods:
        try:
            out[m] = run_method(s, m)
        except solvers.InfeasibleSplitError as e:
            out[m] = str(e)
    return out


def ranges(r: solvers.SplitResult, topo: Topology) -> list:
    """[(device name, first layer, last layer)] for each maximal run of layers on one device."""
    out, a = [], r.assignment
    start = 0
    for i in range(1, len(a) + 1):
        if i == len(a) or a[i] != a[start]:
            out.append((topo.device_names[a[start]], start, i - 1))
            start = i
    return out


def result_json(r, s: SplitSetup) -> dict:
    """JSON-ready dict of one method's result (or {"error": message})."""
    if isinstance(r, str):
        return {"error": r}
    return {
        "latency_ms": {"total": r.total_ms, "per_device": r.per_device_ms, "per_link": r.per_link_ms},
        "assignment": [s.topo.device_names[d] for d in r.assignment],
        "ranges": [{"device": d, "first": s.net.layers[a].name, "last": s.net.layers[b].name, "layers": [a, b]}
                   for d, a, b in ranges(r, s.topo)],
        "bytes_per_link": r.per_link_bytes,
        "peak_memory_bytes": r.peak_bytes,
        "memory_limit_bytes": {d.name: d.memory_bytes for d in s.topo.devices},
        "memory_ok": r.memory_ok,
    }
