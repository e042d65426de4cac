"""The separable run's final network as per-device parts (``run.directory.write_parts``: atomic, process 0).

``parts/<device>.npz`` holds group g's blocks (every block leaf without its group axis) on device g, plus the stem
on the input device and the head on the output device; ``parts/manifest.json`` records the network's spec
(``network.NetSpec``), the decisions the weights were fine-tuned for (perm_ids, levels: int[S]), the devices
(group g runs on ``devices[g]``) and the cluster's links (Mbit/s, latency ms). ``read_parts`` gives back exactly
the params ``network.apply`` takes.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np

from jmsnas.run import directory
from jmsnas.separable import network as net


class Stored(NamedTuple):
    """A separable run's stored network: spec, params (``network.init``'s tree), perm_ids/levels int32[S], devices
    (group g on devices[g]), input_device (index), links [{"src", "dst", "bandwidth_mbps", "latency_ms"}]."""

    spec: net.NetSpec
    params: dict
    perm_ids: np.ndarray
    levels: np.ndarray
    devices: list
    input_device: int
    links: list


def write_parts(workdir: str, spec: net.NetSpec, params, perm_ids, levels, topo, input_device: int,
                arm: str = "controller") -> dict:
    """Writes ``params`` (``network.init``'s tree) of the decisions ``perm_ids``/``levels`` as G parts, group g on
    ``topo``'s device g."""
    params, devices = jax.device_get(params), list(topo.device_names)
    parts = {}
    for g, dev in enumerate(devices):
        p = {"blocks": {str(i): {k: np.asarray(v[g]) for k, v in b.items()} for i, b in enumerate(params["blocks"])}}
        if g == input_device:
            p["stem"] = params["stem"]
        if g == spec.output_group:
            p["head"] = params["head"]
        parts[dev] = {"params": p, "bn": {}, "group": g}
    sep = {"spec": {**spec._asdict(), "blocks": [list(b) for b in spec.blocks]},
           "perm_ids": [int(v) for v in perm_ids], "levels": [int(v) for v in levels], "arm": arm,
           "devices": devices, "input_device": int(input_device),
           "links": [{"src": l.src, "dst": l.dst, "bandwidth_mbps": float(l.bandwidth_mbps),
                      "latency_ms": float(l.latency_ms)} for l in topo.links]}
    return directory.write_parts(workdir, parts, {"separable": sep})


def read_parts(run: str) -> tuple:
    """The ``Stored`` network of a separable run's parts;
    ``directory.RunDirError`` (one line) for a part missing or not of that network."""
    pm = directory.read_manifest(run)
    sep = pm.get("separable")
    if not isinstance(sep, dict):
        raise directory.RunDirError(f"{run}/parts/manifest.json is not a separable network's")
    try:
        s = dict(sep["spec"])
        spec = net.NetSpec(**{**s, "blocks": tuple(net.BlockShape(*b) for b in s["blocks"]),
                              "nsend": tuple(tuple(n) for n in s["nsend"])})
        devices, inp = list(sep["devices"]), int(sep["input_device"])
        trees = {d: directory.unflatten(directory.read_part(run, d, pm["devices"][d])).get("params", {})
                 for d in devices}
        blocks = [{k: np.stack([np.asarray(trees[d]["blocks"][str(i)][k]) for d in devices])
                   for k in trees[devices[0]]["blocks"][str(i)]} for i in range(spec.num_blocks)]
        params = {"stem": trees[devices[inp]]["stem"], "blocks": blocks, "head": trees[devices[spec.output_group]]["head"]}
        return Stored(spec, params, np.asarray(sep["perm_ids"], np.int32), np.asarray(sep["levels"], np.int32),
                      devices, inp, list(sep["links"]))
    except (KeyError, TypeError, ValueError, IndexError) as e:
        if isinstance(e, directory.RunDirError):
            raise
        raise directory.RunDirError(f"{run}/parts: the separable network's parts do not match its manifest "
                                    f"({type(e).__name__}: {e})") from None
