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

The prediction is the search's own cost model, ``separable.cost.evaluate``, of the stored decisions on the run's
cluster (``run_cluster``: the devices' profiles of the run's config, the links as the parts store them, every bandwidth
times the pipeline's scale): per device its compute (stem, blocks, head), per link the sum of its transfers
(bytes * 8 / bandwidth + latency, every frame), and the end-to-end latency of the overlapped exchange. ``analyze``
sets the measured terms beside it in ``analysis.analyze``'s shape (``report.format_table`` prints both).
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from jmsnas.deploy.analysis import median, totals
from jmsnas.deploy.predict import link_name
from jmsnas.deploy.runtime import FORMAT, DeployError, export_versions
from jmsnas.run import directory
from jmsnas.separable import cost, decisions as dec, network as net
from jmsnas.separable.parts import read_parts
from jmsnas.topology import LinkProfile, TopologyError
from jmsnas.topology import cluster as make_cluster


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


def _part_entry(dev: str, g: int, seq: list, spec: net.NetSpec, inp: int, compute_ms: float) -> dict:
    """The manifest entry of group g's staged part: its stages, its remote inputs (the first use of each source),
    the devices its output goes to and the cost model's compute ms per image (``--compute-scale profile``)."""
    remote = {}
    for st in seq:
        for i in st["inputs"]:
            if i["from"] != "carry":
                remote.setdefault(i["from"], i)
    return {"device": dev, "group": g, "layers": list(range(spec.num_blocks)), "stem": g == inp,
            "head": g == spec.output_group, "stages": seq, "inputs": list(remote.values()),
            "output": seq[-1]["output"], "predicted_compute_ms": compute_ms,
            "to": sorted({s["to"] for st in seq for s in st["send"]}) + (["result"] if g == spec.output_group else [])}


def _links(run: str, sent: dict, cluster: list, predicted_ms: dict) -> list:
    """One link per (sender, receiver) that carries something, at the cluster's Mbit/s and latency; ``bytes``: all
    it carries per call (every step's F(x), the stem's output); ``predicted_ms``: the cost model's time of them."""
    topo = {(l["src"], l["dst"]): l for l in cluster}
    links = []
    for (a, b), nbytes in sorted(sent.items()):
        if (a, b) not in topo:
            raise DeployError(f"{run}/parts/manifest.json: the cluster has no link {a}->{b}")
        links.append({"src": a, "dst": b, "bandwidth_mbps": float(topo[(a, b)]["bandwidth_mbps"]),
                      "latency_ms": float(topo[(a, b)]["latency_ms"]), "bytes": nbytes,
                      "predicted_ms": predicted_ms.get(f"{a}->{b}")})
    return links


def export_separable(run: str, out: str | None = None, *, platforms=("cpu",), batch: int = 1) -> dict:
    """Writes ``out`` (default ``RUN/export``) as the module docstring says; returns its manifest."""
    from jmsnas.deploy.export import check_export_args, check_out, program_with_weights, write_export
    platforms = check_export_args(platforms, batch)
    out = os.path.join(run, "export") if out is None else out
    check_out(run, out)
    stored = load(run)
    spec, params, pids, lvls, devices, inp, cluster = stored
    predicted = evaluate(run, stored=stored)
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
        parts[dev] = _part_entry(dev, g, seq, spec, inp, predicted["compute_ms"][dev])
    order = [d for d in devices if d != devices[spec.output_group]] + [devices[spec.output_group]]
    manifest = {"format": FORMAT, "system": "separable", "run": os.path.abspath(run), "platforms": list(platforms),
                "batch": batch, "versions": export_versions(max(conventions)), "kind": "separable",
                "order": order, "root": None, "branches": [], "image_shape": list(x.shape[1:]),
                "parts": {d: parts[d] for d in order}, "links": _links(run, sent, cluster, predicted["link_ms"]),
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
        ds = data.from_config(directory.read_config(run))  # the run's data, as separable.search.prepare loads it
    except (directory.RunDirError, ValueError, KeyError, TypeError) as e:
        raise DeployError(f"{run}: cannot read the run's test images: {' '.join(str(e).split())}") from None
    if not 0 < n <= len(ds.test.images):
        raise DeployError(f"images must be between 1 and the {len(ds.test.images)} test images, got {n}")
    return ds.test.images[:n], ds.test.labels[:n]


def run_cluster(run: str, bandwidth_scale: float = 1.0, stored=None):
    """The run's cluster ``Topology``: its devices' profiles from the run's config (``search.build_cluster``, the
    search's own), its links as the parts store them with every bandwidth x ``bandwidth_scale``. DeployError (one
    line) when the config's devices are not the parts' devices. ``stored``: ``load(run)`` when the caller has it."""
    import ml_collections

    from jmsnas.separable.search import build_cluster
    stored = load(run) if stored is None else stored
    try:
        topo = build_cluster(ml_collections.ConfigDict(directory.read_config(run)))
        if list(topo.device_names) != list(stored.devices):
            raise TopologyError(f"its config's cluster has devices {list(topo.device_names)}, its parts "
                                f"{list(stored.devices)}")
        links = [LinkProfile(l["src"], l["dst"], float(l["bandwidth_mbps"]) * bandwidth_scale,
                             float(l["latency_ms"])) for l in stored.links]
        return make_cluster(topo.name, topo.devices, links)
    except (directory.RunDirError, TopologyError, KeyError, TypeError, AttributeError) as e:
        raise DeployError(f"{run}: cannot rebuild the run's cluster: {' '.join(str(e).split())}") from None


def evaluate(run: str, bandwidth_scale: float = 1.0, stored=None) -> dict:
    """``separable.cost.evaluate`` of the run's stored decisions on ``run_cluster(run, bandwidth_scale)`` (ms per
    image): nothing in it comes from a measurement. ``stored``: ``load(run)`` when the caller has it."""
    stored = load(run) if stored is None else stored
    return cost.evaluate(stored.spec, run_cluster(run, bandwidth_scale, stored), stored.perm_ids, stored.levels,
                         stored.input_device)


def analyze(run: str, manifest: dict, raw: dict) -> dict:
    """Predicted vs measured of a separable pipeline run (``pipeline.run_pipeline``'s raw record) in
    ``analysis.analyze``'s shape, ms per image (batch 1; with a larger batch the measured terms are per call).

    predicted: ``evaluate`` at the run's bandwidth scale -- "total" (the overlapped latency), "per_device"
    (compute), "per_link" (every transfer on the link), "synchronous_ms". measured (latency phase, else stream;
    medians over images): "total" (image sent -> logits received at the coordinator, one clock), "per_device" (the
    device's stage calls, host time x its stretch), "per_link" (sum over the link's frames of release at the
    receiver - start of transmission, on the coordinator's clock), "link_mbps" (median payload Mbit/s the
    receivers saw, over the frames long enough to tell)."""
    s = raw["settings"]
    c = evaluate(run, s["bandwidth_scale"])
    pred = {"total": c["latency_ms"], "synchronous_ms": c["synchronous_ms"], "per_device": c["compute_ms"],
            "per_link": c["link_ms"]}
    ph = "latency" if "latency" in raw["records"] else "stream"
    recs, order = raw["records"][ph], manifest["order"]
    ids = sorted(recs[order[0]])
    frames = lambda l, i: recs[l["dst"]][i].get("frames", {}).get(l["src"], [])
    link = lambda l: link_name(l["src"], l["dst"])
    m = {**totals([(v[1] - v[0]) * 1e3 for v in raw["coordinator"][ph].values() if len(v) == 2]),
         "per_device": {d: median([recs[d][i]["host_ms"] * raw["stretch"][d] for i in ids]) for d in order},
         "per_link": {link(l): median([sum(f[3] - f[0] for f in frames(l, i)) * 1e3 for i in ids])
                      for l in manifest["links"]},
         "link_mbps": {link(l): median([f[4] for i in ids for f in frames(l, i) if f[4] is not None
                                     and np.isfinite(f[4])]) for l in manifest["links"]}}
    return {"settings": s, "predicted": pred, "measured": m, "error_pct": 100.0 * (m["total"] / pred["total"] - 1.0),
            "calib_ms": raw["calib_ms"], "stretch": raw["stretch"], "clock": raw.get("clock", {}),
            "where": raw.get("where", {})}
