"""A separable network (``jmsnas separable``, paper 004) as deployable parts: G workers exchanging features.

The exchanges go both ways inside one forward pass, so a group is not one call but a sequence of stages; every
stage is a ``jax.export`` program of its own and the worker runs them in order (``runtime.load_stages``,
``worker``). For group g on device ``devices[g]`` with S transmission steps (window s = blocks ``spec.window(s)``):

* the input device first runs ``stem`` (image -> h) and sends h, float32, to every other device;
* stage k = 0..S takes the carry (stage 0 of another device: h from the input device) and, for k > 0, what
  ``src_{k-1}[g]`` sent at step k-1; runs the blocks of window k-1 after its first one, adds the received
  features (zero-padded to every channel, float32), then the first block of window k (k < S). Its output is the
  carry of stage k+1, and ``F(x)`` of it (the first N_send channels, float16 when the network sends float16) goes to
  ``perm_k[g]`` (nothing when that is g itself). The output device's stage S ends with the head (logits -> result).

What crosses a link is exactly what the training code transmits (``network.transmit``), only without the unsent
channels. ``whole_network(run)`` is ``network.apply`` on the stored params and decisions (the check's reference).
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from jmsnas.deploy.runtime import FORMAT, DeployError, export_versions
from jmsnas.run import directory
from jmsnas.separable import decisions as dec, network as net
from jmsnas.separable.parts import read_parts


def is_separable(run: str) -> bool:
    """Whether ``run`` holds a separable network's parts (``separable.parts.write_parts``)."""
    try:
        return isinstance(directory.read_manifest(run).get("separable"), dict)
    except directory.RunDirError:
        return False


def load(run: str) -> tuple:
    """``separable.parts.read_parts`` with its errors as one DeployError line."""
    try:
        return read_parts(run)
    except directory.RunDirError as e:
        raise DeployError(str(e)) from None


def _stage_fn(spec: net.NetSpec, k: int, received: bool, head: bool):
    """f(params, state, carry[, received]) of stage k (see the module docstring); params {"blocks": {"i": ...},
    "head"}."""
    def f(params, _state, x, *got):
        if k > 0:
            for i in spec.window(k - 1)[1:]:
                x = net.block_apply(params["blocks"][str(i)], x, spec.blocks[i])
            if received:
                r = got[0].astype(jnp.float32)
                x = x + jnp.pad(r, ((0, 0),) * 3 + ((0, x.shape[-1] - r.shape[-1]),))
        if k < spec.num_steps:
            i = spec.window(k)[0]
            x = net.block_apply(params["blocks"][str(i)], x, spec.blocks[i])
        return net.head_apply(params["head"], x) if head else x
    return f


def _stage_blocks(spec: net.NetSpec, k: int) -> list:
    return ([str(i) for i in spec.window(k - 1)[1:]] if k > 0 else []) + (
        [str(spec.window(k)[0])] if k < spec.num_steps else [])


def _part_entry(dev: str, g: int, seq: list, spec: net.NetSpec, inp: int) -> dict:
    """The manifest entry of group g's staged part: its stages, its remote inputs (the first use of each source)
    and the devices its output goes to."""
    remote = {}
    for st in seq:
        for i in st["inputs"]:
            if i["from"] != "carry":
                remote.setdefault(i["from"], i)
    return {"device": dev, "group": g, "layers": list(range(spec.num_blocks)), "stem": g == inp,
            "head": g == spec.output_group, "stages": seq, "inputs": list(remote.values()),
            "output": seq[-1]["output"], "predicted_compute_ms": None,
            "to": sorted({s["to"] for st in seq for s in st["send"]}) + (["result"] if g == spec.output_group else [])}


def _links(run: str, sent: dict, cluster: list) -> list:
    """One link per (sender, receiver) that carries something, at the cluster's Mbit/s and latency; ``bytes``: all
    it carries per call (every step's F(x), the stem's output)."""
    topo = {(l["src"], l["dst"]): l for l in cluster}
    links = []
    for (a, b), nbytes in sorted(sent.items()):
        if (a, b) not in topo:
            raise DeployError(f"{run}/parts/manifest.json: the cluster has no link {a}->{b}")
        links.append({"src": a, "dst": b, "bandwidth_mbps": float(topo[(a, b)]["bandwidth_mbps"]),
                      "latency_ms": float(topo[(a, b)]["latency_ms"]), "bytes": nbytes, "predicted_ms": None})
    return links


