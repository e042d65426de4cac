"""The group-separable ResNeXt (paper 004, section 3.1, Table 1) as pure functions over a params pytree.

Layout (per group g = 0..G-1, every group on its own node):

* stem: one 3x3 convolution (``stem_channels``) computed once on the input node; its output is replicated to the G
  groups (Table 1's "concatenate G duplications": the first transmission, a broadcast).
* blocks: ResNeXt bottlenecks, one per group: 1x1 conv M -> P*d, ReLU, 3x3 grouped conv with P = C/G paths of
  width d (the stride of the block), ReLU, 1x1 conv P*d -> M', scaled by a learned scalar gain (initialised to 1;
  no normalisation layer: the networks are shallow), plus the shortcut (a 1x1 projection when the shape changes). eq. (2): ``X_i^l = X_i^{l-1} + T_i(X_i^{l-1}) + D_i^l``.
* transmissions (eq. (3)), with staleness alpha: the blocks form windows of alpha blocks; in window s each node
  sends ``F(X)`` of the output of the window's first block to ``perm_s[i]`` and the receiver adds what it gets to
  the output of the window's last block (alpha = 1: the same block, synchronous; alpha = 2: the features are one
  block stale). ``F`` keeps the first N_send channels (sparsity level, eq. (10)) and casts to float16 when asked.
  A node whose destination is itself sends nothing and adds nothing.
* head: the output node keeps only its own group's features (Table 1's "keep first 1/G channels"), global average
  pool, a dense classifier.

With G = 1 (``reference=True`` in ``make_spec``) the same code is the non-separated ResNeXt with all C paths in
one group: the network the separable one is compared with (eq. (5)-(8): the same number of conv weights).

Params of the blocks are stacked on a leading group axis [G, ...] and the groups run under ``jax.vmap``.
Images are float32 [B, H, W, C_in] (NHWC); logits float32 [B, num_classes].
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmsnas.runcheck import ConfigError
from jmsnas.separable import decisions as dec
from jmsnas.strategies.base import check_int


class BlockShape(NamedTuple):
    """One bottleneck of one group: channels in/out, stride, spatial size in/out (square), paths, path width."""

    cin: int
    cout: int
    stride: int
    size_in: int
    size_out: int
    paths: int
    width: int


class NetSpec(NamedTuple):
    """Static description of a separable network (hashable; safe as a jit static argument)."""

    num_groups: int
    image_size: int
    in_channels: int
    num_classes: int
    stem_channels: int
    blocks: tuple  # BlockShape per block
    alpha: int
    num_levels: int
    p_min: float
    float16: bool
    output_group: int
    nsend: tuple  # per step: tuple of N_send for each of the K levels (eq. (10))

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_steps(self) -> int:
        return len(self.blocks) // self.alpha

    def window(self, s: int) -> tuple:
        """Block indices of transmission window s: the sender's block first, the receiver's add block last."""
        return tuple(range(s * self.alpha, (s + 1) * self.alpha))

    def decision_space(self) -> dec.DecisionSpace:
        return dec.make_space(self.num_groups, self.num_steps, self.num_levels, self.p_min)


def make_spec(*, num_groups: int, image_size: int, in_channels: int, num_classes: int, stem_channels: int,
              stage_channels, stage_blocks, stage_strides, cardinality: int, path_width: int, alpha: int = 1,
              num_levels: int = 1, p_min: float = 50.0, float16: bool = False, output_group: int = 0,
              reference: bool = False) -> NetSpec:
    """Validates the architecture hyperparameters and lays out the blocks.

    ``stage_channels``/``stage_blocks``/``stage_strides``: per stage the block output channels M of one group, the
    number of blocks and the stride of the stage's first block. ``cardinality`` C is the total number of paths,
    split evenly over the G groups. ``reference=True`` builds the non-separated network (one group, all paths).
    """
    ints = dict(image_size=image_size, in_channels=in_channels, num_classes=num_classes, stem_channels=stem_channels,
                cardinality=cardinality, path_width=path_width)
    for name, v in ints.items():
        check_int(name, v, 1)
    g = check_int("G (number of groups/nodes)", num_groups, 2)
    a = check_int("alpha (staleness factor)", alpha, 1)
    k = check_int("K (sparsity levels)", num_levels, 1)
    if cardinality % g:
        raise ConfigError(f"cardinality C={cardinality} must be divisible by G={g} (C/G paths per group)")
    stage_channels, stage_blocks, stage_strides = tuple(stage_channels), tuple(stage_blocks), tuple(stage_strides)
    if not (len(stage_channels) == len(stage_blocks) == len(stage_strides) >= 1):
        raise ConfigError(f"stage_channels {stage_channels}, stage_blocks {stage_blocks} and stage_strides "
                                f"{stage_strides} must have the same length >= 1")
    for i, (c, n, s) in enumerate(zip(stage_channels, stage_blocks, stage_strides)):
        check_int(f"stage_channels[{i}]", c, 1)
        check_int(f"stage_blocks[{i}]", n, 1)
        if s not in (1, 2):
            raise ConfigError(f"stage_strides[{i}] must be 1 or 2, got {s!r}")
        if n % a:
            raise ConfigError(f"stage_blocks[{i}]={n} must be a multiple of alpha={a}: a transmission window "
                                    "may not cross a stage boundary (sent and received features must match in shape)")
    if not (isinstance(output_group, int) and 0 <= output_group < g):
        raise ConfigError(f"output_group must be a node index in 0..{g - 1}, got {output_group!r}")
    if not isinstance(float16, bool):
        raise ConfigError(f"float16 must be true or false, got {float16!r}")
    dec.make_space(g, 1, k, p_min)  # validates p_min
    groups = 1 if reference else g
    blocks, cin, size = [], stem_channels, image_size
    for c, n, s in zip(stage_channels, stage_blocks, stage_strides):
        for j in range(n):
            stride = s if j == 0 else 1
            out = -(-size // stride)
            blocks.append(BlockShape(cin, c, stride, size, out, cardinality // groups, path_width))
            cin, size = c, out
    steps = len(blocks) // a
    nsend = tuple(tuple(dec.n_send(blocks[t * a].cout, lv, k, p_min) for lv in range(k)) for t in range(steps))
    return NetSpec(groups, image_size, in_channels, num_classes, stem_channels, tuple(blocks), a, k, float(p_min),
                   float16, 0 if reference else output_group, nsend)


# --------------------------------------------------------------------------------------------------- params

def _block_shapes(b: BlockShape) -> dict:
    """name -> (shape, fan_in) of one group's block (fan_in 0: zeros, -1: ones)."""
    mid = b.paths * b.width
    p = {"w1": ((b.cin, mid), b.cin), "b1": ((mid,), 0), "w2": ((3, 3, b.width, mid), 9 * b.width),
         "b2": ((mid,), 0), "w3": ((mid, b.cout), mid), "b3": ((b.cout,), 0), "gain": ((), -1)}
    if b.stride != 1 or b.cin != b.cout:
        p["wp"] = ((b.cin, b.cout), b.cin)
    return p


