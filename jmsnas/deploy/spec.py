"""The search space as JSON: what a run's ``parts/manifest.json`` records so that its parts can be rebuilt.

``space_to_dict(space)`` writes the topology (every device profile and link with its fields, D^m) and every
layer slot (device, branch, channels, spatial size, stride); ``space_from_dict`` validates it again through
``topology.make_topology`` and returns an equal ``SearchSpace``. Only the ground floor is imported (topology,
space), so the main job can record the space without depending on the deployment code.
"""
from __future__ import annotations

from jmsnas.space import LayerSlot, SearchSpace
from jmsnas.topology import DeviceProfile, LinkProfile, Topology, TopologyError, make_topology

_SCALARS = ("image_size", "in_channels", "num_classes", "stem_channels", "stem_stride", "head_channels")


def topology_to_dict(topo: Topology) -> dict:
    """The topology's devices, links and D^m as plain JSON values (units in the field names)."""
    return {"name": topo.name, "kind": topo.kind,
            "devices": [d._asdict() for d in topo.devices],
            "links": [l._asdict() for l in topo.links],
            "layers_per_device": list(topo.layers_per_device)}


def topology_from_dict(d: dict) -> Topology:
    """Inverse of ``topology_to_dict``; the result is validated again (TopologyError names a bad value)."""
    try:
        devices = [DeviceProfile(**x) for x in d["devices"]]
        links = [LinkProfile(**x) for x in d["links"]]
        topo = make_topology(d["name"], devices, links, tuple(d["layers_per_device"]))
    except (KeyError, TypeError) as e:
        raise TopologyError(f"the recorded topology is malformed: {type(e).__name__}: {e}") from None
    if topo.kind != d.get("kind", topo.kind):
        raise TopologyError(f"the recorded topology says kind {d['kind']!r} but its links form a {topo.kind!r}")
    return topo


def space_to_dict(space: SearchSpace) -> dict:
    """Everything that fixes the network's shapes: topology, layer slots and the stem/head sizes."""
    out = {k: int(getattr(space, k)) for k in _SCALARS}
    out["topology"] = topology_to_dict(space.topology)
    out["layers"] = [{k: int(v) for k, v in s._asdict().items()} for s in space.layers]
    return out


def space_from_dict(d: dict) -> SearchSpace:
    """Inverse of ``space_to_dict`` (ValueError / TopologyError name what is missing or bad)."""
    missing = [k for k in (*_SCALARS, "topology", "layers") if k not in d]
    if missing:
        raise ValueError(f"the recorded space lacks {missing}")
    topo = topology_from_dict(d["topology"])
    try:
        layers = tuple(LayerSlot(**s) for s in d["layers"])
    except TypeError as e:
        raise ValueError(f"the recorded space has a malformed layer slot: {e}") from None
    for s in layers:
        if not 0 <= s.device < topo.num_devices:
            raise ValueError(f"layer {s.index} names device index {s.device}; the topology has "
                             f"{topo.num_devices} devices")
    return SearchSpace(topo, layers, *(int(d[k]) for k in _SCALARS))
