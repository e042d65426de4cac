"""Auto-Split end to end on a zoo network, your own model or a ``jmsnas search`` run: distortion tables,
Algorithm 1, baselines.

``autosplit(model, topology, memory_bytes, max_drop, bits)`` returns a JSON-ready dict with every method's split,
per-layer bit widths, latency breakdown (ms), bytes sent and edge memory, and for a run its measured accuracy.

* A run directory: the folded compact network (``network.load_run``). Activation ranges are calibrated on the
  first 4 batches of 64 training images; D^w, D^a are MSEs on them. A candidate's accuracy drop is measured on the
  validation split (float accuracy minus quantized accuracy, layers after the split in float; ``select_on="test"``
  checks A on the test split, the paper's protocol, where the evaluation set is the one A is stated on); the
  chosen solution and the baselines are then measured on both splits.
* A model reference (``pkg.module:factory``, ``jmsnas.traced``) with evaluation data (``--data FILE.npz`` or
  ``tfds:NAME``): the traced graph, its real weights, accuracy measured (``jmsnas.traced.quant``).
* A zoo network has no trained weights: D^w comes from He-normal weights of each layer's real shape (fan-in and
  channels; at most 64 channels sampled), D^a from standard-normal samples of its output size (at most 65,536),
  both relative to the tensor's mean square (a noise-to-signal ratio). Accuracy cannot be measured, so the
  drop of a candidate is its total relative distortion sum_i (D^w_i + D^a_i) over the edge layers (the error of
  eq. (5c)) and the threshold A bounds that sum; the output says so.
"""
from __future__ import annotations

import math
import os

import numpy as np

from jmsnas.quant import network, solver
from jmsnas.quant.quantizers import act_distortion, check_bit_set, weight_distortion
from jmsnas.split import compare, zoo
from jmsnas.topology import Topology

ZOO_NOTE = ("zoo network without trained weights: distortion from its real shapes alone (He-normal weights, "
            "normal activations, relative to their mean square); accuracy is not measured and A bounds the total "
            "relative distortion of the edge layers")