def param_shapes(spec: NetSpec) -> dict:
    """The params tree as name -> (shape, std) (std 0: zeros, -1: ones; He-normal std sqrt(2 / fan_in) for convs)."""
    g = spec.num_groups
    he = lambda shape, fan: (shape, float(np.sqrt(2.0 / fan)) if fan > 0 else float(fan))
    c_last = spec.blocks[-1].cout
    return {"stem": {"w": he((3, 3, spec.in_channels, spec.stem_channels), 9 * spec.in_channels),
                     "b": ((spec.stem_channels,), 0.0)},
            "blocks": [{k: he((g,) + shape, fan) for k, (shape, fan) in _block_shapes(b).items()}
                       for b in spec.blocks],
            "head": {"w": ((c_last, spec.num_classes), float(np.sqrt(1.0 / c_last))), "b": ((spec.num_classes,), 0.0)}}


def init(key: jax.Array, spec: NetSpec) -> dict:
    """Params: stem (shared, on the input node), blocks (each leaf with a leading group axis G), head.

    Convolutions are He-normal, biases zero, the residual gains one. All normals come from one draw of
    ``jax.random.normal(key, [total])`` cut into the leaves (one small program: a per-leaf draw under jit takes
    XLA:CPU tens of seconds to compile)."""
    leaves, tree = jax.tree_util.tree_flatten(param_shapes(spec), is_leaf=lambda x: isinstance(x, tuple)
                                              and len(x) == 2 and isinstance(x[0], tuple))
    sizes = [int(np.prod(shape)) for shape, _ in leaves]
    flat = jax.random.normal(key, (sum(sizes),), jnp.float32)
    out, off = [], 0
    for (shape, std), n in zip(leaves, sizes):
        # std 0: zeros; std -1: ones (the residual gains)
        out.append(jnp.ones(shape) if std < 0 else jnp.reshape(flat[off:off + n], shape) * std)
        off += n
    return jax.tree_util.tree_unflatten(tree, out)


# -------------------------------------------------------------------------------------------------- forward

