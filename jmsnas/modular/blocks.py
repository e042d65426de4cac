"""A trained network as a chain of blocks (paper 002's M = Block_1 || ... || Block_N), each with its parameters
and a JSON spec from which its forward is rebuilt, so a child saved to disk can run without the code that built it.

Three sources (the third, your own model traced, is ``jmsnas.modular.traced.from_traced``; ``api.load_network``
picks one by the model's name):

* ``from_run(run_dir)``: the derived network of a ``jmsnas search`` run (``config.json``, ``result.json`` and
  ``parts/*.npz``): block 0 is the stem, blocks 1..L the searched layers, block L+1 the head. Batch norm runs in
  inference mode with the stored statistics; the forward is the same ``ops`` code as
  ``supernet.compact_apply``. Chain runs only (a mesh aggregator reads several layers at once).
* ``from_zoo(name, key)``: a ``split.zoo`` network at its real parameter shapes with random (He-scaled) weights,
  for loading-time measurements. A block is a run of layers between two cut points (places where exactly one
  tensor is live), so a ResNet bottleneck with its shortcut is one block. Activations are ReLU, batch norm is a
  per-channel scale and shift (its inference form); parameter counts equal the zoo's (and torchvision's).

``forward(specs)`` returns a jitted ``f(params_list, x) -> y`` for consecutive blocks; ``x`` is NHWC float32.
"""
from __future__ import annotations

import base64
import functools
import hashlib
import json
import math
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmsnas import ops as O
from jmsnas.run import directory
from jmsnas.space import OPS


class ModularError(ValueError):
    """A bad input to modularizing or loading (one line naming the value and what was expected)."""


class Block(NamedTuple):
    name: str
    spec: dict  # JSON-serialisable; block_apply(spec, params, x) rebuilds the forward
    params: dict  # pytree of float32 numpy arrays


class Network(NamedTuple):
    name: str
    input_shape: tuple  # (H, W, C) of one image
    blocks: tuple  # of Block


def block_bytes(block: Block) -> int:
    """Bytes of a block's parameters (float32: 4 per value)."""
    return int(sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(block.params)))


def block_arrays(block: Block) -> int:
    """Number of arrays (checkpoint leaves) of a block."""
    return len(jax.tree_util.tree_leaves(block.params))


