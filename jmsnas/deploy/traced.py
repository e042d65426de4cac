"""Your own model (``jmsnas.traced``) cut at a split's points into per-device ``jax.export`` parts, in the
deploy format of ``export.py`` (``runtime.FORMAT``), so ``jmsnas pipeline`` runs it across devices.

``export_traced(model, topology, workdir)`` traces the model, splits its layer graph over the topology with a
``split.compare`` method (default ``chain_dp``) or at given ``cuts`` (a mesh routes through pre + root + first branch + post as the
sequential methods do) and writes

* ``WORKDIR/export/``: per device ``<device>.jaxexport`` + ``<device>.npz`` and ``manifest.json``; every part is
  ``f(*weights, *inputs) -> output`` over its contiguous range of layers (``traced.run.segment``); the weights
  are the parameter leaves its layers read, named by their path (``params/conv1/kernel``). When several tensors
  cross a cut (a skip connection) they travel packed as one float32[B, elements] tensor (``run.pack``) and are
  unpacked by the receiver; a device that runs no layer relays its input. On a mesh the idle branch devices
  receive nothing they do not need: the root sends them an empty frame (its output's first 0 channels, the
  part's ``send_channels``; the link carries 0 payload bytes, as the manifest says) and they send back a
  float32[B, 1] zero token the aggregator ignores. Part entries carry ``"kind": "traced"`` and ``"layers"``
  (indices), ``"ops"`` (layer
  names); the manifest's ``"traced"`` records the model, method and assignment;
* ``WORKDIR/reference/whole.jaxexport`` + ``whole.npz``: the model's own ``apply(params, x)`` as one program, what
  ``jmsnas pipeline --check`` compares the parts' output with (no need for the model's code at check time);
* ``WORKDIR/traced.json``: the model reference (when given as text), topology, method, assignment, the split's
  predicted latency and the evaluation data (``--data``), from which the pipeline takes its images.
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import export as jax_export

from jmsnas import safeio
from jmsnas import topology as topo_mod
from jmsnas.deploy.export import check_export_args, device_graph, write_export
from jmsnas.deploy.runtime import FORMAT, DeployError, export_versions

RECORD = "traced.json"


def is_traced(workdir: str) -> bool:
    """True when ``workdir`` was written by ``export_traced``."""
    return os.path.isfile(os.path.join(workdir, RECORD))


def ranges(topo, assignment, num_layers: int) -> dict:
    """{device name: (first layer, end)} for the devices of the split's path; layers move forward along it."""
    from jmsnas.split.solvers import chain_path
    path = chain_path(topo)
    pos = {m: i for i, m in enumerate(path)}
    at = [pos[int(m)] for m in assignment]
    if any(b < a for a, b in zip(at, at[1:])):
        raise DeployError("the split's assignment moves backwards along the device path")
    out, start = {}, 0
    for i, m in enumerate(path):
        end = start
        while end < num_layers and at[end] == i:
            end += 1
        out[topo.device_names[m]] = (start, end)
        start = end
    return out


def _part_fn(t, a: int, b: int, names: list, leaf_ids: list, use: int, batch: int, token: bool):
    from jmsnas.traced import run
    seg = run.segment(t, a, b)

    def call(*args):
        if token:
            return jnp.zeros((batch, 1), jnp.float32)
        leaves = dict(zip(leaf_ids, args[:len(names)]))
        xs = args[len(names):]
        h = run.unpack(t, a, xs[use], batch)
        return run.pack(seg(leaves, *h), batch)
    return call


def _export(fn, specs, platforms):
    try:
        return jax_export.export(jax.jit(fn), platforms=platforms)(*specs)
    except Exception as e:  # noqa: BLE001 - lowering errors for an unsupported platform or op
        raise DeployError(f"cannot export a part for {list(platforms)}: {type(e).__name__}: "
                          f"{' '.join(str(e).split())[:300]}") from None


