"""The compact network of a ``jmsnas search`` run as batch-norm-folded units, and its quantized forward.

A run directory holds ``config.json`` (the resolved configuration), ``result.json`` (the architecture) and
``parts/*.npz`` + ``parts/manifest.json`` (the retrained weights and batch-norm statistics per device).
``load_run`` rebuilds the compact network from them and folds every eval-mode batch norm into its convolution
(w' = w * s, b' = bias - mean * s with s = scale / sqrt(var + eps); Auto-Split's graph optimisation, Fig. 4b).
The result is a chain of units in topological order (the DAG of ``graph.NetSpec``):

* ``conv``: the stem, k x k convolution + bias + ReLU6;
* per MBConv layer ``pw`` expand (+ ReLU6), ``dw`` depthwise (+ ReLU6), ``pw`` project (+ the layer input when
  the op has a shortcut, so that unit reads two tensors); identity layers add no unit;
* ``pw`` head convolution (+ ReLU6) and ``fc`` (global average pool, dense layer).

``forward(net, params, x, wbits, abits, ranges)`` quantizes unit i's weights at wbits[i] and its output at
abits[i] (0 = float; traced int32[U] arrays, so one compiled program serves every bit assignment and split).
"""
from __future__ import annotations

import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmsnas import data
from jmsnas.dwconv import depthwise_conv
from jmsnas.graph import LayerSpec, NetSpec
from jmsnas.ops import BN_EPS, full_conv
from jmsnas.quant.quantizers import act_distortion, fake_quant_act, fake_quant_weight, weight_distortion
from jmsnas.run import directory as RD
from jmsnas.space import OPS


class Unit(NamedTuple):
    """One quantizable layer (static): kind, stride, ReLU6, inputs (unit indices, -1 = image; a second input is
    added after the layer), output shape per image."""

    name: str
    kind: str
    stride: int
    relu6: bool
    inputs: tuple
    out_shape: tuple


class FoldedNet(NamedTuple):
    """units: tuple of Unit (static, hashable); params: tuple of {"w", "b"} float32 arrays; input_shape (H, W, C)."""

    name: str
    units: tuple
    params: tuple
    input_shape: tuple


class Run(NamedTuple):
    """A loaded search run: its folded network, configuration, result and data set."""

    directory: str
    net: FoldedNet
    config: dict
    result: dict
    dataset: data.Dataset


def _fold(w, bn, stats):
    s = np.asarray(bn["scale"]) / np.sqrt(np.asarray(stats["var"]) + BN_EPS)
    return {"w": np.asarray(w, np.float32) * s.astype(np.float32),
            "b": (np.asarray(bn["bias"]) - np.asarray(stats["mean"]) * s).astype(np.float32)}


def fold_compact(name: str, space, ops, params, state) -> FoldedNet:
    """Folds a compact network (``supernet.extract`` layout: params/state with stem, layers, head) into units."""
    units, folded = [], []

    def add(unit_name, kind, stride, relu6, inputs, shape, p):
        units.append(Unit(unit_name, kind, stride, relu6, tuple(inputs), tuple(int(v) for v in shape)))
        folded.append(p)
        return len(units) - 1

    hw = space.stem_out_hw
    t = add("stem", "conv", space.stem_stride, True, (-1,), (hw, hw, space.stem_channels),
            _fold(params["stem"]["w"], params["stem"]["bn"], state["stem"]["bn"]))
    for s, i in zip(space.layers, ops):
        op, p, st = OPS[int(i)], params["layers"][s.index], state["layers"][s.index]
        if op.is_identity:
            continue
        mid = s.in_ch * op.expand
        e = add(f"layer{s.index}.expand", "pw", 1, True, (t,), (s.in_hw, s.in_hw, mid),
                _fold(p["expand"], p["bn1"], st["bn1"]))
        d = add(f"layer{s.index}.dw", "dw", s.stride, True, (e,), (s.out_hw, s.out_hw, mid),
                _fold(p["dw"], p["bn2"], st["bn2"]))
        t = add(f"layer{s.index}.project", "pw", 1, False, (d, t) if op.residual else (d,),
                (s.out_hw, s.out_hw, s.out_ch), _fold(p["project"], p["bn3"], st["bn3"]))
    h = params["head"]
    last = space.layers[-1]
    t = add("head.conv", "pw", 1, True, (t,), (last.out_hw, last.out_hw, space.head_channels),
            _fold(h["conv"], h["bn"], state["head"]["bn"]))
    add("head.fc", "fc", 1, False, (t,), (space.num_classes,),
        {"w": np.asarray(h["dense_w"], np.float32), "b": np.asarray(h["dense_b"], np.float32)})
    params_j = tuple({k: jnp.asarray(v) for k, v in p.items()} for p in folded)
    return FoldedNet(name, tuple(units), params_j, (space.image_size, space.image_size, space.in_channels))


def load_run(run: str) -> Run:
    """The folded compact network, configuration, result and data of the search run in ``run`` (read through
    ``run.directory``: the space and architecture from result.json, the weights from parts/)."""
    try:
        result = RD.read_result(run)
        cfg = RD.read_config(run)
        space, ops, params, state = RD.read_compact(run)
    except RD.RunDirError as e:
        raise ValueError(str(e)) from None
    if space.topology.kind != "chain":
        raise ValueError(f"run {run!r} searched a {space.topology.kind} topology; autosplit reads chain runs "
                         "(a mesh's parallel branches have no single edge/cloud cut)")
    net = fold_compact(os.path.basename(os.path.normpath(run)), space, ops, params, state)
    ds = data.from_config(cfg)
    return Run(run, net, cfg, result, ds)


