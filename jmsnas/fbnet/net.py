"""FBNet networks as pure functions over explicit parameter and batch-norm state dicts (NHWC).

Block kK_eE[_gG] on layer (C -> C', stride s): 1 x 1 convolution C -> E*C in G groups, BN, ReLU, channel shuffle
(G > 1), K x K depthwise convolution (stride s), BN, ReLU, 1 x 1 convolution E*C -> C' in G groups, BN, plus the
input when the shape is kept. ``skip``: the input where the shape is kept, else 1 x 1 convolution (stride s), BN,
ReLU (FBNet's ``Identity``). Stem: 3 x 3 convolution, BN, ReLU; head: 1 x 1 convolution, BN, ReLU, global average
pool, dense.

Two forms: ``init``/``apply`` of one fixed architecture (what is deployed and timed), and a weight-sharing
``supernet_init``/``supernet_apply`` holding every candidate of every layer, whose architecture argument is a
traced int32[22] (``lax.switch`` per layer), so one compiled step serves every sub-network.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jmsnas import ops as O
from jmsnas.dwconv import depthwise_conv
from jmsnas.fbnet.space import Block, FBNetSpace, Layer


def _grouped_pointwise(x, w):
    """1 x 1 convolution in G groups: x[..., G*Ci], w[G, Ci, Co] -> [..., G*Co]."""
    g, ci, co = w.shape
    if g == 1:
        return O.pointwise(x, w[0])
    xs = x.reshape(x.shape[:-1] + (g, ci))
    return jnp.einsum("...gi,gio->...go", xs, w).reshape(x.shape[:-1] + (g * co,))


def _shuffle(x, groups: int):
    """ShuffleNet's channel shuffle: (G, C/G) -> (C/G, G)."""
    if groups == 1:
        return x
    c = x.shape[-1]
    return jnp.swapaxes(x.reshape(x.shape[:-1] + (groups, c // groups)), -1, -2).reshape(x.shape)


def _bn_relu(p, st, x, train: bool, relu: bool = True):
    y, new = O.batch_norm(p, st, x, train, impl="xla")
    return (jax.nn.relu(y) if relu else y), new


def block_init(key, block: Block, layer: Layer):
    """Parameters and BN state of ``block`` on ``layer`` (skip keeping the shape has none)."""
    if block.is_skip:
        if layer.keeps_shape:
            return {}, {}
        params = {"conv": O._he(key, (layer.in_ch, layer.out_ch), layer.in_ch)}
        params["bn"], bn = O.bn_init(layer.out_ch)
        return params, {"bn": bn}
    g, mid = block.groups, layer.in_ch * block.expand
    k1, k2, k3 = jax.random.split(key, 3)
    params = {"expand": O._he(k1, (g, layer.in_ch // g, mid // g), layer.in_ch // g),
              "dw": O._he(k2, (block.kernel, block.kernel, mid), block.kernel ** 2),
              "project": O._he(k3, (g, mid // g, layer.out_ch // g), mid // g)}
    state = {}
    for name, ch in (("bn1", mid), ("bn2", mid), ("bn3", layer.out_ch)):
        params[name], state[name] = O.bn_init(ch)
    return params, state


def block_apply(params, state, x, block: Block, layer: Layer, train: bool, dw_impl: str = "auto"):
    """(y, new BN state) of ``block`` on ``layer``."""
    if block.is_skip:
        if layer.keeps_shape:
            return x, state
        h = x[:, ::layer.stride, ::layer.stride, :]
        h, bn = _bn_relu(params["bn"], state["bn"], O.pointwise(h, params["conv"]), train)
        return h, {"bn": bn}
    new = {}
    h = _grouped_pointwise(x, params["expand"])
    h, new["bn1"] = _bn_relu(params["bn1"], state["bn1"], h, train)
    h = _shuffle(h, block.groups)
    h = depthwise_conv(h, params["dw"], layer.stride, impl=dw_impl)
    h, new["bn2"] = _bn_relu(params["bn2"], state["bn2"], h, train)
    h = _grouped_pointwise(h, params["project"])
    h, new["bn3"] = _bn_relu(params["bn3"], state["bn3"], h, train, relu=False)
    if layer.keeps_shape:
        h = h + x
    return h, new


def _stem_head_init(key, space: FBNetSpace):
    k1, k2, k3 = jax.random.split(key, 3)
    stem = {"w": O._he(k1, (3, 3, space.in_channels, space.stem_channels), 9 * space.in_channels)}
    stem["bn"], stem_bn = O.bn_init(space.stem_channels)
    last = space.stage_channels[-1]
    head = {"conv": O._he(k2, (last, space.head_channels), last),
            "dense_w": O._scaled_normal(k3, (space.head_channels, space.num_classes), 1.0 / space.head_channels),
            "dense_b": O._filled(space.num_classes, 0.0)}
    head["bn"], head_bn = O.bn_init(space.head_channels)
    return {"stem": stem, "head": head}, {"stem": {"bn": stem_bn}, "head": {"bn": head_bn}}


def _stem(params, state, x, train: bool):
    y = O.full_conv(x, params["w"], 1)
    y, bn = _bn_relu(params["bn"], state["bn"], y, train)
    return y, {"bn": bn}


def _head(params, state, x, train: bool):
    h, bn = _bn_relu(params["bn"], state["bn"], O.pointwise(x, params["conv"]), train)
    h = jnp.mean(h, axis=(1, 2))
    return h @ params["dense_w"] + params["dense_b"], {"bn": bn}


def init(key, space: FBNetSpace, arch):
    """(params, state) of the fixed architecture ``arch`` (22 op indices)."""
    arch = tuple(int(i) for i in arch)
    keys = jax.random.split(key, len(arch) + 1)
    params, state = _stem_head_init(keys[0], space)
    params["layers"], state["layers"] = [], []
    for k, lay, i in zip(keys[1:], space.layers, arch):
        p, s = block_init(k, space.blocks[i], lay)
        params["layers"].append(p)
        state["layers"].append(s)
    return params, state


def apply(space: FBNetSpace, arch, params, state, x, train: bool = False, dw_impl: str = "auto"):
    """(logits, new state) of the fixed architecture ``arch`` (a static tuple of op indices) on x[B, H, W, C]."""
    h, st_stem = _stem(params["stem"], state["stem"], x, train)
    new_layers = []
    for lay, i, p, s in zip(space.layers, arch, params["layers"], state["layers"]):
        h, s = block_apply(p, s, h, space.blocks[int(i)], lay, train, dw_impl)
        new_layers.append(s)
    logits, st_head = _head(params["head"], state["head"], h, train)
    return logits, {"stem": st_stem, "head": st_head, "layers": new_layers}


def numpy_init(shapes, seed: int = 0):
    """Arrays for a tree of ShapeDtypeStructs (``jax.eval_shape`` of an init) drawn in NumPy with the same
    scales as the jax.random initialisers (He normal over each weight's fan-in, 1/fan-in for the classifier,
    batch-norm scale and variance 1, biases and means 0): no executable per shape, which for the 198 blocks of the
    supernet costs minutes of compilation."""
    import numpy as np
    rng = np.random.default_rng(seed)

    def one(path, s):
        name = jax.tree_util.keystr(path)
        if any(f"'{k}'" in name for k in ("var", "scale")):
            return jnp.ones(s.shape, s.dtype)
        if any(f"'{k}'" in name for k in ("bias", "mean", "dense_b")):
            return jnp.zeros(s.shape, s.dtype)
        grouped = len(s.shape) == 3 and ("'expand'" in name or "'project'" in name)
        fan = s.shape[1] if grouped else int(np.prod(s.shape[:-1]))
        var = (1.0 if "'dense_w'" in name else 2.0) / max(fan, 1)
        return jnp.asarray((rng.standard_normal(s.shape) * np.sqrt(var)).astype(s.dtype))
    return jax.tree_util.tree_map_with_path(one, shapes)


def supernet_init(key, space: FBNetSpace):
    """(params, state) holding every candidate of every layer: layers[n][op name]."""
    keys = jax.random.split(key, space.num_layers + 1)
    params, state = _stem_head_init(keys[0], space)
    params["layers"], state["layers"] = [], []
    for kl, lay in zip(keys[1:], space.layers):
        ps, ss = {}, {}
        for kb, b in zip(jax.random.split(kl, len(space.blocks)), space.blocks):
            ps[b.name], ss[b.name] = block_init(kb, b, lay)
        params["layers"].append(ps)
        state["layers"].append(ss)
    return params, state


def supernet_apply(space: FBNetSpace, params, state, arch, x, train: bool, dw_impl: str = "auto"):
    """(logits, new state) of the sub-network ``arch`` (int32[22], may be traced) with the shared weights."""
    h, st_stem = _stem(params["stem"], state["stem"], x, train)
    new_layers = []
    for n, lay in enumerate(space.layers):
        p, s = params["layers"][n], state["layers"][n]

        def branch(b, h=h, p=p, s=s, lay=lay):
            def f(_):
                y, new_b = block_apply(p[b.name], s[b.name], h, b, lay, train, dw_impl)
                return y, {**s, b.name: new_b}
            return f

        h, s = lax.switch(arch[n], [branch(b) for b in space.blocks], None)
        new_layers.append(s)
    logits, st_head = _head(params["head"], state["head"], h, train)
    return logits, {"stem": st_stem, "head": st_head, "layers": new_layers}