def stem_apply(p: dict, x: jnp.ndarray) -> jnp.ndarray:
    """float32 [B, H, W, C_in] -> [B, H, W, stem_channels]."""
    y = jax.lax.conv_general_dilated(x, p["w"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jax.nn.relu(y + p["b"])


def grouped_conv3x3(h: jnp.ndarray, w: jnp.ndarray, stride: int, paths: int) -> jnp.ndarray:
    """3x3 SAME convolution with ``paths`` groups as a sum of 9 shifted batched matmuls (XLA:CPU runs grouped
    convolutions very slowly; this is the same operator as ``lax.conv_general_dilated(..., feature_group_count=
    paths)`` with an HWIO kernel).

    h float32 [B, s, s, paths * width_in]; w [3, 3, width_in, paths * width_out] -> [B, s', s', paths * width_out].
    """
    b, size, _, c = h.shape
    win, wout = w.shape[2], w.shape[3] // paths
    out = -(-size // stride)
    pad_total = max((out - 1) * stride + 3 - size, 0)
    lo = pad_total // 2
    hp = jnp.pad(h, ((0, 0), (lo, pad_total - lo), (lo, pad_total - lo), (0, 0))).reshape(
        b, size + pad_total, size + pad_total, paths, win)
    wk = w.reshape(3, 3, win, paths, wout)
    acc = 0.0
    for dy in range(3):
        for dx in range(3):
            tap = hp[:, dy:dy + (out - 1) * stride + 1:stride, dx:dx + (out - 1) * stride + 1:stride]
            acc = acc + jnp.einsum("byxpi,ipo->byxpo", tap, wk[dy, dx])
    return acc.reshape(b, out, out, paths * wout)


def block_apply(p: dict, x: jnp.ndarray, b: BlockShape) -> jnp.ndarray:
    """One group's bottleneck: float32 [B, s_in, s_in, cin] -> [B, s_out, s_out, cout] (no received features)."""
    h = jax.nn.relu(x @ p["w1"] + p["b1"])
    h = jax.nn.relu(grouped_conv3x3(h, p["w2"], b.stride, b.paths) + p["b2"])
    y = h @ p["w3"] + p["b3"]
    sc = x[:, ::b.stride, ::b.stride, :]
    if "wp" in p:
        sc = sc @ p["wp"]
    return sc + p["gain"] * y


def head_apply(p: dict, feats: jnp.ndarray) -> jnp.ndarray:
    """The output node's classifier: float32 [B, s, s, c] -> logits [B, num_classes]."""
    return jnp.mean(jax.nn.relu(feats), axis=(1, 2)) @ p["w"] + p["b"]


def transmit(spec: NetSpec, step: int, x: jnp.ndarray, perm_id, level) -> jnp.ndarray:
    """What every node receives at ``step``: F(x) of its sender, or zeros for a node that keeps its features.

    x float32 [G, B, s, s, c] (each node's output of the window's first block); perm_id, level int32 scalars.
    Returns float32 [G, B, s, s, c].
    """
    g, c = spec.num_groups, x.shape[-1]
    perm = jnp.asarray(dec.permutation_table(g))[perm_id]  # destination of each node
    src = jnp.zeros((g,), jnp.int32).at[perm].set(jnp.arange(g, dtype=jnp.int32))  # sender of each node
    n = jnp.asarray(spec.nsend[step], jnp.int32)[level]
    sent = x.astype(jnp.float16).astype(jnp.float32) if spec.float16 else x
    sent = jnp.where(jnp.arange(c) < n, sent, 0.0)
    keep = (src != jnp.arange(g)).astype(x.dtype)
    return sent[src] * keep[:, None, None, None, None]


def features(spec: NetSpec, params: dict, x: jnp.ndarray, perm_ids=None, levels=None) -> jnp.ndarray:
    """Every group's final features float32 [G, B, s, s, c] under decisions perm_ids/levels int32[S] (None: no
    transmission at all, the G groups run independently)."""
    h = stem_apply(params["stem"], x)
    xs = jnp.broadcast_to(h, (spec.num_groups,) + h.shape)
    for s in range(spec.num_steps):
        sent = None
        for i in spec.window(s):
            xs = jax.vmap(lambda p, v, b=spec.blocks[i]: block_apply(p, v, b))(params["blocks"][i], xs)
            if i == spec.window(s)[0] and perm_ids is not None:
                sent = transmit(spec, s, xs, perm_ids[s], levels[s])
        if sent is not None:
            xs = xs + sent
    return xs


def apply(spec: NetSpec, params: dict, x: jnp.ndarray, perm_ids=None, levels=None) -> jnp.ndarray:
    """Logits float32 [B, num_classes] computed by the output node from its own group's features."""
    return head_apply(params["head"], features(spec, params, x, perm_ids, levels)[spec.output_group])


def num_params(params) -> int:
    return int(sum(np.prod(l.shape) for l in jax.tree_util.tree_leaves(params)))
