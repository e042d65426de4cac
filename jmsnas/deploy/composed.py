"""A composed configuration (``jmsnas.compose.network``) as deployable parts, in the deploy format (``runtime.FORMAT``).

A composed run directory is a search run's (result.json with ``space`` and ``architecture``: op and device per
layer; parts/ by ``compose.network.write_parts``: every device's float layers and, under ``params/modules/<j>``, the
module weights of the boundaries its links cross) whose result.json adds ``compose`` (``compose.network.to_result``,
docs/composed.md). ``export_composed(run)`` writes ``RUN/export/`` (chain and mesh), one ``jax.export`` program per
device:

* weights: every layer's kernels on a quantizing device stored at its weight bits (``quant.parts.pack_weight``:
  packed codes + per-channel scale at 2..8 bits, float16 at 16) and dequantized inside the program; batch norm,
  stem, head and modules float32; a link's module weights cut to its d channels (``compose.network.module_slice``):
  the Conv-Reduce in the sender's part, the Conv-Recover in the receiver's;
* inputs: the image (first device) or, per incoming link, its wire bytes uint8[n], which the program decodes and
  recovers (several: averaged, the mesh aggregator); then the stem where the split puts it (the first device,
  or, where result.json's ``compose.stem_device`` names another, that one: the links before it carry the image),
  the device's layers, and the head on the last;
* output: the logits (last device) or, per outgoing link in ``to`` order, the Conv-Reduce of the tensor at the
  link's boundary encoded at its bits, concatenated into one uint8 vector; the manifest's ``send_slices`` {device:
  [start, stop]} sends each destination its slice. A link's wire format (``links[i]["wire"]``): at 1..8 bits the
  range (lo, hi: float32, ``packing.RANGE_BYTES``) then one row of packed codes per image (``packing.pack`` of
  ``quantizers.act_codes`` over the range of the whole batch); at 16/32 bits the float16/float32 values. Its
  ``bytes`` = ``packing.frame_bytes(hw * hw * d, bits, batch)``: at batch 1 ``compose.terms``' wire_bytes of the
  link's (boundary, module, bits).

``whole_network(run, batch)`` is ``compose.network.composed_apply`` on the run's weights, over consecutive chunks of
``batch`` images (a transmitted tensor's range is its batch's): what ``jmsnas pipeline --check`` compares with.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from jmsnas import ops as O
from jmsnas import topology
from jmsnas.compose import network as CN
from jmsnas.deploy.autosplit import decode_rows, encode_rows
from jmsnas.deploy.export import (check_export_args, check_out, device_graph, load_run, program_with_weights,
                                  write_export)
from jmsnas.deploy.runtime import FORMAT, DeployError, export_versions
from jmsnas.quant import parts as qparts
from jmsnas.quant.packing import RANGE_BYTES, frame_bytes
from jmsnas.run import directory
from jmsnas.space import OPS, op_index


def is_composed(run: str) -> bool:
    """Whether ``run``'s result.json records a composed configuration (``compose``)."""
    try:
        return isinstance(directory.read_result(run).get("compose"), dict)
    except (directory.RunDirError, AttributeError):
        return False


def _assignment(space, result: dict, run: str) -> np.ndarray:
    names = space.topology.device_names
    arch = result.get("architecture")
    try:
        rows = sorted(arch, key=lambda e: e["layer"])
        a = np.array([names.index(e["device"]) for e in rows], np.int64)
    except (TypeError, KeyError, ValueError) as e:
        raise DeployError(f"{run}/result.json: architecture is not a list of {{layer, op, device}} with the "
                          f"topology's devices {list(names)} ({e})") from None
    if a.shape != (space.num_layers,):
        raise DeployError(f"{run}/result.json: architecture lists {len(a)} layers, its space has {space.num_layers}")
    stem = (result.get("compose") or {}).get("stem_device")
    if stem is None:
        return a
    if stem not in names:
        raise DeployError(f"{run}/result.json: compose.stem_device {stem!r} is not one of the topology's devices "
                          f"{list(names)}")
    return np.append(a, names.index(stem))