def _write(path: str, blob: bytes) -> None:
    with open(path, "wb") as f:
        f.write(bytes(blob))


def assignment_of_cuts(topo, cuts, num_layers: int):
    """int[N] device indices from P-1 cut points along the path (device p runs layers cuts[p-1] .. cuts[p]-1)."""
    from jmsnas.split.solvers import chain_path
    path = chain_path(topo)
    try:
        cuts = [int(c) for c in cuts]
        ok = all(float(c) == int(c) for c in cuts)
    except (TypeError, ValueError):
        ok = False
    if not ok or len(cuts) != len(path) - 1 or any(not 0 <= c <= num_layers for c in cuts) \
            or any(b < a for a, b in zip(cuts, cuts[1:])):
        raise DeployError(f"cuts must be {len(path) - 1} non-decreasing layer indices in 0..{num_layers} (one per "
                          f"link of the path {[topo.device_names[m] for m in path]}), got {list(cuts) if isinstance(cuts, (list, tuple)) else cuts!r}")
    bounds = [0] + cuts + [num_layers]
    return np.array([path[p] for p in range(len(path)) for _ in range(bounds[p], bounds[p + 1])], int)


def export_traced(model, topology, workdir: str, *, method: str = "chain_dp", cuts=None, platforms=("cpu",),
                  batch: int = 1, act_bits: int = 32, weight_bits: int = 32, bandwidths_mbps=None, data=None,
                  data_dir=None) -> dict:
    """Writes WORKDIR as the module docstring says; returns the export manifest. ``model``: a reference or a
    ``traced.ref.UserModel``; ``topology``: a preset name, a topology file or a ``Topology``; ``cuts``: the
    split's points given instead of ``method`` (``assignment_of_cuts``)."""
    from jmsnas.split import compare, solvers
    from jmsnas.traced import evaldata, run
    from jmsnas.traced.ref import resolve
    from jmsnas.traced.trace import trace
    platforms = check_export_args(platforms, batch)
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise DeployError(f"--workdir {workdir!r} is a file; expected a directory for the export")
    if os.path.isdir(workdir) and os.listdir(workdir) and not is_traced(workdir):
        raise DeployError(f"--workdir {workdir!r} holds other files; expected a new or empty directory or an earlier "
                          "`jmsnas export --model` there")
    if cuts is None and (method not in compare.METHODS or method == "mesh"):
        raise DeployError(f"method must be one of {[m for m in compare.METHODS if m != 'mesh']}, got {method!r}")
    um = resolve(model)
    t = trace(um)
    topo = topo_mod.resolve(topology, None, bandwidths_mbps) if isinstance(topology, str) else topology
    if topo.kind not in ("chain", "mesh"):
        raise DeployError(f"the pipeline deploys chain and mesh topologies; {topo.name!r} is a {topo.kind}")
    if topo.buses:
        raise DeployError(f"topology {topo.name!r} has shared buses; the pipeline paces every link on its own")
    if data is not None:
        _, labels = evaldata.load(data, um.input_shape, data_dir)  # refused now, not at pipeline time
        evaldata.check_classes(labels, t.output_shape, data)
    setup = compare.make_setup(t.net, topo, act_bits=act_bits, weight_bits=weight_bits)
    n = len(t.net.layers)
    if cuts is not None:
        method = "given"
        result = solvers.path_latency(assignment_of_cuts(topo, cuts, n), setup.compute_ms, setup.out_bytes,
                                      setup.input_bytes, topo, edges=setup.edges, peak=setup.peak)
    else:
        try:
            result = compare.run_method(setup, method)
        except solvers.InfeasibleSplitError as e:
            raise DeployError(f"method {method!r} finds no split within the devices' memory: {e}") from None
    rng = ranges(topo, result.assignment, n)
    order, srcs, dsts = device_graph(topo)
    path_devs = list(rng)
    leaves = run.leaves_dict(t)
    shapes: dict = {"image": ((batch,) + tuple(um.input_shape), um.input_dtype)}
    cut_of: dict = {"image": 0}
    programs, parts, edge = {}, {}, {}  # edge: {(src, dst): (shape, dtype)} where a link carries less than src's output
    for dev in order:  # execution order: every input's shape is known before it is needed
        token = dev not in rng
        ins = srcs[dev]
        if token:  # an idle branch: an empty trigger from the root (send_channels 0), no tensor
            a = b = cut_of[ins[0]]
            use = 0
            for src in ins:
                parts[src].setdefault("send_channels", {})[dev] = 0
                edge[(src, dev)] = (tuple(shapes[src][0][:-1]) + (0,), shapes[src][1])
        else:
            a, b = rng[dev]
            on_path = [i for i, s in enumerate(ins) if s == "image" or s in path_devs]
            use = on_path[0]
            if cut_of[ins[use]] != a:
                raise DeployError(f"device {dev!r} would receive cut {cut_of[ins[use]]}, its layers start at {a}")
        ids = [] if token else run.segment_leaves(t, a, b)
        names = [t.leaf_names[i] for i in ids]
        specs = [jax.ShapeDtypeStruct(tuple(np.shape(leaves[i])), jnp.asarray(leaves[i]).dtype) for i in ids]
        in_shapes = [edge.get((s, dev), shapes[s]) for s in ins]
        specs += [jax.ShapeDtypeStruct(tuple(shp), np.dtype(dt)) for shp, dt in in_shapes]
        exp = _export(_part_fn(t, a, b, names, ids, use, batch, token), specs, platforms)
        out = exp.out_avals[0]
        shapes[dev] = (tuple(int(d) for d in out.shape), str(out.dtype))
        cut_of[dev] = b
        programs[dev] = (exp.serialize(), {nm: np.asarray(leaves[i]) for nm, i in zip(names, ids)})
        parts[dev] = {
            "device": dev, "kind": "traced", "layers": list(range(a, b)),
            "ops": [t.net.layers[k].name for k in range(a, b)], "stem": False, "head": b == n and a < b,
            "idle_branch": token, "weight_names": names,
            "inputs": [{"from": s, "shape": list(shp), "dtype": dt} for s, (shp, dt) in zip(ins, in_shapes)],
            "output": {"shape": list(shapes[dev][0]), "dtype": shapes[dev][1]}, "to": dsts[dev],
            "predicted_compute_ms": float(result.per_device_ms.get(dev, 0.0)),
        }
    reference = _reference_program(um, batch, platforms)
    links = []
    for l in topo.links:
        shape, dtype = edge.get((l.src, l.dst), shapes[l.src])
        links.append({"src": l.src, "dst": l.dst, "bandwidth_mbps": float(l.bandwidth_mbps),
                      "latency_ms": float(l.latency_ms), "bytes": int(np.prod(shape)) * np.dtype(dtype).itemsize,
                      "predicted_ms": float(result.per_link_ms.get(f"{l.src}->{l.dst}", 0.0))})
    predicted = {"total": float(result.total_ms), "per_device": {k: float(v) for k, v in result.per_device_ms.items()},
                 "per_link": {k: float(v) for k, v in result.per_link_ms.items()}}
    record = {"model": model if isinstance(model, str) else None, "name": um.name, "method": method,
              "assignment": [topo.device_names[int(m)] for m in result.assignment],
              "ranges": {d: list(r) for d, r in rng.items()}, "layers": [l.name for l in t.net.layers],
              "input_shape": list(um.input_shape), "input_dtype": um.input_dtype,
              "data": os.path.abspath(data) if data and not data.startswith("tfds:") else data,
              "data_dir": data_dir, "act_bits": act_bits, "weight_bits": weight_bits}
    manifest = {"format": FORMAT, "run": os.path.abspath(workdir), "platforms": list(platforms), "batch": batch,
                "versions": export_versions(), "kind": topo.kind, "topology": topo_mod.to_dict(topo), "order": order,
                "root": topo.device_names[topo.root] if topo.kind == "mesh" else None,
                "branches": [topo.device_names[b] for b in topo.branches],
                "parts": parts, "links": links, "predicted_latency_ms": predicted, "architecture": None,
                "traced": record}
    try:  # all or nothing per folder (safeio.atomic_dir); disk errors as one line
        with safeio.write_errors(f"the export to {workdir!r}"):
            os.makedirs(workdir, exist_ok=True)
            with safeio.atomic_dir(os.path.join(workdir, "reference")) as tmp:
                _write(os.path.join(tmp, "whole.jaxexport"), reference[0])
                np.savez(os.path.join(tmp, "whole.npz"), **reference[1])
            write_export(os.path.join(workdir, "export"), programs, parts, manifest)
            with safeio.atomic_write(os.path.join(workdir, RECORD), encoding="utf-8") as f:
                json.dump({**record, "topology": topo_mod.to_dict(topo), "predicted_latency_ms": predicted}, f,
                          indent=2)
    except ValueError as e:
        raise DeployError(str(e)) from None
    return manifest


