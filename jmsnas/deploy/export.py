"""``export_run``: every device's part of a finished run as a serialized ``jax.export`` program plus its weights.

Reads ``RUN/parts/manifest.json`` (the layers and ops of every device and the recorded search space, see
``jmsnas.space.to_dict``), ``RUN/parts/<device>.npz`` (the compact network's weights and batch-norm statistics of
that device) and ``RUN/result.json`` (the predicted latency breakdown of eq. (1)/(2)), and writes into
``RUN/export/``:

* ``<device>.jaxexport``: the part's forward pass in inference mode, ``f(*weights, *inputs) -> output``, lowered
  for ``platforms`` (cpu; cuda / tpu when asked) with a fixed batch size; float32 NHWC tensors;
* ``<device>.npz``: the weights in argument order;
* ``manifest.json`` (``runtime.FORMAT``): per part the device, layers, ops, files with their SHA-256, its inputs
  (where each comes from: ``"image"`` or a device, with shape and dtype), its output and where it goes (devices or
  ``"result"``), the predicted compute ms of the run's cost table; the links with bandwidth, latency and bytes per
  transfer; the execution order and the run's predicted breakdown; what made the programs (``versions``: jax,
  jaxlib, serialization version, the programs' calling convention) and the platforms they hold.

A part computes exactly what ``supernet.compact_apply`` computes for its layers: the stem on the first device in
execution order, the head on the last, a mesh aggregator averages its branch inputs in branch order. A device with
no layers (a searched split may leave one) relays its input unchanged. Depthwise convolutions use XLA's own
convolution (``dw_impl="xla"``) so the program holds no jmsnas-specific custom calls and runs on any backend.
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import export as jax_export

from jmsnas import ops as O
from jmsnas.deploy.runtime import FORMAT, MANIFEST, DeployError, export_versions, load_manifest, sha256
from jmsnas import runcheck, safeio, topology
from jmsnas import space as S
from jmsnas.run import directory
from jmsnas.space import OPS, SearchSpace, op_index

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


def part_forward(space: SearchSpace, layers, ops, *, stem: bool, head: bool, dw_impl: str = "xla"):
    """f(params, state, *xs) -> y: one device's part in inference mode (the slice of ``compact_apply``).

    ``params``/``state``: the part's nested weights and BN statistics ({"layers": {"3": ...}, "stem", "head"});
    ``xs``: the image (with ``stem``) or the tensors from the devices before it (several: averaged).
    """
    layers, ops = [int(n) for n in layers], [int(i) for i in ops]

    def f(params, state, *xs):
        if stem:
            h, _ = O.conv_bn_apply(params["stem"], state["stem"], xs[0], space.stem_stride, False)
        else:
            h = xs[0] if len(xs) == 1 else sum(xs) / len(xs)
        for n, i in zip(layers, ops):
            p = params.get("layers", {}).get(str(n), {})
            st = state.get("layers", {}).get(str(n), {})
            h, _ = O.op_apply(p, st, h, OPS[i], space.layers[n].stride, False, dw_impl)
        if head:
            h, _ = O.head_apply(params["head"], state["head"], h, False)
        return h
    return f


def device_graph(topo) -> tuple:
    """(order, inputs, outputs): execution order of device names, each device's sources and destinations
    ("image" into the first, "result" out of the last)."""
    names = topo.device_names
    order = [names[m] for m in topo.path_order()]
    pos = {n: i for i, n in enumerate(order)}
    srcs = {n: sorted((l.src for l in topo.links if l.dst == n), key=pos.get) for n in order}
    dsts = {n: sorted((l.dst for l in topo.links if l.src == n), key=pos.get) for n in order}
    srcs[order[0]], dsts[order[-1]] = ["image"], ["result"]
    return order, srcs, dsts


def check_out(run: str | None, out: str) -> None:
    """DeployError unless ``out`` may receive an export: not inside a run's own files (``RUN/parts``, ...; no
    check for ``run`` None, a folder of Auto-Split parts that may be named ``parts``), and new, empty or an earlier
    export (its manifest.json), since the export replaces the whole folder."""
    try:
        if run is not None:
            runcheck.check_out_dir(out, "--out", own=run)
    except ValueError as e:
        raise DeployError(str(e)) from None
    if os.path.exists(out) and (not os.path.isdir(out) or (
            os.listdir(out) and not os.path.isfile(os.path.join(out, MANIFEST)))):
        raise DeployError(f"--out {out!r} exists and is not an earlier export (no {MANIFEST}); the export replaces "
                          "its folder, so give a new or empty one (nothing was written)")


def load_run(run: str) -> tuple:
    """(space, parts manifest, result) of a finished run (``run.directory``); DeployError for a missing or
    mismatched file."""
    try:
        pm = directory.read_manifest(run)
        result = directory.read_result(run)
    except directory.RunDirError as e:
        raise DeployError(str(e)) from None
    if "space" not in pm:
        raise DeployError(f"{run}/parts/manifest.json records no search space (written by an older jmsnas); "
                          "run the search again to export it")
    try:
        space = S.from_dict(pm["space"], "space")
    except ValueError as e:
        raise DeployError(f"{run}/parts/manifest.json: {e}") from None
    if space.topology.kind not in ("chain", "mesh"):
        raise DeployError(f"the pipeline deploys chain and mesh topologies; {space.topology.name!r} is a "
                          f"{space.topology.kind}")
    if space.topology.buses:
        raise DeployError(f"topology {space.topology.name!r} has shared buses "
                          f"{[b.name for b in space.topology.buses]}; the pipeline paces every link on its own")
    for dev, entry in pm.get("devices", {}).items():
        for n, op in zip(entry.get("layers", []), entry.get("ops", [])):
            if not 0 <= int(n) < space.num_layers:
                raise DeployError(f"parts/manifest.json: device {dev!r} names layer {n}; the space has "
                                  f"{space.num_layers}")
            if op not in [o.name for o in OPS]:
                raise DeployError(f"parts/manifest.json: device {dev!r} layer {n} has unknown op {op!r}")
    return space, pm, result


def _check_weights(device: str, flat: dict, entry: dict, space: SearchSpace, stem: bool, head: bool) -> None:
    """The part file must hold exactly the tensors its layers need (a manifest that does not match the parts)."""
    want_layers = {str(n) for n, op in zip(entry["layers"], entry["ops"]) if not OPS[op_index(op)].is_identity}
    have_layers = {k.split("/")[2] for k in flat if k.split("/")[1] == "layers"}
    problems = []
    if want_layers != have_layers:
        problems.append(f"layers with weights {sorted(have_layers)}, the manifest needs {sorted(want_layers)}")
    for what, needed in (("stem", stem), ("head", head)):
        has = any(k.split("/")[1] == what for k in flat)
        if has != needed:
            problems.append(f"{'no' if needed else 'an unexpected'} {what}")
    if problems:
        raise DeployError(f"part file for device {device!r} does not match parts/manifest.json: "
                          + "; ".join(problems))


def program_with_weights(fn, weights: dict, in_specs, platforms) -> tuple:
    """(Exported, flat weights {name: array}) of ``fn(params, state, *inputs)`` with the weights as arguments."""
    flat = dict(directory.flat_arrays(weights.get("params", {}), "params"))
    flat.update(directory.flat_arrays(weights.get("bn", {}), "bn"))
    names = sorted(flat)

    def call(*args):
        t = directory.unflatten(dict(zip(names, args[:len(names)])))
        return fn(t.get("params", {}), t.get("bn", {}), *args[len(names):])
    specs = [jax.ShapeDtypeStruct(np.shape(flat[k]), np.asarray(flat[k]).dtype) for k in names] + list(in_specs)
    return jax_export.export(jax.jit(call), platforms=platforms)(*specs), {k: np.asarray(flat[k]) for k in names}


def write_export(out: str, programs: dict, parts: dict, manifest: dict) -> dict:
    """The export folder ``out`` as one unit (``safeio.atomic_dir``): every device's ``<device>.jaxexport`` and
    ``<device>.npz`` from {device: (serialized program, {name: weight})}, their names and SHA-256 recorded in
    ``parts[device]``, and ``manifest``; returns the manifest read back. Disk errors are one DeployError line."""
    try:
        with safeio.write_errors(f"the export to {out!r}"), safeio.atomic_dir(out) as tmp:
            for dev, (blob, weights) in programs.items():
                prog = safeio.child_path(tmp, dev, ".jaxexport", "device name")
                wfile = safeio.child_path(tmp, dev, ".npz", "device name")
                with open(prog, "wb") as f:
                    f.write(bytes(blob))
                np.savez(wfile, **weights)
                parts[dev].update(program=f"{dev}.jaxexport", program_sha256=sha256(prog),
                                  weights=f"{dev}.npz", weights_sha256=sha256(wfile))
            with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
                json.dump(manifest, f, indent=2)
    except ValueError as e:
        raise DeployError(str(e)) from None
    return load_manifest(out)


def check_export_args(platforms, batch) -> tuple:
    """``platforms`` as a tuple after checking it and ``batch`` (every export's shared arguments)."""
    platforms = tuple(platforms)
    bad = [p for p in platforms if p not in PLATFORMS]
    if not platforms or bad:
        raise DeployError(f"platforms must be a non-empty subset of {list(PLATFORMS)}, got {list(platforms)}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise DeployError(f"batch must be a positive integer, got {batch!r}")
    return platforms


def export_run(run: str, out: str | None = None, *, platforms=("cpu",), batch: int = 1) -> dict:
    """Writes ``out`` (default ``RUN/export``) as described in the module docstring; returns its manifest."""
    platforms = check_export_args(platforms, batch)
    out = os.path.join(run, "export") if out is None else out
    check_out(run, out)
    space, pm, result = load_run(run)
    if "compose" in result:
        raise DeployError(f"{run} holds a composed configuration (result.json compose: split modules and bit widths); "
                          "export it with jmsnas.deploy.composed.export_composed (jmsnas export does)")
    order, srcs, dsts = device_graph(space.topology)
    missing = [n for n in order if n not in pm["devices"]]
    if missing:
        raise DeployError(f"parts/manifest.json has no part for devices {missing} of topology {space.topology.name!r}")
    try:
        flats = {dev: directory.read_part(run, dev, pm["devices"][dev]) for dev in order}
    except directory.RunDirError as e:
        raise DeployError(str(e)) from None
    predicted = result.get("latency_ms", {})
    shapes: dict = {"image": [batch, space.image_size, space.image_size, space.in_channels]}
    programs, manifest_parts, conventions = {}, {}, set()
    for dev in order:  # execution order: every input's shape is known before it is needed
        entry = pm["devices"][dev]
        stem, head = dev == order[0], dev == order[-1]
        _check_weights(dev, flats[dev], entry, space, stem, head)
        fwd = part_forward(space, entry["layers"], [op_index(o) for o in entry["ops"]], stem=stem, head=head)
        in_shapes = [shapes[s] for s in srcs[dev]]
        exp, weights = program_with_weights(fwd, directory.unflatten(flats[dev]),
                                            [jax.ShapeDtypeStruct(tuple(s), jnp.float32) for s in in_shapes],
                                            platforms)
        conventions.add(int(exp.calling_convention_version))
        out_shape = [int(d) for d in exp.out_avals[0].shape]
        shapes[dev] = out_shape
        programs[dev] = (exp.serialize(), weights)
        pd = predicted.get("per_device", {})
        manifest_parts[dev] = {
            "device": dev, "layers": [int(n) for n in entry["layers"]], "ops": list(entry["ops"]),
            "stem": stem, "head": head, "weight_names": sorted(weights),
            "inputs": [{"from": s, "shape": shp, "dtype": "float32"} for s, shp in zip(srcs[dev], in_shapes)],
            "output": {"shape": out_shape, "dtype": "float32"}, "to": dsts[dev],
            "predicted_compute_ms": pd.get(dev),
        }
    topo = space.topology
    links = []
    for l in topo.links:
        nbytes = int(np.prod(shapes[l.src])) * 4
        links.append({"src": l.src, "dst": l.dst, "bandwidth_mbps": float(l.bandwidth_mbps),
                      "latency_ms": float(l.latency_ms), "bytes": nbytes,
                      "predicted_ms": predicted.get("per_link", {}).get(f"{l.src}->{l.dst}")})
    manifest = {"format": FORMAT, "run": os.path.abspath(run), "platforms": list(platforms), "batch": batch,
                "versions": export_versions(max(conventions)),
                "kind": topo.kind, "topology": topology.to_dict(topo), "order": order,
                "root": topo.device_names[topo.root] if topo.kind == "mesh" else None,
                "branches": [topo.device_names[b] for b in topo.branches],
                "parts": manifest_parts, "links": links, "predicted_latency_ms": predicted,
                "architecture": result.get("architecture")}
    return write_export(out, programs, manifest_parts, manifest)