def load(run: str) -> tuple:
    """(space, choices, config, assignment, parts manifest, result, {device: nested part weights}) of a composed
    run; DeployError (one line) for what does not fit."""
    space, pm, result = load_run(run)
    try:
        ops = directory.read_ops(run, space)
        a = _assignment(space, result, run)
        ch, cfg = CN.from_result(space, result.get("compose"), ops, f"{run}/result.json compose")
        CN.cuts(space, ch, cfg, a)
        order = [space.topology.device_names[m] for m in space.topology.path_order()]
        missing = [d for d in order if d not in pm["devices"]]
        if missing:
            raise DeployError(f"{run}/parts/manifest.json has no part for devices {missing}")
        weights = {d: directory.unflatten(directory.read_part(run, d, pm["devices"][d])) for d in order}
    except (directory.RunDirError, ValueError) as e:
        raise DeployError(str(e)) from None
    return space, ch, cfg, a, pm, result, weights


def _module(weights: dict, dev: str, j: int, side: str, c: int, d: int, link: str, run: str):
    w = weights[dev].get("params", {}).get("modules", {}).get(str(j), {}).get(side)
    what = "Conv-Reduce" if side == "reduce" else "Conv-Recover"
    if w is None:
        raise DeployError(f"{run}/parts/{dev}.npz lacks the {what} of boundary {j} (params/modules/{j}/{side}) that "
                          f"link {link} uses")
    shape = tuple(np.shape(w))
    if len(shape) != 4 or shape[:2] != (1, 1) or not (
            shape[2] == c and shape[3] >= d if side == "reduce" else shape[2] >= d and shape[3] == c):
        raise DeployError(f"{run}/parts/{dev}.npz: params/modules/{j}/{side} has shape {list(shape)}; link {link} "
                          f"needs a 1x1 {what} between {c} channels and at least {d}")
    return np.asarray(w, np.float32)


def _layer_weights(weights: dict, dev: str, n: int, op: str, run: str):
    tree = weights[dev]
    p, st = tree.get("params", {}).get("layers", {}).get(str(n)), tree.get("bn", {}).get("layers", {}).get(str(n))
    if OPS[op_index(op)].is_identity:
        return {}, {}
    if p is None or st is None:
        raise DeployError(f"{run}/parts/{dev}.npz lacks the weights of layer {n} ({op}) that parts/manifest.json "
                          "places there")
    return p, st


def _stored(params_n: dict, bits: int) -> dict:
    """A layer's parameters as a part stores them: kernels packed at ``bits`` (``pack_weight``; 32: float32)."""
    if bits == 32:
        return params_n
    return {k: v if isinstance(v, dict) else qparts.pack_weight(v, bits) for k, v in params_n.items()}


def _loaded(stored: dict, bits: int, shapes: dict) -> dict:
    """``_stored``'s layer back as float32 kernels inside the program (``quant.parts.edge_weight``)."""
    if bits == 32:
        return stored
    return {k: v if k not in shapes else qparts.edge_weight({f"w/{s}": x for s, x in v.items()}, "w",
                                                            {"weight_bits": bits, "w_shape": shapes[k]})
            for k, v in stored.items()}


def encode(z, bits: int):
    """uint8[n]: z float32[B, ...] in a link's wire format (module docstring)."""
    if bits > 8:
        return encode_rows(z, 0.0, 0.0, bits).reshape(-1)
    lo, hi = jnp.min(z), jnp.max(z)
    rng = jax.lax.bitcast_convert_type(jnp.stack([lo, hi]).astype(jnp.float32), jnp.uint8).reshape(-1)
    return jnp.concatenate([rng, encode_rows(z, lo, hi, bits).reshape(-1)])


def decode(wire, bits: int, batch: int, shape: tuple):
    """float32[batch, *shape] from ``encode``'s bytes."""
    if bits > 8:
        return decode_rows(wire.reshape(batch, -1), 0.0, 0.0, bits, shape)
    lohi = jax.lax.bitcast_convert_type(wire[:RANGE_BYTES].reshape(2, 4), jnp.float32)
    return decode_rows(wire[RANGE_BYTES:].reshape(batch, -1), lohi[0], lohi[1], bits, shape)