# ----------------------------------------------------------------------------------------------- forward

def unit_output(u: Unit, p, outs: dict, impl: str = "auto"):
    """One folded unit (``outs``: {unit index: output, -1: the image}): layer, ReLU6 if any, plus its second
    input; ``impl`` "xla" keeps the program free of custom calls (an exported part)."""
    h = outs[u.inputs[0]]
    if u.kind == "conv":
        y = full_conv(h, p["w"], u.stride, impl) + p["b"]
    elif u.kind == "dw":
        y = depthwise_conv(h, p["w"], u.stride, impl) + p["b"]
    elif u.kind == "pw":
        y = jnp.einsum("bhwc,cd->bhwd", h, p["w"]) + p["b"]
    else:  # fc
        y = jnp.mean(h, axis=(1, 2)) @ p["w"] + p["b"]
    if u.relu6:
        y = jax.nn.relu6(y)
    for j in u.inputs[1:]:
        y = y + outs[j]
    return y


def forward_all(units: tuple, params, x, wbits, abits, ranges):
    """Every unit's output (a list) for images x float[B, H, W, C]; unit i's weights at wbits[i], its output at
    abits[i] over ranges[i] = (lo, hi) (int32[U], int32[U], float32[U, 2]; bits 0 = float)."""
    outs = {-1: x}
    for i, u in enumerate(units):
        p = {"w": fake_quant_weight(params[i]["w"], wbits[i]), "b": params[i]["b"]}
        outs[i] = fake_quant_act(unit_output(u, p, outs), ranges[i, 0], ranges[i, 1], abits[i])
    return [outs[i] for i in range(len(units))]


_forward_all = jax.jit(forward_all, static_argnames=("units",))
EVAL_BATCH = 256  # every batch is padded to this size, so calibration and evaluation share one compilation


def _padded(x):
    x = np.asarray(x, np.float32)
    return jnp.asarray(np.concatenate([x, np.zeros((EVAL_BATCH - len(x),) + x.shape[1:], np.float32)]))


def forward(units: tuple, params, x, wbits, abits, ranges):
    """Logits float32[B, classes] of the (partly) quantized network (see ``forward_all``)."""
    return forward_all(units, params, x, wbits, abits, ranges)[-1]


def float_bits(net: FoldedNet):
    """(wbits, abits, ranges) meaning "no quantization" for every unit."""
    u = len(net.units)
    return np.zeros(u, np.int32), np.zeros(u, np.int32), np.zeros((u, 2), np.float32)


def calibrate(net: FoldedNet, images: np.ndarray):
    """(ranges float32[U, 2] = per-unit (min, max) of the float outputs, outputs: list of float32 arrays) on the
    first ``EVAL_BATCH`` images (the calibration data: 4 batches of 64)."""
    x = np.asarray(images[:EVAL_BATCH], np.float32)
    if len(x) == 0:
        raise ValueError("calibration needs at least one image")
    outs = [np.asarray(o)[: len(x)] for o in _forward_all(net.units, net.params, _padded(x), *float_bits(net))]
    ranges = np.array([[o.min(), o.max()] for o in outs], np.float32)
    return ranges, outs


def distortion_tables(net: FoldedNet, ranges, outputs, bit_set):
    """(D^w float[U, K], D^a float[U, K]): MSE of every unit's folded weights and calibrated outputs at each b."""
    return weight_distortion([p["w"] for p in net.params], bit_set), act_distortion(outputs, ranges, bit_set)


def accuracy(net: FoldedNet, images, labels, wbits, abits, ranges) -> float:
    """Top-1 accuracy in [0, 1] of the network quantized as given."""
    correct = 0
    args = (jnp.asarray(wbits, jnp.int32), jnp.asarray(abits, jnp.int32), jnp.asarray(ranges, jnp.float32))
    for s in range(0, len(images), EVAL_BATCH):
        x = images[s:s + EVAL_BATCH]
        logits = np.asarray(_forward_all(net.units, net.params, _padded(x), *args)[-1])[: len(x)]
        correct += int(np.sum(np.argmax(logits, -1) == np.asarray(labels[s:s + EVAL_BATCH])))
    return correct / max(1, len(images))


def net_spec(net: FoldedNet) -> NetSpec:
    """The folded network as a ``graph.NetSpec`` (params = folded weights + biases) for costs and memory."""
    layers = []
    shape = lambda j: net.input_shape if j < 0 else net.units[j].out_shape
    for u, p in zip(net.units, net.params):
        cin = shape(u.inputs[0])[-1]
        out = u.out_shape
        k = p["w"].shape[0]
        macs = {"conv": np.prod(out) * k * k * cin, "dw": np.prod(out) * k * k, "pw": np.prod(out) * cin,
                "fc": out[0] * cin}[u.kind]
        kind = {"conv": "conv", "dw": "dwconv", "pw": "conv", "fc": "fc"}[u.kind]
        layers.append(LayerSpec(u.name, kind, int(macs), int(p["w"].size + p["b"].size), out,
                                tuple(j for j in u.inputs if j >= 0)))
    spec = NetSpec(net.name, tuple(net.input_shape), tuple(layers))
    spec.validate()
    return spec
