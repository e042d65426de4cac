"""The topology types: devices, links, shared buses and the validated Topology (paper 003, section III).

Units are in the field names: compute in GFLOP/s, memory in bytes, bandwidth in Mbit/s, latency in ms.

Three topology kinds are supported:

* ``chain``: UE -> M-2 edge devices -> cloud (Fig. 2(a)); device m sends the output of its last layer d(m)
  to device m+1 over one link, eq. (1).
* ``mesh``: a chain part C and a tree part T with root r (Fig. 2(b)). The devices before r form a chain, r runs
  its layers and forwards its output to every branch device, the branches run in parallel, and the next chain
  device (the aggregator) merges their outputs; devices after the aggregator form a chain again, eq. (2).

The structure is inferred from the link graph and validated: cycles, unconnected devices, several sources,
bad bandwidths and names are rejected with an error naming the offending value.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import networkx as nx

from jmsnas.safeio import name_problem, short  # a leaf: imports nothing of jmsnas


class TopologyError(ValueError):
    """An invalid device, link or topology description."""


class DeviceProfile(NamedTuple):
    """One compute node.

    Attributes:
      name: unique device name.
      peak_gflops: peak compute throughput in GFLOP/s (2 FLOPs = 1 multiply-add).
      memory_bytes: memory available for weights and activations, in bytes.
      mem_bandwidth_gbs: memory bandwidth in GB/s (used by the roofline cost model).
      efficiency: fraction of the peak that small convolution layers reach in practice (0, 1].
      layer_overhead_ms: fixed cost per executed layer in ms (kernel launch, framework dispatch).
      note: where the figures come from.
      active_power_w: power drawn while the device computes, in W (so its compute energy in mJ is W x busy ms);
        None: not known (its energy is not reported, and cannot be limited).
      energy_budget_mj: the most energy the device may spend on one inference (compute and its radios), in mJ;
        None: no limit.
      quantize: whether the composed search quantizes the weights of the layers this device runs
        (``jmsnas.compose.choices.make_choices``); None: not given (every device but the last in execution order).
    """

    name: str
    peak_gflops: float
    memory_bytes: float
    mem_bandwidth_gbs: float = 25.0
    efficiency: float = 0.3
    layer_overhead_ms: float = 0.0
    note: str = ""
    active_power_w: float | None = None
    energy_budget_mj: float | None = None
    quantize: bool | None = None


class LinkProfile(NamedTuple):
    """A directed link from device ``src`` to device ``dst``.

    Attributes:
      bandwidth_mbps: capacity in Mbit/s (10^6 bit/s).
      latency_ms: fixed per-transfer latency in ms, added to bytes*8/bandwidth.
      wireless: True for a radio link, False for a wired one (informational).
      tx_power_w / rx_power_w: power the sender's / the receiver's interface draws while a tensor is on the link,
        in W, charged to that device for the airtime bytes*8 / bandwidth (the fixed latency is not airtime);
        None: not known (the link's energy is not reported).
    """

    src: str
    dst: str
    bandwidth_mbps: float
    latency_ms: float = 0.0
    wireless: bool = False
    tx_power_w: float | None = None
    rx_power_w: float | None = None


def transfer_ms(num_bytes, bandwidth_mbps, latency_ms=0.0):
    """Communication latency in ms of ``num_bytes`` over a link: bytes*8 / (Mbit/s * 1e3) + fixed latency."""
    return num_bytes * 8.0 / (bandwidth_mbps * 1e3) + latency_ms


class BusGroup(NamedTuple):
    """Links that share one medium of ``bandwidth_mbps`` Mbit/s (e.g. SplitNets' 1.2 Gbit/s sensor bus).

    Attributes:
      name: unique bus name.
      bandwidth_mbps: the bus capacity in Mbit/s, shared by all its links.
      links: the links on the bus as ``(src, dst)`` device-name pairs, in file order.
    """

    name: str
    bandwidth_mbps: float
    links: tuple

    def share_mbps(self) -> float:
        """Mbit/s each link gets when all of the bus's links transmit at once (an equal share)."""
        return self.bandwidth_mbps / len(self.links)


class Topology(NamedTuple):
    """A validated device graph with its chain/mesh structure and the layers each device may run (D^m).

    Device indices follow ``devices``. ``pre`` are the chain devices before the root (mesh) or all devices
    (chain); ``root``/``branches``/``post`` are empty or -1 for a chain. ``post[0]`` is the aggregator.
    A star has no ``pre`` and no root (-1); its ``branches`` are the source devices (sensors).
    ``link_index(a, b)`` gives the position of link a->b in ``links``; ``buses`` the shared-bus groups.
    """

    name: str
    kind: str
    devices: tuple
    links: tuple
    layers_per_device: tuple
    pre: tuple
    root: int
    branches: tuple
    post: tuple
    buses: tuple = ()

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def device_names(self) -> tuple:
        return tuple(d.name for d in self.devices)

    @property
    def link_names(self) -> tuple:
        return tuple(f"{l.src}->{l.dst}" for l in self.links)

    def link_index(self, src: int, dst: int) -> int:
        a, b = self.devices[src].name, self.devices[dst].name
        for i, l in enumerate(self.links):
            if l.src == a and l.dst == b:
                return i
        raise TopologyError(f"no link {a}->{b} in topology {self.name!r}")

    def path_order(self) -> tuple:
        """Devices in execution order (mesh branches in their listed order)."""
        if self.kind in ("chain", "cluster"):
            return self.pre
        if self.kind == "star":
            return self.branches + self.post
        return self.pre + (self.root,) + self.branches + self.post

    def bus_of(self, link: int):
        """The BusGroup that link number ``link`` belongs to, or None."""
        pair = (self.links[link].src, self.links[link].dst)
        return next((b for b in self.buses if pair in b.links), None)


def _check_number(what: str, value, *, positive: bool = True, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TopologyError(f"{what} must be a number, got {value!r}")
    if math.isnan(value) or math.isinf(value):
        raise TopologyError(f"{what} must be finite, got {value!r}")
    if positive and (value < 0 or (value == 0 and not allow_zero)):
        raise TopologyError(f"{what} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def _validate_device(d: DeviceProfile) -> None:
    if name_problem(d.name):  # a device's name names its files (parts/<name>.npz, ...)
        raise TopologyError(f"device name {name_problem(d.name)}, got {short(d.name)}")
    _check_number(f"device {d.name!r} peak_gflops", d.peak_gflops)
    _check_number(f"device {d.name!r} memory_bytes", d.memory_bytes)
    _check_number(f"device {d.name!r} mem_bandwidth_gbs", d.mem_bandwidth_gbs)
    _check_number(f"device {d.name!r} efficiency", d.efficiency)
    _check_number(f"device {d.name!r} layer_overhead_ms", d.layer_overhead_ms, allow_zero=True)
    for what in ("active_power_w", "energy_budget_mj"):
        if getattr(d, what) is not None:
            _check_number(f"device {d.name!r} {what}", getattr(d, what), allow_zero=what == "active_power_w")
    if d.energy_budget_mj is not None and d.active_power_w is None:
        raise TopologyError(f"device {d.name!r} has an energy_budget_mj but no active_power_w: its energy is unknown")
    if d.efficiency > 1:
        raise TopologyError(f"device {d.name!r} efficiency must be in (0, 1], got {d.efficiency!r}")


def _validate_link(l: LinkProfile, names: set) -> None:
    for end in (l.src, l.dst):
        if end not in names:
            raise TopologyError(f"link {l.src}->{l.dst} names unknown device {end!r}; known: {sorted(names)}")
    if l.src == l.dst:
        raise TopologyError(f"link {l.src}->{l.dst} is a self-loop")
    _check_number(f"link {l.src}->{l.dst} bandwidth_mbps", l.bandwidth_mbps)
    _check_number(f"link {l.src}->{l.dst} latency_ms", l.latency_ms, allow_zero=True)
    for what in ("tx_power_w", "rx_power_w"):
        if getattr(l, what) is not None:
            _check_number(f"link {l.src}->{l.dst} {what}", getattr(l, what), allow_zero=True)


def _validate_buses(buses, pairs) -> tuple:
    out, seen = [], {}
    for b in buses:
        b = BusGroup(b[0], b[1], tuple(tuple(p) for p in b[2]))
        if not isinstance(b.name, str) or not b.name or b.name in {o.name for o in out}:
            raise TopologyError(f"bus name must be a unique non-empty string, got {b.name!r}")
        _check_number(f"bus {b.name!r} bandwidth_mbps", b.bandwidth_mbps)
        if not b.links:
            raise TopologyError(f"bus {b.name!r} has no links")
        for p in b.links:
            if p not in pairs:
                raise TopologyError(f"bus {b.name!r} names link {'->'.join(map(str, p))} which is not a link of the "
                                    f"topology; links: {['->'.join(q) for q in pairs]}")
            if p in seen:
                raise TopologyError(f"link {'->'.join(p)} is on two buses: {seen[p]!r} and {b.name!r}")
            seen[p] = b.name
        out.append(b)
    return tuple(out)


def _validate_devices_and_links(devices, links) -> tuple:
    """Every device and link valid, names unique, no link twice; returns (device names, (src, dst) pairs)."""
    for d in devices:
        _validate_device(d)
    names = [d.name for d in devices]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise TopologyError(f"duplicate device names: {dup}")
    for l in links:
        _validate_link(l, set(names))
    pairs = [(l.src, l.dst) for l in links]
    if len(set(pairs)) != len(pairs):
        raise TopologyError(f"duplicate links among {pairs}")
    return names, pairs


def make_topology(name: str, devices: Sequence[DeviceProfile], links: Sequence[LinkProfile],
                  layers_per_device: Sequence[int], buses: Sequence[BusGroup] = ()) -> Topology:
    """Builds and validates a chain, mesh or star topology; the kind is inferred from the link graph."""
    devices, links = tuple(devices), tuple(links)
    if len(devices) < 1:
        raise TopologyError("a topology needs at least one device")
    names, pairs = _validate_devices_and_links(devices, links)
    buses = _validate_buses(buses, pairs)
    lpd = tuple(layers_per_device)
    if len(lpd) != len(devices):
        raise TopologyError(f"layers_per_device has {len(lpd)} entries {list(lpd)} but there are "
                            f"{len(devices)} devices {names}")
    for n, k in zip(names, lpd):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise TopologyError(f"layers_per_device for device {n!r} must be an integer >= 1, got {k!r}")

    g = nx.DiGraph()
    g.add_nodes_from(names)
    g.add_edges_from(pairs)
    try:
        cycle = nx.find_cycle(g)
        raise TopologyError(f"topology {name!r} has a cycle: {' -> '.join(e[0] for e in cycle)} -> {cycle[0][0]}")
    except nx.NetworkXNoCycle:
        pass
    if len(devices) > 1:
        isolated = [n for n in names if g.degree(n) == 0]
        if isolated:
            raise TopologyError(f"device(s) {isolated} are not connected to any other device")
        if not nx.is_weakly_connected(g):
            parts = [sorted(c) for c in nx.weakly_connected_components(g)]
            raise TopologyError(f"topology {name!r} is not connected: components {parts}")
    sources = [n for n in names if g.in_degree(n) == 0]
    sinks = [n for n in names if g.out_degree(n) == 0]
    if len(sinks) != 1:
        raise TopologyError(f"topology {name!r} needs exactly one sink device (the cloud), got {sinks}")
    idx = {n: i for i, n in enumerate(names)}
    order = list(nx.topological_sort(g))
    if len(sources) > 1:
        return _star(name, g, devices, links, lpd, sources, idx, order, buses)
    if len(sources) != 1:
        raise TopologyError(f"topology {name!r} needs exactly one source device (the UE), got {sources}")
    forks = [n for n in names if g.out_degree(n) > 1]
    if not forks:
        if any(g.in_degree(n) > 1 for n in names):
            raise TopologyError(f"topology {name!r}: a device merges several inputs without a fork")
        return Topology(name, "chain", devices, links, lpd, tuple(idx[n] for n in order), -1, (), (), buses)
    if len(forks) > 1:
        raise TopologyError(f"topology {name!r}: only one tree root may fork, got {forks}")
    root = forks[0]
    branches = list(g.successors(root))
    aggs = {s for b in branches for s in g.successors(b)}
    bad = [b for b in branches if g.in_degree(b) != 1 or g.out_degree(b) != 1]
    if bad or len(aggs) != 1:
        raise TopologyError(f"topology {name!r}: every branch device of root {root!r} must have one input "
                            f"(the root) and one output (the aggregator); offending: {bad or sorted(aggs)}")
    agg = aggs.pop()
    if g.in_degree(agg) != len(branches):
        raise TopologyError(f"topology {name!r}: aggregator {agg!r} must receive exactly the branches {branches}")
    pos = {n: i for i, n in enumerate(order)}
    pre = [n for n in order if pos[n] < pos[root]]
    post = [n for n in order if pos[n] >= pos[agg]]
    branches = sorted(branches, key=lambda b: idx[b])
    for seq in (pre + [root], post):
        for a, b in zip(seq, seq[1:]):
            if not g.has_edge(a, b):
                raise TopologyError(f"topology {name!r}: chain devices {a!r} and {b!r} are not linked in order")
    return Topology(name, "mesh", devices, links, lpd, tuple(idx[n] for n in pre), idx[root],
                    tuple(idx[b] for b in branches), tuple(idx[n] for n in post), buses)


def _star(name, g, devices, links, lpd, sources, idx, order, buses) -> Topology:
    """Several sources that each send to one aggregator, then a chain (the caller checked: acyclic, one sink)."""
    aggs = sorted({s for src in sources for s in g.successors(src)})
    bad = [s for s in sources if g.out_degree(s) != 1]
    if bad or len(aggs) != 1:
        raise TopologyError(f"topology {name!r} has several sources {sources}: each must send to one common "
                            f"aggregator (a star of sensors); offending: {bad or aggs}")
    agg = aggs[0]
    if g.in_degree(agg) != len(sources):
        raise TopologyError(f"topology {name!r}: aggregator {agg!r} must receive exactly the sources {sources}")
    post = [n for n in order if n not in sources]
    for a, b in zip(post, post[1:]):
        if not g.has_edge(a, b) or g.out_degree(a) != 1 or g.in_degree(b) != 1:
            raise TopologyError(f"topology {name!r}: devices after aggregator {agg!r} must form a chain; "
                                f"{a!r} and {b!r} are not linked in order")
    return Topology(name, "star", devices, links, lpd, (), -1, tuple(sorted(idx[s] for s in sources)),
                    tuple(idx[n] for n in post), buses)


def chain(name: str, devices: Sequence[DeviceProfile], bandwidths_mbps: Sequence[float],
          layers_per_device: Sequence[int], *, latencies_ms: Sequence[float] | None = None,
          wireless: Sequence[bool] | None = None) -> Topology:
    """A chain devices[0] -> devices[1] -> ... with one bandwidth (Mbit/s) per consecutive pair."""
    devices = tuple(devices)
    if len(bandwidths_mbps) != len(devices) - 1:
        raise TopologyError(f"a chain of {len(devices)} devices needs {len(devices) - 1} bandwidths, "
                            f"got {list(bandwidths_mbps)}")
    lat = latencies_ms or [0.0] * len(bandwidths_mbps)
    wl = wireless or [False] * len(bandwidths_mbps)
    links = [LinkProfile(a.name, b.name, bw, la, w)
             for a, b, bw, la, w in zip(devices, devices[1:], bandwidths_mbps, lat, wl)]
    return make_topology(name, devices, links, layers_per_device)


def cluster(name: str, devices: Sequence[DeviceProfile], links: Sequence[LinkProfile]) -> Topology:
    """A fully connected cluster of G >= 2 peers (kind ``"cluster"``, the separable networks of paper 004): every
    ordered pair of devices has a link, so any node can send to any other. Cycles are the point here, which is why
    this is not a chain or mesh of ``make_topology``. ``pre`` lists the devices in order; one layer slot each."""
    devices, links = tuple(devices), tuple(links)
    if len(devices) < 2:
        raise TopologyError(f"a cluster needs at least 2 devices, got {len(devices)}")
    names, pairs = _validate_devices_and_links(devices, links)
    missing = [f"{a}->{b}" for a in names for b in names if a != b and (a, b) not in pairs]
    if missing:
        raise TopologyError(f"cluster {name!r} must link every ordered pair of devices; missing links {missing}")
    return Topology(name, "cluster", devices, links, (1,) * len(devices), tuple(range(len(devices))), -1, (), ())