def part_forward(space, dev: int, plan: tuple, layers, ops, bits, shapes: dict, *, stem: bool, head: bool,
                 batch: int):
    """f(params, state, *inputs): device ``dev``'s part (module docstring); ``plan``: ``compose.network.cuts``,
    ``shapes`` {layer: {kernel: shape}} of its quantized layers."""
    order = {m: k for k, m in enumerate(space.topology.path_order())}
    ins = sorted((c for c in plan if c.dst == dev), key=lambda c: order[c.src])
    outs = sorted((c for c in plan if c.src == dev), key=lambda c: order[c.dst])

    def f(params, state, *xs):
        links = params.get("links", {})
        if not ins:  # the first device: the image
            h = xs[0]
        else:
            ys = []
            for c, x in zip(ins, xs):
                z = decode(x, c.bits, batch, (c.hw, c.hw, c.d))
                ys.append(z if c.r == 0 else CN.receive_side(links[str(c.link)], z))
            h = ys[0] if len(ys) == 1 else sum(ys) / len(ys)
        if stem:
            h, _ = O.conv_bn_apply(params["stem"], state["stem"], h, space.stem_stride, False)
        for n, i, b in zip(layers, ops, bits):
            p = _loaded(params.get("layers", {}).get(str(n), {}), b, shapes.get(n, {}))
            st = state.get("layers", {}).get(str(n), {})
            h, _ = O.op_apply(p, st, h, OPS[i], space.layers[n].stride, False, "xla")
        if head:
            return O.head_apply(params["head"], state["head"], h, False)[0]
        return jnp.concatenate([encode(h if c.r == 0 else CN.send_side(links[str(c.link)], h, c.d), c.bits)
                                for c in outs])
    return f, ins, outs


def _part_weights(space, dev_name, m, plan, entry_layers, ops, bits, weights, run, ends):
    params, state, shapes = {"layers": {}}, {"layers": {}}, {}
    for what in ends:  # "stem" on its device (the first unless the split sends the input), "head" on the last
        p, st = weights[dev_name].get("params", {}).get(what), weights[dev_name].get("bn", {}).get(what)
        if p is None or st is None:
            which = "device the split gives the stem" if what == "stem" else "last device in execution order"
            raise DeployError(f"{run}/parts/{dev_name}.npz lacks the {what} (the {which} runs it)")
        params[what], state[what] = p, st
    for n, i, b in zip(entry_layers, ops, bits):
        p, st = _layer_weights(weights, dev_name, n, OPS[i].name, run)
        if p:
            params["layers"][str(n)], state["layers"][str(n)] = _stored(p, b), st
            shapes[n] = {k: tuple(np.shape(v)) for k, v in p.items() if not isinstance(v, dict)}
    for c in plan:
        name = f"{space.topology.links[c.link].src}->{space.topology.links[c.link].dst}"
        for side, end in (("reduce", c.src), ("recover", c.dst)):
            if c.r and end == m:
                w = _module(weights, dev_name, c.boundary, side, c.c, c.d, name, run)
                cut = w[..., :c.d] if side == "reduce" else w[:, :, :c.d, :]  # as compose.network.module_slice
                params.setdefault("links", {}).setdefault(str(c.link), {})[side] = np.ascontiguousarray(cut)
    return params, state, shapes