def export_separable(run: str, out: str | None = None, *, platforms=("cpu",), batch: int = 1) -> dict:
    """Writes ``out`` (default ``RUN/export``) as the module docstring says; returns its manifest."""
    from jmsnas.deploy.export import check_export_args, check_out, program_with_weights, write_export
    platforms = check_export_args(platforms, batch)
    out = os.path.join(run, "export") if out is None else out
    check_out(run, out)
    spec, params, pids, lvls, devices, inp, cluster = load(run)
    G, S, wire = spec.num_groups, spec.num_steps, "float16" if spec.float16 else "float32"
    dest = dec.permutation_table(G)[pids]  # [S, G]: where node g sends at step s
    src = np.argsort(dest, axis=1)  # [S, G]: who sends to node g at step s
    f32 = lambda shape: jax.ShapeDtypeStruct(tuple(shape), jnp.float32)
    x = f32((batch, spec.image_size, spec.image_size, spec.in_channels))
    h = f32((batch, spec.image_size, spec.image_size, spec.stem_channels))
    programs, parts, stages, sent = {}, {}, {}, {}
    conventions = set()
    blk = lambda i, g: {k: v[g] for k, v in params["blocks"][i].items()}

    def add(dev, name, fn, weights, inputs, in_specs, send, carry, result):
        exp, w = program_with_weights(fn, {"params": weights}, in_specs, platforms)
        conventions.add(int(exp.calling_convention_version))
        programs[name] = (exp.serialize(), w)
        stages[name] = {"stage": name, "weight_names": sorted(w), "inputs": inputs, "send": send, "carry": carry,
                        "result": result, "output": {"shape": [int(d) for d in exp.out_avals[0].shape],
                                                     "dtype": "float32"}}
        for s in send:
            sent[(dev, s["to"])] = sent.get((dev, s["to"]), 0) + s["bytes"]
        return stages[name], [int(d) for d in exp.out_avals[0].shape]

    for g, dev in enumerate(devices):
        seq, shape = [], list(h.shape)
        if g == inp:
            stem = lambda p, _s, im: net.stem_apply(p["stem"], im)
            st, _ = add(dev, f"{dev}.stem", stem, {"stem": params["stem"]},
                        [{"from": "image", "shape": list(x.shape), "dtype": "float32"}], [x],
                        [{"to": d, "channels": None, "dtype": "float32", "bytes": int(np.prod(h.shape)) * 4}
                         for d in devices if d != dev], True, False)
            seq.append(st)
        for k in range(S + 1):
            first = {"from": "carry" if (k > 0 or g == inp) else devices[inp], "shape": shape, "dtype": "float32"}
            inputs, specs = [first], [f32(shape)]
            got = k > 0 and src[k - 1, g] != g
            if got:
                c = spec.blocks[spec.window(k - 1)[0]]
                n = spec.nsend[k - 1][int(lvls[k - 1])]
                rshape = [batch, c.size_out, c.size_out, n]
                inputs.append({"from": devices[src[k - 1, g]], "shape": rshape, "dtype": wire})
                specs.append(jax.ShapeDtypeStruct(tuple(rshape), jnp.dtype(wire)))
            head = k == S and g == spec.output_group
            w = {"blocks": {i: blk(int(i), g) for i in _stage_blocks(spec, k)}}
            if head:
                w["head"] = params["head"]
            send = []
            if k < S and dest[k, g] != g:
                c = spec.blocks[spec.window(k)[0]]
                n = spec.nsend[k][int(lvls[k])]
                send.append({"to": devices[dest[k, g]], "channels": n, "dtype": wire,
                             "bytes": batch * c.size_out ** 2 * n * (2 if spec.float16 else 4)})
            st, shape = add(dev, f"{dev}.{k}", _stage_fn(spec, k, got, head), w, inputs, specs, send, k < S, head)
            seq.append(st)
        parts[dev] = _part_entry(dev, g, seq, spec, inp)
    order = [d for d in devices if d != devices[spec.output_group]] + [devices[spec.output_group]]
    manifest = {"format": FORMAT, "system": "separable", "run": os.path.abspath(run), "platforms": list(platforms),
                "batch": batch, "versions": export_versions(max(conventions)), "kind": "separable",
                "order": order, "root": None, "branches": [], "image_shape": list(x.shape[1:]),
                "parts": {d: parts[d] for d in order}, "links": _links(run, sent, cluster),
                "decisions": {"perm_ids": pids.tolist(), "levels": lvls.tolist(), "destinations": dest.tolist()}}
    return write_export(out, programs, stages, manifest)


def whole_network(run: str):
    """f(images float32[B, H, W, C]) -> logits: ``network.apply`` on the run's stored params and decisions, in
    one process."""
    spec, params, pids, lvls = load(run)[:4]
    fn = jax.jit(lambda x: net.apply(spec, params, x, jnp.asarray(pids), jnp.asarray(lvls)))
    return lambda x: np.asarray(fn(jnp.asarray(x, jnp.float32)))


def test_images(run: str, n: int) -> tuple:
    """(images float32[n, H, W, C], labels int32[n]): the first n test images of the run's dataset."""
    from jmsnas import data
    try:
        cfg = directory.read_config(run)  # the run's data, as separable.search.prepare loads it
        ds = data.load(cfg["dataset"], data_dir=cfg.get("data_dir"), val_fraction=cfg["val_fraction"],
                       seed=cfg["seed"], max_train=cfg.get("max_train"))
    except (directory.RunDirError, ValueError, KeyError, TypeError) as e:
        raise DeployError(f"{run}: cannot read the run's test images: {' '.join(str(e).split())}") from None
    if not 0 < n <= len(ds.test.images):
        raise DeployError(f"images must be between 1 and the {len(ds.test.images)} test images, got {n}")
    return ds.test.images[:n], ds.test.labels[:n]


def summary(raw: dict) -> dict:
    """What a separable pipeline run measured (``pipeline.run_pipeline``'s raw record), ms: the end-to-end time
    per image at the coordinator (median per phase) and each device's compute span (first stage start -> last
    stage end, median, latency phase). The equations of ``predict`` model chains, meshes and buses, not the G-way
    exchange, so no prediction stands beside it."""
    med = lambda xs: float(np.median(xs)) if len(xs) else float("nan")
    e2e = {ph: med([(v[1] - v[0]) * 1e3 for v in recs.values() if len(v) == 2])
           for ph, recs in raw["coordinator"].items()}
    first = "latency" if "latency" in raw["records"] else "stream"
    span = {d: med([(r["c1"] - r["c0"]) * 1e3 for r in recs.values()]) for d, recs in raw["records"][first].items()}
    return {"settings": raw["settings"], "measured_total_ms": e2e, "device_span_ms": span,
            "calib_ms": raw["calib_ms"]}