def shape_distortion(net, bit_set, seed: int = 0, max_channels: int = 64, max_elems: int = 65536):
    """(D^w, D^a) float[N, K] of a network from its shapes alone, relative to each tensor's mean square."""
    rng = np.random.default_rng(seed)
    w_el = solver.folded_weight_elems(net)
    ws, acts, has_w = [], [], []
    for l, we in zip(net.layers, w_el):
        cout = l.out_shape[-1]
        fan = max(1, int(we // cout) - (1 if l.kind in ("conv", "dwconv", "fc") else 0))
        ws.append(rng.normal(0.0, math.sqrt(2.0 / fan), (fan, min(cout, max_channels))).astype(np.float32))
        has_w.append(we > 0)
        acts.append(rng.standard_normal(min(l.out_elems, max_elems)).astype(np.float32))
    dw = weight_distortion(ws, bit_set) / np.array([np.mean(w * w) for w in ws])[:, None]
    dw[~np.array(has_w)] = 0.0
    ranges = np.array([[a.min(), a.max()] for a in acts], np.float32)
    da = act_distortion(acts, ranges, bit_set) / np.array([np.mean(a * a) for a in acts])[:, None]
    return dw, da


def _solution_json(p: solver.Solution, prob: solver.Problem) -> dict:
    return {
        "split": p.split,
        "edge_layers": list(prob.names[: p.split]),
        "bits": [{"layer": prob.names[i], "weight": (p.wbits[i] if prob.w_elems[i] > 0 else None),
                  "activation": p.abits[i]} for i in range(p.split)],
        "latency_ms": {"total": p.latency_ms, "edge": p.edge_ms, "transmit": p.transmit_ms, "cloud": p.cloud_ms},
        "sent_bytes": p.sent_bytes, "edge_memory_bytes": p.edge_memory_bytes,
        "fits_memory": bool(p.edge_memory_bytes <= prob.memory_bytes), "distortion": p.distortion,
    }


def _check(memory_bytes, max_drop):
    if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, (int, float)) or not memory_bytes > 0 \
            or not math.isfinite(memory_bytes):
        raise ValueError(f"--memory-mb must be a positive number, got {memory_bytes / 2**20 if isinstance(memory_bytes, (int, float)) else memory_bytes!r}")
    if isinstance(max_drop, bool) or not isinstance(max_drop, (int, float)) or not max_drop >= 0 \
            or not math.isfinite(max_drop):
        raise ValueError(f"--max-accuracy-drop must be a number >= 0 (a fraction, 0.01 = 1 point), got {max_drop!r}")


def _check_fits(net, w_elems, memory_bytes: float, bits) -> None:
    """ValueError when M is below the smallest edge part (the first layer at b_min, eq. (6)): nothing to split."""
    smallest = bits[0] * (w_elems[0] + net.layers[0].out_elems) / 8
    if memory_bytes < smallest:
        raise ValueError(f"--memory-mb {memory_bytes / 2**20:.6g} is below any edge part: the first layer "
                         f"{net.layers[0].name!r} alone needs {smallest / 2**20:.6g} MiB at {bits[0]} bits")


SELECT_ON = ("val", "test")


def prepare(model: str, topo: Topology, memory_bytes: float, bits, select_on: str = "val", data=None,
            data_dir=None):
    """(problem, drop function, context dict) for a zoo name, a model reference (``jmsnas.traced``: your own
    model, with evaluation ``data``) or a run directory; raises ValueError early."""
    bits = check_bit_set(bits)
    from jmsnas.traced import quant as traced_quant
    from jmsnas.traced.ref import UserModel, is_reference
    if isinstance(model, UserModel) or (model not in zoo.NAMES and is_reference(model) and not os.path.isdir(model)):
        return traced_quant.prepare(model, topo, memory_bytes, bits, select_on, data, data_dir, _check_fits)
    if data is not None:
        raise ValueError(f"--data is for model references (pkg.module:factory); {model!r} brings its own data")
    if model in zoo.NAMES:
        net = zoo.get(model)
        _check_fits(net, solver.folded_weight_elems(net), memory_bytes, bits)
        dw, da = shape_distortion(net, bits)
        prob = solver.make_problem(net, topo, memory_bytes, bits, dw, da)
        return prob, (lambda s: s.distortion), {"kind": "zoo", "name": net.name, "note": ZOO_NOTE}
    if not os.path.isdir(model):
        raise ValueError(f"--model {model!r} is neither a zoo network {list(zoo.NAMES)} nor a run directory")
    run = network.load_run(model)
    fn = run.net
    spec = network.net_spec(fn)
    _check_fits(spec, [l.params for l in spec.layers], memory_bytes, bits)
    ranges, outs = network.calibrate(fn, run.dataset.train.images)
    dw, da = network.distortion_tables(fn, ranges, outs, bits)
    prob = solver.make_problem(spec, topo, memory_bytes, bits, dw, da, w_elems=[l.params for l in spec.layers],
                               input_bits=8)
    u = len(fn.units)
    val, test = run.dataset.val, run.dataset.test
    acc = lambda split, s: network.accuracy(fn, split.images, split.labels, *s.bit_arrays(u), ranges)
    ref_val = network.accuracy(fn, val.images, val.labels, *network.float_bits(fn))
    ref_test = network.accuracy(fn, test.images, test.labels, *network.float_bits(fn))
    cache = {}
    split, ref = (val, ref_val) if select_on == "val" else (test, ref_test)

    def drop(s):
        if s.key() not in cache:
            cache[s.key()] = ref - acc(split, s) if s.split else 0.0
        return cache[s.key()]

    ctx = {"kind": "run", "name": fn.name, "run": run, "ranges": ranges, "acc": acc, "eval": {"val": val, "test": test},
           "float_accuracy": {"val": ref_val, "test": ref_test}, "result_test_accuracy":
           run.result.get("accuracy", {}).get("test")}
    return prob, drop, ctx


def autosplit(model: str, topo: Topology, memory_bytes: float, max_drop: float, bits=(2, 4, 6, 8, 16),
              latency_variants: bool = True, select_on: str = "val", data=None, data_dir=None) -> dict:
    """Runs Auto-Split and the baselines; returns (JSON-ready report, (problem, chosen solution, context))."""
    _check(memory_bytes, max_drop)
    if select_on not in SELECT_ON:
        raise ValueError(f"--select-on must be one of {list(SELECT_ON)}, got {select_on!r}")
    bits = check_bit_set(bits)
    path = compare.solvers.chain_path(topo)  # a topology without an edge -> cloud path: refused before a model loads
    prob, drop, ctx = prepare(model, topo, memory_bytes, bits, select_on, data, data_dir)
    floor = solver.potential_splits(prob)
    cands = solver.candidates(prob, latency_variants)
    chosen, chosen_drop, tried = solver.select(cands, drop, max_drop)
    methods = {"cloud_only": solver.cloud_only(prob), "edge_only_u8": solver.edge_only_u8(prob),
               "neurosurgeon": solver.neurosurgeon(prob), "u8_split": solver.u8_split(prob),
               "autosplit": chosen}
    out = {"model": ctx["name"], "kind": ctx["kind"], "topology": topo.name,
           "edge_device": topo.devices[path[0]].name, "cloud_device": topo.devices[path[-1]].name,
           "links_mbps": {ln: l.bandwidth_mbps for ln, l in zip(topo.link_names, topo.links)},
           "memory_limit_bytes": memory_bytes, "max_accuracy_drop": max_drop, "bits": list(bits),
           "potential_splits": floor, "candidates": len(cands), "candidates_checked": tried,
           "layers": len(prob.names), "methods": {}}
    if ctx["kind"] == "zoo":
        out["note"] = ctx["note"]
    for name, s in methods.items():
        j = _solution_json(s, prob)
        j["method"] = s.method
        if "acc" in ctx:
            if j["fits_memory"]:
                j["accuracy"] = {k: ctx["acc"](split, s) for k, split in ctx["eval"].items()}
                j["accuracy_drop"] = {k: ctx["float_accuracy"][k] - v for k, v in j["accuracy"].items()}
        else:
            j["relative_distortion"] = s.distortion
        out["methods"][name] = j
    if "acc" in ctx:
        out["float_accuracy"] = ctx["float_accuracy"]
        out["selected_on"] = select_on
    if ctx["kind"] == "run":
        out["search_result_test_accuracy"] = ctx["result_test_accuracy"]
    if ctx["kind"] == "traced":
        out["data"] = ctx["data"]
    return out, (prob, chosen, ctx)