def export_composed(run: str, out: str | None = None, *, platforms=("cpu",), batch: int = 1) -> dict:
    """Writes ``out`` (default ``RUN/export``) as the module docstring says; returns its manifest."""
    platforms = check_export_args(platforms, batch)
    out = os.path.join(run, "export") if out is None else out
    check_out(run, out)
    space, ch, cfg, a, pm, result, weights = load(run)
    topo = space.topology
    plan, lbits = CN.cuts(space, ch, cfg, a), CN.layer_bits(space, ch, cfg, a)
    order, srcs, dsts = device_graph(topo)
    predicted = result.get("latency_ms", {})
    image = [batch, space.image_size, space.image_size, space.in_channels]
    programs, parts, conventions = {}, {}, set()
    stem_at = CN.stem_device(space, a)
    for k, dev in enumerate(order):
        m = topo.device_names.index(dev)
        layers = [n for n in range(space.num_layers) if int(a[n]) == m]
        ops, bits = [int(cfg.ops[n]) for n in layers], [lbits[n] for n in layers]
        ends = ["stem"] * (m == stem_at) + ["head"] * (k == len(order) - 1)
        params, state, shapes = _part_weights(space, dev, m, plan, layers, ops, bits, weights, run, ends)
        fwd, ins, outs = part_forward(space, m, plan, layers, ops, bits, shapes, stem=m == stem_at,
                                      head=k == len(order) - 1, batch=batch)
        nbytes = {c.link: frame_bytes(c.hw * c.hw * c.d, c.bits, batch) for c in plan}
        in_shapes = [image] if k == 0 else [[nbytes[c.link]] for c in ins]
        in_dtype = "float32" if k == 0 else "uint8"
        exp, flat = program_with_weights(fwd, {"params": params, "bn": state},
                                         [jax.ShapeDtypeStruct(tuple(s), np.dtype(in_dtype)) for s in in_shapes],
                                         platforms)
        conventions.add(int(exp.calling_convention_version))
        shape = [int(d) for d in exp.out_avals[0].shape]
        at, send = 0, {}
        for c in outs:
            send[topo.device_names[c.dst]] = [at, at + nbytes[c.link]]
            at += nbytes[c.link]
        if outs and shape != [at]:
            raise DeployError(f"part {dev!r} encodes {shape} bytes, its links' wire formats make {at}")
        programs[dev] = (exp.serialize(), flat)
        parts[dev] = {"device": dev, "layers": layers, "ops": [OPS[i].name for i in ops], "weight_bits": bits,
                      "stem": m == stem_at, "head": k == len(order) - 1, "weight_names": sorted(flat),
                      "inputs": [{"from": s, "shape": shp, "dtype": in_dtype} for s, shp in zip(srcs[dev], in_shapes)],
                      "output": {"shape": shape, "dtype": str(exp.out_avals[0].dtype)}, "to": dsts[dev],
                      "send_slices": send, "predicted_compute_ms": predicted.get("per_device", {}).get(dev)}
    links = []
    for c in plan:
        l = topo.links[c.link]
        links.append({"src": l.src, "dst": l.dst, "bandwidth_mbps": float(l.bandwidth_mbps),
                      "latency_ms": float(l.latency_ms), "bytes": frame_bytes(c.hw * c.hw * c.d, c.bits, batch),
                      "predicted_ms": predicted.get("per_link", {}).get(f"{l.src}->{l.dst}"),
                      "wire": {"boundary": c.boundary, "module": c.r, "channels": c.d, "shape": [c.hw, c.hw, c.d],
                               "bits": c.bits, "range_bytes": RANGE_BYTES if c.bits <= 8 else 0,
                               "bytes_per_image": frame_bytes(c.hw * c.hw * c.d, c.bits)}})
    manifest = {"format": FORMAT, "system": "composed", "run": os.path.abspath(run), "platforms": list(platforms),
                "batch": batch, "versions": export_versions(max(conventions)), "kind": topo.kind,
                "topology": topology.to_dict(topo), "order": order,
                "root": topo.device_names[topo.root] if topo.kind == "mesh" else None,
                "branches": [topo.device_names[b] for b in topo.branches], "parts": parts, "links": links,
                "predicted_latency_ms": predicted, "architecture": result.get("architecture"),
                "compose": result.get("compose")}
    return write_export(out, programs, parts, manifest)


def whole_network(run: str, batch: int = 1):
    """f(images float32[N, H, W, C]) -> logits: ``composed_apply`` on the run's weights (XLA's depthwise convolution,
    as the parts), ``batch`` images at a time (N a multiple of it)."""
    space, ch, cfg, a, pm, result, weights = load(run)
    params, state, modules = {"layers": {}}, {"layers": {}}, {}
    for tree in weights.values():
        for key, sub in tree.get("params", {}).items():
            if key == "layers":
                params["layers"].update({int(n): v for n, v in sub.items()})
            elif key == "modules":
                for j, sides in sub.items():
                    modules.setdefault(j, {}).update(sides)
            else:
                params[key] = sub
        for key, sub in tree.get("bn", {}).items():
            if key == "layers":
                state["layers"].update({int(n): v for n, v in sub.items()})
            else:
                state[key] = sub
    params["layers"] = tuple(params["layers"].get(n, {}) for n in range(space.num_layers))
    state["layers"] = tuple(state["layers"].get(n, {}) for n in range(space.num_layers))
    fn = jax.jit(lambda x: CN.composed_apply(space, ch, cfg, a, params, state, modules, x, dw_impl="xla")[0])

    def f(images):
        x = np.asarray(images, np.float32)
        if len(x) % batch:
            raise DeployError(f"images must come in multiples of the batch {batch}, got {len(x)}")
        return np.concatenate([np.asarray(fn(x[i:i + batch])) for i in range(0, len(x), batch)])
    return f