def _reference_program(um, batch: int, platforms) -> tuple:
    """(serialized program, weights) of the model's own apply for one batch: what ``pipeline --check`` runs."""
    leaves, treedef = jax.tree_util.tree_flatten(um.params)
    fn = lambda *args: um.apply(jax.tree_util.tree_unflatten(treedef, list(args[:-1])), args[-1])
    specs = [jax.ShapeDtypeStruct(tuple(np.shape(l)), jnp.asarray(l).dtype) for l in leaves]
    specs.append(jax.ShapeDtypeStruct((batch,) + tuple(um.input_shape), np.dtype(um.input_dtype)))
    exp = _export(fn, specs, platforms)
    return exp.serialize(), {f"{i:05d}": np.asarray(l) for i, l in enumerate(leaves)}


def _record(workdir: str) -> dict:
    path = os.path.join(workdir, RECORD)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise DeployError(f"cannot read {path}: {e}") from None


def whole_model(workdir: str):
    """f(images float[B', H, W, C]) -> outputs of the model's own apply (``reference/whole``), any B' that is a
    multiple of the export batch."""
    d = os.path.join(workdir, "reference")
    try:
        with open(os.path.join(d, "whole.jaxexport"), "rb") as f:
            exp = jax_export.deserialize(bytearray(f.read()))
        with np.load(os.path.join(d, "whole.npz"), allow_pickle=False) as z:
            weights = [z[k] for k in sorted(z.files)]
    except Exception as e:  # noqa: BLE001 - missing or damaged reference files
        raise DeployError(f"cannot read the reference model in {d}: {type(e).__name__}: {e}") from None
    b = int(exp.in_avals[-1].shape[0])
    fn = jax.jit(lambda x: exp.call(*weights, x))

    def whole(images):
        images = np.asarray(images, exp.in_avals[-1].dtype)
        return np.concatenate([np.asarray(fn(images[s:s + b])) for s in range(0, len(images), b)])
    return whole


def eval_images(workdir: str, n: int) -> tuple:
    """(images [n, ...], labels int32[n] or None): the first n of the recorded evaluation data, else n standard
    normal images (seed 0) without labels."""
    from jmsnas.traced import evaldata
    rec = _record(workdir)
    shape = tuple(rec["input_shape"])
    if rec.get("data"):
        images, labels = evaldata.load(rec["data"], shape, rec.get("data_dir"))
        if not 0 < n <= len(images):
            raise DeployError(f"images must be between 1 and the {len(images)} images of {rec['data']!r}, got {n}")
        return images[:n].astype(rec["input_dtype"]), labels[:n]
    if n < 1:
        raise DeployError(f"images must be a positive number, got {n}")
    x = np.random.default_rng(0).standard_normal((n,) + shape).astype(rec["input_dtype"])
    return x, None
