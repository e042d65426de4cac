"""The search space as JSON: what a run's ``parts/manifest.json`` records so that its parts can be rebuilt.

``space_to_dict(space)`` writes the topology in the topology-file format (``topology.to_dict``: every device and
link with its fields, buses, D^m) and every layer slot (device, branch, channels, spatial size, stride);
``space_from_dict`` validates it again (``topology.from_dict``) and returns an equal ``SearchSpace``. Only the
ground floor is imported (topology, space), so the main job can record the space without depending on the
deployment code.
"""
from __future__ import annotations

from jmsnas import topology
from jmsnas.space import LayerSlot, SearchSpace

_SCALARS = ("image_size", "in_channels", "num_classes", "stem_channels", "stem_stride", "head_channels")


def space_to_dict(space: SearchSpace) -> dict:
    """Everything that fixes the network's shapes: topology, layer slots and the stem/head sizes."""
    out = {k: int(getattr(space, k)) for k in _SCALARS}
    out["topology"] = topology.to_dict(space.topology)
    out["layers"] = [{k: int(v) for k, v in s._asdict().items()} for s in space.layers]
    return out


def space_from_dict(d: dict) -> SearchSpace:
    """Inverse of ``space_to_dict`` (ValueError / TopologyError name what is missing or bad)."""
    missing = [k for k in (*_SCALARS, "topology", "layers") if k not in d]
    if missing:
        raise ValueError(f"the recorded space lacks {missing}")
    topo = topology.from_dict(d["topology"], "the recorded topology")
    try:
        layers = tuple(LayerSlot(**s) for s in d["layers"])
    except TypeError as e:
        raise ValueError(f"the recorded space has a malformed layer slot: {e}") from None
    for s in layers:
        if not 0 <= s.device < topo.num_devices:
            raise ValueError(f"layer {s.index} names device index {s.device}; the topology has "
                             f"{topo.num_devices} devices")
    return SearchSpace(topo, layers, *(int(d[k]) for k in _SCALARS))
