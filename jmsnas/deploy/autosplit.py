"""Auto-Split's chosen configuration (``jmsnas autosplit --write-parts DIR``, ``quant.parts``) as deployable parts.

``export_autosplit(parts_dir)`` writes ``DIR/export/`` in the deploy format (``runtime.FORMAT``), a 2-device chain
edge -> cloud that ``jmsnas pipeline`` / ``run_pipeline`` runs like any other export:

* the edge program takes its weights as stored — every unit's codes packed at its weight bit width
  (``i/w_packed`` + per-channel ``i/w_scale``, or ``i/w_f16`` at 16 bits), its bias and the calibrated range of its
  output — unpacks and dequantizes them inside the program, runs the edge units with every output
  fake-quantized at its activation bit width, and returns the tensors that cross the split as their codes packed
  at their bit widths (``packing.pack``; 16 bits: float16, 32/float: float32 bytes), one uint8[B, bytes] row per
  image, tensors concatenated in the manifest's ``sent`` order. The link therefore carries ceil(elements * b / 8)
  bytes per tensor plus the frame's header;
* the cloud program takes the cloud units' float weights and the sent tensors' ranges, unpacks the codes
  (``packing.unpack``), dequantizes them (``quantizers.act_dequant``: bit for bit what the fake-quantized network
  computes) and runs the cloud units in float to the logits.

``fake_quant_reference(parts_dir)`` is the whole network as Auto-Split evaluates it (``quant.network.forward`` on
the dequantized weights with the stored activation bits), what the deployed outputs are checked against;
``eval_images(parts_dir, n)`` are the images ``jmsnas pipeline --workdir PARTS`` streams: the test split of the run
the parts came from (``source`` in their manifest), else standard normal ones without labels.
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import export as jax_export

from jmsnas.deploy.runtime import FORMAT, MANIFEST, DeployError, export_versions
from jmsnas.quant import network, parts as qparts
from jmsnas.quant.packing import pack, unpack
from jmsnas.quant.quantizers import act_codes, act_dequant, fake_quant_act
from jmsnas.topology import presets

KEYS = ("model", "split", "edge", "cloud", "input_shape", "units", "sent", "files")


def is_autosplit(directory: str) -> bool:
    """Whether ``directory`` holds Auto-Split parts (its manifest.json has the keys ``quant.parts`` writes)."""
    try:
        with open(os.path.join(directory, MANIFEST), encoding="utf-8") as f:
            m = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(m, dict) and all(k in m for k in KEYS)


def encode_rows(y, lo, hi, bits: int):
    """uint8[B, bytes]: tensor y float32[B, ...] as sent at ``bits`` (1..8 packed codes, 16 float16, else float32)."""
    flat = y.reshape(y.shape[0], -1)
    if 1 <= bits <= 8:
        return pack(act_codes(flat, lo, hi, bits), bits)
    dt = jnp.float16 if bits == 16 else jnp.float32
    return jax.lax.bitcast_convert_type(flat.astype(dt), jnp.uint8).reshape(flat.shape[0], -1)


def decode_rows(row, lo, hi, bits: int, shape: tuple):
    """The receiver's float32[B, *shape] from ``encode_rows``'s bytes (dequantized codes, or the float values)."""
    n = int(np.prod(shape))
    if 1 <= bits <= 8:
        y = act_dequant(unpack(row, bits, n), lo, hi, bits)
    else:
        dt, k = (jnp.float16, 2) if bits == 16 else (jnp.float32, 4)
        y = jax.lax.bitcast_convert_type(row.reshape(row.shape[0], n, k), dt).astype(jnp.float32)
    return y.reshape((row.shape[0],) + tuple(shape))


def sent_bytes(m: dict) -> list:
    """Bytes per image of every sent tensor, in ``sent`` order (the manifest's ``bytes``)."""
    return [int(s["bytes"]) for s in m["sent"]]


def edge_forward(m: dict):
    """f(edge weights dict, x) -> uint8[B, sum(sent bytes)]: the edge part (see the module docstring)."""
    units, n = qparts.units(m), int(m["split"])

    def f(w, x):
        outs = {-1: x}
        pre = {}
        for i in range(n):
            weight = qparts.edge_weight(w, i, m["units"][i])
            lo, hi = w[f"{i}/act_range"][0], w[f"{i}/act_range"][1]
            pre[i] = network.unit_output(units[i], {"w": weight, "b": w[f"{i}/b"]}, outs, "xla")  # no custom calls
            outs[i] = fake_quant_act(pre[i], lo, hi, int(m["units"][i]["act_bits"]))
        rows = [encode_rows(pre[s["tensor"]], w[f"{s['tensor']}/act_range"][0], w[f"{s['tensor']}/act_range"][1],
                        int(s["bits"])) for s in m["sent"]]
        return jnp.concatenate(rows, axis=-1)
    return f


def cloud_forward(m: dict):
    """f(cloud weights dict, packed uint8[B, bytes]) -> logits: the cloud part (see the module docstring)."""
    units, n = qparts.units(m), int(m["split"])

    def f(w, packed):
        outs, at = {}, 0
        for s, nbytes in zip(m["sent"], sent_bytes(m)):
            j = int(s["tensor"])
            r = w[f"sent/{j}/act_range"]
            outs[j] = decode_rows(packed[:, at:at + nbytes], r[0], r[1], int(s["bits"]), units[j].out_shape)
            at += nbytes
        for i in range(n, len(units)):
            outs[i] = network.unit_output(units[i], {"w": w[f"{i}/w"], "b": w[f"{i}/b"]}, outs, "xla")
        return outs[len(units) - 1]
    return f


def _export(fn, weights: dict, arg) -> tuple:
    names = sorted(weights)

    def call(*args):
        return fn(dict(zip(names, args[:len(names)])), args[len(names)])
    specs = [jax.ShapeDtypeStruct(weights[k].shape, weights[k].dtype) for k in names] + [arg]
    return names, call, specs


def export_autosplit(parts_dir: str, out: str | None = None, *, platforms=("cpu",), batch: int = 1,
                     bandwidth_mbps: float | None = None, latency_ms: float = 0.0) -> dict:
    """Writes ``out`` (default ``PARTS/export``) as the module docstring says; returns its manifest. The link's
    bandwidth defaults to the ``autosplit`` preset's edge -> cloud link."""
    from jmsnas.deploy.export import check_export_args, check_out, write_export
    platforms = check_export_args(platforms, batch)
    out = os.path.join(parts_dir, "export") if out is None else out
    if not is_autosplit(parts_dir):
        raise DeployError(f"{parts_dir} holds no Auto-Split parts (manifest.json with {list(KEYS)})")
    check_out(None, out)  # the export replaces the whole folder: only an earlier one
    m, edge_w, cloud_w = qparts.read_parts(parts_dir)
    e, c = m["edge"], m["cloud"]
    cloud_w = dict(cloud_w)
    for s in m["sent"]:
        cloud_w[f"sent/{s['tensor']}/act_range"] = edge_w[f"{s['tensor']}/act_range"]
    total = sum(sent_bytes(m))
    image = jax.ShapeDtypeStruct((batch,) + tuple(m["input_shape"]), jnp.float32)
    wire = jax.ShapeDtypeStruct((batch, total), jnp.uint8)
    programs, parts, conventions = {}, {}, set()
    for dev, fn, w, arg, src, to in ((e, edge_forward(m), edge_w, image, "image", [c]),
                                     (c, cloud_forward(m), cloud_w, wire, e, ["result"])):
        names, call, specs = _export(fn, w, arg)
        exp = jax_export.export(jax.jit(call), platforms=platforms)(*specs)
        conventions.add(int(exp.calling_convention_version))
        out_aval = exp.out_avals[0]
        programs[dev] = (exp.serialize(), {k: w[k] for k in names})
        parts[dev] = {"device": dev, "layers": [i for i, u in enumerate(m["units"]) if u["device"] == dev],
                      "ops": [u["kind"] for u in m["units"] if u["device"] == dev], "stem": dev == e,
                      "head": dev == c, "weight_names": names,
                      "inputs": [{"from": src, "shape": list(arg.shape), "dtype": str(np.dtype(arg.dtype))}],
                      "output": {"shape": [int(d) for d in out_aval.shape], "dtype": str(np.dtype(out_aval.dtype))},
                      "to": to, "predicted_compute_ms": None}
    if bandwidth_mbps is None:
        link = [l for l in presets.topology("autosplit").links][0]
        bandwidth_mbps = float(link.bandwidth_mbps)
    made = export_versions(max(conventions))
    manifest = {"format": FORMAT, "system": "autosplit", "run": os.path.abspath(parts_dir),
                "platforms": list(platforms), "batch": batch, "versions": made, "kind": "chain", "order": [e, c],
                "root": None, "branches": [], "parts": parts,
                "links": [{"src": e, "dst": c, "bandwidth_mbps": float(bandwidth_mbps), "latency_ms": float(latency_ms),
                           "bytes": batch * total, "predicted_ms": None,
                           "sent": [{"tensor": s["tensor"], "bits": s["bits"], "bytes_per_image": b}
                                    for s, b in zip(m["sent"], sent_bytes(m))]}],
                "predicted_latency_ms": {}, "architecture": None}
    return write_export(out, programs, parts, manifest)


def fake_quant_reference(parts_dir: str):
    """f(images float32[B, H, W, C]) -> logits of Auto-Split's fake-quantized network (``quant.network.forward``
    on ``quant.parts.load_parts``: dequantized edge weights, stored activation bits and ranges)."""
    net, abits, ranges = qparts.load_parts(parts_dir)
    wbits = np.zeros(len(net.units), np.int32)
    fn = jax.jit(lambda x: network.forward(net.units, net.params, x, wbits, abits, ranges))
    return lambda x: np.asarray(fn(jnp.asarray(x, jnp.float32)))


def eval_images(parts_dir: str, n: int) -> tuple:
    """(images float32[n, H, W, C], labels int32[n] or None): the first n test images of the run the parts were
    cut from (the manifest's ``source``, the data Auto-Split measured its accuracy on), or, for parts that record
    no source, n standard normal images (seed 0) without labels. DeployError (one line) when the recorded run
    cannot be read or has fewer test images."""
    m, _, _ = qparts.read_parts(parts_dir)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise DeployError(f"images must be a positive number, got {n!r}")
    source = m.get("source")
    if not source:
        return np.random.default_rng(0).standard_normal((n,) + tuple(m["input_shape"])).astype(np.float32), None
    try:
        test = network.load_run(source).dataset.test
    except (ValueError, OSError) as e:
        raise DeployError(f"{parts_dir}/manifest.json names the run {source!r} as its source, which cannot be "
                          f"read for test images: {' '.join(str(e).split())}") from None
    if n > len(test.images):
        raise DeployError(f"images must be between 1 and the {len(test.images)} test images of {source!r}, got {n}")
    return np.asarray(test.images[:n], np.float32), np.asarray(test.labels[:n])
