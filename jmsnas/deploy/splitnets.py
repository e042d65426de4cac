"""SplitNets' searched network (``jmsnas evolve`` with a ``splitnets`` block, paper 000) as deployable parts.

``export_splitnets(run)`` reads ``RUN/parts/`` (``splitnets.search.write_parts``: ``sensor.npz``, ``aggregator.npz``
and the manifest with the split-aware space) and writes ``RUN/export/`` in the deploy format (``runtime.FORMAT``),
a star of V sensors on one shared bus into the aggregator (``kind: "bus"``):

* ``sensor0`` .. ``sensor{V-1}``: each runs the on-sensor part on its own view (``inputs[0]["view"]`` = v of the
  images float32[B, V, s, s, C]): the stem, the on-sensor blocks and the Conv-Reduce, and sends its d channels
  float32[B, s', s', d] to the aggregator. The V sensors run the same program and weights (the views share them);
* ``aggregator``: takes the V reduced features in view order, fuses them (View-Fuse, ``splitnets.module.fuse``;
  one view: Conv-Recover) and runs the on-aggregator blocks and the head to the logits.

The bus is shared as the cost model shares it (``splitnets.hardware.comm_ms``): every sensor's link runs at
bus_mbps / V, all V at once, so the V transfers take as long as the V payloads one after the other. Eq. for the
pipeline's prediction (``predict.total_ms``): T = max_v (sensor_v + link_v) + aggregator.

``whole_network(run)`` composes the same pieces in one process; the tests hold the deployed outputs against the
training code's own forward pass (``splitnets.net.apply_fixed`` on the supernet's weights).
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from jmsnas import ops as O
from jmsnas.deploy.runtime import FORMAT, MANIFEST, DeployError, export_versions
from jmsnas.run import directory
from jmsnas.space import OPS, op_index
from jmsnas.splitnets import module as SM
from jmsnas.splitnets.space import SplitSpace


def is_splitnets(run: str) -> bool:
    """Whether ``run`` holds SplitNets parts (its parts manifest records the views and the split)."""
    try:
        with open(os.path.join(run, directory.PARTS, MANIFEST), encoding="utf-8") as f:
            m = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(m, dict) and "views" in m and isinstance(m.get("split"), dict) \
        and set(m.get("devices", {})) == {"sensor", "aggregator"}


def load(run: str) -> tuple:
    """(SplitSpace, parts manifest, {"sensor": nested weights, "aggregator": ...}) of a SplitNets run."""
    try:
        pm = directory.read_manifest(run)
        if "splitnets_space" not in pm:
            raise DeployError(f"{run}/parts/manifest.json records no split-aware space (written by an older jmsnas); "
                              "run jmsnas evolve again to deploy it")
        space = SplitSpace(**{k: tuple(v) if isinstance(v, list) else v for k, v in pm["splitnets_space"].items()})
        weights = {d: directory.unflatten(directory.read_part(run, d, pm["devices"][d]))
                   for d in ("sensor", "aggregator")}
    except directory.RunDirError as e:
        raise DeployError(str(e)) from None
    except (TypeError, ValueError) as e:
        raise DeployError(f"{run}/parts/manifest.json: its space is not a SplitNets space: {e}") from None
    return space, pm, weights


def _blocks(space: SplitSpace, layers, params, state, h):
    for layer in layers:
        p, j = int(layer["phase"]), int(layer["slot"])
        op = OPS[op_index(layer["op"])]
        key = f"{p}.{j}"
        h, _ = O.mbconv_apply(params["blocks"][key], state["blocks"][key], h, op, space.slot(p, j)[4], False, "xla")
    return h


def sensor_forward(space: SplitSpace, layers):
    """f(params, state, view float32[B, s, s, C]) -> the reduced features float32[B, s', s', d]."""
    def f(params, state, x):
        h, _ = O.conv_bn_apply(params["stem"], state["stem"], x, 1, False, "xla")
        h = _blocks(space, layers, params, state, h)
        return SM.reduce(params, h, params["reduce"].shape[-1])
    return f


def aggregator_forward(space: SplitSpace, layers):
    """f(params, state, *V reduced features) -> logits float32[B, classes] (View-Fuse or Conv-Recover first)."""
    def f(params, state, *zs):
        if space.views == 1:
            h = SM.recover(params, zs[0])
        else:
            z = jnp.stack(zs, axis=1)  # [B, V, s, s, d]: view-major, as the training code folds the views
            h = SM.fuse(params, z.reshape((-1,) + z.shape[2:]), space.views)
        h = _blocks(space, layers, params, state, h)
        return O.head_apply(params["head"], state["head"], h, False)[0]
    return f


def _tree(weights: dict) -> tuple:
    return weights.get("params", {}), weights.get("bn", {})


def sensor_names(views: int) -> list:
    return [f"sensor{v}" for v in range(views)]


def export_splitnets(run: str, out: str | None = None, *, platforms=("cpu",), batch: int = 1) -> dict:
    """Writes ``out`` (default ``RUN/export``) as the module docstring says; returns its manifest."""
    from jmsnas.deploy.export import check_export_args, check_out, program_with_weights, write_export
    platforms = check_export_args(platforms, batch)
    out = os.path.join(run, "export") if out is None else out
    check_out(run, out)
    space, pm, weights = load(run)
    try:
        result = directory.read_result(run)
    except directory.RunDirError as e:
        raise DeployError(str(e)) from None
    V, s = space.views, space.image_size
    hw = result.get("splitnets", {})
    bus_mbps = float(pm.get("bus_mbps") or 0.0)
    sensors = sensor_names(V)
    view = jax.ShapeDtypeStruct((batch, s, s, space.in_channels), jnp.float32)
    sen_exp, sen_w = program_with_weights(sensor_forward(space, pm["devices"]["sensor"]["layers"]),
                                          weights["sensor"], [view], platforms)
    feat = jax.ShapeDtypeStruct(tuple(sen_exp.out_avals[0].shape), jnp.float32)
    agg_exp, agg_w = program_with_weights(aggregator_forward(space, pm["devices"]["aggregator"]["layers"]),
                                          weights["aggregator"], [feat] * V, platforms)
    shape = lambda a: [int(d) for d in a.shape]
    lat = result.get("latency_ms", {})
    programs, parts = {}, {}
    for v, d in enumerate(sensors):
        programs[d] = (sen_exp.serialize(), sen_w)
        parts[d] = {"device": d, "layers": pm["devices"]["sensor"]["layers"], "stem": True, "head": False,
                    "weight_names": sorted(sen_w), "inputs": [{"from": "image", "view": v, "shape": shape(view),
                                                               "dtype": "float32"}],
                    "output": {"shape": shape(feat), "dtype": "float32"}, "to": ["aggregator"],
                    "predicted_compute_ms": lat.get("per_device", {}).get("sensor")}
    programs["aggregator"] = (agg_exp.serialize(), agg_w)
    parts["aggregator"] = {"device": "aggregator", "layers": pm["devices"]["aggregator"]["layers"], "stem": False,
                           "head": True, "weight_names": sorted(agg_w),
                           "inputs": [{"from": d, "shape": shape(feat), "dtype": "float32"} for d in sensors],
                           "output": {"shape": shape(agg_exp.out_avals[0]), "dtype": "float32"}, "to": ["result"],
                           "predicted_compute_ms": lat.get("per_device", {}).get("aggregator")}
    if not bus_mbps > 0:
        raise DeployError(f"{run}/parts/manifest.json records no bus bandwidth (bus_mbps); run jmsnas evolve again")
    nbytes = int(np.prod(feat.shape)) * 4
    links = [{"src": d, "dst": "aggregator", "bandwidth_mbps": bus_mbps / V, "latency_ms": 0.0, "bytes": nbytes,
              "predicted_ms": None} for d in sensors]
    manifest = {"format": FORMAT, "system": "splitnets", "run": os.path.abspath(run), "platforms": list(platforms),
                "batch": batch, "versions": export_versions(int(max(sen_exp.calling_convention_version,
                                                                    agg_exp.calling_convention_version))),
                "kind": "bus", "order": sensors + ["aggregator"], "root": None, "branches": [],
                "image_shape": [V, s, s, space.in_channels],
                "bus": {"bandwidth_mbps": bus_mbps, "senders": V, "split": pm["split"]},
                "parts": parts, "links": links, "predicted_latency_ms": lat, "architecture": result.get("architecture"),
                "splitnets": hw}
    return write_export(out, programs, parts, manifest)


def whole_network(run: str):
    """f(images float32[B, V, s, s, C]) -> logits: every view through the sensor part, then the aggregator, in one
    process (the parts' own functions, not the exported programs)."""
    space, pm, weights = load(run)
    sen = sensor_forward(space, pm["devices"]["sensor"]["layers"])
    agg = aggregator_forward(space, pm["devices"]["aggregator"]["layers"])
    (sp, ss), (ap, ast) = _tree(weights["sensor"]), _tree(weights["aggregator"])
    fn = jax.jit(lambda x: agg(ap, ast, *[sen(sp, ss, x[:, v]) for v in range(space.views)]))
    return lambda x: np.asarray(fn(jnp.asarray(x, jnp.float32)))


def test_images(run: str, n: int) -> tuple:
    """(images float32[n, V, s, s, C], labels int32[n]): the first n multi-view test images of the run's dataset
    (``splitnets.views`` of its config)."""
    import ml_collections

    from jmsnas.splitnets import search, views as VW
    try:
        cfg = search.with_defaults(ml_collections.ConfigDict(directory.read_config(run)))
        ds = VW.load(cfg.dataset, views=cfg.splitnets.views, view_size=cfg.splitnets.view_size,
                     data_dir=cfg.get("data_dir"), val_fraction=cfg.val_fraction, seed=cfg.seed,
                     image_size=cfg.get("image_size"), max_train=cfg.get("max_train"))
    except (directory.RunDirError, ValueError, KeyError, AttributeError) as e:
        raise DeployError(f"{run}: cannot read the run's multi-view test images: {' '.join(str(e).split())}") \
            from None
    if not 0 < n <= len(ds.test.images):
        raise DeployError(f"images must be between 1 and the {len(ds.test.images)} test images, got {n}")
    return ds.test.images[:n], ds.test.labels[:n]
