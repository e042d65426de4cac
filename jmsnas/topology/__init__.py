"""Devices, links and the topologies a network is split over (paper 003, section III; docs/topology.md).

Units are in the field names: compute in GFLOP/s, memory in bytes, bandwidth in Mbit/s, latency in ms.

* ``types``: ``DeviceProfile``, ``LinkProfile``, ``BusGroup``, the validated ``Topology`` (kinds ``chain``,
  ``mesh``, ``star``, ``cluster``) and its constructors ``make_topology``, ``chain``, ``cluster``.
* ``file``: the YAML/JSON topology-file format (``load``, ``dump``, ``to_dict``, ``from_dict``).
* ``presets``: named devices (the paper's four, SplitNets' sensor and aggregator, Auto-Split's Eyeriss and TPU)
  and named topologies (``chain``, ``mesh``, ``splitnets``, ``autosplit``).
* ``resolve(name_or_path)``: the one way from what a user types (a preset name or a topology file) to a Topology.

Layering: ``types`` imports nothing of jmsnas, ``presets`` imports ``types``, ``file`` imports both; no cycle.
"""
from __future__ import annotations

import os

from jmsnas.topology import presets
from jmsnas.topology.file import dump, from_dict, is_file_name, load, to_dict
from jmsnas.topology.types import (BusGroup, DeviceProfile, LinkProfile, Topology, TopologyError, chain, cluster,
                                   make_topology, transfer_ms)

__all__ = ["BusGroup", "DeviceProfile", "LinkProfile", "Topology", "TopologyError", "chain", "cluster",
           "make_topology", "transfer_ms", "dump", "from_dict", "is_file_name", "load", "to_dict", "presets",
           "resolve", "with_bandwidths"]


def resolve(name, layers_per_device=None, bandwidths_mbps=None) -> Topology:
    """The Topology that ``name`` names: a preset (``presets.TOPOLOGIES``) or a topology file (.yaml, .yml, .json or
    an existing file, ``load``).

    ``layers_per_device``: D^m, one entry per device; a preset uses it instead of its own, a file only when it has
    none. ``bandwidths_mbps``: None or empty to keep the links, else one value for every link or one per link in
    ``links`` order (``with_bandwidths``). Raises TopologyError (a ValueError) naming the bad value.
    """
    lpd = None if layers_per_device is None else tuple(layers_per_device)
    if isinstance(name, str) and name in presets.TOPOLOGIES:
        topo = presets.TOPOLOGIES[name]() if lpd is None else presets.TOPOLOGIES[name](lpd)
    elif is_file_name(name):
        topo = load(os.fspath(name), lpd)
    else:
        raise TopologyError(f"unknown topology {name!r}; expected a preset {sorted(presets.TOPOLOGIES)} or a "
                            "topology file (.yaml, .yml or .json)")
    return with_bandwidths(topo, bandwidths_mbps)


def with_bandwidths(topo: Topology, bandwidths_mbps=None) -> Topology:
    """``topo`` with its link bandwidths replaced (Mbit/s): None or empty keeps them, one value sets every link,
    one per link (in ``topo.links`` order) sets each."""
    if not bandwidths_mbps:
        return topo
    bws = list(bandwidths_mbps)
    if len(bws) == 1:
        bws = bws * len(topo.links)
    if len(bws) != len(topo.links):
        raise TopologyError(f"--bandwidth needs 1 or {len(topo.links)} values (links {list(topo.link_names)}), "
                            f"got {len(bws)}: {bws}")
    links = [l._replace(bandwidth_mbps=float(bw)) for l, bw in zip(topo.links, bws)]
    return make_topology(topo.name, topo.devices, links, topo.layers_per_device, topo.buses)