def tree_sha256(tree) -> str:
    """sha256 of a pytree's leaf paths, shapes, dtypes and bytes (in path order)."""
    h = hashlib.sha256()
    for path, leaf in sorted(jax.tree_util.tree_flatten_with_path(tree)[0], key=lambda t: jax.tree_util.keystr(t[0])):
        a = np.ascontiguousarray(leaf)
        h.update(f"{jax.tree_util.keystr(path)}|{a.shape}|{a.dtype}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def fingerprint(net: Network) -> str:
    """sha256 (16 hex digits) of the name, input shape, block specs and every parameter (``tree_sha256``)."""
    head = json.dumps([net.name, list(net.input_shape), [b.spec for b in net.blocks]], sort_keys=True)
    return hashlib.sha256((head + tree_sha256([b.params for b in net.blocks])).encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------------------------ forward

def _conv(x, w, stride: int, groups: int):
    return jax.lax.conv_general_dilated(x, w, (stride, stride), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                        feature_group_count=groups)


def _zoo_layer(layer: dict, p: dict, xs: list):
    kind = layer["kind"]
    if kind in ("conv", "dwconv"):
        y = _conv(xs[0], p["w"], layer["stride"], layer["groups"]) * p["scale"] + p["shift"]
        return jax.nn.relu(y) if layer["relu"] else y
    if kind == "se":
        s = jax.nn.relu(jnp.mean(xs[0], axis=(1, 2)) @ p["w1"] + p["b1"])
        return xs[0] * jax.nn.sigmoid(s @ p["w2"] + p["b2"])[:, None, None, :]
    if kind == "add":
        y = xs[0] + xs[1]
        return jax.nn.relu(y) if layer["relu"] else y
    if kind == "maxpool":
        return jax.lax.reduce_window(xs[0], -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1),
                                     ((0, 0), (1, 1), (1, 1), (0, 0)))
    if kind == "avgpool":
        return jnp.mean(xs[0], axis=(1, 2))
    if kind == "fc":
        return xs[0] @ p["w"] + p["b"]
    raise ModularError(f"unknown zoo layer kind {kind!r}")


def _jmsnas_block(spec: dict, p: dict, x):
    from jmsnas.space import OPS, op_index
    part = spec["part"]
    if part == "stem":
        return O.conv_bn_apply(p["params"], p["state"], x, spec["stride"], False)[0]
    if part == "head":
        return O.head_apply(p["params"], p["state"], x, False)[0]
    return O.op_apply(p.get("params", {}), p.get("state", {}), x, OPS[op_index(spec["op"])], spec["stride"], False,
                      spec.get("dw_impl", "auto"))[0]


def block_apply(spec: dict, params: dict, x):
    """Output of one block for input x [B, ...] (NHWC for images)."""
    if spec["kind"] == "jmsnas":
        return _jmsnas_block(spec, params, x)
    if spec["kind"] == "traced":  # your own model (jmsnas.modular.traced): a serialized jax.export program
        return _exported(spec["program"]).call(*[params[k] for k in spec["args"]], x)
    outs = []
    for layer in spec["layers"]:
        xs = [x if i < 0 else outs[i] for i in layer["inputs"]]
        outs.append(_zoo_layer(layer, params.get(f"l{len(outs)}", {}), xs))
    return outs[-1]


@functools.lru_cache(maxsize=256)
def _exported(program: str):
    from jax import export as jax_export
    return jax_export.deserialize(bytearray(base64.b64decode(program)))


@functools.lru_cache(maxsize=256)
def _forward(specs_json: str):
    specs = json.loads(specs_json)

    def f(params_list, x):
        for spec, p in zip(specs, params_list):
            x = block_apply(spec, p, x)
        return x

    return jax.jit(f)


def forward(specs) -> callable:
    """Jitted ``f(params_list, x)`` running the blocks of ``specs`` (a list of block specs) in order; cached by
    spec, so a child's function compiles once per input shape."""
    return _forward(json.dumps(list(specs), sort_keys=True))


# ------------------------------------------------------------------------------------------------ zoo networks

def _zoo_layer_spec(net, i: int, local: dict) -> tuple:
    """(layer spec dict, param shapes dict) of zoo layer i; ``local`` maps global layer index -> block position."""
    from jmsnas.split.zoo import INPUT_SHAPE
    L = net.layers[i]
    srcs = L.inputs or (-1,)
    in_shape = INPUT_SHAPE if srcs[0] < 0 else net.layers[srcs[0]].out_shape
    inputs = [local.get(j, -1) for j in srcs]
    spec = {"name": L.name, "kind": L.kind, "inputs": inputs}
    shapes = {}
    leaf = L.name.rsplit(".", 1)[-1]
    if L.kind in ("conv", "dwconv"):
        cin, cout = in_shape[-1], L.out_shape[-1]
        groups = cin if L.kind == "dwconv" else 1
        k = math.isqrt((L.params - 2 * cout) // (cout * (cin // groups)))
        if cout * (cin // groups) * k * k + 2 * cout != L.params:
            raise ModularError(f"zoo layer {L.name!r}: cannot recover a kernel size from {L.params} parameters")
        spec.update(stride=int(round(in_shape[0] / L.out_shape[0])), groups=groups,
                    relu=leaf not in ("project", "conv3", "downsample"))
        shapes = {"w": (k, k, cin // groups, cout), "scale": (cout,), "shift": (cout,)}
    elif L.kind == "se":
        c = in_shape[-1]
        sq = (L.params - c) // (2 * c + 1)
        shapes = {"w1": (c, sq), "b1": (sq,), "w2": (sq, c), "b2": (c,)}
    elif L.kind == "add":
        spec["relu"] = L.name.startswith("layer")  # ResNet: ReLU after the sum; MBConv: none
    elif L.kind == "pool":
        spec["kind"] = "avgpool" if len(L.out_shape) == 1 else "maxpool"
    elif L.kind == "fc":
        shapes = {"w": (in_shape[-1], L.out_shape[-1]), "b": (L.out_shape[-1],)}
    return spec, shapes


def zoo_cut_points(net) -> list:
    """Layer indices i after which exactly one tensor (layer i's output) is live: no later layer reads an
    earlier one. The last layer is always a cut point."""
    n = len(net.layers)
    earliest_read_after = [n] * n  # min input index over layers j > i
    low = n
    for j in range(n - 1, -1, -1):
        earliest_read_after[j] = low
        ins = net.layers[j].inputs or (-1,)
        low = min(low, *ins)
    return [i for i in range(n) if earliest_read_after[i] >= i]


def _init_param(rng, name: str, shape: tuple) -> np.ndarray:
    if name in ("w", "w1", "w2"):
        fan_in = int(np.prod(shape[:-1]))
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(math.sqrt(2.0 / fan_in)))
    if name == "scale":
        return np.ones(shape, np.float32)
    return np.zeros(shape, np.float32)


def from_zoo(name: str, seed: int = 0) -> Network:
    """Zoo network ``name`` with random weights at its real parameter shapes, one block per cut-point run."""
    from jmsnas.split import zoo
    try:
        net = zoo.get(name)
    except ValueError as e:
        raise ModularError(str(e)) from None
    rng = np.random.default_rng(seed)
    blocks, start = [], 0
    for cut in zoo_cut_points(net):
        local, layers, params = {}, [], {}
        for i in range(start, cut + 1):
            spec, shapes = _zoo_layer_spec(net, i, local)
            local[i] = len(layers)
            layers.append(spec)
            if shapes:  # keyed by position: orbax joins tree keys with ".", which zoo names contain
                params[f"l{local[i]}"] = {k: _init_param(rng, k, s) for k, s in shapes.items()}
        label = net.layers[start].name if start == cut else f"{net.layers[start].name}..{net.layers[cut].name}"
        blocks.append(Block(label, {"kind": "zoo", "layers": layers}, params))
        start = cut + 1
    return Network(net.name, tuple(zoo.INPUT_SHAPE), tuple(blocks))


# ------------------------------------------------------------------------------------------------ jmsnas runs

def run_config(run_dir: str, config=None):
    """The run's configuration: ``config`` if given, else ``<run_dir>/config.json`` (``run.directory``)."""
    import ml_collections
    if config is not None:
        return config
    if not os.path.isfile(os.path.join(run_dir, directory.CONFIG)):
        raise ModularError(f"run directory {run_dir!r} has no config.json; pass the run's config file "
                           "(--config FILE)")
    try:
        return ml_collections.ConfigDict(directory.read_config(run_dir))
    except directory.RunDirError as e:
        raise ModularError(str(e)) from None


def from_run(run_dir: str, config=None) -> Network:
    """The derived network of the ``jmsnas search`` run in ``run_dir`` (stem, layers, head as blocks): its space
    and architecture from result.json, its weights from parts/ (``run.directory``)."""
    try:
        space, ops, params, state = directory.read_compact(run_dir)
        cfg = run_config(run_dir, config)
    except directory.RunDirError as e:
        raise ModularError(str(e)) from None
    if space.topology.kind == "mesh":
        raise ModularError(f"run {run_dir!r} has a mesh topology; modularizing needs a chain (one tensor "
                           "between consecutive layers)")
    return from_compact(space, ops, params, state, f"jmsnas-run:{os.path.basename(os.path.abspath(run_dir))}",
                        cfg.get("dw_impl", "auto"))


def from_compact(space, ops, params, state, name: str = "jmsnas", dw_impl: str = "auto") -> Network:
    """Blocks of a compact network (``supernet.extract``'s params and state) of a chain space."""
    to_np = lambda t: jax.tree_util.tree_map(lambda a: np.asarray(a, np.float32), t)
    blocks = [Block("stem", {"kind": "jmsnas", "part": "stem", "stride": space.stem_stride},
                    to_np({"params": params["stem"], "state": state["stem"]}))]
    for s, i in zip(space.layers, ops):
        op = OPS[int(i)].name
        blocks.append(Block(f"layer{s.index}:{op}", {"kind": "jmsnas", "part": "layer", "op": op, "stride": s.stride,
                                                     "dw_impl": dw_impl},
                            to_np({"params": params["layers"][s.index], "state": state["layers"][s.index]})))
    blocks.append(Block("head", {"kind": "jmsnas", "part": "head"},
                        to_np({"params": params["head"], "state": state["head"]})))
    return Network(name, (space.image_size, space.image_size, space.in_channels), tuple(blocks))
