"""The chosen Auto-Split configuration as deployable parts: the edge part quantized and packed, the cloud in float.

``write_parts(net, ranges, solution, directory, topo)`` writes

* ``<edge>.npz``: for every edge unit i, ``i/w_packed`` (uint8: the symmetric codes plus 2^(b-1) - 1, packed at
  b bits by ``packing.pack``), ``i/w_scale`` float32[C_out], or ``i/w_f16`` at 16 bits; ``i/b`` float32 bias;
  ``i/act_range`` float32[2] (lo, hi) of its output quantizer;
* ``<cloud>.npz``: ``i/w``, ``i/b`` float32 for the cloud units;
* ``manifest.json``: the split, each unit (name, kind, stride, ReLU6, inputs, output shape, device, weight and
  activation bits, the shape of its weights) and the tensors sent with their bits and packed bytes.

``load_parts(directory)`` reads them back into a ``FoldedNet`` whose edge weights are the dequantized codes,
with the activation bits and ranges to run it by (``network.forward`` with weight bits 0).
"""
from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np

from jmsnas import safeio
from jmsnas.quant import network, solver
from jmsnas.quant.packing import pack, transmitted_bytes, unpack
from jmsnas.quant.quantizers import weight_codes
from jmsnas.split.solvers import chain_path

INPUT_BITS = 8  # bits per value of the raw input sent by a split at 0 (as solver.build_problem's default)


def write_parts(net: network.FoldedNet, ranges, sol: solver.Solution, directory: str, topo,
                source: str | None = None) -> dict:
    """Writes the edge (quantized) and cloud (float) parts of split ``sol`` into ``directory``; returns the manifest.
    ``source``: the run directory the network came from (recorded as ``source``: where a pipeline takes its test
    images)."""
    path = chain_path(topo)
    edge, cloud = topo.devices[path[0]].name, topo.devices[path[-1]].name
    n = sol.split
    e, c, units = {}, {}, []
    for i, (u, p) in enumerate(zip(net.units, net.params)):
        w = np.asarray(p["w"], np.float32)
        entry = {"name": u.name, "kind": u.kind, "stride": u.stride, "relu6": u.relu6, "inputs": list(u.inputs),
                 "out_shape": list(u.out_shape), "w_shape": list(w.shape), "device": edge if i < n else cloud,
                 "weight_bits": None, "act_bits": None}
        if i < n:
            wb, ab = sol.wbits[i], sol.abits[i]
            entry.update(weight_bits=wb, act_bits=ab)
            e.update({f"{i}/{k}": v for k, v in pack_weight(w, wb).items()})
            e[f"{i}/b"] = np.asarray(p["b"], np.float32)
            e[f"{i}/act_range"] = np.asarray(ranges[i], np.float32)
        else:
            c[f"{i}/w"], c[f"{i}/b"] = w, np.asarray(p["b"], np.float32)
        units.append(entry)
    def tensor(j):  # j = -1 is the raw input (split 0: the camera's pixels, at solver.INPUT_BITS)
        shape, bits = (net.input_shape, INPUT_BITS) if j < 0 else (net.units[j].out_shape, sol.abits[j])
        return {"tensor": j, "bits": bits, "bytes": transmitted_bytes(int(np.prod(shape)), bits)}
    sent = [tensor(j) for j in solver.crossing_of(tuple(network.net_spec(net).edges()), len(net.units), n)]
    manifest = {"model": net.name, "split": n, "edge": edge, "cloud": cloud, "input_shape": list(net.input_shape),
                "units": units, "sent": sent, "files": {edge: f"{edge}.npz", cloud: f"{cloud}.npz"},
                "source": None if source is None else os.path.abspath(source)}
    with safeio.write_errors(f"the parts to {directory!r}"):
        safeio.npz_folder(directory, {edge: e, cloud: c}, manifest)
    return manifest


def read_parts(directory: str) -> tuple:
    """(manifest, edge arrays, cloud arrays) as ``write_parts`` wrote them (``safeio``: size caps, files inside the
    folder only); ValueError (one line) for a missing or damaged file."""
    m = safeio.read_json(os.path.join(directory, "manifest.json"), "parts manifest")
    return m, *(safeio.load_npz(safeio.child_path(directory, m["files"][m[d]][:-4], ".npz", "part file"),
                                "part file") for d in ("edge", "cloud"))


def load_parts(directory: str):
    """(FoldedNet with dequantized edge weights, abits int32[U], ranges float32[U, 2]) from ``write_parts``."""
    m, e, c = read_parts(directory)
    params = []
    abits = np.zeros(len(m["units"]), np.int32)
    ranges = np.zeros((len(m["units"]), 2), np.float32)
    for i, u in enumerate(m["units"]):
        if u["device"] == m["edge"]:
            params.append({"w": edge_weight(e, i, u, np), "b": e[f"{i}/b"]})
            abits[i], ranges[i] = u["act_bits"], e[f"{i}/act_range"]
        else:
            params.append({"w": c[f"{i}/w"], "b": c[f"{i}/b"]})
    net = network.FoldedNet(m["model"], units(m), tuple({k: jnp.asarray(v) for k, v in p.items()} for p in params),
                            tuple(m["input_shape"]))
    return net, abits, ranges


def units(m: dict) -> tuple:
    """The manifest's units as ``network.Unit``s."""
    return tuple(network.Unit(u["name"], u["kind"], u["stride"], u["relu6"], tuple(u["inputs"]), tuple(u["out_shape"]))
                 for u in m["units"])


def pack_weight(w, bits: int) -> dict:
    """A weight array (output channels last) as stored at ``bits``: {"w_packed": uint8 codes + 2^(b-1) - 1 packed
    at b bits (``packing.pack``), "w_scale": float32[C_out]} for 2..8 bits, {"w_f16": float16} above;
    ``edge_weight`` reads it back."""
    w = np.asarray(w, np.float32)
    if bits > 8:
        return {"w_f16": w.astype(np.float16)}
    codes, scale = weight_codes(w, bits)
    qmax = 2 ** (bits - 1) - 1
    return {"w_packed": np.asarray(pack((np.asarray(codes) + qmax).reshape(-1).astype(np.uint8), bits)),
            "w_scale": np.asarray(scale, np.float32)}


def edge_weight(e, i: int, u: dict, xp=jnp):
    """Unit ``i``'s float32 weights from its stored edge arrays ``e`` (``u``: its manifest entry): the packed codes
    dequantized, or the float16 weights at 16 bits; ``xp`` numpy, or jax.numpy inside a program."""
    wb, shape = u["weight_bits"], tuple(u["w_shape"])
    if wb > 8:
        return e[f"{i}/w_f16"].astype(xp.float32)
    codes = xp.asarray(unpack(e[f"{i}/w_packed"], wb, int(np.prod(shape)))).astype(xp.int32) - (2 ** (wb - 1) - 1)
    return codes.reshape(shape).astype(xp.float32) * e[f"{i}/w_scale"]
